#!/usr/bin/env bash
# The local cluster with simulated GPU nodes, for README command 1 and the end-to-end tests: a real
# Kubernetes cluster on this one machine with nano-gpu installed as shipped. The control plane
# (hack/control-plane.sh), kube-controller-manager, the default kube-scheduler, kube-proxy and N real
# nodes, each a containerd (Debian's, with runc and the CNI plugins) and a real kubelet, all built or
# installed like upstream; then deploy/ through a kustomize overlay: the allocator as its Deployment, the agent
# as its DaemonSet, on fake NVML cards. How, and why each step is needed here, is in
# ../shared/reference/real-nodes.md; in short:
#   - one network namespace (<dir>/netns) holds every process and pod: node IPs 10.201.0.<k>/32 and
#     the apiserver's 10.201.0.254 on its loopback, one CNI bridge per node (10.244.<k>.0/24); this
#     machine's own network is never touched, and its loopback reaches the apiserver through a
#     forwarder (tests/src/bin/netns-forward.rs);
#   - one mount namespace per node (<dir>/nodes/<node>/mntns) in which the node's own directories
#     stand at the kubelet's and containerd's hard-coded paths (/var/lib, /var/log, /run/containerd,
#     /run/netns) and at /usr/local (empty), so a hostPath in a pod means that node's path, as on a
#     real machine;
#   - one cgroup root per node in every cgroup hierarchy;
#   - the GPU driver: each containerd runs containers through nvidia-runtime-standin
#     (tests/src/bin/nvidia-runtime-standin.rs), which gives a container that sets
#     NVIDIA_VISIBLE_DEVICES the fake NVML and only its visible cards, as nvidia-container-runtime
#     gives the driver's.
#
# Usage: hack/cluster.sh up <dir> [--nodes N] [--containerd2 M] [--runtime-class] [--dra] [--bare]
#                                [--namespace NS] [--network-policies] [--apiserver-arg FLAG]...
#                                        (--bare: no nano-gpu; --apiserver-arg: one more kube-apiserver
#                                        flag, e.g. --watch-cache-sizes=pods#0; --containerd2 M: the
#                                        last M nodes run containerd 2 (hack/containerd-build.sh) with
#                                        CDI, their cards in a CDI spec as nvidia-ctk writes one;
#                                        --runtime-class: the NVIDIA runtime (its stand-in) is the
#                                        RuntimeClass nvidia, each node's default runtime plain runc,
#                                        and the install adds the component runtime-class-nvidia;
#                                        --dra: the install adds the component dra, the agents
#                                        serve DRA where the runtime has CDI (containerd 2 nodes);
#                                        --namespace NS: nano-gpu installed in NS, the overlay's
#                                        `namespace:`, instead of nano-gpu-system;
#                                        --network-policies: the install adds the component
#                                        network-policies (the API server takes them; nothing here
#                                        enforces them);
#                                        writes <dir>/cluster.env)
#        hack/cluster.sh install <dir>           (nano-gpu as shipped: images made here, deploy/ applied with
#                                                kustomize; NANO_GPU_INSTALL_FROM: another version, below)
#        hack/cluster.sh down <dir>              (no process, mount, cgroup or namespace is left)
#        hack/cluster.sh restart <dir> kubelet|containerd <node>   (kill -9, then start it again)
#        hack/cluster.sh crash <dir> etcd|kube-apiserver|kube-controller-manager|kube-scheduler SECONDS
#                                                (kill -9, then the same command line SECONDS later)
#        hack/cluster.sh freeze <dir> NAME SECONDS (SIGSTOP, SIGCONT SECONDS later: a hung component)
#        hack/cluster.sh ctr <dir> <node> ARGS...  (containerd's ctr on that node, namespace k8s.io)
#        hack/cluster.sh load <dir> IMAGE.tar    (imports an image archive into every node's containerd)
# Env:   NANO_GPU_BIN   dir with nano-gpu-allocator, nano-gpu-agent, libfakenvml.so and the test tools
#                       netns-forward, pause, nvidia-runtime-standin, nvidia-smi, gpu-use (default: the
#                       development build, made first)
#        NANO_GPU_FAKE_NVML  path of libfakenvml.so (default: in NANO_GPU_BIN)
#        NANO_GPU_CACHE cache root (default ~/.cache/nano-gpu)
#        NANO_GPU_INSTALL_FROM  install: the version in this directory (hack/previous-build.sh's
#                       bin/ and deploy/) instead of this checkout's
#        NANO_GPU_REAL_GPU=1  up: the machine's own NVIDIA driver instead of the fake one (hack/gpu-node.sh,
#                       on a GPU machine): every node runs containerd 2 with NVIDIA's container runtime
#                       (NANO_GPU_NVIDIA_RUNTIME, in CDI mode, its config NANO_GPU_RUNTIME_CONFIG_FILE)
#                       over runc, the node's CDI spec NANO_GPU_CDI_SPEC (nvidia-ctk's), the driver's
#                       /usr/local/nvidia seen by the node; no kube-proxy (no iptables there): the
#                       apiserver's Service address is forwarded to it, and the apiserver reaches
#                       webhooks at their endpoints; CONTAINERD2_BIN, K8S_BIN, NANO_GPU_CNI_BIN and
#                       NANO_GPU_BUSYBOX name the carried binaries
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=hack/cards.sh
source "$ROOT/hack/cards.sh"
# shellcheck source=hack/lib.sh
source "$ROOT/hack/lib.sh"
CP_IP=10.201.0.254
SERVICE_CIDR=10.0.0.0/24
SERVICE_IP=10.0.0.1 # the apiserver's Service (hack/control-plane.sh)
POD_CIDR=10.244.0.0/16
CACHE=${NANO_GPU_CACHE:-$HOME/.cache/nano-gpu}
log() { echo "cluster: $*" >&2; }
die() { log "error: $*"; exit 1; }

node_ip() { echo "10.201.0.$1"; }

