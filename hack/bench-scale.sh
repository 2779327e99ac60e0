#!/usr/bin/env bash
# Benchmark at Kubernetes' scale (issue: 5,000 nodes and 150,000 pods): the real etcd, kube-apiserver
# and kube-scheduler (nano-gpu's profile, deploy/scheduler-config.yaml) and the allocator's binary,
# against kubelet-less nodes written as the agents would write them (tests/src/bin/bench-scale.rs).
# For each size: a fresh control plane on this machine's loopback, the nodes and their placed pods,
# then the allocator and kube-scheduler, then the bursts. Prints JSON lines (scale-fill, scale-rest,
# scale-burst per burst, scale-ratio: the GPU bursts' throughput over the others', the median of
# --rounds rounds), then stops the deciding replica (scale-failover, scale-probe), restarts
# the API server (scale-probe) and checks what must hold (scale-check: fails the script when it does
# not). Not in CI: at 5,000 nodes it runs for long.
# Usage: hack/bench-scale.sh [--sizes 500,1000,2000] [--pods-per-node 30] [--burst N] [--gpu-fill F]
#                            [--rounds 3]   (rounds of the GPU, CPU-only and extended bursts)
#                            [--replicas 2]  (allocator + kube-scheduler pairs, as the Deployment runs)
#                            [--waiting N]  (N GPU pods that fit nowhere wait through the run: how
#                                            often kube-scheduler tries them and what it costs)
#                            [--percent-counted]  (the profile before 2026-11-29: kube-scheduler counts
#                                                  nano-gpu/gpu-percent, ignoredByScheduler: false, and
#                                                  SchedulerPopFromBackoffQ stays on; to compare)
#                            [--scheduler-flag F]...  (one more flag for both kube-schedulers)
#                            [--keep]   (leave the last size's cluster running; its dir is printed)
# Env:   NANO_GPU_TRACE  the pod list (default: openb's default list in ../shared, where it lies)
#        NANO_GPU_ALLOCATOR_BIN  the allocator binary to measure (default: the one built here; for a
#                                baseline, e.g. one built from an earlier commit)
# The shipped kube-scheduler configuration leaves its client at 50 QPS (burst 100), which caps binds at
# about 50/s: here both QPS and burst are raised (1,000 and 2,000), for the GPU and CPU-only bursts alike.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=hack/lib.sh
source "$ROOT/hack/lib.sh"
log() { echo "bench-scale: $*" >&2; }
die() { log "error: $*"; exit 1; }

SIZES=500,1000,2000 PER_NODE=30 BURST='' FILL=0.6 KEEP='' REPLICAS=2 ROUNDS=3 WAITING=0 COUNTED=''
SCHEDULER_FLAGS=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --sizes) SIZES=$2; shift 2 ;;
    --pods-per-node) PER_NODE=$2; shift 2 ;;
    --burst) BURST=$2; shift 2 ;;
    --gpu-fill) FILL=$2; shift 2 ;;
    --replicas) REPLICAS=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --waiting) WAITING=$2; shift 2 ;;
    --percent-counted) COUNTED=1; shift ;;
    --scheduler-flag) SCHEDULER_FLAGS+=("$2"); shift 2 ;;
    --keep) KEEP=1; shift ;;
    *) die "unknown flag $1" ;;
  esac
done
TRACE=${NANO_GPU_TRACE:-$ROOT/../shared/traces/openb/openb_pod_list_default.csv}
trace_flag=()
if [[ -f $TRACE ]]; then trace_flag=(--trace "$TRACE"); else log "no $TRACE: a synthetic pod list"; fi

# The shipped kube-scheduler's feature gates (deploy/allocator.yaml), but with --percent-counted;
# before --scheduler-flag's, which so may override them.
if [[ -z $COUNTED ]]; then
  mapfile -t gates < <(sed -n 's/^ *- \(--feature-gates=.*\)$/\1/p' "$ROOT/deploy/allocator.yaml")
  SCHEDULER_FLAGS=("${gates[@]}" "${SCHEDULER_FLAGS[@]}")
fi

