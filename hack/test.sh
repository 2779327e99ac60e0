#!/usr/bin/env bash
# README command 2: every test of the project, with the lint gates CI enforces.
# Needs ../shared beside the repository (the openb trace), or NANO_GPU_SHARED pointing at it.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy --all-targets -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== cargo test --workspace"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo test --workspace --locked 2>&1 | tee "$log"
# One closing line over every test binary of the run.
awk '/^test result:/ { p += $4; f += $6 } END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
