#!/usr/bin/env bash
# Structured random inputs for every decoder that reads what others write (tests/tests/fuzz.rs), for
# a fixed budget: CASES inputs per property (default 20000; the test run uses proptest's 256).
# A failure prints the smallest input proptest found; add it to tests/tests/fuzz.rs as a named case.
# Usage: hack/fuzz.sh [CASES]
set -euo pipefail
cd "$(dirname "$0")/.."
cases=${1:-20000}
start=$SECONDS
PROPTEST_CASES=$cases cargo test --locked -p nano-gpu-tests --test fuzz -- --test-threads 2
echo "fuzz: $cases inputs per property, every property passed, in $((SECONDS - start)) s"
