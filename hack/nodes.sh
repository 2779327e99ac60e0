#!/usr/bin/env bash
# A real Kubernetes cluster on this one machine, for the e2e and README command 1: the control plane
# (hack/control-plane.sh), kube-controller-manager, the default kube-scheduler, kube-proxy and N real nodes, each a containerd
# (Debian's, with runc and the CNI plugins) and a real kubelet, all built or installed like upstream.
# How, and why each step is needed here, is in ../shared/reference/real-nodes.md; in short:
#   - one network namespace (<dir>/netns) holds every process and pod: node IPs 10.201.0.<k>/32 and
#     the apiserver's 10.201.0.254 on its loopback, one CNI bridge per node (10.244.<k>.0/24); this
#     machine's own network is never touched, and its loopback reaches the apiserver through a
#     forwarder (tests/src/bin/netns-forward.rs);
#   - one mount namespace per node (<dir>/nodes/<node>/mntns) in which the node's own directories
#     stand at the kubelet's and containerd's hard-coded paths (/var/lib, /var/log, /run/containerd,
#     /run/netns), so a hostPath in a pod means that node's path, as on a real machine;
#   - one cgroup root per node in every cgroup v1 hierarchy.
#
# Usage: hack/nodes.sh up <dir> [--nodes N]   (sources nothing; writes <dir>/nodes.env)
#        hack/nodes.sh down <dir>             (no process, mount, cgroup or namespace is left)
#        hack/nodes.sh load <dir> IMAGE.tar   (imports an image archive into every node's containerd)
#        hack/nodes.sh images                 (prints the dir of the harness's base images)
#        hack/nodes.sh install <dir>          (nano-gpu as shipped: images made here, deploy/ applied)
# Env:   NANO_GPU_BIN   dir with nano-gpu-allocator, nano-gpu-agent, libfakenvml.so and the test tools
#                       netns-forward, pause, nvidia-runtime-standin (default: release build)
#        NANO_GPU_FAKE_NVML  path of libfakenvml.so (default: in NANO_GPU_BIN)
#        NANO_GPU_CACHE cache root (default ~/.cache/nano-gpu)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=hack/cards.sh
source "$ROOT/hack/cards.sh"
CP_IP=10.201.0.254
SERVICE_CIDR=10.0.0.0/24
POD_CIDR=10.244.0.0/16
CACHE=${NANO_GPU_CACHE:-$HOME/.cache/nano-gpu}
log() { echo "nodes: $*" >&2; }
die() { log "error: $*"; exit 1; }

node_ip() { echo "10.201.0.$1"; }

# alive PID: running and not a zombie.
alive() { kill -0 "$1" 2>/dev/null && [[ $(awk '{ print $3 }' "/proc/$1/stat" 2>/dev/null) != Z ]]; }

# The test tools (Rust, tests/src/bin) the harness runs.
tools() {
  if [[ -z ${NANO_GPU_BIN:-} ]]; then
    (cd "$ROOT" && cargo build --release --locked -p nano-gpu-tests --bin netns-forward --bin pause \
      --bin nvidia-runtime-standin -p fakenvml -p nano-gpu-allocator -p nano-gpu-agent >&2)
    NANO_GPU_BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release
  fi
  for f in netns-forward pause nvidia-runtime-standin; do [[ -x $NANO_GPU_BIN/$f ]] || die "$NANO_GPU_BIN/$f missing"; done
  FAKE_NVML=${NANO_GPU_FAKE_NVML:-$NANO_GPU_BIN/libfakenvml.so}
  [[ -f $FAKE_NVML ]] || die "$FAKE_NVML missing (cargo build --release -p fakenvml)"
}

# rootfs_new: an empty root filesystem laid out as Debian's (merged /usr), with the users the shipped
# images have (root, and nonroot 65532 as in distroless).
rootfs_new() {
  local r
  r=$(mktemp -d)
  mkdir -p "$r"/{usr/bin,usr/lib,usr/lib64,usr/local/bin,etc,tmp,proc,sys,dev,run,var}
  chmod 1777 "$r/tmp"
  ln -s usr/bin "$r/bin"; ln -s usr/lib "$r/lib"; ln -s usr/lib64 "$r/lib64"
  printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$r/etc/passwd"
  printf 'root:x:0:\nnonroot:x:65532:\n' >"$r/etc/group"
  echo "$r"
}