# The test tools (Rust, tests/src/bin) the harness runs.
tools() {
  if [[ -z ${NANO_GPU_BIN:-} ]]; then
    # Every target of every package in the development profile: the allocator, the agent, the fake
    # NVML and the test tools in one command, and exactly the build `cargo test --workspace` makes
    # (the tests' dev-dependencies change tokio's features, so a build without them is another
    # build of nearly everything), so the test command builds the workspace once: a release build
    # here took it as long again. The placement engine is optimised in that profile too
    # (Cargo.toml).
    (cd "$ROOT" && cargo build --locked --workspace --all-targets >&2)
    NANO_GPU_BIN=${CARGO_TARGET_DIR:-$ROOT/target}/debug
  fi
  local f needed=(nano-gpu-allocator nano-gpu-agent netns-forward pause)
  if ((REAL_GPU)); then
    needed+=(cuda-probe)
  else
    needed+=(nvidia-runtime-standin nvidia-smi gpu-use nvidia-cuda-mps-control)
  fi
  for f in "${needed[@]}"; do
    [[ -x $NANO_GPU_BIN/$f ]] || die "$NANO_GPU_BIN/$f missing"
  done
  ((REAL_GPU)) && return
  FAKE_NVML=${NANO_GPU_FAKE_NVML:-$NANO_GPU_BIN/libfakenvml.so}
  [[ -f $FAKE_NVML ]] || die "$FAKE_NVML missing (cargo build -p fakenvml)"
}

# runtime_config: the node's NVIDIA runtime configuration (the stand-in reads it as
# nvidia-container-runtime reads /etc/nvidia-container-runtime/config.toml): by default what the
# README asks of a node (devices from the device plugin's mounts, a pod's NVIDIA_VISIBLE_DEVICES
# ignored unless it is privileged); NANO_GPU_RUNTIME_CONFIG=default leaves the toolkit's defaults.
runtime_config() {
  case ${NANO_GPU_RUNTIME_CONFIG:-secure} in
    secure) printf '%s\n' 'accept-nvidia-visible-devices-envvar-when-unprivileged = false' \
      'accept-nvidia-visible-devices-as-volume-mounts = true' ;;
    default) echo "# the NVIDIA container toolkit's defaults" ;;
    *) die "NANO_GPU_RUNTIME_CONFIG=$NANO_GPU_RUNTIME_CONFIG: secure or default" ;;
  esac
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

# glibc_fill ROOTFS: the rest of glibc that Debian's images have (libpthread, libdl, librt, libm,
# libgcc_s). The NVIDIA driver's libraries, which the runtime mounts into a container, load them;
# our binaries do not (their glibc has these in libc), so `rootfs_add` alone leaves them out.
glibc_fill() {
  local lib path
  for lib in libpthread.so.0 libdl.so.2 librt.so.1 libm.so.6 libgcc_s.so.1; do
    path=$(ldconfig -p | awk -v l="$lib" '$1 == l && /x86-64/ { print $NF; exit }')
    if [[ -n $path ]]; then rootfs_add "$1" "$path"; fi
  done
}

# image_of OUT.tar REF CONFIG FILL ARGS...: an image REF (hack/image.sh) of a fresh root filesystem
# that `FILL ROOTFS ARGS...` filled.
image_of() {
  local out=$1 ref=$2 config=$3 rootfs
  shift 3
  rootfs=$(rootfs_new)
  "$1" "$rootfs" "${@:2}"
  bash "$ROOT/hack/image.sh" "$out" "$ref" "$rootfs" "$config"
  rm -rf "$rootfs"
}

# busybox_fill ROOTFS BUSYBOX: busybox and a link per applet in /usr/bin.
busybox_fill() {
  local a
  install -D -m 755 "$2" "$1/usr/bin/busybox"
  for a in $("$2" --list); do [[ $a == busybox ]] || ln -s busybox "$1/usr/bin/$a"; done
}

# cached_images NAME HASH MAKE: prints $CACHE/images/NAME-HASH, running `MAKE DIR` first unless it
# is complete; one set per NAME is kept, and one writer at a time (tests start clusters side by side).
cached_images() {
  local out=$CACHE/images/$1-$2
  mkdir -p "$CACHE/images"
  exec 8>"$CACHE/images/.lock" && flock 8
  if [[ ! -f $out/.complete ]]; then
    rm -rf "$CACHE/images/$1"-*
    mkdir -p "$out"
    "$3" "$out"
    touch "$out/.complete"
  fi
  echo "$out"
}

# cuda_fill ROOTFS: busybox with the nvidia-smi stand-in (tests/src/bin/nvidia-smi.rs) and a CUDA
# process stand-in (tests/src/bin/gpu-use.rs).
cuda_fill() {
  busybox_fill "$1" "$BUSYBOX"
  if ((REAL_GPU)); then
    # The real driver's: what CDI mounts (and the rest of glibc it loads), and the CUDA probe
    # (tests/cuda-probe).
    rootfs_add "$1" "$NANO_GPU_BIN/cuda-probe" /usr/bin/cuda-probe
    glibc_fill "$1"
    return
  fi
  rootfs_add "$1" "$NANO_GPU_BIN/nvidia-smi" /usr/bin/nvidia-smi
  rootfs_add "$1" "$NANO_GPU_BIN/gpu-use" /usr/bin/gpu-use
}

# The base images every node needs: the sandbox's pause, busybox, and the GPU workload image the
# examples and tests run, under the name deploy/examples/ uses (there: CUDA's base image, which sets
# NVIDIA_VISIBLE_DEVICES=all as this one does; here busybox and `nvidia-smi -L`).
base_images_into() {
  image_of "$1/pause.tar" nano-gpu.local/pause:1 '{"Entrypoint":["/pause"]}' rootfs_add "$NANO_GPU_BIN/pause" /pause
  image_of "$1/busybox.tar" nano-gpu.local/busybox:1 '{"Entrypoint":["/bin/sh"],"Env":["PATH=/bin"]}' \
    busybox_fill "$BUSYBOX"
  image_of "$1/cuda.tar" "$(image_ref examples/share-30.yaml nvidia/cuda)" \
    '{"Env":["PATH=/usr/bin:/bin","NVIDIA_VISIBLE_DEVICES=all","NVIDIA_DRIVER_CAPABILITIES=compute,utility"]}' cuda_fill
}

# image_ref FILE NAME: the image deploy/FILE names for NAME (e.g. nano-gpu/agent:0.1.0).
image_ref() { grep -o "image: *[^ ]*$2:[^ ]*" "$ROOT/deploy/$1" | head -1 | sed 's/image: *//'; }
# install_image_ref FILE NAME: the name the installed version's image has here (INSTALL_TAG, below).
install_image_ref() {
  if [[ -n $INSTALL_TAG ]]; then echo "$2:$INSTALL_TAG"; else image_ref "$1" "$2"; fi
}

