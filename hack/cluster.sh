#!/usr/bin/env bash
# A local nano-gpu cluster with simulated GPU nodes, from real parts:
#   - etcd, kube-apiserver (RBAC) and kube-scheduler built from upstream (hack/k8s-build.sh);
#   - deploy/ applied as shipped: namespace, RBAC, scheduler ConfigMap, webhook configuration, ...;
#   - kube-scheduler started with the KubeSchedulerConfiguration of deploy/scheduler-config.yaml;
#   - nano-gpu-allocator with its webhook registered;
#   - per node: a kubelet stand-in (upstream kubelet device manager, hack/kubelet-standin) and a
#     nano-gpu-agent reading fake cards through the real NVML path (libfakenvml.so).
# The components run as local processes instead of the Deployment and DaemonSet (there are no
# container runtime and no controller-manager here); what has to change for that is swapped in the
# applied objects, and said below where it happens. Each component authenticates with a token of the
# ServiceAccount deploy/ gives it, so the shipped RBAC is what is tested.
#
# Usage: hack/cluster.sh up <dir> [--nodes N]   (prints nothing on stdout; sources <dir>/cluster.env)
#        hack/cluster.sh down <dir>             (stops every process it started; nothing is left)
# Env:   NANO_GPU_BIN        dir with nano-gpu-allocator and nano-gpu-agent (default: release build)
#        NANO_GPU_FAKE_NVML  path of libfakenvml.so (default: next to the binaries)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
log() { echo "cluster: $*" >&2; }
die() { log "error: $*"; exit 1; }

