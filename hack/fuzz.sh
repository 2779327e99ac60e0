#!/usr/bin/env bash
# Every decoder that reads what others write (tests/fuzz/src/lib.rs), fed for a fixed budget:
#   hack/fuzz.sh [CASES]              proptest on stable Rust (tests/tests/fuzz.rs): CASES inputs per
#                                     property (default 20000; the test run uses proptest's 256)
#   hack/fuzz.sh --coverage [SECONDS] libFuzzer, coverage-guided (cargo fuzz on nightly, both installed
#                                     here if missing): SECONDS per entry point (default 60), from the
#                                     corpus kept in the cache (started from nano_gpu_fuzz::seeds)
# A failure prints the input (proptest: the smallest it found; libFuzzer: the file under
# tests/fuzz/artifacts/); add it to tests/tests/fuzz.rs as a named regression case.
# Env: FUZZ_SANITIZER (default none: safe Rust; `address` for ASan), NANO_GPU_CACHE.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS

if [[ ${1:-} != --coverage ]]; then
  cases=${1:-20000}
  PROPTEST_CASES=$cases cargo test --locked -p nano-gpu-tests --test fuzz -- --test-threads 2
  echo "fuzz: $cases inputs per property, every property passed, in $((SECONDS - start)) s"
  exit 0
fi

seconds=${2:-60}
cache=${NANO_GPU_CACHE:-$HOME/.cache/nano-gpu}
cargo_fuzz_version=0.13.2
rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
fuzz_root=$cache/cargo-fuzz-$cargo_fuzz_version
if [[ ! -x $fuzz_root/bin/cargo-fuzz ]]; then
  cargo install --locked cargo-fuzz --version "$cargo_fuzz_version" --root "$fuzz_root"
fi
export PATH=$fuzz_root/bin:$PATH
corpus=$cache/fuzz-corpus
targets=$(cargo run --locked -q -p nano-gpu-fuzz --bin fuzz-seeds -- "$corpus")
failed=()
for target in $targets; do
  before=$(find "$corpus/$target" -type f | wc -l)
  if cargo +nightly fuzz run --fuzz-dir tests/fuzz --features libfuzzer -s "${FUZZ_SANITIZER:-none}" \
    "$target" "$corpus/$target" -- -max_total_time="$seconds" -rss_limit_mb=4096 -print_final_stats=1 \
    >"$cache/fuzz-$target.log" 2>&1; then
    stats=$(grep -E '^stat::number_of_executed_units|^stat::peak_rss_mb' "$cache/fuzz-$target.log" | tr '\n' ' ')
    echo "fuzz: $target: ${seconds}s, corpus $before -> $(find "$corpus/$target" -type f | wc -l) inputs, $stats"
  else
    failed+=("$target")
    echo "fuzz: $target FAILED; its log: $cache/fuzz-$target.log, the input under tests/fuzz/artifacts/$target/"
    grep -E 'panicked|ERROR|SUMMARY|Test unit written' "$cache/fuzz-$target.log" | head -5
  fi
done
((${#failed[@]} == 0)) || { echo "fuzz: failed: ${failed[*]}"; exit 1; }
echo "fuzz: coverage-guided, ${seconds}s per entry point, nothing found, in $((SECONDS - start)) s"