# rootfs_add ROOTFS FILE [DEST]: FILE at DEST (default: the same path) with the libraries it loads.
rootfs_add() {
  local rootfs=$1 src=$2 dest=${3:-$2} lib
  install -D -m 755 "$src" "$rootfs$dest"
  while read -r lib; do
    [[ -e $rootfs$lib ]] || install -D -m 755 "$lib" "$rootfs$lib"
  done < <(ldd "$src" 2>/dev/null | grep -o '/[^ ]*' || true)
}

# The base images every node needs, made once per content: the sandbox's pause, and busybox for tests.
# Prints the dir holding pause.tar and busybox.tar.
base_images() {
  local busybox=/bin/busybox hash out rootfs
  [[ -x $busybox ]] && "$busybox" --list | grep -qx nc || die "$busybox missing; apt-get install busybox-static"
  hash=$(cat "$NANO_GPU_BIN/pause" "$busybox" "$ROOT/hack/image.sh" "$ROOT/hack/nodes.sh" | sha256sum | cut -c1-16)
  out=$CACHE/images/base-$hash
  # One writer at a time (tests start clusters side by side).
  mkdir -p "$CACHE/images"
  exec 8>"$CACHE/images/.lock" && flock 8
  if [[ ! -f $out/busybox.tar ]]; then
    rm -rf "$CACHE"/images/base-*
    mkdir -p "$out"
    rootfs=$(rootfs_new)
    rootfs_add "$rootfs" "$NANO_GPU_BIN/pause" /pause
    bash "$ROOT/hack/image.sh" "$out/pause.tar" nano-gpu.local/pause:1 "$rootfs" '{"Entrypoint":["/pause"]}'
    rm -rf "$rootfs"; rootfs=$(rootfs_new)
    install -D -m 755 "$busybox" "$rootfs/usr/bin/busybox"
    for a in $("$busybox" --list); do [[ $a == busybox ]] || ln -s busybox "$rootfs/usr/bin/$a"; done
    bash "$ROOT/hack/image.sh" "$out/busybox.tar" nano-gpu.local/busybox:1 "$rootfs" \
      '{"Entrypoint":["/bin/sh"],"Env":["PATH=/bin"]}'
    rm -rf "$rootfs"
  fi
  echo "$out"
}

# image_ref FILE NAME: the image deploy/FILE names for NAME (e.g. nano-gpu/agent:0.1.0).
image_ref() { grep -o "image: *[^ ]*$2:[^ ]*" "$ROOT/deploy/$1" | head -1 | sed 's/image: *//'; }

