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
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
UPSTREAM=$ROOT/hack/upstream/nvidia-container-toolkit
CACHE=${NANO_GPU_CACHE:-$HOME/.cache/nano-gpu}
NICE=${NANO_GPU_BUILD_NICE:-15}
# shellcheck source=hack/upstream-module.sh
source "$ROOT/hack/upstream-module.sh"
# cgo: nvidia-ctk loads NVML (go-nvml, dlopen) to find the cards.
cached_commands nvidia-toolkit "$VERSION" github.com/NVIDIA/nvidia-container-toolkit hack/nvidia-toolkit-build.sh \
  1 "" "-s -w" nvidia-ctk nvidia-container-runtime
