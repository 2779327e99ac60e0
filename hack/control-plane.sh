#!/usr/bin/env bash
# Starts/stops a real local Kubernetes control plane (etcd + kube-apiserver) for
# the local cluster (hack/cluster.sh, which starts the rest).
# Usage: hack/control-plane.sh start <dir>   # fresh state in <dir>, waits for /readyz
#        hack/control-plane.sh stop <dir>    # kills every process with a <dir>/*.pid
#        hack/control-plane.sh client <dir> NAME SUBJECT SERVER
#                                            # <dir>/NAME.kubeconfig: a client cert for SUBJECT
#                                            # (e.g. /O=system:nodes/CN=system:node:node-1) at SERVER
# Env:   K8S_BIN  dir with etcd/kube-apiserver/kubectl (default: hack/k8s-build.sh)
#        NETNS    the cluster's network namespace file (hack/cluster.sh makes it): the control
#                 plane runs in it, the apiserver on CP_IP:6443 (the address cluster.sh gives it
#                 there) for the nodes and their pods; this machine's loopback reaches it through
#                 NETNS_FORWARD (tests/src/bin/netns-forward.rs)
#        LOOPBACK=1 instead of NETNS: etcd and the apiserver on this machine's loopback, on free ports
#                 (no nodes or pods reach it: hack/bench-scale.sh's kubelet-less cluster)
#        APISERVER_ARGS more kube-apiserver flags, one per line (hack/cluster.sh up --apiserver-arg)
# <dir> afterwards holds admin.kubeconfig (system:masters), pki/, *.log, *.pid and control-plane.env.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SERVICE_CIDR=10.0.0.0/24      # kube-proxy routes it inside NETNS
SERVICE_IP=10.0.0.1           # first IP: the "kubernetes" Service
READY_TIMEOUT=${READY_TIMEOUT:-90}

log() { echo "control-plane: $*" >&2; }
die() { log "error: $*"; exit 1; }
usage() { die "usage: $0 start|stop <dir> | client <dir> NAME SUBJECT SERVER | client-ca <dir> NAME SUBJECT"; }

# shellcheck source=hack/lib.sh
source "$ROOT/hack/lib.sh"

stop() {
  local f files=()
  # Others first (e.g. a scheduler a later script put here), etcd last.
  for f in "$DIR"/*.pid; do
    [[ -e $f && $f != */kube-apiserver.pid && $f != */etcd.pid ]] && files+=("$f")
  done
  files+=("$DIR/kube-apiserver.pid" "$DIR/etcd.pid")
  for f in "${files[@]}"; do stop_pid "$f"; done
}


# ca SUBJECT: a new CA (EC key and self-signed cert) in $PKI.
ca() {
  mkdir -p "$PKI" && chmod 700 "$PKI"
  openssl req -x509 -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:P-256 -days 365 -sha256 \
    -subj "$1" -keyout "$PKI/ca.key" -out "$PKI/ca.crt" \
    -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign \
    >>"$PKI/openssl.log" 2>&1 || die "openssl failed for the CA; see $PKI/openssl.log"
}

# cert NAME SUBJECT EXTENSIONS: EC key + cert signed by the CA in $PKI.
cert() {
  local pki=$PKI
  printf '%s\n' "basicConstraints=CA:FALSE" "keyUsage=critical,digitalSignature,keyEncipherment" "$3" >"$pki/$1.ext"
  { openssl req -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:P-256 -subj "$2" \
      -keyout "$pki/$1.key" -out "$pki/$1.csr" &&
    openssl x509 -req -in "$pki/$1.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
      -days 365 -sha256 -extfile "$pki/$1.ext" -out "$pki/$1.crt"; } >>"$pki/openssl.log" 2>&1 ||
    die "openssl failed for $1; see $pki/openssl.log"
  rm -f "$pki/$1.csr" "$pki/$1.ext"
}

certs() {
  local pki=$PKI
  ca "/CN=nano-gpu-test-ca"
  cert apiserver "/CN=kube-apiserver" "extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,IP:$SERVICE_IP,${CP_IP:+IP:$CP_IP,}DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
  cert admin "/O=system:masters/CN=nano-gpu-admin" extendedKeyUsage=clientAuth
  cert front-proxy-client "/CN=front-proxy-client" extendedKeyUsage=clientAuth
  # The apiserver's client certificate towards kubelets (logs, exec).
  cert kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" extendedKeyUsage=clientAuth
  # Service-account token signing key pair.
  { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$pki/sa.key" &&
    openssl pkey -in "$pki/sa.key" -pubout -out "$pki/sa.pub"; } >>"$pki/openssl.log" 2>&1 ||
    die "openssl failed for the service-account key; see $pki/openssl.log"
}