# nano-gpu's images, as the Dockerfiles lay them out (binary, user, entrypoint), and kube-scheduler's
# under the name deploy/ uses; made once per content. Prints the dir holding the archives.
nano_gpu_images() {
  local hash out rootfs
  for f in nano-gpu-allocator nano-gpu-agent; do [[ -x $NANO_GPU_BIN/$f ]] || die "$NANO_GPU_BIN/$f missing"; done
  hash=$(cat "$NANO_GPU_BIN/nano-gpu-allocator" "$NANO_GPU_BIN/nano-gpu-agent" "$K8S_BIN/kube-scheduler" \
    "$ROOT/hack/image.sh" "$ROOT/deploy/"*.yaml | sha256sum | cut -c1-16)
  out=$CACHE/images/nano-gpu-$hash
  mkdir -p "$CACHE/images"
  exec 8>"$CACHE/images/.lock" && flock 8
  if [[ ! -f $out/kube-scheduler.tar ]]; then
    # One set at a time: the images of earlier builds go.
    rm -rf "$CACHE"/images/nano-gpu-*
    mkdir -p "$out"
    # Dockerfile.allocator: distroless cc (glibc), USER 65532, ENTRYPOINT the binary, CMD serve.
    rootfs=$(rootfs_new)
    rootfs_add "$rootfs" "$NANO_GPU_BIN/nano-gpu-allocator" /usr/local/bin/nano-gpu-allocator
    bash "$ROOT/hack/image.sh" "$out/allocator.tar" "$(image_ref allocator.yaml nano-gpu/allocator)" "$rootfs" \
      '{"User":"65532:65532","Entrypoint":["/usr/local/bin/nano-gpu-allocator"],"Cmd":["serve"],"Env":["PATH=/usr/local/bin:/usr/bin:/bin"]}'
    rm -rf "$rootfs"
    # Dockerfile.agent: Debian slim (glibc), root, ENTRYPOINT the binary.
    rootfs=$(rootfs_new)
    rootfs_add "$rootfs" "$NANO_GPU_BIN/nano-gpu-agent" /usr/local/bin/nano-gpu-agent
    bash "$ROOT/hack/image.sh" "$out/agent.tar" "$(image_ref agent.yaml nano-gpu/agent)" "$rootfs" \
      '{"Entrypoint":["/usr/local/bin/nano-gpu-agent"],"Env":["PATH=/usr/local/bin:/usr/bin:/bin"]}'
    rm -rf "$rootfs"
    # registry.k8s.io/kube-scheduler: the static binary on PATH.
    rootfs=$(rootfs_new)
    install -D -m 755 "$K8S_BIN/kube-scheduler" "$rootfs/usr/local/bin/kube-scheduler"
    bash "$ROOT/hack/image.sh" "$out/kube-scheduler.tar" "$(image_ref allocator.yaml kube-scheduler)" "$rootfs" \
      '{"Env":["PATH=/usr/local/bin:/usr/bin:/bin"]}'
    rm -rf "$rootfs"
  fi
  echo "$out"
}

# The shipped install on the real nodes: `kubectl apply -f deploy/` with one swap (no cluster DNS
# here: kube-scheduler's extender URL names the allocator Service by its ClusterIP, not its DNS name).
install_nano_gpu() {
  local images k node ip
  # shellcheck source=/dev/null
  source "$DIR/control-plane.env"
  # shellcheck source=/dev/null
  source "$DIR/nodes.env"
  images=$(nano_gpu_images)
  kubectl() { "$K8S_BIN/kubectl" --kubeconfig "$ADMIN_KUBECONFIG" "$@"; }
  for node in "$DIR"/nodes/*/; do
    node=$(basename "$node")
    for f in allocator agent kube-scheduler; do in_node "$node" ctr -n k8s.io images import "$images/$f.tar" >/dev/null; done
    kubectl label node "$node" nano-gpu/node=true --overwrite >&2
  done
  kubectl apply -f "$ROOT/deploy/" >&2
  ip=$(kubectl get service nano-gpu-allocator -n nano-gpu-system -o jsonpath='{.spec.clusterIP}')
  kubectl get configmap nano-gpu-scheduler-config -n nano-gpu-system -o yaml |
    sed "s#urlPrefix: http://nano-gpu-allocator.nano-gpu-system.svc:#urlPrefix: http://$ip:#" |
    kubectl replace -f - >&2
  # Pods made before the swap read the old configuration: replace them.
  kubectl delete pods -n nano-gpu-system -l app.kubernetes.io/name=nano-gpu-allocator --wait=true >&2
  wait_for "nano-gpu-allocator (a leader ready)" 120 bash -c "'$K8S_BIN/kubectl' --kubeconfig '$ADMIN_KUBECONFIG' \
    get deployment nano-gpu-allocator -n nano-gpu-system -o jsonpath='{.status.readyReplicas}' | grep -q '[1-9]'"
  for node in "$DIR"/nodes/*/; do
    node=$(basename "$node")
    wait_for "$node allocatable" 120 bash -c "'$K8S_BIN/kubectl' --kubeconfig '$ADMIN_KUBECONFIG' get node $node \
      -o jsonpath='{.status.allocatable.nano-gpu/gpu-percent}' | grep -q '[1-9]'"
  done
  log "installed: deploy/ on $NODES real nodes"
}

# ---- pieces run inside the namespaces ----

IN_NET=()
in_node() { nsenter "--net=$NETNS" "--mount=$DIR/nodes/$1/mntns" "${@:2}"; }

