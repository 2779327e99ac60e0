#!/usr/bin/env bash
# README command 2: every test of the project, with the lint gates CI enforces, end-to-end tests
# against the real control plane included.
# Needs ../shared beside the repository (the openb trace), or NANO_GPU_SHARED pointing at it, Go
# (to build upstream etcd and Kubernetes from the Go module proxy), and for the real-node tests root
# with Debian's containerd, runc, containernetworking-plugins, iptables, conntrack, busybox-static and
# chromium-headless-shell (the GPU map's browser test) and prometheus (the monitoring kit's test)
# (.ci/run installs them).
set -euo pipefail
cd "$(dirname "$0")/.."

# Each step is announced with "== what", and its time printed when the next begins: CI keeps the
# whole command under an hour, and these lines show where the time goes.
step_name=
step() {
  if [[ -n $step_name ]]; then echo "== ($step_name: $((SECONDS - step_start)) s)"; fi
  step_name=$1
  step_start=$SECONDS
  [[ -z $1 ]] || echo "== $1"
}

# The test clusters' nodes and the build share the disk; a node with too little of it left stops
# scheduling (DiskPressure), which reads as a cluster that never came up.
for dir in "${CARGO_TARGET_DIR:-target}" "${TMPDIR:-/tmp}"; do
  mkdir -p "$dir"
  free_gb=$(( $(df -Pk "$dir" | awk 'NR == 2 { print $4 }') / 1024 / 1024 ))
  echo "== disk: ${free_gb} GB free for $dir"
  if (( free_gb < 10 )); then echo "warning: under 10 GB free for $dir; the cluster tests need several" >&2; fi
done
step "cargo fmt --check"
cargo fmt --all -- --check
step "cargo clippy --all-targets -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings
# The engine alone, with proto's features as the engine asks them (none): in the workspace build
# above, features other crates turn on could hide an engine that reaches for proto's k8s or gRPC parts.
step "cargo clippy -p nano-gpu-engine (the pure engine builds on its own)"
cargo clippy -p nano-gpu-engine --all-targets --locked -- -D warnings
# The book: mdBook must build it (a page missing from its contents fails); its links, anchors and
# reference pages are checked by the docs test below.
step "the book (hack/book.sh)"
bash hack/book.sh
# The end-to-end tests run real upstream Kubernetes: build it first (once per version, cached), so
# its build shows here rather than inside a test. The newest tested version is the default; the
# end-to-end test runs again on the oldest still supported.
OLDEST=v1.35.8
step "upstream Kubernetes binaries (hack/k8s-build.sh): the newest, and $OLDEST"
bash hack/k8s-build.sh >/dev/null
NANO_GPU_K8S_VERSION=$OLDEST bash hack/k8s-build.sh >/dev/null
step "containerd 2 for the containerd-2 nodes (hack/containerd-build.sh)"
bash hack/containerd-build.sh >/dev/null
step "gpushare's kubectl plugin from ../shared/tools (hack/gpushare-inspect-build.sh)"
bash hack/gpushare-inspect-build.sh >/dev/null
step "the Prometheus Operator, for its component's test (hack/prometheus-operator-build.sh)"
bash hack/prometheus-operator-build.sh >/dev/null
# The upgrade test starts from the previous version: built once per commit (a cold build of its
# binaries takes some minutes), here rather than inside the test.
step "the previous version, for the upgrade test (hack/previous-build.sh)"
bash hack/previous-build.sh >/dev/null
# README command 1 as a newcomer runs it, stopping by itself once the examples are placed. CI keeps
# its target directory between runs: what cargo placed at the top of target/debug goes first, so the
# command must build (or link anew) every binary it runs rather than find one an earlier command left
# there. Its build is the one the tests below use.
step "README command 1: hack/local-up.sh --check"
built=${CARGO_TARGET_DIR:-target}/debug
if [[ -d $built ]]; then find "$built" -maxdepth 1 -type f -delete; fi
bash hack/local-up.sh --check
step "cargo test --workspace --no-run (the test binaries' build)"
cargo test --workspace --locked --no-run
step "cargo test --workspace"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo test --workspace --locked --no-fail-fast 2>&1 | tee "$log"
step "the end-to-end test on Kubernetes $OLDEST"
# --workspace, as above: naming the package alone unifies other features and builds everything again.
NANO_GPU_K8S_VERSION=$OLDEST cargo test --workspace --test e2e --locked 2>&1 | tee -a "$log"
step ""
echo "== all steps: $SECONDS s"
# One closing line over every test binary of the run.
awk '/^test result:/ { p += $4; f += $6 } END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