# The shipped Deployment's --require-ready-agent: the allocator places only where a Ready agent pod
# runs (the driver writes one per node, as the DaemonSet and kubelet would).
mapfile -t AGENT_FLAG < <(sed -n 's/^ *- \(--require-ready-agent=.*\)$/\1/p' "$ROOT/deploy/allocator.yaml")
[[ ${#AGENT_FLAG[@]} -eq 1 ]] || die "deploy/allocator.yaml: no --require-ready-agent flag found"

cd "$ROOT"
cargo build --release --locked -p nano-gpu-allocator -p nano-gpu-tests --bin nano-gpu-allocator --bin bench-scale >&2
BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release
ALLOCATOR=${NANO_GPU_ALLOCATOR_BIN:-$BIN/nano-gpu-allocator}
K8S_BIN=${K8S_BIN:-$(bash "$ROOT/hack/k8s-build.sh")}

# The shipped scheduler configuration, with this run's extender address and a faster client (and,
# with --percent-counted, kube-scheduler counting nano-gpu/gpu-percent itself).
scheduler_config() {
  local counted=()
  if [[ -n $COUNTED ]]; then
    counted=(-e '/- name: nano-gpu\/gpu-percent/{n;s/ignoredByScheduler: true/ignoredByScheduler: false/}')
  fi
  sed -n '/scheduler-config.yaml: |/,$p' "$ROOT/deploy/scheduler-config.yaml" | tail -n +2 | sed 's/^    //' |
    sed -e "s#urlPrefix: http://127.0.0.1:8888#urlPrefix: http://127.0.0.1:$1#" "${counted[@]}"
  printf 'clientConnection:\n  kubeconfig: %s\n  qps: 1000\n  burst: 2000\n' "$ADMIN_KUBECONFIG"
}

# replica NAME: the pod object of replica NAME (for its leader label and catch-up mark), its
# allocator, and its kube-scheduler under the pod's name as host name (the identity the allocator
# follows); appends its --replica flag to REPLICA_FLAGS.
replica() {
  local name=$1 ap sp op
  "$K8S_BIN/kubectl" --kubeconfig "$ADMIN_KUBECONFIG" apply -f - >&2 <<EOF
apiVersion: v1
kind: Pod
metadata: { name: $name, namespace: nano-gpu-system, labels: { app.kubernetes.io/name: nano-gpu-allocator } }
spec:
  nodeName: node-00000
  containers: [{ name: allocator, image: registry.k8s.io/pause:3.10 }]
EOF
  free_port ap; free_port sp; free_port op
  scheduler_config "$ap" >"$DIR/scheduler-$name.yaml"
  launch "allocator-$name" env POD_NAME="$name" POD_NAMESPACE=nano-gpu-system "$ALLOCATOR" \
    --kubeconfig "$ADMIN_KUBECONFIG" serve --listen "127.0.0.1:$ap" --operator-listen "127.0.0.1:$op" --leader-elect \
    --follow-scheduler-lease nano-gpu-scheduler "${AGENT_FLAG[@]}"
  # shellcheck disable=SC2016 # expanded by the inner shell
  launch "kube-scheduler-$name" unshare --uts sh -c 'hostname "$0" && exec "$@"' "$name" \
    "$K8S_BIN/kube-scheduler" --config "$DIR/scheduler-$name.yaml" \
    --authentication-kubeconfig "$ADMIN_KUBECONFIG" --authorization-kubeconfig "$ADMIN_KUBECONFIG" \
    --bind-address 127.0.0.1 --secure-port "$sp" --leader-elect-resource-namespace nano-gpu-system \
    "${SCHEDULER_FLAGS[@]}"
  REPLICA_FLAGS+=(--replica "$name,127.0.0.1:$ap,$(cat "$DIR/allocator-$name.pid"),$(cat "$DIR/kube-scheduler-$name.pid"),127.0.0.1:$sp,127.0.0.1:$op")
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

  REPLICA_FLAGS=()
  for ((r = 1; r <= REPLICAS; r++)); do replica "nano-gpu-allocator-$r"; done
  common=(--kubeconfig "$ADMIN_KUBECONFIG" --label "$nodes")
  "$BIN/bench-scale" measure "${common[@]}" "${REPLICA_FLAGS[@]}" --burst "$burst" --rounds "$ROUNDS" \
    --waiting "$WAITING" \
    "${trace_flag[@]}" --control-plane "$(cat "$DIR/etcd.pid"),$(cat "$DIR/kube-apiserver.pid")"
  if ((REPLICAS > 1)); then "$BIN/bench-scale" failover "${common[@]}" "${REPLICA_FLAGS[@]}" --what failover; fi
  # The API server killed and started again 2 s later: the time until a new share, created from
  # 0.3 s after the kill on, is bound.
  crash kube-apiserver 2 &
  restart=$!
  sleep 0.3
  "$BIN/bench-scale" probe "${common[@]}" --what apiserver-restart
  wait "$restart"
  "$BIN/bench-scale" check "${common[@]}"
done
if [[ -n $KEEP ]]; then log "left running: $DIR (stop: hack/control-plane.sh stop $DIR)"; fi