# nano-gpu's images, as the Dockerfiles lay them out (binary in /usr/local/bin, user, entrypoint), and
# kube-scheduler's (the upstream binary built here) under the name deploy/ uses.
nano_gpu_images_into() {
  local path='"Env":["PATH=/usr/local/bin:/usr/bin:/bin"]'
  # Dockerfile.allocator: distroless cc (glibc), USER 65532, ENTRYPOINT the binary, CMD serve.
  image_of "$1/allocator.tar" "$(install_image_ref allocator.yaml nano-gpu/allocator)" \
    '{"User":"65532:65532","Entrypoint":["/usr/local/bin/nano-gpu-allocator"],"Cmd":["serve"],'"$path}" \
    rootfs_add "$INSTALL_BIN/nano-gpu-allocator" /usr/local/bin/nano-gpu-allocator
  # Dockerfile.agent: Debian slim (glibc, all of it: the driver's NVML loads more than the agent), root,
  # ENTRYPOINT the binary.
  image_of "$1/agent.tar" "$(install_image_ref agent.yaml nano-gpu/agent)" \
    '{"Entrypoint":["/usr/local/bin/nano-gpu-agent"],'"$path}" agent_fill
  image_of "$1/kube-scheduler.tar" "$(scheduler_image)" "{$path}" \
    rootfs_add "$K8S_BIN/kube-scheduler" /usr/local/bin/kube-scheduler
}

agent_fill() {
  rootfs_add "$1" "$INSTALL_BIN/nano-gpu-agent" /usr/local/bin/nano-gpu-agent
  glibc_fill "$1"
}

# scheduler_image: kube-scheduler's image for this cluster's version. deploy/ names the newest tested
# version; on a cluster of another version it is set to that version, as its user would.
scheduler_image() { echo "registry.k8s.io/kube-scheduler:$(k8s_version)"; }
k8s_version() { sed -n 's/^k8s=\([^ ]*\).*/\1/p' "$K8S_BIN/.versions"; }
# import_images NODE ARCHIVE...: the images into the node's containerd.
import_images() {
  local a
  for a in "${@:2}"; do node_ctr "$1" -n k8s.io images import "$a" >/dev/null; done
}

# The shipped install on the real nodes, as an operator's kustomize overlay ($DIR/install, README
# "Installing with kustomize") that names deploy/ as its base and these choices:
#   - the local cluster runs as a cluster moving from gpushare does ("Moving from gpushare" in the
#     README): the component gpushare-gib;
#   - kube-scheduler's image is the cluster's version: deploy/ names the newest tested, the component
#     kube-scheduler-v1.35 the oldest;
#   - the optional profile deploy/default-scheduler/ (a component): the extender also over HTTPS for
#     clients of the CA in $DIR/extender-client (made here), whose scheduler certificate the
#     end-to-end test gives a kube-scheduler of its own;
#   - a patch of its own: the allocator evicts pods over their GPU memory grant
#     (NANO_GPU_EVICT_OVERRUNS=true, opt-in) and reads the cards' load every 2 s from a Prometheus on
#     the control plane's address (NANO_GPU_PROMETHEUS_URL, port 19090): the end-to-end test runs one
#     there for a while; the rest of the time none answers, and placement is the policy's alone.
#
# NANO_GPU_INSTALL_FROM=DIR installs another version instead, as hack/previous-build.sh lays it out
# (DIR/bin: its nano-gpu-allocator and nano-gpu-agent, DIR/deploy: its manifests): its images are
# tagged with DIR's name, and its overlay is install-<that name> in the cluster's directory.
# Installing over a running version is an upgrade (or a rollback) as the upgrade page has it: the
# same overlay pointed at another base and other images, applied; what only a first install does
# (the namespace, its Secret, the RuntimeClasses) is not done again.
INSTALL_BIN='' INSTALL_DEPLOY='' INSTALL_TAG=''
install_nano_gpu() {
  local images k f deploy version overlay=$DIR/install set=nano-gpu
  INSTALL_BIN=$NANO_GPU_BIN INSTALL_DEPLOY=$ROOT/deploy INSTALL_TAG=
  if [[ -n ${NANO_GPU_INSTALL_FROM:-} ]]; then
    INSTALL_BIN=$NANO_GPU_INSTALL_FROM/bin INSTALL_DEPLOY=$NANO_GPU_INSTALL_FROM/deploy
    INSTALL_TAG=$(basename "$NANO_GPU_INSTALL_FROM" | cut -c1-12)
    overlay=$DIR/install-$INSTALL_TAG set=version-$INSTALL_TAG
  fi
  for f in nano-gpu-allocator nano-gpu-agent; do [[ -x $INSTALL_BIN/$f ]] || die "$INSTALL_BIN/$f missing"; done
  [[ -f $INSTALL_DEPLOY/Kustomization ]] || die "$INSTALL_DEPLOY is not a deploy/ directory"
  images=$(cached_images "$set" "$(cat "$INSTALL_BIN/nano-gpu-allocator" "$INSTALL_BIN/nano-gpu-agent" \
    "$K8S_BIN/kube-scheduler" "$ROOT/hack/image.sh" "$ROOT/hack/cluster.sh" "$INSTALL_DEPLOY/"*.yaml |
    sha256sum | cut -c1-16)" nano_gpu_images_into)
  for ((k = 1; k <= NODES; k++)); do import_images "node-$k" "$images"/{allocator,agent,kube-scheduler}.tar; done
  mkdir -p "$overlay"
  deploy=$(realpath --relative-to="$overlay" "$INSTALL_DEPLOY")
  version=$(k8s_version)
  {
    echo "apiVersion: kustomize.config.k8s.io/v1beta1"
    echo "kind: Kustomization"
    echo "resources: [$deploy]"
    if [[ $NAMESPACE != nano-gpu-system ]]; then echo "namespace: $NAMESPACE"; fi
    if [[ -n $INSTALL_TAG ]]; then
      echo "images:"
      echo "  - {name: nano-gpu/allocator, newTag: \"$INSTALL_TAG\"}"
      echo "  - {name: nano-gpu/agent, newTag: \"$INSTALL_TAG\"}"
    fi
    echo "components:"
    echo "  - $deploy/components/gpushare-gib"
    echo "  - $deploy/default-scheduler"
    if [[ $version == v1.35.* ]]; then echo "  - $deploy/components/kube-scheduler-v1.35"; fi
    if ((RUNTIME_CLASS)); then echo "  - $deploy/components/runtime-class-nvidia"; fi
    if ((DRA)); then echo "  - $deploy/components/dra"; fi
    if ((NETWORK_POLICIES)); then echo "  - $deploy/components/network-policies"; fi
    echo "patches:"
    echo "  - patch: |-"
    echo "      apiVersion: apps/v1"
    echo "      kind: Deployment"
    echo "      metadata: {name: nano-gpu-allocator, namespace: nano-gpu-system}"
    echo "      spec:"
    echo "        template:"
    echo "          spec:"
    echo "            containers:"
    echo "              - name: allocator"
    echo "                env:"
    echo "                  - {name: NANO_GPU_EVICT_OVERRUNS, value: \"true\"}"
    echo "                  - {name: NANO_GPU_PROMETHEUS_URL, value: \"http://$CP_IP:19090\"}"
    echo "                  - {name: NANO_GPU_LOAD_REFRESH_SECONDS, value: \"2\"}"
    echo "                  - {name: NANO_GPU_LOAD_STALE_SECONDS, value: \"10\"}"
  } >"$overlay/kustomization.yaml"
  kubectl kustomize "$overlay" >"$overlay/built.yaml"
  grep -q "image: $(scheduler_image)\$" "$overlay/built.yaml" ||
    die "the install does not run $(scheduler_image): $overlay/built.yaml"
  if ! kubectl -n "$NAMESPACE" get secret nano-gpu-extender-client-ca >/dev/null 2>&1; then
    # The Secret the default-scheduler profile's replicas mount, in the namespace, before the install.
    kubectl create namespace "$NAMESPACE" --dry-run=client -o yaml | kubectl apply -f - >&2
    # The cluster's RuntimeClasses, as the GPU Operator or the operator makes them: the NVIDIA
    # runtime's, and plain runc's for pods that choose it.
    if ((RUNTIME_CLASS)); then
      printf '%s\n' "apiVersion: node.k8s.io/v1" "kind: RuntimeClass" "metadata: {name: nvidia}" "handler: nvidia" \
        "---" "apiVersion: node.k8s.io/v1" "kind: RuntimeClass" "metadata: {name: runc}" "handler: runc" |
        kubectl apply -f - >&2
    fi
    bash "$ROOT/hack/control-plane.sh" client-ca "$DIR/extender-client" scheduler "/CN=kube-scheduler" >&2
    kubectl -n "$NAMESPACE" create secret generic nano-gpu-extender-client-ca \
      --from-file=ca.crt="$DIR/extender-client/ca.crt" >&2
  fi
  # On a first install no node is labelled yet, so no agent runs before the user's step below.
  kubectl apply -k "$overlay" >&2
  # The user's step: label the GPU nodes.
  for ((k = 1; k <= NODES; k++)); do kubectl label node "node-$k" nano-gpu/node=true --overwrite >&2; done
  wait_for "nano-gpu-allocator (a replica ready)" 120 allocator_ready
  kubectl -n "$NAMESPACE" rollout status deployment/nano-gpu-allocator --timeout=180s >&2
  # The allocators write their CA into the webhook configuration, created in the same apply.
  wait_for "the webhook's CA bundle" 60 webhook_trusted
  for ((k = 1; k <= NODES; k++)); do wait_for "node-$k allocatable" 120 gpu_allocatable "node-$k"; done
  log "installed: ${INSTALL_DEPLOY#"$ROOT/"} through the overlay $overlay on $NODES real nodes"
}