# launch NAME ARGS...: detached; its pid (the program itself: nsenter execs it) in <dir>/NAME.pid.
launch() {
  local name=$1; shift
  setsid "$@" </dev/null >"$DIR/$name.log" 2>&1 &
  echo $! >"$DIR/$name.pid"
}

# wait_for WHAT SECONDS COMMAND...: retries COMMAND every 0.5 s.
wait_for() {
  local what=$1 secs=$2 i; shift 2
  for ((i = 0; i < secs * 2; i++)); do "$@" >/dev/null 2>&1 && return 0; sleep 0.5; done
  die "$what not ready after ${secs}s; logs in $DIR"
}

cgroup_root() { echo "/nano-gpu-$(sha256sum <<<"$DIR" | cut -c1-8)-$1"; }
HIERARCHIES=(cpu cpuacct cpuset memory devices freezer blkio pids systemd unified)

# node_mounts NODE: the node's mount namespace, its paths bound over the hard-coded ones.
node_mounts() {
  local node=$1 root=$DIR/nodes/$1 d
  mkdir -p "$root"/{var/lib,var/log,run/containerd,run/netns,cni/net.d,cni/ipam,sysctl}
  touch "$root/mntns"
  unshare "--mount=$root/mntns" --propagation private true
  # protectKernelDefaults: the kubelet checks these sysctls and would write them machine-wide if
  # it were allowed to; it sees the values it expects here, and the machine keeps its own.
  printf '1\n' >"$root/sysctl/overcommit_memory"
  printf '10\n' >"$root/sysctl/panic"
  printf '1\n' >"$root/sysctl/panic_on_oops"
  nsenter "--mount=$root/mntns" bash -s -- "$root" <<'EOF'
    set -e
    for d in var/lib var/log run/containerd run/netns; do mkdir -p "/$d"; mount --bind "$1/$d" "/$d"; done
    mount --bind "$1/sysctl/overcommit_memory" /proc/sys/vm/overcommit_memory
    mount --bind "$1/sysctl/panic" /proc/sys/kernel/panic
    mount --bind "$1/sysctl/panic_on_oops" /proc/sys/kernel/panic_on_oops
EOF
  for d in "${HIERARCHIES[@]}"; do
    [[ -d /sys/fs/cgroup/$d ]] || continue
    mkdir -p "/sys/fs/cgroup/$d$(cgroup_root "$node")"
  done
  if [[ -d /sys/fs/cgroup/cpuset ]]; then
    cat /sys/fs/cgroup/cpuset/cpuset.cpus >"/sys/fs/cgroup/cpuset$(cgroup_root "$node")/cpuset.cpus"
    cat /sys/fs/cgroup/cpuset/cpuset.mems >"/sys/fs/cgroup/cpuset$(cgroup_root "$node")/cpuset.mems"
  fi
}

