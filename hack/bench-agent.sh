#!/usr/bin/env bash
# Benchmark of the node agent (issue: node agent): the real `nano-gpu-agent` with 8 fake cards, a fake
# API server holding the node's pods and a fake kubelet over real unix sockets; GetPreferredAllocation
# -> Allocate -> PreStartContainer per pod with 50 more pods pending. Prints one JSON line. Extra flags
# go to the driver (--cards N --pending N --measured N --rounds N --idle-seconds N).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p nano-gpu-agent -p nano-gpu-tests --bin nano-gpu-agent --bin bench-agent >&2
target="${CARGO_TARGET_DIR:-target}/release"
exec "$target/bench-agent" --agent "$target/nano-gpu-agent" "$@"
