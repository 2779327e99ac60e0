# shellcheck shell=bash
# Sourced by hack/control-plane.sh and hack/cluster.sh (which define `die`).
# free_port VAR: sets VAR to a loopback port nothing listens on, that no earlier call handed out, and
# below the kernel's ephemeral range, so no client connection of the cluster can be holding it by
# the time the server binds (a port from that range once did: "Address already in use").
USED=" "
free_port() {
  local p i low
  low=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32768)
  ((low > 12000)) || die "the ephemeral port range starts at $low: no room below it"
  for ((i = 0; i < 100; i++)); do
    p=$((10000 + RANDOM % (low - 10000)))
    if [[ $USED != *" $p "* ]] && ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
      USED+="$p "; printf -v "$1" %s "$p"; return
    fi
  done
  die "no free loopback port"
}
