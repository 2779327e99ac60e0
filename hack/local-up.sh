#!/usr/bin/env bash
# README command 1: the local cluster with simulated GPU nodes (hack/cluster.sh: real kubelets on
# containerd in one network namespace, upstream control plane, nano-gpu installed as shipped on fake
# NVML cards), then deploy/examples/ applied, what each example container saw, and the placement
# shown with `nano-gpu-allocator inspect`. Runs until Ctrl-C, which takes everything down.
#
# Usage: hack/local-up.sh [--nodes N] [--dir DIR]   (default 3 nodes, DIR .cache/local-up; needs root)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
NODES=3
DIR=$ROOT/.cache/local-up
while [[ $# -gt 0 ]]; do
  case $1 in
    --nodes) NODES=$2; shift 2 ;;
    --dir) DIR=$2; shift 2 ;;
    *) echo "usage: $0 [--nodes N] [--dir DIR]" >&2; exit 2 ;;
  esac
done
DIR=$(realpath -m "$DIR")

# A cluster left from an earlier run (killed without Ctrl-C) goes first.
bash "$ROOT/hack/cluster.sh" down "$DIR" >/dev/null 2>&1 || true
trap 'echo; echo "stopping..."; bash "$ROOT/hack/cluster.sh" down "$DIR"' EXIT
trap 'exit 130' INT TERM
bash "$ROOT/hack/cluster.sh" up "$DIR" --nodes "$NODES"
# shellcheck source=/dev/null
source "$DIR/cluster.env"
kubectl() { "$K8S_BIN/kubectl" --kubeconfig "$ADMIN_KUBECONFIG" "$@"; }

kubectl apply -f "$ROOT/deploy/examples/"
echo "waiting for the example pods to run..."
kubectl wait --for=jsonpath='{.status.phase}'=Running pod --all -n nano-gpu-demo --timeout=120s || true
kubectl get pods -n nano-gpu-demo -o wide
echo
for pod in $(kubectl get pods -n nano-gpu-demo -o jsonpath='{.items[*].metadata.name}'); do
  echo "== $pod: what its containers saw (nvidia-smi -L, GPU env)"
  kubectl logs -n nano-gpu-demo "$pod" --all-containers --prefix 2>/dev/null || true
done
echo
"$NANO_GPU_BIN/nano-gpu-allocator" --kubeconfig "$ADMIN_KUBECONFIG" inspect --gpushare gib
cat <<MSG

The cluster runs until Ctrl-C. Try:
  $K8S_BIN/kubectl --kubeconfig $ADMIN_KUBECONFIG get pods -A -o wide
  $K8S_BIN/kubectl --kubeconfig $ADMIN_KUBECONFIG exec -n nano-gpu-demo share-30 -- nvidia-smi -L
  $NANO_GPU_BIN/nano-gpu-allocator --kubeconfig $ADMIN_KUBECONFIG inspect --gpushare gib
Logs: $DIR/*.log (control plane, kubelets, containerd), pods' logs under $DIR/nodes/<node>/var/log/pods
MSG
while true; do sleep 3600; done
