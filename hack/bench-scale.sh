#!/usr/bin/env bash
# Benchmark at Kubernetes' scale (issue: 5,000 nodes and 150,000 pods): the real etcd, kube-apiserver
# and kube-scheduler (nano-gpu's profile, deploy/scheduler-config.yaml) and the allocator's binary,
# against kubelet-less nodes written as the agents would write them (tests/src/bin/bench-scale.rs).
# For each size: a fresh control plane on this machine's loopback, the nodes and their placed pods,
# then the allocator and kube-scheduler, then the bursts. Prints JSON lines (scale-fill, scale-rest,
# scale-burst per burst kind). Not in CI: at 5,000 nodes it runs for long.
# Usage: hack/bench-scale.sh [--sizes 500,1000,2000] [--pods-per-node 30] [--burst N] [--gpu-fill F]
#                            [--keep]   (leave the last size's cluster running; its dir is printed)
# Env:   NANO_GPU_TRACE  the pod list (default: openb's default list in ../shared, where it lies)
# The shipped kube-scheduler configuration leaves its client at 50 QPS (burst 100), which caps binds at
# about 50/s: here both QPS and burst are raised (1,000 and 2,000), for the GPU and CPU-only bursts alike.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=hack/lib.sh
source "$ROOT/hack/lib.sh"
log() { echo "bench-scale: $*" >&2; }
die() { log "error: $*"; exit 1; }

SIZES=500,1000,2000 PER_NODE=30 BURST= FILL=0.6 KEEP=
while [[ $# -gt 0 ]]; do
  case $1 in
    --sizes) SIZES=$2; shift 2 ;;
    --pods-per-node) PER_NODE=$2; shift 2 ;;
    --burst) BURST=$2; shift 2 ;;
    --gpu-fill) FILL=$2; shift 2 ;;
    --keep) KEEP=1; shift ;;
    *) die "unknown flag $1" ;;
  esac
done
TRACE=${NANO_GPU_TRACE:-$ROOT/../shared/traces/openb/openb_pod_list_default.csv}
trace_flag=()
if [[ -f $TRACE ]]; then trace_flag=(--trace "$TRACE"); else log "no $TRACE: a synthetic pod list"; fi

cd "$ROOT"
cargo build --release --locked -p nano-gpu-allocator -p nano-gpu-tests --bin nano-gpu-allocator --bin bench-scale >&2
BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release
K8S_BIN=${K8S_BIN:-$(bash "$ROOT/hack/k8s-build.sh")}

# The shipped scheduler configuration, with this run's extender address, no leader election and a
# faster client.
scheduler_config() {
  sed -n '/scheduler-config.yaml: |/,$p' "$ROOT/deploy/scheduler-config.yaml" | tail -n +2 | sed 's/^    //' |
    sed -e "s#urlPrefix: http://127.0.0.1:8888#urlPrefix: http://127.0.0.1:$1#" -e 's/leaderElect: true/leaderElect: false/'
  printf 'clientConnection:\n  kubeconfig: %s\n  qps: 1000\n  burst: 2000\n' "$ADMIN_KUBECONFIG"
}

DIR=
stop_cluster() {
  if [[ -n $DIR ]]; then bash "$ROOT/hack/control-plane.sh" stop "$DIR" >&2; rm -rf "$DIR"; fi
}
trap 'if [[ -z $KEEP ]]; then stop_cluster; fi' EXIT

IFS=, read -ra sizes <<<"$SIZES"
for nodes in "${sizes[@]}"; do
  stop_cluster
  DIR=$(mktemp -d /tmp/nano-gpu-scale-XXXXXX)
  log "$nodes nodes in $DIR"
  # No node lifecycle controller runs to lift the not-ready taint that admission puts on new nodes.
  LOOPBACK=1 K8S_BIN=$K8S_BIN APISERVER_ARGS=$'--disable-admission-plugins=TaintNodesByCondition' \
    bash "$ROOT/hack/control-plane.sh" start "$DIR" >&2
  # shellcheck source=/dev/null
  source "$DIR/control-plane.env"
  # Room for two GPU bursts on the cards the fill leaves free (openb asks ~0.86 card a GPU pod).
  burst=${BURST:-$(awk -v n="$nodes" -v f="$FILL" 'BEGIN { b = int(n * 8 * (1 - f) * 0.4); print (b > 1000 ? 1000 : b) }')}
  "$BIN/bench-scale" fill --kubeconfig "$ADMIN_KUBECONFIG" --nodes "$nodes" --pods-per-node "$PER_NODE" \
    --gpu-fill "$FILL" --label "$nodes" "${trace_flag[@]}"

  free_port AP; free_port SP
  scheduler_config "$AP" >"$DIR/scheduler.yaml"
  POD_NAMESPACE=nano-gpu-system launch allocator "$BIN/nano-gpu-allocator" --kubeconfig "$ADMIN_KUBECONFIG" \
    serve --listen "127.0.0.1:$AP"
  launch kube-scheduler "$K8S_BIN/kube-scheduler" --config "$DIR/scheduler.yaml" \
    --authentication-kubeconfig "$ADMIN_KUBECONFIG" --authorization-kubeconfig "$ADMIN_KUBECONFIG" \
    --bind-address 127.0.0.1 --secure-port "$SP"
  "$BIN/bench-scale" measure --kubeconfig "$ADMIN_KUBECONFIG" --allocator "127.0.0.1:$AP" \
    --allocator-pid "$(cat "$DIR/allocator.pid")" --burst "$burst" --label "$nodes" "${trace_flag[@]}"
  running "$DIR/allocator.pid" || die "the allocator exited; log: $DIR/allocator.log"
done
if [[ -n $KEEP ]]; then log "left running: $DIR (stop: hack/control-plane.sh stop $DIR)"; fi