[[ $# -ge 2 ]] || die "usage: $0 up|down <dir> [--nodes N]"
CMD=$1
DIR=$(realpath -m "$2")
shift 2
NODES=3
while [[ $# -gt 0 ]]; do
  case $1 in
    --nodes) NODES=$2; shift 2 ;;
    *) die "unknown flag $1" ;;
  esac
done

if [[ $CMD == down ]]; then
  exec bash "$ROOT/hack/control-plane.sh" stop "$DIR"
fi
[[ $CMD == up ]] || die "unknown command $CMD"

# Our binaries.
if [[ -z ${NANO_GPU_BIN:-} ]]; then
  (cd "$ROOT" && cargo build --release --locked -p nano-gpu-allocator -p nano-gpu-agent -p fakenvml >&2)
  NANO_GPU_BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release
fi
FAKE_NVML=${NANO_GPU_FAKE_NVML:-$NANO_GPU_BIN/libfakenvml.so}
for f in "$NANO_GPU_BIN/nano-gpu-allocator" "$NANO_GPU_BIN/nano-gpu-agent" "$FAKE_NVML"; do
  [[ -e $f ]] || die "$f missing"
done

# Upstream binaries and the control plane (its `stop` later stops everything with a pid file here).
K8S_BIN=$(bash "$ROOT/hack/k8s-build.sh")
(( NODES == 0 )) || [[ -x $K8S_BIN/kubelet-standin ]] || die "$K8S_BIN/kubelet-standin missing"
mkdir -p "$DIR"
K8S_BIN=$K8S_BIN bash "$ROOT/hack/control-plane.sh" start "$DIR" >&2
# shellcheck source=/dev/null
source "$DIR/control-plane.env"
trap 'log "up failed; logs in $DIR"; bash "$ROOT/hack/control-plane.sh" stop "$DIR"' EXIT
# shellcheck source=hack/lib.sh
source "$ROOT/hack/lib.sh"

# The shipped manifests, as they are.
kubectl apply -f "$ROOT/deploy/" >&2

# sa_kubeconfig FILE SERVICEACCOUNT: a kubeconfig with a token of that ServiceAccount.
sa_kubeconfig() {
  local token
  token=$(kubectl create token "$2" -n nano-gpu-system --duration=48h)
  cat >"$DIR/$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: local
  cluster:
    server: $APISERVER_URL
    certificate-authority-data: $(base64 -w0 <"$DIR/pki/ca.crt")
users:
- name: $2
  user:
    token: $token
contexts:
- name: $2
  context: { cluster: local, user: $2 }
current-context: $2
EOF
}
sa_kubeconfig allocator.kubeconfig nano-gpu-allocator
sa_kubeconfig agent.kubeconfig nano-gpu-agent

free_port EXTENDER_PORT; free_port WEBHOOK_PORT; free_port SCHEDULER_PORT
# Swapped: the webhook reaches the allocator process on loopback instead of through its Service.
kubectl patch mutatingwebhookconfiguration nano-gpu-allocator --type=json -p \
  "[{\"op\":\"replace\",\"path\":\"/webhooks/0/clientConfig\",\"value\":{\"url\":\"https://localhost:$WEBHOOK_PORT/mutate\"}}]" >&2

launch allocator env POD_NAME=allocator-0 POD_NAMESPACE=nano-gpu-system \
  "$NANO_GPU_BIN/nano-gpu-allocator" --kubeconfig "$DIR/allocator.kubeconfig" serve \
  --listen "127.0.0.1:$EXTENDER_PORT" --tls-listen "127.0.0.1:$WEBHOOK_PORT" --tls-dns-names localhost \
  --leader-elect --gpushare gib
wait_for "allocator (leader)" 60 curl -sf "http://127.0.0.1:$EXTENDER_PORT/readyz"

# kube-scheduler with the shipped configuration; swapped: the extender URL (loopback instead of the
# Service) and the client connection (a ServiceAccount token instead of in-cluster).
kubectl get configmap nano-gpu-scheduler-config -n nano-gpu-system \
  -o jsonpath='{.data.scheduler-config\.yaml}' >"$DIR/scheduler-config.yaml"
sed -i "s#urlPrefix: .*#urlPrefix: http://127.0.0.1:$EXTENDER_PORT#" "$DIR/scheduler-config.yaml"
printf 'clientConnection:\n  kubeconfig: %s\n' "$DIR/allocator.kubeconfig" >>"$DIR/scheduler-config.yaml"
launch kube-scheduler "$K8S_BIN/kube-scheduler" --config "$DIR/scheduler-config.yaml" \
  --secure-port "$SCHEDULER_PORT" --bind-address 127.0.0.1 \
  --authentication-kubeconfig "$DIR/allocator.kubeconfig" --authorization-kubeconfig "$DIR/allocator.kubeconfig"
wait_for kube-scheduler 60 curl -skf "https://127.0.0.1:$SCHEDULER_PORT/healthz"

# shellcheck source=hack/cards.sh
source "$ROOT/hack/cards.sh"

for ((k = 1; k <= NODES; k++)); do
  node=node-$k
  root=$DIR/nodes/$node
  mkdir -p "$root/device-plugins" "$root/pod-resources" "$root/sys/class/drm"
  nvml_config "$node" "$k" >"$root/nvml.json"
  launch "standin-$node" "$K8S_BIN/kubelet-standin" --kubeconfig "$ADMIN_KUBECONFIG" --node-name "$node" \
    --root-dir "$root"
  probe=0; free_port probe
  echo "$probe" >"$root/agent-probe-port"
  launch "agent-$node" env FAKE_NVML_CONFIG="$root/nvml.json" RUST_LOG=info \
    "$NANO_GPU_BIN/nano-gpu-agent" --kubeconfig "$DIR/agent.kubeconfig" --node-name "$node" \
    --plugin-dir "$root/device-plugins" --pod-resources-socket "$root/pod-resources/kubelet.sock" \
    --nvml-lib "$FAKE_NVML" --sysfs-root "$root/sys" --gpushare gib --probe-listen "127.0.0.1:$probe" \
    --refresh-seconds 5 --xid-quiet-seconds 10
done
for ((k = 1; k <= NODES; k++)); do
  node=node-$k
  wait_for "agent on $node" 60 curl -sf "http://127.0.0.1:$(cat "$DIR/nodes/$node/agent-probe-port")/readyz"
  wait_for "$node allocatable" 60 gpu_allocatable "$node"
done
# The allocator has seen every node's cards.
for ((k = 1; k <= NODES; k++)); do
  wait_for "allocator view of node-$k" 60 bash -c "curl -sf http://127.0.0.1:$EXTENDER_PORT/inspect | grep -q '\"GPU-node-$k-0\"'"
done

cat >"$DIR/cluster.env" <<EOF
K8S_BIN=$K8S_BIN
NANO_GPU_BIN=$NANO_GPU_BIN
ADMIN_KUBECONFIG=$ADMIN_KUBECONFIG
APISERVER_URL=$APISERVER_URL
EXTENDER_URL=http://127.0.0.1:$EXTENDER_PORT
WEBHOOK_PORT=$WEBHOOK_PORT
SCHEDULER_PORT=$SCHEDULER_PORT
NODES=$NODES
EOF
trap - EXIT
log "up: $NODES nodes; kubectl --kubeconfig $ADMIN_KUBECONFIG ...; stop with: $0 down $DIR"
