#!/usr/bin/env bash
# Builds a pinned upstream Prometheus Operator from the Go module proxy into a per-version cache, with
# its CRDs beside it, for the test of deploy/components/prometheus-operator against the real operator
# (tests/tests/prometheus_operator.rs): the operator turns the component's PodMonitors and
# PrometheusRule into the Prometheus configuration and rule files it would hand a Prometheus.
# Test harness only: Go builds upstream components, never product logic.
#
# Usage: hack/prometheus-operator-build.sh   -> prints the version's directory on stdout: bin/operator
#                                               and crds/*.yaml (logs on stderr)
# Env:   NANO_GPU_CACHE                      cache root (default ~/.cache/nano-gpu)
#        NANO_GPU_BUILD_NICE                 nice level for go build (default 15)
#
# Bumping: change the version below and run this script; it re-pins
# hack/upstream/prometheus-operator/go.mod and go.sum: commit those with it.
set -euo pipefail

log() { echo "prometheus-operator-build: $*" >&2; }
die() { log "error: $*"; exit 1; }

# The newest version the Go module proxy serves here.
VERSION=v0.85.0
MODULE=github.com/prometheus-operator/prometheus-operator

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
UPSTREAM=$ROOT/hack/upstream/prometheus-operator
CACHE=${NANO_GPU_CACHE:-$HOME/.cache/nano-gpu}
OUT=$CACHE/prometheus-operator/$VERSION
STAMP=$OUT/.version
NICE=${NANO_GPU_BUILD_NICE:-15}

built() { [[ -x $OUT/bin/operator && -f $STAMP && $(cat "$STAMP") == "prometheus-operator=$VERSION" ]]; }
if built; then echo "$OUT"; exit 0; fi
# shellcheck source=hack/upstream-module.sh
source "$ROOT/hack/upstream-module.sh"
build_lock "$CACHE/prometheus-operator"
if built; then echo "$OUT"; exit 0; fi
command -v go >/dev/null 2>&1 || die "'go' not found in PATH; install Go to build the Prometheus Operator"
# The operator's own go.mod points its API and client modules at its source tree with replace
# directives: required from our module, they come at the versions it requires.
pin_module "$UPSTREAM" hack/prometheus-operator-build.sh "$MODULE" "$VERSION" "$MODULE/cmd/operator"

start=$SECONDS
mkdir -p "$OUT/bin" "$OUT/crds"
rm -f "$STAMP"
log "building the operator ..."
(cd "$UPSTREAM" && CGO_ENABLED=0 nice -n "$NICE" go build -mod=readonly -trimpath -buildvcs=false \
  -gcflags=all=-dwarf=false -ldflags="-s -w" -o "$OUT/bin/operator.tmp" "$MODULE/cmd/operator") || die "building the operator failed"
mv -f "$OUT/bin/operator.tmp" "$OUT/bin/operator"
src=$(cd "$UPSTREAM" && go mod download -json "$MODULE@$VERSION" | sed -n 's/.*"Dir": "\([^"]*\)".*/\1/p')
[[ -d $src/example/prometheus-operator-crd ]] || die "no CRDs in $src/example/prometheus-operator-crd"
cp "$src"/example/prometheus-operator-crd/*.yaml "$OUT/crds/"
chmod u+w "$OUT"/crds/*.yaml
echo "prometheus-operator=$VERSION" >"$STAMP"
log "built in $((SECONDS - start))s into $OUT"
echo "$OUT"
