# shellcheck shell=bash
# The simulated GPU nodes' cards (hack/cluster.sh).
# Sourced; `nvml_config NODE K` prints node K's cards in the fake NVML's format (tests/fakenvml).

# Simulated GPU nodes, mixed card models: name|memory MiB|count, one line per model of a node.
node_cards() {
  case $(( ($1 - 1) % 3 )) in
    0) echo "NVIDIA A100-SXM4-80GB|81920|4" ;;
    1) printf '%s\n' "Tesla T4|15360|2" "NVIDIA A10|23028|2" ;;
    2) echo "Tesla V100-SXM2-32GB|32768|8" ;;
  esac
}
nvml_config() {
  local node=$1 i=0 model mem count first=1 n
  printf '{"cards":['
  while IFS='|' read -r model mem count; do
    for ((n = 0; n < count; n++)); do
      ((first)) || printf ','
      first=0
      printf '{"uuid":"GPU-%s-%d","name":"%s","memoryMiB":%d,"minor":%d,"pciBusId":"00000000:%02X:00.0"}' \
        "$node" "$i" "$model" "$mem" "$i" $((0x10 + i))
      i=$((i + 1))
    done
  done < <(node_cards "$2")
  printf ']}\n'
}


# cdi_spec NODE K: node K's cards as a CDI spec (kind nvidia.com/gpu, one device per card named by its
# UUID and by its index), as `nvidia-ctk cdi generate` writes NVIDIA's for a runtime with CDI. Where
# NVIDIA's spec adds the card's device nodes and the driver's libraries, this one adds what the
# runtime stand-in reads as the card's name (/dev/null at /var/run/nvidia-container-devices/<uuid>,
# the device list a runtime set as the README asks takes from mounts), so the stand-in gives the
# container that card through the fake driver.
cdi_spec() {
  local node=$1 i=0 model mem count n first=1 uuid name
  printf '{"cdiVersion":"0.6.0","kind":"nvidia.com/gpu","devices":['
  while IFS='|' read -r model mem count; do
    for ((n = 0; n < count; n++)); do
      uuid=GPU-$node-$i
      for name in "$uuid" "$i"; do
        ((first)) || printf ','
        first=0
        printf '{"name":"%s","containerEdits":{"mounts":[{"hostPath":"/dev/null","containerPath":"/var/run/nvidia-container-devices/%s","options":["ro","nosuid","nodev","bind"]}]}}' \
          "$name" "$uuid"
      done
      i=$((i + 1))
    done
  done < <(node_cards "$2")
  printf ']}\n'
}
