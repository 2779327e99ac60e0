#!/usr/bin/env bash
# Makes a one-layer container image archive (the `docker save` layout, which `ctr images import`
# reads) from a root filesystem directory, for the real-node cluster: no registry is reachable here.
#
# Usage: hack/image.sh OUT.tar REF ROOTFS CONFIG
#   REF     the image name, e.g. nano-gpu/agent:0.1.0
#   ROOTFS  directory that becomes the image's filesystem (owned by root in the image)
#   CONFIG  the image's run config as JSON, e.g. '{"Entrypoint":["/pause"],"User":"65532:65532"}'
# Deterministic: the same ROOTFS and CONFIG give the same image ID.
set -euo pipefail
[[ $# -eq 4 ]] || { echo "usage: $0 OUT.tar REF ROOTFS CONFIG" >&2; exit 1; }
OUT=$1 REF=$2 ROOTFS=$3 CONFIG=$4
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

tar --sort=name --numeric-owner --owner=0 --group=0 --mtime=@0 -C "$ROOTFS" -cf "$work/layer.tar" .
layer=$(sha256sum "$work/layer.tar" | cut -d' ' -f1)
mkdir "$work/$layer"
mv "$work/layer.tar" "$work/$layer/layer.tar"
printf '{"architecture":"amd64","os":"linux","config":%s,"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' \
  "$CONFIG" "$layer" >"$work/config.json"
config=$(sha256sum "$work/config.json" | cut -d' ' -f1)
mv "$work/config.json" "$work/$config.json"
printf '[{"Config":"%s.json","RepoTags":["%s"],"Layers":["%s/layer.tar"]}]' "$config" "$REF" "$layer" \
  >"$work/manifest.json"
tar --sort=name --numeric-owner --owner=0 --group=0 --mtime=@0 -C "$work" -cf "$OUT.tmp" .
mv -f "$OUT.tmp" "$OUT"
