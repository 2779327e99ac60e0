# shellcheck shell=bash
# What the harness scripts share: process handling, waiting, free ports, kubectl. Sourced by
# hack/control-plane.sh and hack/cluster.sh, which define `log`, `die` and DIR (the
# cluster's directory: every process the harness starts names it on its command line).

# alive PID: running and not a zombie.
alive() { kill -0 "$1" 2>/dev/null && [[ $(awk '{ print $3 }' "/proc/$1/stat" 2>/dev/null) != Z ]]; }

# ours PIDFILE: prints the pid when it is alive and its command line mentions $DIR, so a recycled
# pid is never killed.
ours() {
  local pid
  pid=$(cat "$1" 2>/dev/null) && [[ $pid =~ ^[0-9]+$ ]] && alive "$pid" &&
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF "$DIR/" && echo "$pid"
}

# running PIDFILE: the process we just started is alive (its command line may be empty for a moment
# while setsid and nsenter exec it, so not `ours`).
running() { local pid; pid=$(cat "$1" 2>/dev/null) && [[ $pid =~ ^[0-9]+$ ]] && alive "$pid"; }

# stop_pid PIDFILE: SIGTERM, up to 10 s, then SIGKILL, for a process of ours; removes the file.
stop_pid() {
  local pid i name
  name=$(basename "$1" .pid)
  if pid=$(ours "$1"); then
    log "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do alive "$pid" || break; sleep 0.1; done
    alive "$pid" && { log "$name ignored SIGTERM, killing"; kill -KILL "$pid" 2>/dev/null || true; }
  fi
  rm -f "$1"
}

# launch NAME ARGS...: detached from our session and stdio (callers that capture our output do not
# hang, and Ctrl-C in their terminal does not reach it); logs to $DIR/NAME.log, pid in $DIR/NAME.pid
# (the program's own: setsid and nsenter exec it). A log already there (a node's kubelet or
# containerd started again by `cluster.sh restart`) is kept as NAME.log.1, .2, ...: NAME.log is the
# running program's alone, as the tests that read a restarted kubelet's log expect.
launch() {
  local name=$1 n=1; shift
  printf '%s\0' "$@" >"$DIR/$name.argv"
  if [[ -s $DIR/$name.log ]]; then
    while [[ -e $DIR/$name.log.$n ]]; do n=$((n + 1)); done
    mv "$DIR/$name.log" "$DIR/$name.log.$n"
  fi
  setsid "$@" </dev/null >"$DIR/$name.log" 2>&1 &
  echo $! >"$DIR/$name.pid"
}

# freeze NAME SECONDS: SIGSTOP to a program `launch` started, SIGCONT SECONDS later (it hangs: its
# connections stay open and unanswered, as when a machine stalls or a network drops packets).
freeze() {
  local name=$1 secs=$2 pid
  pid=$(ours "$DIR/$name.pid") || die "$name is not running"
  kill -STOP "$pid"
  log "froze $name for ${secs}s"
  sleep "$secs"
  kill -CONT "$pid"
}

# crash NAME SECONDS: kill -9 of a program `launch` started, then, SECONDS later, the same command
# line again (what a crash and its service manager do); its log goes on in the same file.
crash() {
  local name=$1 secs=$2 pid argv
  pid=$(ours "$DIR/$name.pid") || die "$name is not running"
  [[ -f $DIR/$name.argv ]] || die "$name was not started by launch"
  kill -KILL "$pid"
  while alive "$pid"; do sleep 0.05; done
  log "killed $name; starting it again in ${secs}s"
  sleep "$secs"
  mapfile -d '' argv <"$DIR/$name.argv"
  setsid "${argv[@]}" </dev/null >>"$DIR/$name.log" 2>&1 &
  echo $! >"$DIR/$name.pid"
}

# wait_for WHAT SECONDS COMMAND...: retries COMMAND (a program or a function) every 0.2 s.
wait_for() {
  local what=$1 secs=$2 i; shift 2
  for ((i = 0; i < secs * 5; i++)); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
  die "$what not ready after ${secs}s; logs in $DIR"
}

# kubectl ARGS...: as the cluster's admin (K8S_BIN and ADMIN_KUBECONFIG of control-plane.env).
kubectl() { "$K8S_BIN/kubectl" --kubeconfig "$ADMIN_KUBECONFIG" "$@"; }

# gpu_allocatable NODE: the Node advertises nano-gpu/gpu-percent (its agent registered and serves).
gpu_allocatable() {
  kubectl get node "$1" -o jsonpath='{.status.allocatable.nano-gpu/gpu-percent}' | grep -q '[1-9]'
}

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
