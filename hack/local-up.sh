#!/usr/bin/env bash
# README command 1: a local cluster with simulated GPU nodes (hack/cluster.sh: upstream etcd,
# kube-apiserver and kube-scheduler, the allocator, per node a kubelet stand-in and an agent on fake
# NVML cards), then deploy/examples/ applied and the placement shown with `nano-gpu-allocator inspect`.
# Runs until Ctrl-C, which stops everything.
#
# Usage: hack/local-up.sh [--nodes N] [--dir DIR]   (default 3 nodes, DIR .cache/local-up)
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

bash "$ROOT/hack/control-plane.sh" stop "$DIR" >/dev/null 2>&1 || true
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
"$NANO_GPU_BIN/nano-gpu-allocator" --kubeconfig "$ADMIN_KUBECONFIG" inspect
cat <<MSG

The cluster runs until Ctrl-C. Try:
  $K8S_BIN/kubectl --kubeconfig $ADMIN_KUBECONFIG get pods -A
  $NANO_GPU_BIN/nano-gpu-allocator --kubeconfig $ADMIN_KUBECONFIG inspect
What each container got (env, device IDs): $DIR/nodes/<node>/standin-state.json
Logs: $DIR/*.log
MSG
while true; do sleep 3600; done
