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

# Each step is announced with "== what", and its time printed when the next begins; the last line
# but one gives every step's and every job's time as one JSON object, so a regression shows in the
# log of the run that caused it. Budgets: docs/src/development/tests.md#ci.
step_name=
steps_json=
step() {
  if [[ -n $step_name ]]; then
    echo "== ($step_name: $((SECONDS - step_start)) s)"
    steps_json+="${steps_json:+,}{\"step\":\"$step_name\",\"seconds\":$((SECONDS - step_start))}"
  fi
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
step "shellcheck (hack/, .ci/run)"
shellcheck hack/*.sh .ci/run
# The end-to-end tests run real upstream Kubernetes: the newest tested version here (README command 1
# starts a cluster of it); the other upstream parts only some suites use are built by
# hack/run-tests.sh while the tests run. The oldest still supported is not in this command: the
# end-to-end suite on it is `bash hack/run-tests.sh LOG e2e@oldest` (a second Kubernetes build).
step "upstream Kubernetes binaries (hack/k8s-build.sh), the newest"
bash hack/k8s-build.sh >/dev/null
# README command 1 as a newcomer runs it, stopping by itself once the examples are placed. CI keeps
# its target directory between runs: what cargo placed at the top of target/debug goes first, so the
# command must build (or link anew) every binary it runs rather than find one an earlier command left
# there. Its build (`cargo build --workspace --all-targets`) is the one the tests below use.
step "README command 1: hack/local-up.sh --check"
built=${CARGO_TARGET_DIR:-target}/debug
if [[ -d $built ]]; then find "$built" -maxdepth 1 -type f -delete; fi
bash hack/local-up.sh --check
step "cargo test --workspace --no-run (the test binaries' build)"
cargo test --workspace --locked --no-run
# Every test binary, the lints and the book, side by side (hack/run-tests.sh says how), each job's
# output printed whole when it ends.
step "tests, lints and the book (hack/run-tests.sh)"
log=$(mktemp)
trap 'rm -f "$log" "$log.times"' EXIT
status=0
NANO_GPU_JOB_TIMES=$log.times bash hack/run-tests.sh "$log" || status=$?
step ""
echo "== all steps: $SECONDS s"
[[ ! -s $log.times ]] || steps_json+=",$(paste -sd, "$log.times")"
echo "ci-steps: {\"total_seconds\":$SECONDS,\"steps\":[$steps_json]}"
# One closing line over every test binary of the run.
awk '/^test result:/ { p += $4; f += $6 } END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
exit "$status"