webhook_trusted() {
  kubectl get mutatingwebhookconfiguration nano-gpu-allocator -o jsonpath='{.webhooks[0].clientConfig.caBundle}' | grep -q .
}
allocator_ready() {
  kubectl get deployment nano-gpu-allocator -n "$NAMESPACE" -o jsonpath='{.status.readyReplicas}' | grep -q '[1-9]'
}
node_ready() {
  kubectl get node "$1" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' | grep -qx True
}

# kube_proxy_healthy: kube-proxy says its rules are synced (its /healthz, in the namespace).
kube_proxy_healthy() {
  "${IN_NET[@]}" curl -sf -o /dev/null --max-time 2 http://127.0.0.1:10256/healthz
}

# ---- pieces run inside the namespaces ----

# in_node NODE ARGS...: runs ARGS in the node's namespaces (the cluster's network, the node's mounts).
in_node() { "${IN_NET[@]}" "--mount=$DIR/nodes/$1/mntns" "${@:2}"; }

# cgroup_root NODE: the node's cgroup root (the kubelet's cgroupRoot), the same in every hierarchy.
cgroup_root() { echo "$CGROUP_PREFIX-$1"; }

# node_mounts NODE: the node's mount namespace, its paths bound over the hard-coded ones.
node_mounts() {
  local node=$1 root=$DIR/nodes/$1 d
  mkdir -p "$root"/{var/lib,var/log,run/containerd,run/netns,run/cdi,usr/local,cni/net.d,cni/ipam,sysctl}
  touch "$root/mntns"
  unshare "--mount=$root/mntns" --propagation private true
  # protectKernelDefaults: the kubelet checks these sysctls and would write them machine-wide if
  # it were allowed to; it sees the values it expects here, and the machine keeps its own.
  printf '1\n' >"$root/sysctl/overcommit_memory"
  printf '10\n' >"$root/sysctl/panic"
  printf '1\n' >"$root/sysctl/panic_on_oops"
  # A real driver's /usr/local/nvidia, seen from inside before the node's /usr/local is bound over it.
  if ((REAL_GPU)); then
    mkdir -p "$root/host-usr-local"
    nsenter "--mount=$root/mntns" mount --rbind /usr/local "$root/host-usr-local"
  fi
  nsenter "--mount=$root/mntns" bash -s -- "$root" "$REAL_GPU" "$root/host-usr-local" <<'EOF'
    set -e
    # /usr/local too: what an operator installs there (HAMi-core's /usr/local/vgpu) is the node's.
    # /run/cdi: the CDI specs a containerd 2 node's runtime reads (/var/run/cdi).
    for d in var/lib var/log run/containerd run/netns run/cdi usr/local; do mkdir -p "/$d"; mount --bind "$1/$d" "/$d"; done
    # A real driver (NANO_GPU_REAL_GPU): where the machine has it, the node sees it too.
    if [[ $2 == 1 && -d $3/nvidia ]]; then mkdir -p /usr/local/nvidia; mount --rbind "$3/nvidia" /usr/local/nvidia; fi
    mount --bind "$1/sysctl/overcommit_memory" /proc/sys/vm/overcommit_memory
    mount --bind "$1/sysctl/panic" /proc/sys/kernel/panic
    mount --bind "$1/sysctl/panic_on_oops" /proc/sys/kernel/panic_on_oops
EOF
  # The kubelet needs its cgroup root in every hierarchy before it starts (real-nodes.md); cgroup v2
  # has one.
  if [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then
    mkdir -p "/sys/fs/cgroup$(cgroup_root "$node")"
  else
    for d in /sys/fs/cgroup/*/; do mkdir -p "${d%/}$(cgroup_root "$node")"; done
  fi
  if [[ -d /sys/fs/cgroup/cpuset ]]; then
    cat /sys/fs/cgroup/cpuset/cpuset.cpus >"/sys/fs/cgroup/cpuset$(cgroup_root "$node")/cpuset.cpus"
    cat /sys/fs/cgroup/cpuset/cpuset.mems >"/sys/fs/cgroup/cpuset$(cgroup_root "$node")/cpuset.mems"
  fi
}

# runtimes_toml TABLE: containerd's runtimes under TABLE (the CRI plugin's runtimes table, as the
# node's containerd version names it). The handler nvidia is the NVIDIA runtime's stand-in: the fake
# driver for containers that set NVIDIA_VISIBLE_DEVICES, then runc. The default (handler runc) is
# the stand-in too, as on nodes whose default runtime is NVIDIA's (nvidia-docker's setup); with
# --runtime-class it is runc itself (both configurations NVIDIA's toolkit sets up). Pods' CDI
# annotations reach the runtime (pod_annotations), as on nodes set up to pass them: the stand-in
# reads them only in its CDI mode, which the enforcement suite turns on to see the annotation canary
# tell such a node.
#
# A real GPU node (NANO_GPU_REAL_GPU) runs NVIDIA's own runtime in both, and passes no annotation.
runtimes_toml() {
  local handler binary standin=$NANO_GPU_BIN/nvidia-runtime-standin
  ((REAL_GPU)) && standin=$NANO_GPU_NVIDIA_RUNTIME
  for handler in runc nvidia; do
    binary=$standin
    if [[ $handler == runc ]] && ((RUNTIME_CLASS)); then binary=$(command -v runc); fi
    printf '  [%s.%s]\n    runtime_type = "io.containerd.runc.v2"\n' "$1" "$handler"
    ((REAL_GPU)) || printf '    pod_annotations = ["cdi.k8s.io/*"]\n'
    printf '    [%s.%s.options]\n      SystemdCgroup = false\n      BinaryName = "%s"\n' "$1" "$handler" "$binary"
  done
}

# containerd2 K: whether node K runs containerd 2 (the last CONTAINERD2 nodes do).
containerd2() { (($1 > NODES - CONTAINERD2)); }

# node_ctr NODE ARGS...: the ctr of the node's containerd, in its namespaces.
node_ctr() {
  local k=${1#node-}
  if containerd2 "$k"; then in_node "$1" "$CONTAINERD2_BIN/ctr" "${@:2}"; else in_node "$1" ctr "${@:2}"; fi
}

# start_containerd2 NODE K: containerd 2 (config version 3), its runc shim found on PATH, CDI on with
# the node's /var/run/cdi, NRI off (its socket would be this machine's /var/run/nri).
start_containerd2() {
  local node=$1 k=$2 root=$DIR/nodes/$1
  cat >"$root/containerd.toml" <<EOF
version = 3
[plugins.'io.containerd.nri.v1.nri']
  disable = true
[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = "nano-gpu.local/pause:1"
[plugins.'io.containerd.cri.v1.runtime']
  # Nothing here may lower oom_score_adj (real-nodes.md).
  restrict_oom_score_adj = true
  enable_cdi = true
  cdi_spec_dirs = ["/var/run/cdi"]
$(runtimes_toml "plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes")
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["$CNI_BIN"]
    conf_dir = "$root/cni/net.d"
EOF
  local env=("PATH=$CONTAINERD2_BIN:$(dirname "$(command -v runc)"):$PATH")
  # NVIDIA's runtime, started by the shim with containerd's environment, reads this file.
  ((REAL_GPU)) && env+=("NVIDIA_CTK_CONFIG_FILE_PATH=$NANO_GPU_RUNTIME_CONFIG_FILE")
  launch "containerd-$node" "${IN_NET[@]}" "--mount=$root/mntns" env "${env[@]}" \
    "$CONTAINERD2_BIN/containerd" --config "$root/containerd.toml"
}

start_containerd() {
  local node=$1 k=$2 root=$DIR/nodes/$1
  cni_config "$node" "$k"
  if containerd2 "$k"; then start_containerd2 "$node" "$k"; return; fi
  cat >"$root/containerd.toml" <<EOF
version = 2
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "nano-gpu.local/pause:1"
  # Nothing here may lower oom_score_adj (real-nodes.md).
  restrict_oom_score_adj = true
$(runtimes_toml 'plugins."io.containerd.grpc.v1.cri".containerd.runtimes')
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$CNI_BIN"
    conf_dir = "$root/cni/net.d"
EOF
  launch "containerd-$node" "${IN_NET[@]}" "--mount=$root/mntns" containerd --config "$root/containerd.toml"
}

# cni_config NODE K: the node's pod network, a bridge of its own.
# (Without portmap on a real GPU node: it needs iptables, which that machine lacks.)
cni_config() {
  local node=$1 k=$2 root=$DIR/nodes/$1 portmap=',
  {"type": "portmap", "capabilities": {"portMappings": true}}'
  ((REAL_GPU)) && portmap=
  cat >"$root/cni/net.d/10-bridge.conflist" <<EOF
{"cniVersion": "0.4.0", "name": "nano-gpu-$node", "plugins": [
  {"type": "bridge", "bridge": "ngbr$k", "isGateway": true, "isDefaultGateway": true,
   "ipMasq": false, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.244.$k.0/24"}]], "dataDir": "$root/cni/ipam"}}$portmap]}
EOF
}

start_kubelet() {
  local node=$1 k=$2 root=$DIR/nodes/$1 ip
  ip=$(node_ip "$k")
  bash "$ROOT/hack/control-plane.sh" client "$DIR" "kubelet-$node" "/O=system:nodes/CN=system:node:$node" "$CP_URL" >&2
  # maxPods stays at the kubelet's default (110). At 60, a burst put 59 pods on one node, and the
  # agent DaemonSet's rollout there made kube-scheduler preempt one of them for the new
  # system-node-critical agent pod while the old one was still terminating.
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
# The nodes share the machine's disk: a percentage of a big shared disk (1 % of 250 GB) would set
# DiskPressure, taint every node and stop scheduling while gigabytes are free. What stops the node
# instead is what stops a real one: too little left to write its own state.
evictionHard: { memory.available: "50Mi", nodefs.available: "256Mi", imagefs.available: "256Mi", nodefs.inodesFree: "1%" }
EOF
  # client.go at 2: the device manager's line for each device list a plugin sends ("State pushed
  # for device plugin"), which the tests read to tell when a restarted kubelet had our devices.
  # kuberuntime_manager.go at 2: why the kubelet makes a pod's sandbox again ("has no IP address",
  # "No ready sandbox"), as after a containerd restart that lost one. kubelet.go at 2: each pod's
  # SyncLoop ADD/DELETE/REMOVE; manager.go at 3: which departed pods the device manager frees
  # ("Pods to be removed"), which the fault suite prints when a checkpoint keeps a deleted share.
  launch "kubelet-$node" "${IN_NET[@]}" "--mount=$root/mntns" "$K8S_BIN/kubelet" --config "$root/kubelet.yaml" \
    --kubeconfig "$DIR/kubelet-$node.kubeconfig" --hostname-override "$node" --node-ip "$ip" -v=1 \
    --vmodule=client=2,kuberuntime_manager=2,kubelet=2,manager=3
}

up() {
  local n=$1 k node images
  tools
  local needed=(containerd runc iptables nsenter unshare) workload=(nvidia-smi gpu-use)
  if ((REAL_GPU)); then
    needed=(runc nsenter unshare sysctl) workload=(cuda-probe) CONTAINERD2=$n
    [[ -x ${NANO_GPU_NVIDIA_RUNTIME:-} ]] || die "NANO_GPU_NVIDIA_RUNTIME: NVIDIA's runtime, not ${NANO_GPU_NVIDIA_RUNTIME:-set}"
    [[ -f ${NANO_GPU_CDI_SPEC:-} ]] || die "NANO_GPU_CDI_SPEC: the node's CDI spec, not ${NANO_GPU_CDI_SPEC:-set}"
    [[ -f ${NANO_GPU_RUNTIME_CONFIG_FILE:-} ]] ||
      die "NANO_GPU_RUNTIME_CONFIG_FILE: the NVIDIA runtime's config.toml, not ${NANO_GPU_RUNTIME_CONFIG_FILE:-set}"
  fi
  for c in "${needed[@]}"; do
    command -v "$c" >/dev/null || die "$c not found; apt-get install containerd runc containernetworking-plugins iptables"
  done
  [[ -x $CNI_BIN/bridge ]] || die "$CNI_BIN/bridge missing; apt-get install containernetworking-plugins"
  # (Not `busybox --list | grep -q`: with pipefail, grep leaving early can fail the pipe.)
  if ! [[ -x $BUSYBOX ]] || ! grep -qx nc <("$BUSYBOX" --list); then
    die "$BUSYBOX missing; apt-get install busybox-static"
  fi
  images=$(cached_images base "$(cat "$NANO_GPU_BIN/pause" "${workload[@]/#/$NANO_GPU_BIN/}" "$BUSYBOX" "$ROOT/hack/image.sh" "$ROOT/hack/cluster.sh" |
    sha256sum | cut -c1-16)" base_images_into)
  K8S_BIN=${K8S_BIN:-$(bash "$ROOT/hack/k8s-build.sh")}
  if ((CONTAINERD2 > 0)); then
    ((CONTAINERD2 <= n)) || die "--containerd2 $CONTAINERD2: more than the $n nodes"
    CONTAINERD2_BIN=${CONTAINERD2_BIN:-$(bash "$ROOT/hack/containerd-build.sh")}
  fi
  mkdir -p "$DIR"
  [[ -e $DIR/netns ]] && die "$DIR/netns exists: run $0 down $DIR first"
  trap 'log "up failed; logs in $DIR"; down' EXIT

  # The network namespace: loopback addresses for the apiserver and the nodes, ClusterIPs routed to
  # loopback (kube-proxy's rules take them from there), forwarding between the nodes' pod bridges.
  touch "$NETNS"
  unshare "--net=$NETNS" true
  "${IN_NET[@]}" "${IP[@]}" link set lo up
  "${IN_NET[@]}" "${IP[@]}" addr add "$CP_IP/32" dev lo
  for ((k = 1; k <= n; k++)); do "${IN_NET[@]}" "${IP[@]}" addr add "$(node_ip "$k")/32" dev lo; done
  "${IN_NET[@]}" "${IP[@]}" route add "$SERVICE_CIDR" dev lo
  "${IN_NET[@]}" sysctl -qw net.ipv4.ip_forward=1

  K8S_BIN=$K8S_BIN NETNS=$NETNS CP_IP=$CP_IP NETNS_FORWARD=$NANO_GPU_BIN/netns-forward APISERVER_ARGS=$APISERVER_ARGS \
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

  for ((k = 1; k <= n; k++)); do
    node=node-$k
    node_mounts "$node"
    if ((REAL_GPU)); then
      install -m 644 "$NANO_GPU_CDI_SPEC" "$DIR/nodes/$node/run/cdi/"
      start_containerd "$node" "$k"
      continue
    fi
    # The node's fake driver (see tests/src/bin/nvidia-runtime-standin.rs): its cards and NVML.
    mkdir -p "$DIR/nodes/$node/var/lib/nano-gpu-fake-driver/procs"
    chmod 1777 "$DIR/nodes/$node/var/lib/nano-gpu-fake-driver/procs"
    nvml_config "$node" "$k" >"$DIR/nodes/$node/var/lib/nano-gpu-fake-driver/nvml.json"
    runtime_config >"$DIR/nodes/$node/var/lib/nano-gpu-fake-driver/config.toml"
    install -m 755 "$FAKE_NVML" "$DIR/nodes/$node/var/lib/nano-gpu-fake-driver/libnvidia-ml.so.1"
    install -m 755 "$NANO_GPU_BIN/nvidia-cuda-mps-control" "$DIR/nodes/$node/var/lib/nano-gpu-fake-driver/"
    if containerd2 "$k"; then cdi_spec "$node" "$k" >"$DIR/nodes/$node/run/cdi/nvidia.json"; fi
    start_containerd "$node" "$k"
  done
  for ((k = 1; k <= n; k++)); do
    node=node-$k
    wait_for "containerd on $node" 30 node_ctr "$node" version
    import_images "$node" "$images"/{pause,busybox,cuda}.tar
    start_kubelet "$node" "$k"
  done
  for ((k = 1; k <= n; k++)); do wait_for "node-$k Ready" 90 node_ready "node-$k"; done
  if ((REAL_GPU)); then
    # No kube-proxy: the one Service pods need, the apiserver's, is its address forwarded to it.
    "${IN_NET[@]}" "${IP[@]}" addr add "$SERVICE_IP/32" dev lo
    launch service-forward "${IN_NET[@]}" "$NANO_GPU_BIN/netns-forward" --netns "$NETNS" "$SERVICE_IP:443=$CP_IP:6443"
  else
    start_kube_proxy
  fi
  wait_for "default ServiceAccount" 60 kubectl get serviceaccount default -n default
  write_cluster_env "$n"
  ((bare)) || install_nano_gpu
  trap - EXIT
  log "up: $n real nodes$( ((bare)) || echo ", nano-gpu installed"); kubectl --kubeconfig $ADMIN_KUBECONFIG get nodes; stop with: $0 down $DIR"
}

start_kube_proxy() {
  # One kube-proxy: every node shares the namespace, so one set of rules serves them all. It starts
  # once its node (node-1) is registered: kube-proxy waits 30 s for its Node, and when the Node shows
  # up later with addresses it did not start with, it exits for its service manager to start it
  # again (upstream pkg/proxy/node.go); nothing here would, and the pods would lose the Services.
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
  wait_for "kube-proxy (its rules synced; log: $DIR/kube-proxy.log)" 60 kube_proxy_healthy
}

write_cluster_env() {
  local n=$1
  { cat "$DIR/control-plane.env"
    cat <<EOF
NETNS=$NETNS
CP_IP=$CP_IP
NODES=$n
CONTAINERD2=$CONTAINERD2
CONTAINERD2_BIN=$CONTAINERD2_BIN
RUNTIME_CLASS=$RUNTIME_CLASS
DRA=$DRA
NETWORK_POLICIES=$NETWORK_POLICIES
NAMESPACE=$NAMESPACE
CGROUP_PREFIX=$CGROUP_PREFIX
NANO_GPU_BIN=$NANO_GPU_BIN
K8S_VERSION=$(k8s_version)
REAL_GPU=$REAL_GPU
CNI_BIN=$CNI_BIN
BUSYBOX=$BUSYBOX
NANO_GPU_NVIDIA_RUNTIME=${NANO_GPU_NVIDIA_RUNTIME:-}
NANO_GPU_RUNTIME_CONFIG_FILE=${NANO_GPU_RUNTIME_CONFIG_FILE:-}
EOF
  } >"$DIR/cluster.env"
}

# restart COMPONENT NODE: kill -9 of the node's kubelet or containerd, then the same one started
# again (what a crash and its service manager do). Containers keep running through both.
restart() {
  local what=$1 node=$2 k pid
  k=${node#node-}
  [[ $node == node-* && -d $DIR/nodes/$node ]] || die "no node $node in $DIR"
  pid=$(ours "$DIR/$what-$node.pid") || die "$what of $node is not running"
  kill -KILL "$pid"
  while alive "$pid"; do sleep 0.05; done
  case $what in
    kubelet) start_kubelet "$node" "$k" ;;
    containerd) start_containerd "$node" "$k"; wait_for "containerd on $node" 30 node_ctr "$node" version ;;
    *) die "restart: kubelet or containerd, not $what" ;;
  esac
  log "restarted $what on $node"
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

# Our cgroup roots that exist, one per node and hierarchy.
our_cgroups() {
  local cg
  for cg in /sys/fs/cgroup/*/"${CGROUP_PREFIX#/}"-* /sys/fs/cgroup/"${CGROUP_PREFIX#/}"-*; do
    [[ -d $cg ]] && echo "$cg"
  done
  return 0
}

# cpu_report: one line of the CPU seconds each daemon of the cluster spent over its life (user and
# system, with the children it waited for) and its pods' (their cgroups), so a test run's log shows
# where its clusters' CPU went (a suite's own count leaves its cluster out).
cpu_report() {
  local f pid name hz parts=() usec=0 cg v acct=()
  hz=$(getconf CLK_TCK)
  for f in "$DIR"/*.pid; do
    pid=$(ours "$f") || continue
    name=$(basename "$f" .pid)
    # Fields after the command's name (which may hold spaces): utime, stime, cutime, cstime are 12-15.
    v=$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | awk '{ print $12 + $13 + $14 + $15 }') || continue
    parts+=("$name $((${v:-0} / hz))")
  done
  ((${#parts[@]})) || return 0
  # cgroup v1 counts in cpuacct (ns), v2 in cpu.stat (us); each node's cgroup holds its pods'.
  while read -r cg; do [[ -f $cg/cpuacct.usage ]] && acct+=("$cg/cpuacct.usage"); done < <(our_cgroups)
  if ((${#acct[@]})); then
    for f in $(realpath "${acct[@]}" | sort -u); do usec=$((usec + $(cat "$f") / 1000)); done
  else
    while read -r cg; do
      [[ -f $cg/cpu.stat ]] || continue
      v=$(awk '$1 == "usage_usec" { print $2 }' "$cg/cpu.stat")
      usec=$((usec + ${v:-0}))
    done < <(our_cgroups)
  fi
  parts+=("pods $((usec / 1000000))")
  log "CPU over its life, s: $(printf '%s, ' "${parts[@]}" | sed 's/, $//')"
}

down() {
  local f pid m cg tries
  trap - EXIT
  [[ -d $DIR ]] || return 0
  cpu_report
  # Pods first, while their kubelets run: the kubelets stop their containers and sandboxes. No
  # controller recreates them once kube-controller-manager is gone.
  stop_pid "$DIR/kube-controller-manager.pid"
  if [[ -f $DIR/control-plane.env ]]; then
    # shellcheck source=/dev/null
    source "$DIR/control-plane.env"
    if kubectl get --raw /readyz >/dev/null 2>&1; then
      kubectl delete pods --all -A --grace-period=1 --wait=true --timeout=60s >/dev/null 2>&1 ||
        log "some pods were not deleted in 60s; killing them"
    fi
  fi
  for f in "$DIR"/kubelet-*.pid "$DIR"/kube-proxy.pid "$DIR"/containerd-*.pid; do
    [[ -e $f ]] && stop_pid "$f"
  done
  # What is left in our cgroups (containers whose kubelet is gone), the control plane, then anything
  # still in our network namespace (containerd shims).
  while read -r cg; do find "$cg" -name cgroup.procs -exec cat {} + 2>/dev/null; done < <(our_cgroups) |
    sort -u | xargs -r kill -KILL 2>/dev/null || true
  bash "$ROOT/hack/control-plane.sh" stop "$DIR" >&2
  for pid in $(ns_pids); do kill -KILL "$pid" 2>/dev/null || true; done
  # cgroups, deepest first (a cgroup empties a moment after its last process dies).
  while read -r cg; do
    for ((tries = 0; tries < 50; tries++)); do
      find "$cg" -depth -type d -exec rmdir {} + 2>/dev/null || true
      [[ -d $cg ]] || break
      sleep 0.1
    done
    if [[ -d $cg ]]; then log "could not remove cgroup $cg"; fi
  done < <(our_cgroups)
  # The namespaces' pins, and any mount under $DIR, deepest first.
  while read -r m; do umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true; done \
    < <(awk -v d="$DIR/" 'index($5, d) == 1 { print $5 }' /proc/self/mountinfo | sort -r)
  rm -f "$DIR/netns" "$DIR"/nodes/*/mntns
  if awk -v d="$DIR/" 'index($5, d) == 1 { found = 1 } END { exit !found }' /proc/self/mountinfo; then
    log "mounts left under $DIR"
  else
    # What only a running cluster needs (images, snapshots, the etcd data) goes; the logs stay.
    rm -rf "$DIR"/nodes/*/var/lib/containerd "$DIR/etcd"
  fi
}

# cluster_env: what `up` wrote (NANO_GPU_BIN given in the environment wins).
cluster_env() {
  local bin=${NANO_GPU_BIN:-}
  [[ -f $DIR/cluster.env ]] || die "$DIR/cluster.env missing: run $0 up $DIR first"
  # shellcheck source=/dev/null
  source "$DIR/cluster.env"
  NANO_GPU_BIN=${bin:-$NANO_GPU_BIN}
}

[[ $# -ge 2 ]] || die "usage: $0 up|down|install|restart|ctr|load <dir> ..."
CMD=$1
DIR=$(realpath -m "$2")
shift 2
NETNS=$DIR/netns
IN_NET=(nsenter "--net=$NETNS")
# The node kinds `up` chose (cluster.env says them for the other commands).
CONTAINERD2=0 CONTAINERD2_BIN=${CONTAINERD2_BIN:-} RUNTIME_CLASS=0 DRA=0 NETWORK_POLICIES=0 NAMESPACE=nano-gpu-system
REAL_GPU=${NANO_GPU_REAL_GPU:-0}
CNI_BIN=${NANO_GPU_CNI_BIN:-/usr/lib/cni} BUSYBOX=${NANO_GPU_BUSYBOX:-/bin/busybox}
# iproute2's ip, else busybox's (a GPU machine may have neither iproute2 nor iptables).
IP=(ip)
command -v ip >/dev/null || IP=("$BUSYBOX" ip)
# Per cluster directory, so clusters side by side never share a cgroup.
CGROUP_PREFIX=/nano-gpu-$(sha256sum <<<"$DIR" | cut -c1-8)
case $CMD in
  up)
    NODES=3
    bare=0
    APISERVER_ARGS=
    while [[ $# -gt 0 ]]; do
      case $1 in
        --nodes) NODES=$2; shift 2 ;;
        --containerd2) CONTAINERD2=$2; shift 2 ;;
        --runtime-class) RUNTIME_CLASS=1; shift ;;
        --dra) DRA=1; shift ;;
        --namespace) NAMESPACE=$2; shift 2 ;;
        --network-policies) NETWORK_POLICIES=1; shift ;;
        --bare) bare=1; shift ;;
        --apiserver-arg) APISERVER_ARGS+=${APISERVER_ARGS:+$'\n'}$2; shift 2 ;;
        *) die "unknown flag $1" ;;
      esac
    done
    up "$NODES" ;;
  down) down; log "down" ;;
  install) cluster_env; tools; install_nano_gpu ;;
  restart) [[ $# -eq 2 ]] || die "usage: $0 restart <dir> kubelet|containerd <node>"; cluster_env; restart "$1" "$2" ;;
  crash | freeze)
    [[ $# -eq 2 && $2 =~ ^[0-9.]+$ ]] || die "usage: $0 $CMD <dir> etcd|kube-apiserver|kube-controller-manager|... SECONDS"
    cluster_env; "$CMD" "$1" "$2" ;;
  ctr) [[ $# -ge 2 ]] || die "usage: $0 ctr <dir> <node> ARGS..."; cluster_env; node_ctr "$1" -n k8s.io "${@:2}" ;;
  load)
    [[ $# -eq 1 && -f $1 ]] || die "usage: $0 load <dir> IMAGE.tar"
    cluster_env; for node in "$DIR"/nodes/*/; do import_images "$(basename "$node")" "$1"; done ;;
  *) die "unknown command $CMD" ;;
esac
