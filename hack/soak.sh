#!/usr/bin/env bash
# The soak (tests/tests/soak.rs) for MINUTES (default 30; the test run does 3): GPU pods created and
# deleted without pause on the local cluster while every part of the system is restarted in turn,
# then the fault suite's invariants; prints the resident memory and open descriptors of every
# allocator and agent process over the run. Needs what `bash hack/test.sh` needs (root, ../shared).
# Usage: hack/soak.sh [MINUTES] (NANO_GPU_SOAK_SEED=N repeats a run's choices)
set -euo pipefail
cd "$(dirname "$0")/.."
minutes=${1:-30}
bash hack/k8s-build.sh >/dev/null
cargo build --locked -p nano-gpu-agent -p nano-gpu-allocator
start=$SECONDS
NANO_GPU_SOAK_SECONDS=$((minutes * 60)) cargo test --locked -p nano-gpu-tests --test soak -- --nocapture 2>&1 |
  grep -E '^(soak:|test |thread|  left|  right|assertion)|panicked'
echo "soak: $minutes min of churn passed in $((SECONDS - start)) s"
