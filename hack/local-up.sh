#!/usr/bin/env bash
# README command 1: the local cluster with simulated GPU nodes (hack/cluster.sh: real kubelets on
# containerd in one network namespace, upstream control plane, nano-gpu installed as shipped on fake
# NVML cards), then deploy/examples/ applied, what each example container saw, and the placement
# shown with `nano-gpu-allocator inspect`. Runs until Ctrl-C, which takes everything down.
#
# Usage: hack/local-up.sh [--nodes N] [--dir DIR] [--check]
#   (default 3 nodes, DIR .cache/local-up; needs root)
#   --check: stop by itself once the examples are placed, after checking what it printed (every
#   example pod Running, every container of it shown a card by nvidia-smi, the inspect table shown);
#   exit 0 only if all of that holds. The test command runs it so.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
NODES=3
DIR=$ROOT/.cache/local-up
CHECK=
while [[ $# -gt 0 ]]; do
  case $1 in
    --nodes) NODES=$2; shift 2 ;;
    --dir) DIR=$2; shift 2 ;;
    --check) CHECK=1; shift ;;
    *) echo "usage: $0 [--nodes N] [--dir DIR] [--check]" >&2; exit 2 ;;
  esac
done
failed=()
fail() { echo "local-up: check failed: $*" >&2; failed+=("$*"); }
DIR=$(realpath -m "$DIR")

# A cluster left from an earlier run (killed without Ctrl-C) goes first.
bash "$ROOT/hack/cluster.sh" down "$DIR" >/dev/null 2>&1 || true
trap 'echo; echo "stopping..."; bash "$ROOT/hack/cluster.sh" down "$DIR"' EXIT
trap 'exit 130' INT TERM
bash "$ROOT/hack/cluster.sh" up "$DIR" --nodes "$NODES"
# shellcheck source=/dev/null
source "$DIR/cluster.env"
kubectl() { "$K8S_BIN/kubectl" --kubeconfig "$ADMIN_KUBECONFIG" "$@"; }

# The allocator places GPU pods only on nodes whose agent is Ready (--require-ready-agent), which an
# agent is a few seconds after its node shows the resource: examples sent before that wait, and on a
# slow machine one of them (model-select, which only node-1's A100s take) found them full after its
# back-off. Every agent Ready first.
kubectl -n "$NAMESPACE" rollout status daemonset/nano-gpu-agent --timeout=180s
kubectl apply -f "$ROOT/deploy/examples/"
echo "waiting for the example pods to run..."
if ! kubectl wait --for=jsonpath='{.status.phase}'=Running pod --all -n nano-gpu-demo --timeout=120s; then
  fail "not every example pod is Running after 120 s"
  kubectl get events -n nano-gpu-demo --field-selector reason=FailedScheduling || true
  kubectl logs -n "$NAMESPACE" -l app.kubernetes.io/name=nano-gpu-allocator -c allocator --tail=40 \
    --prefix || true
fi
kubectl get pods -n nano-gpu-demo -o wide
echo
# Each example pod: one per manifest that makes a Pod.
want=$(cat "$ROOT"/deploy/examples/*.yaml | grep -c '^kind: Pod$')
pods=$(kubectl get pods -n nano-gpu-demo -o jsonpath='{.items[*].metadata.name}')
[[ $(wc -w <<<"$pods") -eq $want ]] || fail "$want example pods expected, found: $pods"
for pod in $pods; do
  echo "== $pod: what its containers saw (nvidia-smi -L, GPU env)"
  kubectl logs -n nano-gpu-demo "$pod" --all-containers --prefix 2>/dev/null || true
  if [[ -n $CHECK ]]; then
    [[ $(kubectl get pod -n nano-gpu-demo "$pod" -o jsonpath='{.status.phase}') == Running ]] ||
      fail "$pod is not Running"
    for c in $(kubectl get pod -n nano-gpu-demo "$pod" -o jsonpath='{.spec.containers[*].name}'); do
      # nvidia-smi prints its line once the container started: give a fresh container a moment. The
      # log is read whole first (grep -q ending a pipe early fails it under pipefail).
      shown=
      for _ in 1 2 3 4 5 6 7 8 9 10; do
        log=$(kubectl logs -n nano-gpu-demo "$pod" -c "$c" 2>/dev/null || true)
        if grep -q '^GPU [0-9]*: .*(UUID: ' <<<"$log"; then shown=1; break; fi
        sleep 1
      done
      [[ -n $shown ]] || fail "$pod/$c: nvidia-smi -L showed no card"
    done
  fi
done
echo
inspect=$("$NANO_GPU_BIN/nano-gpu-allocator" --kubeconfig "$ADMIN_KUBECONFIG" inspect --gpushare gib) ||
  fail "nano-gpu-allocator inspect failed"
echo "$inspect"
grep -q '^NODE .*CARD .*MODEL' <<<"$inspect" || fail "the inspect table was not shown"
if [[ -n $CHECK ]]; then
  if [[ ${#failed[@]} -gt 0 ]]; then
    echo "local-up: ${#failed[@]} check(s) failed" >&2
    exit 1
  fi
  echo "local-up: check passed: $want example pods Running, each container shown its card, the inspect table shown"
  exit 0
fi
cat <<MSG

The cluster runs until Ctrl-C. Try:
  $K8S_BIN/kubectl --kubeconfig $ADMIN_KUBECONFIG get pods -A -o wide
  $K8S_BIN/kubectl --kubeconfig $ADMIN_KUBECONFIG exec -n nano-gpu-demo share-30 -- nvidia-smi -L
  $NANO_GPU_BIN/nano-gpu-allocator --kubeconfig $ADMIN_KUBECONFIG inspect --gpushare gib
Logs: $DIR/*.log (control plane, kubelets, containerd), pods' logs under $DIR/nodes/<node>/var/log/pods
MSG
while true; do sleep 3600; done
