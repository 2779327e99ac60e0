#!/usr/bin/env bash
# Benchmark of the extender service (issue: allocator service): the real `nano-gpu-allocator serve`
# on loopback, a fake API server with 5,000 nodes x 8 cards and 40,000 placed pods, then
# filter -> prioritize -> bind for 10,000 new pods. Prints three JSON lines (see below). Extra flags go to the driver
# (--nodes N --cards N --placed N --pods N).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p nano-gpu-allocator -p nano-gpu-tests --bin nano-gpu-allocator --bin bench-extender >&2
target="${CARGO_TARGET_DIR:-target}/release"
# First line: the usual mix (6 request shapes). Second line: 2,000 distinct CPU requests (exact CPU
# requests users choose), with a `shapes` field; targets and measured numbers in the README.
"$target/bench-extender" --allocator "$target/nano-gpu-allocator" "$@"
"$target/bench-extender" --allocator "$target/nano-gpu-allocator" --shapes 2000 "$@"
# Third line: the first's mix while /metrics and /map/data are each read every second (Prometheus
# scraping, the GPU map polling), with a `scrape` field; compare its verbs with the first line's.
"$target/bench-extender" --allocator "$target/nano-gpu-allocator" --scrape-ms 1000 "$@"
