#!/usr/bin/env bash
# Builds NVIDIA's container toolkit (nvidia-ctk and nvidia-container-runtime) at a pinned version from
# the Go module proxy into a per-version cache: the real GPU node's runtime and CDI spec writer
# (hack/gpu-node.sh carries them in its bundle, and its dry run in the test command runs them).
# Test harness only: Go builds upstream components, never product logic.
#
# Usage: hack/nvidia-toolkit-build.sh   -> prints the bin dir on stdout (logs on stderr)
# Env:   NANO_GPU_CACHE                 cache root (default ~/.cache/nano-gpu)
#        NANO_GPU_BUILD_NICE            nice level for go build (default 15)
#
# Bumping: change the version below and run this script; it re-pins
# hack/upstream/nvidia-container-toolkit/go.mod and go.sum: commit those with it.
set -euo pipefail

log() { echo "nvidia-toolkit-build: $*" >&2; }
die() { log "error: $*"; exit 1; }

VERSION=v1.20.2
MODULE=github.com/NVIDIA/nvidia-container-toolkit
CMDS=(nvidia-ctk nvidia-container-runtime)

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
UPSTREAM=$ROOT/hack/upstream/nvidia-container-toolkit
CACHE=${NANO_GPU_CACHE:-$HOME/.cache/nano-gpu}
BIN=$CACHE/nvidia-toolkit/$VERSION/bin
STAMP=$BIN/.version
NICE=${NANO_GPU_BUILD_NICE:-15}

built() {
  local c
  for c in "${CMDS[@]}"; do [[ -x $BIN/$c ]] || return 1; done
  [[ -f $STAMP && $(cat "$STAMP") == "nvidia-container-toolkit=$VERSION" ]]
}
if built; then echo "$BIN"; exit 0; fi
# shellcheck source=hack/upstream-module.sh
source "$ROOT/hack/upstream-module.sh"
build_lock "$CACHE/nvidia-toolkit"
if built; then echo "$BIN"; exit 0; fi
command -v go >/dev/null 2>&1 || die "'go' not found in PATH; install Go to build NVIDIA's toolkit"
pin_module "$UPSTREAM" hack/nvidia-toolkit-build.sh "$MODULE" "$VERSION" "${CMDS[@]/#/$MODULE/cmd/}"

total=$SECONDS
mkdir -p "$BIN"
rm -f "$STAMP"
# cgo: nvidia-ctk loads NVML (go-nvml, dlopen) to find the cards.
for c in "${CMDS[@]}"; do
  start=$SECONDS
  log "building $c ..."
  (cd "$UPSTREAM" && CGO_ENABLED=1 nice -n "$NICE" go build -trimpath -buildvcs=false -gcflags=all=-dwarf=false \
    -ldflags="-s -w" -o "$BIN/$c.tmp" "$MODULE/cmd/$c") || die "building $c failed"
  mv -f "$BIN/$c.tmp" "$BIN/$c"
  log "built $c in $((SECONDS - start))s"
done
echo "nvidia-container-toolkit=$VERSION" >"$STAMP"
log "built in $((SECONDS - total))s into $BIN"
echo "$BIN"
