#!/usr/bin/env bash
# Builds gpushare's own kubectl plugin, kubectl-inspect-gpushare, from the source kept beside the
# project (../shared/tools/kubectl-inspect-gpushare: the Go module proxy does not serve gpushare's
# repositories) into a cache keyed by a hash of that source. A test client, like the upstream
# binaries: its source is never copied into this repository.
#
# Usage: hack/gpushare-inspect-build.sh   -> prints the binary's path on stdout (logs on stderr)
# Env:   NANO_GPU_CACHE        cache root (default ~/.cache/nano-gpu)
#        NANO_GPU_SHARED       the shared directory (default ../shared beside the repository)
#        NANO_GPU_BUILD_NICE   nice level for go build (default 15)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SRC=${NANO_GPU_SHARED:-$ROOT/../shared}/tools/kubectl-inspect-gpushare
CACHE=${NANO_GPU_CACHE:-$HOME/.cache/nano-gpu}
log() { echo "gpushare-inspect-build: $*" >&2; }
die() { log "error: $*"; exit 1; }

[[ -f $SRC/go.mod ]] || die "$SRC/go.mod missing (gpushare's kubectl plugin source)"
hash=$(cat "$SRC"/go.mod "$SRC"/go.sum "$SRC"/*.go | sha256sum | cut -c1-16)
BIN=$CACHE/gpushare/$hash/kubectl-inspect-gpushare
if [[ -x $BIN ]]; then echo "$BIN"; exit 0; fi

mkdir -p "$(dirname "$BIN")"
exec 9>"$CACHE/gpushare/.build.lock" && flock 9
if [[ -x $BIN ]]; then echo "$BIN"; exit 0; fi
command -v go >/dev/null 2>&1 || die "'go' not found in PATH; install Go >= 1.26 to build gpushare's kubectl plugin"
start=$SECONDS
log "building kubectl-inspect-gpushare from $SRC ..."
# The source directory may be read-only: nothing is written there (go.sum is complete).
(cd "$SRC" && CGO_ENABLED=0 nice -n "${NANO_GPU_BUILD_NICE:-15}" go build -mod=readonly -trimpath \
  -buildvcs=false -gcflags=all=-dwarf=false -ldflags="-s -w" -o "$BIN.tmp" .) || die "building kubectl-inspect-gpushare failed"
mv -f "$BIN.tmp" "$BIN"
log "built in $((SECONDS - start))s: $BIN"
echo "$BIN"
