#!/usr/bin/env bash
# Benchmark of what pending pods cost the allocator (issue: tenant boundary): the real
# `nano-gpu-allocator serve` against a fake API server with 500 nodes x 8 cards and 4,000 placed pods,
# once alone and once with 1,000 pending GPU pods whose annotations are the largest a tenant can give
# (a 1 KiB nano-gpu/gpu-model of 32 models, 250 KiB of other annotations). Prints one JSON line with
# both runs' resident memory and the growth per pending pod. Extra flags go to the driver
# (--nodes N --cards N --placed N --pending N --filler-kib N --listing paged|streamed).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p nano-gpu-allocator -p nano-gpu-tests --bin nano-gpu-allocator --bin bench-pending >&2
target="${CARGO_TARGET_DIR:-target}/release"
"$target/bench-pending" --allocator "$target/nano-gpu-allocator" "$@"
