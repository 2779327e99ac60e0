#!/usr/bin/env bash
# Builds pinned upstream Kubernetes test binaries (etcd, kube-apiserver,
# kube-scheduler, kubectl) from the Go module proxy into a per-version cache.
# Test harness only: Go is used here to build upstream components, never
# product logic.
#
# Usage: hack/k8s-build.sh        -> prints the bin dir on stdout (logs on stderr)
# Env:   NANO_GPU_CACHE           cache root (default ~/.cache/nano-gpu)
#        NANO_GPU_BUILD_NICE      nice level for go build (default 15)
#
# Bumping: change the versions below and run this script; it re-pins the Go
# modules in hack/upstream/*/ (go.mod/go.sum) - commit those files with it.
set -euo pipefail

K8S_VERSION=v1.35.8
# The etcd that k8s $K8S_VERSION pins for its own tests (hack/lib/etcd.sh).
ETCD_VERSION=v3.6.6

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
UPSTREAM=$ROOT/hack/upstream
CACHE=${NANO_GPU_CACHE:-$HOME/.cache/nano-gpu}
BIN=$CACHE/k8s/$K8S_VERSION/bin
STAMP="$BIN/.versions"
NICE=${NANO_GPU_BUILD_NICE:-15}
BINARIES=(etcd kube-apiserver kube-scheduler kubectl)
K8S_CMDS=(kube-apiserver kube-scheduler kubectl)

log() { echo "k8s-build: $*" >&2; }
die() { log "error: $*"; exit 1; }

# Fast path: everything already built for these exact versions.
built() {
  local b
  for b in "${BINARIES[@]}"; do [[ -x $BIN/$b ]] || return 1; done
  [[ -f $STAMP && $(cat "$STAMP") == "k8s=$K8S_VERSION etcd=$ETCD_VERSION" ]]
}
if built; then echo "$BIN"; exit 0; fi

command -v go >/dev/null 2>&1 ||
  die "'go' not found in PATH; install Go >= 1.25 (https://go.dev/dl/) to build the test control plane"
log "using $(go version)"

# Prints the version DIR/go.mod requires for MODULE (empty if none).
required_version() {
  [[ -f $1/go.mod ]] || return 0
  awk -v m="$2" '{ for (i = 1; i < NF; i++) if ($i == m && $(i + 1) ~ /^v/) { print $(i + 1); exit } }' "$1/go.mod"
}

# Re-creates DIR's go.mod/go.sum from scratch. Extra args go to `go mod edit`.
repin() {
  local dir=$1; shift
  log "re-pinning $dir (commit the new go.mod/go.sum)"
  mkdir -p "$dir"
  rm -f "$dir/go.mod" "$dir/go.sum"
  (
    cd "$dir"
    go mod init "nano-gpu/hack/upstream/$(basename "$dir")" 2>/dev/null
    go mod edit "$@"
    go mod tidy
  )
}

# k8s.io/kubernetes points its staging modules (k8s.io/api, ...) at ./staging
# with replace directives, so it cannot be `go install`ed. Our own module
# requires it and replaces each staging module with its published v0.X.Y tag.
pin_kubernetes() {
  local dir=$UPSTREAM/kubernetes
  [[ $(required_version "$dir" k8s.io/kubernetes) == "$K8S_VERSION" ]] && return 0
  local gomod staging_ver=${K8S_VERSION/#v1./v0.} m args=()
  gomod=$(mkdir -p "$UPSTREAM" && cd "$UPSTREAM" && go mod download -json "k8s.io/kubernetes@$K8S_VERSION" |
    sed -n 's/.*"GoMod": "\([^"]*\)".*/\1/p')
  [[ -f $gomod ]] || die "could not download k8s.io/kubernetes@$K8S_VERSION from the Go module proxy"
  args+=("-require=k8s.io/kubernetes@$K8S_VERSION")
  # Staging modules are the k8s.io/* requirements pinned at v0.0.0.
  while read -r m; do
    args+=("-replace=$m=$m@$staging_ver")
  done < <(awk '$1 ~ /^k8s\.io\// && $2 == "v0.0.0" { print $1 }' "$gomod")
  # Keep upstream's language version and GODEBUG defaults.
  args+=("-go=$(awk '$1 == "go" { print $2; exit }' "$gomod")")
  m=$(awk '$1 == "godebug" && NF == 2 { print $2; exit }' "$gomod")
  [[ -n $m ]] && args+=("-godebug=$m")
  for m in "${K8S_CMDS[@]}"; do args+=("-tool=k8s.io/kubernetes/cmd/$m"); done
  repin "$dir" "${args[@]}"
}

# etcd's server module has a main package at its root (the real etcd binary).
pin_etcd() {
  local dir=$UPSTREAM/etcd
  [[ $(required_version "$dir" go.etcd.io/etcd/server/v3) == "$ETCD_VERSION" ]] && return 0
  repin "$dir" "-require=go.etcd.io/etcd/server/v3@$ETCD_VERSION" "-tool=go.etcd.io/etcd/server/v3"
}

# build NAME MODULE_DIR PACKAGE LDFLAGS: go build into $BIN/NAME atomically.
build() {
  local name=$1 dir=$2 pkg=$3 ldflags=$4 start=$SECONDS
  log "building $name from $pkg ..."
  # Static like upstream release builds (no C toolchain needed); tags match
  # upstream's non-debug builds; niced so it does not starve other work.
  (cd "$dir" && CGO_ENABLED=0 nice -n "$NICE" go build -trimpath -buildvcs=false \
    -tags=selinux,notest,grpcnotrace -ldflags="$ldflags" -o "$BIN/$name.tmp" "$pkg") ||
    die "building $name failed"
  mv -f "$BIN/$name.tmp" "$BIN/$name"
  log "built $name in $((SECONDS - start))s ($(du -h "$BIN/$name" | cut -f1))"
}

total=$SECONDS
pin_kubernetes
pin_etcd
mkdir -p "$BIN"
rm -f "$STAMP"

# Version stamping as upstream's hack/lib/version.sh does, so /version and
# `kubectl version` report the real release instead of v0.0.0-master.
minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
ld="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ld+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  ld+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
done
for cmd in "${K8S_CMDS[@]}"; do
  build "$cmd" "$UPSTREAM/kubernetes" "k8s.io/kubernetes/cmd/$cmd" "$ld"
done
build etcd "$UPSTREAM/etcd" go.etcd.io/etcd/server/v3 "-s -w"

echo "k8s=$K8S_VERSION etcd=$ETCD_VERSION" >"$STAMP"
log "all binaries built in $((SECONDS - total))s into $BIN"
echo "$BIN"
