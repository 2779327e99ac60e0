#!/usr/bin/env bash
# Builds the two images, nano-gpu/allocator and nano-gpu/agent (Dockerfile.allocator,
# Dockerfile.agent), with docker, podman or buildah, whichever works here.
#
#   hack/build-images.sh [TAG]            (default tag 0.1.0)
#
# Base images come from the registries the Dockerfiles name. Where those registries are out of reach,
# NANO_GPU_LOCAL_BASE=1 makes the bases here instead: a Debian bookworm root filesystem made with
# debootstrap from Debian's mirror (with gcc for the builder stage), and the host's Rust toolchain
# copied into the builder. The Dockerfiles are the same either way; only BUILDER_IMAGE and
# RUNTIME_IMAGE change.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TAG=${1:-0.1.0}
log() { echo "build-images: $*" >&2; }
die() { log "error: $*"; exit 1; }

if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
  build() { docker build "$@"; }
elif command -v podman >/dev/null; then
  build() { podman build --network host "$@"; }
elif command -v buildah >/dev/null; then
  # chroot isolation: works where nested containers and cgroups are not available.
  build() { buildah bud --isolation chroot --network host --layers "$@"; }
else
  die "no container engine (docker daemon, podman or buildah); install one, e.g. apt-get install buildah"
fi

args=()
if [[ ${NANO_GPU_LOCAL_BASE:-0} == 1 ]]; then
  command -v buildah >/dev/null || die "NANO_GPU_LOCAL_BASE=1 needs buildah"
  command -v debootstrap >/dev/null || die "NANO_GPU_LOCAL_BASE=1 needs debootstrap"
  work=${NANO_GPU_CACHE:-$HOME/.cache/nano-gpu}/images
  mkdir -p "$work"
  # image NAME ROOTFS: an image of a root filesystem.
  image() {
    local c
    c=$(buildah from scratch)
    buildah copy "$c" "$2" / >/dev/null
    buildah commit --rm "$c" "$1" >/dev/null
  }
  if ! buildah inspect localhost/nano-gpu-runtime-base:bookworm >/dev/null 2>&1; then
    log "making the runtime base (debootstrap minbase)"
    debootstrap --variant=minbase bookworm "$work/runtime-rootfs" http://deb.debian.org/debian >&2
    image localhost/nano-gpu-runtime-base:bookworm "$work/runtime-rootfs"
  fi
  if ! buildah inspect localhost/nano-gpu-builder:1.95 >/dev/null 2>&1; then
    log "making the builder base (debootstrap + gcc + the host's Rust toolchain)"
    debootstrap --variant=minbase --include=gcc,libc6-dev,ca-certificates bookworm \
      "$work/builder-rootfs" http://deb.debian.org/debian >&2
    # The host's trusted CAs (a proxy on the way to crates.io may need its own).
    cp /etc/ssl/certs/ca-certificates.crt "$work/builder-rootfs/etc/ssl/certs/ca-certificates.crt"
    sysroot=$(rustc --print sysroot)
    mkdir -p "$work/builder-rootfs/usr/local/rust"
    cp -a "$sysroot/." "$work/builder-rootfs/usr/local/rust/"
    ln -sf /usr/local/rust/bin/cargo "$work/builder-rootfs/usr/local/bin/cargo"
    ln -sf /usr/local/rust/bin/rustc "$work/builder-rootfs/usr/local/bin/rustc"
    image localhost/nano-gpu-builder:1.95 "$work/builder-rootfs"
  fi
  args+=(--build-arg BUILDER_IMAGE=localhost/nano-gpu-builder:1.95
         --build-arg RUNTIME_IMAGE=localhost/nano-gpu-runtime-base:bookworm)
fi

for part in allocator agent; do
  log "building nano-gpu/$part:$TAG"
  start=$(date +%s)
  build "${args[@]}" -f "$ROOT/Dockerfile.$part" -t "nano-gpu/$part:$TAG" "$ROOT"
  log "nano-gpu/$part:$TAG built in $(( $(date +%s) - start )) s"
done