start_containerd() {
  local node=$1 k=$2 root=$DIR/nodes/$1
  cat >"$root/containerd.toml" <<EOF
version = 2
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "nano-gpu.local/pause:1"
  # Nothing here may lower oom_score_adj (real-nodes.md).
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
      SystemdCgroup = false
      # In place of nvidia-container-runtime as the default runtime (nvidia-docker's setup): the
      # fake driver for containers that set NVIDIA_VISIBLE_DEVICES, then runc.
      BinaryName = "$NANO_GPU_BIN/nvidia-runtime-standin"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$root/cni/net.d"
EOF
  cat >"$root/cni/net.d/10-bridge.conflist" <<EOF
{"cniVersion": "0.4.0", "name": "nano-gpu-$node", "plugins": [
  {"type": "bridge", "bridge": "ngbr$k", "isGateway": true, "isDefaultGateway": true,
   "ipMasq": false, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.244.$k.0/24"}]], "dataDir": "$root/cni/ipam"}},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}
EOF
  launch "containerd-$node" nsenter "--net=$NETNS" "--mount=$root/mntns" containerd --config "$root/containerd.toml"
}

start_kubelet() {
  local node=$1 k=$2 root=$DIR/nodes/$1 ip
  ip=$(node_ip "$k")
  bash "$ROOT/hack/control-plane.sh" client "$DIR" "kubelet-$node" "/O=system:nodes/CN=system:node:$node" "$CP_URL" >&2
  cat >"$root/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $ip
healthzBindAddress: $ip
readOnlyPort: 0
authentication:
  anonymous: { enabled: false }
  webhook: { enabled: true }
  x509: { clientCAFile: $DIR/pki/ca.crt }
authorization: { mode: Webhook }
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
cgroupDriver: cgroupfs
cgroupRoot: $(cgroup_root "$node")
failCgroupV1: false
failSwapOn: false
oomScoreAdj: 0
protectKernelDefaults: true
resolvConf: ""
clusterDomain: cluster.local
serializeImagePulls: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: { memory.available: "50Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%" }
maxPods: 60
EOF
  launch "kubelet-$node" nsenter "--net=$NETNS" "--mount=$root/mntns" "$K8S_BIN/kubelet" --config "$root/kubelet.yaml" \
    --kubeconfig "$DIR/kubelet-$node.kubeconfig" --hostname-override "$node" --node-ip "$ip" -v=1
}

up() {
  local n=$1 k node images
  tools
  for c in containerd runc iptables nsenter unshare; do
    command -v "$c" >/dev/null || die "$c not found; apt-get install containerd runc containernetworking-plugins iptables"
  done
  [[ -x /usr/lib/cni/bridge ]] || die "/usr/lib/cni/bridge missing; apt-get install containernetworking-plugins"
  images=$(base_images)
  K8S_BIN=${K8S_BIN:-$(bash "$ROOT/hack/k8s-build.sh")}
  mkdir -p "$DIR"
  [[ -e $DIR/netns ]] && die "$DIR/netns exists: run $0 down $DIR first"
  trap 'log "up failed; logs in $DIR"; down' EXIT

  # The network namespace: loopback addresses for the apiserver and the nodes, ClusterIPs routed to
  # loopback (kube-proxy's rules take them from there), forwarding between the nodes' pod bridges.
  touch "$DIR/netns"
  unshare "--net=$DIR/netns" true
  NETNS=$DIR/netns
  IN_NET=(nsenter "--net=$NETNS")
  "${IN_NET[@]}" ip link set lo up
  "${IN_NET[@]}" ip addr add "$CP_IP/32" dev lo
  for ((k = 1; k <= n; k++)); do "${IN_NET[@]}" ip addr add "$(node_ip "$k")/32" dev lo; done
  "${IN_NET[@]}" ip route add "$SERVICE_CIDR" dev lo
  "${IN_NET[@]}" sysctl -qw net.ipv4.ip_forward=1

  K8S_BIN=$K8S_BIN NETNS=$NETNS NETNS_FORWARD=$NANO_GPU_BIN/netns-forward \
    bash "$ROOT/hack/control-plane.sh" start "$DIR" >&2
  # shellcheck source=/dev/null
  source "$DIR/control-plane.env"

  bash "$ROOT/hack/control-plane.sh" client "$DIR" controller-manager "/CN=system:kube-controller-manager" "$CP_URL" >&2
  launch kube-controller-manager "${IN_NET[@]}" "$K8S_BIN/kube-controller-manager" \
    --kubeconfig "$DIR/controller-manager.kubeconfig" \
    --authentication-kubeconfig "$DIR/controller-manager.kubeconfig" \
    --authorization-kubeconfig "$DIR/controller-manager.kubeconfig" \
    --service-account-private-key-file "$DIR/pki/sa.key" --root-ca-file "$DIR/pki/ca.crt" \
    --use-service-account-credentials --leader-elect=false --bind-address 127.0.0.1 \
    --cluster-signing-cert-file "$DIR/pki/ca.crt" --cluster-signing-key-file "$DIR/pki/ca.key"

  # The cluster's default scheduler (pods that ask no GPU); nano-gpu brings its own profile.
  bash "$ROOT/hack/control-plane.sh" client "$DIR" default-scheduler "/CN=system:kube-scheduler" "$CP_URL" >&2
  launch kube-scheduler "${IN_NET[@]}" "$K8S_BIN/kube-scheduler" --kubeconfig "$DIR/default-scheduler.kubeconfig" \
    --authentication-kubeconfig "$DIR/default-scheduler.kubeconfig" \
    --authorization-kubeconfig "$DIR/default-scheduler.kubeconfig" --leader-elect=false --bind-address 127.0.0.1

  # One kube-proxy: every node shares the namespace, so one set of rules serves them all.
  bash "$ROOT/hack/control-plane.sh" client "$DIR" kube-proxy "/CN=system:kube-proxy" "$CP_URL" >&2
  cat >"$DIR/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: { kubeconfig: $DIR/kube-proxy.kubeconfig }
mode: iptables
hostnameOverride: node-1
clusterCIDR: $POD_CIDR
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
oomScoreAdj: 0
# Leave the machine's conntrack settings alone.
conntrack: { maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s }
# Pods reach Services on their own bridge without br_netfilter.
iptables: { masqueradeAll: true }
EOF
  launch kube-proxy "${IN_NET[@]}" "$K8S_BIN/kube-proxy" --config "$DIR/kube-proxy.yaml"

  for ((k = 1; k <= n; k++)); do
    node=node-$k
    node_mounts "$node"
    # The node's fake driver (see tests/src/bin/nvidia-runtime-standin.rs): its cards and NVML.
    mkdir -p "$DIR/nodes/$node/var/lib/nano-gpu-fake-driver"
    nvml_config "$node" "$k" >"$DIR/nodes/$node/var/lib/nano-gpu-fake-driver/nvml.json"
    install -m 755 "$FAKE_NVML" "$DIR/nodes/$node/var/lib/nano-gpu-fake-driver/libnvidia-ml.so.1"
    start_containerd "$node" "$k"
  done
  for ((k = 1; k <= n; k++)); do
    node=node-$k
    wait_for "containerd on $node" 30 in_node "$node" ctr version
    in_node "$node" ctr -n k8s.io images import "$images/pause.tar" >/dev/null
    in_node "$node" ctr -n k8s.io images import "$images/busybox.tar" >/dev/null
    start_kubelet "$node" "$k"
  done
  kubectl() { "$K8S_BIN/kubectl" --kubeconfig "$ADMIN_KUBECONFIG" "$@"; }
  for ((k = 1; k <= n; k++)); do
    wait_for "node-$k Ready" 90 bash -c "'$K8S_BIN/kubectl' --kubeconfig '$ADMIN_KUBECONFIG' get node node-$k \
      -o jsonpath='{.status.conditions[?(@.type==\"Ready\")].status}' | grep -qx True"
  done
  wait_for "default ServiceAccount" 60 kubectl get serviceaccount default -n default

  cat >"$DIR/nodes.env" <<EOF
NETNS=$NETNS
NODES=$n
NETNS_FORWARD=$NANO_GPU_BIN/netns-forward
BASE_IMAGES=$images
EOF
  trap - EXIT
  log "up: $n real nodes; kubectl --kubeconfig $ADMIN_KUBECONFIG get nodes; stop with: $0 down $DIR"
}

# stop_pid FILE: SIGTERM, up to 10 s, then SIGKILL; only a process that still names $DIR.
stop_pid() {
  local pid i
  pid=$(cat "$1" 2>/dev/null) || return 0
  if [[ $pid =~ ^[0-9]+$ ]] && alive "$pid" && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF "$DIR/"; then
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do alive "$pid" || break; sleep 0.1; done
    alive "$pid" && kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$1"
}

# Every process whose network namespace is ours (containerd shims, anything left running).
ns_pids() {
  local ino p
  ino=$(stat -L -c %i "$DIR/netns" 2>/dev/null) || return 0
  for p in /proc/[0-9]*; do
    [[ $(stat -L -c %i "$p/ns/net" 2>/dev/null) == "$ino" ]] && echo "${p#/proc/}"
  done
  return 0
}

down() {
  local f node pid d m tries
  trap - EXIT
  [[ -d $DIR ]] || return 0
  # Pods first, while their kubelets run: the kubelets stop their containers and sandboxes. No
  # controller recreates them once kube-controller-manager is gone.
  stop_pid "$DIR/kube-controller-manager.pid"
  if [[ -f $DIR/control-plane.env ]]; then
    # shellcheck source=/dev/null
    source "$DIR/control-plane.env"
    if "$K8S_BIN/kubectl" --kubeconfig "$ADMIN_KUBECONFIG" get --raw /readyz >/dev/null 2>&1; then
      "$K8S_BIN/kubectl" --kubeconfig "$ADMIN_KUBECONFIG" delete pods --all -A --grace-period=1 \
        --wait=true --timeout=60s >/dev/null 2>&1 || log "some pods were not deleted in 60s; killing them"
    fi
  fi
  for f in "$DIR"/kubelet-*.pid "$DIR"/kube-proxy.pid "$DIR"/containerd-*.pid; do
    [[ -e $f ]] && stop_pid "$f"
  done
  # What is left in our namespaces and cgroups: shims, containers whose kubelet is gone.
  for node in "$DIR"/nodes/*/; do
    node=$(basename "$node")
    for d in "${HIERARCHIES[@]}"; do
      [[ -d /sys/fs/cgroup/$d$(cgroup_root "$node") ]] || continue
      find "/sys/fs/cgroup/$d$(cgroup_root "$node")" -name cgroup.procs -exec cat {} + 2>/dev/null
    done
  done | sort -u | xargs -r kill -KILL 2>/dev/null || true
  for pid in $(ns_pids); do
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q "apiserver-forward\|kube-apiserver\|etcd" || kill -KILL "$pid" 2>/dev/null || true
  done
  bash "$ROOT/hack/control-plane.sh" stop "$DIR" >&2
  for pid in $(ns_pids); do kill -KILL "$pid" 2>/dev/null || true; done
  # cgroups, deepest first (a cgroup empties a moment after its last process dies).
  for node in "$DIR"/nodes/*/; do
    node=$(basename "$node")
    for d in "${HIERARCHIES[@]}"; do
      [[ -d /sys/fs/cgroup/$d$(cgroup_root "$node") ]] || continue
      for ((tries = 0; tries < 50; tries++)); do
        find "/sys/fs/cgroup/$d$(cgroup_root "$node")" -depth -type d -exec rmdir {} + 2>/dev/null || true
        [[ -d /sys/fs/cgroup/$d$(cgroup_root "$node") ]] || break
        sleep 0.1
      done
      [[ -d /sys/fs/cgroup/$d$(cgroup_root "$node") ]] && log "could not remove cgroup $d$(cgroup_root "$node")"
    done
  done
  # The namespaces' pins, and any mount under $DIR, deepest first.
  while read -r m; do umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true; done \
    < <(awk -v d="$DIR/" 'index($5, d) == 1 { print $5 }' /proc/self/mountinfo | sort -r)
  rm -f "$DIR/netns" "$DIR"/nodes/*/mntns
  awk -v d="$DIR/" 'index($5, d) == 1 { found = 1 } END { exit !found }' /proc/self/mountinfo &&
    log "mounts left under $DIR" || true
}

[[ $# -ge 1 ]] || die "usage: $0 up|down|install|load <dir> ... | images"
CMD=$1; shift
case $CMD in
  images) tools; base_images; exit 0 ;;
esac
[[ $# -ge 1 ]] || die "usage: $0 $CMD <dir> ..."
DIR=$(realpath -m "$1"); shift
NETNS=$DIR/netns
case $CMD in
  up)
    NODES=3
    while [[ $# -gt 0 ]]; do
      case $1 in
        --nodes) NODES=$2; shift 2 ;;
        *) die "unknown flag $1" ;;
      esac
    done
    up "$NODES" ;;
  down) down; log "down" ;;
  install) tools; K8S_BIN=${K8S_BIN:-$(bash "$ROOT/hack/k8s-build.sh")}; install_nano_gpu ;;
  load)
    [[ $# -eq 1 && -f $1 ]] || die "usage: $0 load <dir> IMAGE.tar"
    for node in "$DIR"/nodes/*/; do in_node "$(basename "$node")" ctr -n k8s.io images import "$1" >/dev/null; done ;;
  *) die "unknown command $CMD" ;;
esac
