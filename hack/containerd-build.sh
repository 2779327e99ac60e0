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
CMDS=(containerd containerd-shim-runc-v2 ctr)

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
UPSTREAM=$ROOT/hack/upstream/containerd
CACHE=${NANO_GPU_CACHE:-$HOME/.cache/nano-gpu}
BIN=$CACHE/containerd/$VERSION/bin
STAMP=$BIN/.version
NICE=${NANO_GPU_BUILD_NICE:-15}

built() {
  local c
  for c in "${CMDS[@]}"; do [[ -x $BIN/$c ]] || return 1; done
  [[ -f $STAMP && $(cat "$STAMP") == "containerd=$VERSION" ]]
}
if built; then echo "$BIN"; exit 0; fi
# shellcheck source=hack/upstream-module.sh
source "$ROOT/hack/upstream-module.sh"
build_lock "$CACHE/containerd"
if built; then echo "$BIN"; exit 0; fi
command -v go >/dev/null 2>&1 || die "'go' not found in PATH; install Go to build containerd"
# containerd's own module has no replace directives.
pin_module "$UPSTREAM" hack/containerd-build.sh "$MODULE" "$VERSION" "${CMDS[@]/#/$MODULE/cmd/}"

total=$SECONDS
mkdir -p "$BIN"
rm -f "$STAMP"
# Static, as containerd's release builds are: without the btrfs, devmapper and zfs snapshotters,
# which need cgo and which the nodes do not use.
ld="-s -w -X $MODULE/version.Version=$VERSION -X $MODULE/version.Package=$MODULE"
for c in "${CMDS[@]}"; do
  start=$SECONDS
  log "building $c ..."
  (cd "$UPSTREAM" && CGO_ENABLED=0 nice -n "$NICE" go build -trimpath -buildvcs=false -gcflags=all=-dwarf=false \
    -tags=no_btrfs,no_devmapper,no_zfs -ldflags="$ld" -o "$BIN/$c.tmp" "$MODULE/cmd/$c") ||
    die "building $c failed"
  mv -f "$BIN/$c.tmp" "$BIN/$c"
  log "built $c in $((SECONDS - start))s"
done
echo "containerd=$VERSION" >"$STAMP"
log "built in $((SECONDS - total))s into $BIN"
echo "$BIN"
