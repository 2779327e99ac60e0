#!/usr/bin/env bash
# Builds a pinned upstream containerd 2 (containerd, its runc shim and ctr) from the Go module proxy
# into a per-version cache, for the local cluster's containerd-2 nodes (`hack/cluster.sh up
# --containerd2 N`): nodes whose runtime resolves CDI device names, as DRA and a device plugin's
# CDI answers need. The other nodes keep Debian's containerd 1.6.
# Test harness only: Go builds upstream components, never product logic.
#
# Usage: hack/containerd-build.sh   -> prints the bin dir on stdout (logs on stderr)
# Env:   NANO_GPU_CACHE             cache root (default ~/.cache/nano-gpu)
#        NANO_GPU_BUILD_NICE        nice level for go build (default 15)
#
# Bumping: change the version below and run this script; it re-pins hack/upstream/containerd/go.mod
# and go.sum: commit those with it.
set -euo pipefail

log() { echo "containerd-build: $*" >&2; }
die() { log "error: $*"; exit 1; }

VERSION=v2.2.9
MODULE=github.com/containerd/containerd/v2
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
UPSTREAM=$ROOT/hack/upstream/containerd
CACHE=${NANO_GPU_CACHE:-$HOME/.cache/nano-gpu}
NICE=${NANO_GPU_BUILD_NICE:-15}
# shellcheck source=hack/upstream-module.sh
source "$ROOT/hack/upstream-module.sh"
# containerd's own module has no replace directives. Static, as containerd's release builds are:
# without the btrfs, devmapper and zfs snapshotters, which need cgo and which the nodes do not use.
cached_commands containerd "$VERSION" "$MODULE" hack/containerd-build.sh 0 no_btrfs,no_devmapper,no_zfs \
  "-s -w -X $MODULE/version.Version=$VERSION -X $MODULE/version.Package=$MODULE" \
  containerd containerd-shim-runc-v2 ctr
