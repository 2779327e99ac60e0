#!/usr/bin/env bash
# Benchmark of an agent rollout's handover (what a kubelet before 1.36 sees): two real agents over a
# fake kubelet's unix sockets, the old one stopped with SIGTERM; prints one JSON line with the window
# between the end of the old agent's stream and the new agent's registration anew. Extra flags go to
# the driver (--rounds N).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p nano-gpu-agent -p nano-gpu-tests --bin nano-gpu-agent --bin bench-rollout >&2
target="${CARGO_TARGET_DIR:-target}/release"
exec "$target/bench-rollout" --agent "$target/nano-gpu-agent" "$@"
