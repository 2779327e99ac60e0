#!/usr/bin/env bash
# The real-GPU check: what an NVIDIA card and its driver answer to the agent's own code paths
# (inventory, per-process usage, XID events, MPS, the driver's memory limit), as one JSON report.
#
#   bash hack/gpu-check.sh --build   here: builds gpu-check (release, x86-64, glibc; the agent's code
#                                    linked in) into .gpu-check/ (git ignores it) to carry there
#   bash hack/gpu-check.sh           there: runs them; the report goes to stdout and, with the raw
#                                    outputs, to $OUT (default ./gpu-check-out)
#
# Options after the mode go to gpu-check (e.g. --nvml-lib PATH, --nvidia-smi PATH, --python PATH,
# --mps-control PATH: the test runs it against the fake NVML and the harness's stand-ins). Nothing is
# fetched on the GPU machine; PyTorch there is the CUDA workload (without it the CUDA parts are
# skipped, with the reason). It finishes in about two minutes; gpu-check is cut off at 280 s.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BIN=${GPU_CHECK_BIN:-$ROOT/.gpu-check}

if [[ ${1:-} == --build ]]; then
  cd "$ROOT"
  cargo build --release --locked -p nano-gpu-tests --bin gpu-check
  mkdir -p "$BIN"
  cp "${CARGO_TARGET_DIR:-target}/release/gpu-check" "$BIN/"
  ls -l "$BIN"
  exit 0
fi

OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
[[ -x $BIN/gpu-check ]] || { echo "gpu-check: $BIN/gpu-check missing (bash hack/gpu-check.sh --build)" >&2; exit 2; }
SMI=nvidia-smi
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do [[ ${args[i]} == --nvidia-smi ]] && SMI=${args[i + 1]}; done

# shellcheck disable=SC2012 # the listings are for a person to read
{
  echo "== uname -a"; uname -a
  echo "== id"; id
  echo "== $SMI"; timeout 30 "$SMI" 2>&1 || true
  echo "== $SMI topo -m"; timeout 30 "$SMI" topo -m 2>&1 || true
  echo "== nvidia-cuda-mps-control"; command -v nvidia-cuda-mps-control || true
  echo "== driver files"; ls -l /dev/nvidia* /usr/local/nvidia/bin 2>&1 || true
  ldconfig -p 2>/dev/null | grep -i nvidia-ml || true
  cat /proc/driver/nvidia/version 2>&1 || true
  echo "== numa_node"; grep -H . /sys/bus/pci/devices/*/numa_node 2>&1 | head -20
  echo "== /dev/shm"; df -h /dev/shm 2>&1; ls -la /dev/shm 2>&1 | head -20
  echo "== cgroups"; cat /proc/self/cgroup; ls /sys/fs/cgroup 2>&1 | head -40
} >"$OUT/machine.txt" 2>&1
timeout 30 "$SMI" -q -x >"$OUT/nvidia-smi-q.xml" 2>&1 || true
# The MPS daemons it starts log to their stdout, which is gpu-check's: kept apart from the report.
rc=0
timeout 280 "$BIN/gpu-check" --out "$OUT" "$@" >"$OUT/daemons.log" 2>"$OUT/check.log" || rc=$?
cat "$OUT/report.json" 2>/dev/null || echo "gpu-check: no report (exit $rc; see $OUT/check.log)" >&2
exit "$rc"