# kubeconfig NAME USER [SERVER]: self-contained (certs embedded) kubeconfig.
kubeconfig() {
  local pki=$DIR/pki
  cat >"$DIR/$1.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: nano-gpu-test
  cluster:
    server: ${3:-https://127.0.0.1:$APISERVER_PORT}
    certificate-authority-data: $(base64 -w0 <"$pki/ca.crt")
users:
- name: $2
  user:
    client-certificate-data: $(base64 -w0 <"$pki/$1.crt")
    client-key-data: $(base64 -w0 <"$pki/$1.key")
contexts:
- name: $2@nano-gpu-test
  context: { cluster: nano-gpu-test, user: $2 }
current-context: $2@nano-gpu-test
EOF
}


start() {
  command -v openssl >/dev/null || die "openssl not found (needed for test certificates)"
  local f
  for f in "$DIR"/*.pid; do [[ -e $f ]] && ours "$f" >/dev/null && die "already running in $DIR; run: $0 stop $DIR"; done
  BIN=${K8S_BIN:-$(bash "$ROOT/hack/k8s-build.sh")}
  for f in etcd kube-apiserver kubectl; do [[ -x $BIN/$f ]] || die "$BIN/$f missing; run hack/k8s-build.sh"; done
  # Fresh state each start: only our own files, never the whole dir.
  rm -rf "$DIR/etcd" "$DIR/pki" "$DIR"/*.kubeconfig "$DIR"/*.log "$DIR"/*.log.[0-9]* "$DIR"/*.pid "$DIR/control-plane.env"
  local bind advertise port
  if [[ ${LOOPBACK:-} == 1 ]]; then
    IN_NS=()
    bind=127.0.0.1 advertise=127.0.0.1
    free_port ETCD_PORT; free_port ETCD_PEER_PORT; free_port APISERVER_PORT
    port=$APISERVER_PORT
  else
    [[ -n ${NETNS:-} && -x ${NETNS_FORWARD:-} && -n ${CP_IP:-} ]] ||
      die "needs NETNS, NETNS_FORWARD (the netns-forward binary) and CP_IP (hack/cluster.sh sets them), or LOOPBACK=1"
    IN_NS=(nsenter "--net=$NETNS")
    # A fresh namespace: fixed ports inside; this machine reaches the apiserver through the forwarder.
    bind=0.0.0.0 advertise=$CP_IP port=6443
    ETCD_PORT=2379 ETCD_PEER_PORT=2380
    free_port APISERVER_PORT
  fi
  certs
  kubeconfig admin nano-gpu-admin
  # Any failure from here on (die or set -e) must not leave processes behind.
  trap 'log "start failed; logs in $DIR"; stop' EXIT

  local extra_args=()
  [[ -n ${APISERVER_ARGS:-} ]] && mapfile -t extra_args <<<"$APISERVER_ARGS"
  # On loopback no pod reaches the `kubernetes` Service, and the apiserver will not advertise a
  # loopback address in its endpoints.
  [[ ${LOOPBACK:-} == 1 ]] && extra_args+=(--endpoint-reconciler-type=none)
  local etcd_url=http://127.0.0.1:$ETCD_PORT peer_url=http://127.0.0.1:$ETCD_PEER_PORT deadline
  # No fsync: throwaway test data, and fsync dominates etcd latency on CI disks.
  launch etcd "${IN_NS[@]}" "$BIN/etcd" --name=nano-gpu --data-dir="$DIR/etcd" --log-level=warn --unsafe-no-fsync \
    --listen-client-urls="$etcd_url" --advertise-client-urls="$etcd_url" \
    --listen-peer-urls="$peer_url" --initial-advertise-peer-urls="$peer_url" \
    --initial-cluster="nano-gpu=$peer_url"
  # Let etcd listen first, so the apiserver does not log a burst of dial errors.
  until "${IN_NS[@]}" bash -c "(exec 3<>/dev/tcp/127.0.0.1/$ETCD_PORT)" 2>/dev/null; do
    running "$DIR/etcd.pid" || die "etcd exited; log: $DIR/etcd.log"; sleep 0.1
  done

  # The requestheader (front proxy) settings let delegated authn in kube-scheduler etc. start cleanly;
  # logs and exec reach the kubelets by their InternalIP (node names do not resolve) with a client
  # certificate.
  launch kube-apiserver "${IN_NS[@]}" "$BIN/kube-apiserver" \
    --etcd-servers="$etcd_url" --bind-address="$bind" --advertise-address="$advertise" --secure-port="$port" \
    --cert-dir="$DIR/pki" --tls-cert-file="$DIR/pki/apiserver.crt" --tls-private-key-file="$DIR/pki/apiserver.key" \
    --client-ca-file="$DIR/pki/ca.crt" \
    --requestheader-client-ca-file="$DIR/pki/ca.crt" --requestheader-allowed-names=front-proxy-client \
    --requestheader-username-headers=X-Remote-User --requestheader-group-headers=X-Remote-Group \
    --requestheader-extra-headers-prefix=X-Remote-Extra- \
    --proxy-client-cert-file="$DIR/pki/front-proxy-client.crt" --proxy-client-key-file="$DIR/pki/front-proxy-client.key" \
    --authorization-mode=Node,RBAC --service-cluster-ip-range="$SERVICE_CIDR" \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-account-key-file="$DIR/pki/sa.pub" --service-account-signing-key-file="$DIR/pki/sa.key" \
    --kubelet-preferred-address-types=InternalIP,Hostname \
    --kubelet-client-certificate="$DIR/pki/kubelet-client.crt" --kubelet-client-key="$DIR/pki/kubelet-client.key" \
    --allow-privileged=true --profiling=false "${extra_args[@]}"
  # Not in the namespace: it listens here and joins NETNS itself.
  [[ ${LOOPBACK:-} == 1 ]] ||
    launch apiserver-forward "$NETNS_FORWARD" --netns "$NETNS" "127.0.0.1:$APISERVER_PORT=127.0.0.1:6443"

  log "waiting for kube-apiserver on https://127.0.0.1:$APISERVER_PORT/readyz (up to ${READY_TIMEOUT}s)"
  deadline=$((SECONDS + READY_TIMEOUT))
  until "$BIN/kubectl" --kubeconfig="$DIR/admin.kubeconfig" get --raw=/readyz >/dev/null 2>&1; do
    for f in etcd kube-apiserver; do
      running "$DIR/$f.pid" || { tail -n 20 "$DIR/$f.log" >&2; die "$f exited; log: $DIR/$f.log"; }
    done
    ((SECONDS < deadline)) || { tail -n 20 "$DIR/kube-apiserver.log" >&2; die "kube-apiserver not ready after ${READY_TIMEOUT}s"; }
    sleep 0.5
  done
  trap - EXIT

  # For later harness scripts: `source <dir>/control-plane.env`.
  cat >"$DIR/control-plane.env" <<EOF
K8S_BIN=$BIN
APISERVER_URL=https://127.0.0.1:$APISERVER_PORT
APISERVER_PORT=$APISERVER_PORT
ADMIN_KUBECONFIG=$DIR/admin.kubeconfig
CP_URL=https://$advertise:$port
EOF
  log "ready: kubectl --kubeconfig=$DIR/admin.kubeconfig get ns   (stop: $0 stop $DIR)"
}

[[ $# -ge 2 ]] || usage
# Absolute, so pid ownership checks and kubeconfig paths do not depend on cwd.
DIR=$(mkdir -p "$2" && cd "$2" && pwd)
PKI=$DIR/pki
case $1 in
  start) [[ $# -eq 2 ]] || usage; start ;;
  stop) [[ $# -eq 2 ]] || usage; stop; log "stopped" ;;
  client)
    [[ $# -eq 5 ]] || usage
    cert "$3" "$4" extendedKeyUsage=clientAuth
    kubeconfig "$3" "$(sed -n 's#.*/CN=\([^/]*\).*#\1#p' <<<"$4")" "$5" ;;
  client-ca)
    # A CA of its own in <dir> (signing nothing else) and client certificate NAME from it.
    [[ $# -eq 4 ]] || usage
    PKI=$DIR
    ca "/CN=nano-gpu-$3-client-ca"
    cert "$3" "$4" extendedKeyUsage=clientAuth ;;
  *) usage ;;
esac
