#!/usr/bin/env bash
# Runs every test binary of the workspace side by side, and the upstream builds that only some
# suites need in the background, so both cores of a 2-core machine stay busy: one cluster suite alone
# leaves much of them idle while its cluster starts and its pods come and go.
# `hack/test.sh` calls it after `cargo test --workspace --no-run`; run it by hand the same way.
#
# Usage: hack/run-tests.sh LOG [SUITE...]
#   LOG     each job's output is appended to it when the job ends (the closing line counts it)
#   SUITE   only these jobs (names as printed, e.g. `openb`, `e2e@oldest`, `agent:dra`), and the
#           builds they need; default all, the checks included
# Env:   NANO_GPU_TEST_SLOTS   how much test weight runs at once (default 3; weights below)
#        NANO_GPU_BUILD_NICE   nice level of the background jobs (default 5)
#        NANO_GPU_JOB_TIMES    a file to append each job's time to, one JSON object a line
#        NANO_GPU_K8S_OLDEST   the oldest supported Kubernetes, for `e2e@oldest` (default v1.35.8)
#
# What it runs, all at once as far as the machine allows:
# - in the background, in two lanes (Go's builds, cargo's), a little niced but not starved (a build
#   that gets only what the tests leave finishes last, and the suites that need it run after all the
#   rest): the upstream parts only some suites use (containerd 2, NVIDIA's toolkit, Kubernetes'
#   oldest supported version, the previous nano-gpu, gpushare's tool, the Prometheus Operator), each
#   ahead of the suites that need it; then the lints (clippy), the book and the doc tests, which in a full run
#   always run and fail the run as a test does;
# - every test executable cargo built for `cargo test --workspace` (each crate's unit tests, every
#   suite of tests/tests), run as cargo runs it (from its package's directory, with cargo's library
#   path). A test starts when its weight fits in the free slots, the build it needs has finished, and
#   no job of its group runs; tests start in the table's order (longest first), then the rest;
# - when named (`bash hack/run-tests.sh LOG e2e@oldest`), not in a full run: the end-to-end suite a
#   second time, on the oldest supported Kubernetes. Its Kubernetes build costs a cold CI run about
#   what the newest's does (675 to 872 s on both cores), which the 45-minute budget does not hold
#   (docs/src/development/tests.md#ci).
#
# A job whose build failed fails without running. The exit status is 1 if any job failed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

log_file=${1:?usage: hack/run-tests.sh LOG [SUITE...]}
shift
only=("$@")
slots=${NANO_GPU_TEST_SLOTS:-3}
nice_level=${NANO_GPU_BUILD_NICE:-5}
oldest=${NANO_GPU_K8S_OLDEST:-v1.35.8}
target_dir=${CARGO_TARGET_DIR:-$ROOT/target}
work=$(mktemp -d)
declare -A pid_of started_at status group_busy
# On any way out, no job is left running behind the runner: each runs in a process group of its own,
# which goes whole.
stop_jobs() {
  local pid
  for pid in "${!pid_of[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap stop_jobs EXIT
trap 'exit 130' INT TERM

# The known jobs: name, weight (a cluster suite 1, two clusters or both cores 2), group (jobs of one
# group run one at a time: `mps` suites use the machine's /run/nano-gpu/mps; a job of `alone` runs
# while no other test does: `uninstall` checks that nothing of nano-gpu is left on the machine), and
# the builds it needs (a comma between two). The suite that runs alone first, then the longest
# first (times in docs/src/development/tests.md).
TABLE='
uninstall           1 alone -
faults              2 - -
openb               2 - -
e2e                 1 - containerd2
e2e@oldest          1 - containerd2,k8s-oldest
soak                1 - -
upgrade             1 - previous
tenant              1 mps -
gpushare            1 - gpushare
dra                 1 - containerd2
enforcement         1 mps -
gpu_node            1 mps containerd2,nvidia-toolkit
containerd2         1 - containerd2
prometheus_operator 1 - prometheus-operator
runtime_class       1 - -
preemption          1 - -
nodes               1 - -
'

# The background jobs, in the order they run: name, lane, then the command. Jobs of one lane run one
# at a time (each compile already uses both cores; cargo's share one lock; Go's share its cache
# safely). The builds run only when a chosen job needs them; the checks (the lints, the book, the
# doc tests) in every full run.
BUILDS=(
  "containerd2|go|bash hack/containerd-build.sh"
  "nvidia-toolkit|go|bash hack/nvidia-toolkit-build.sh"
  "k8s-oldest|go|NANO_GPU_K8S_VERSION=$oldest bash hack/k8s-build.sh"
  "previous|cargo|bash hack/previous-build.sh"
  "gpushare|go|bash hack/gpushare-inspect-build.sh"
  "prometheus-operator|go|bash hack/prometheus-operator-build.sh"
)
CHECKS=(
  "clippy|cargo|cargo clippy --workspace --all-targets --locked -- -D warnings"
  # The engine alone, with proto's features as the engine asks them (none): in the workspace build,
  # features other crates turn on could hide an engine that reaches for proto's k8s or gRPC parts.
  "clippy-engine|cargo|cargo clippy -p nano-gpu-engine --all-targets --locked -- -D warnings"
  # mdBook must build the book (a page missing from its contents fails); its links, anchors and
  # reference pages are checked by the docs suite.
  "book|cargo|bash hack/book.sh"
  "doc-tests|cargo|cargo test --workspace --locked --doc"
)

# The test executables of the last `cargo test --workspace --no-run`, as "name|package dir|path".
# cargo prints one JSON object per artifact; a test artifact has "test":true and an executable.
tests=$work/tests
if ! cargo test --workspace --locked --no-run --message-format=json >"$work/artifacts" 2>"$work/cargo.err"; then
  cat "$work/cargo.err" >&2
  exit 1
fi
grep '"profile":{[^}]*"test":true' "$work/artifacts" | grep '"executable":"/' |
  sed -E 's/.*"manifest_path":"([^"]*)\/Cargo.toml".*"target":\{"kind":\["([^"]*)"[^]]*\][^}]*"name":"([^"]*)".*"executable":"([^"]*)".*/\2|\3|\1|\4/' |
  while IFS='|' read -r kind name dir exe; do
    # A suite of tests/tests is known by its name; any other test binary by its package's folder
    # and target (`agent:dra`, `allocator:nano_gpu_allocator`).
    if [[ $kind == test && $dir == "$ROOT/tests" ]]; then
      echo "$name|$dir|$exe"
    else
      echo "${dir#"$ROOT"/}:$name|$dir|$exe"
    fi
  done >"$tests"
[[ -s $tests ]] || { echo "run-tests: cargo listed no test executable" >&2; exit 1; }
dups=$(cut -d'|' -f1 "$tests" | sort | uniq -d)
[[ -z $dups ]] || { echo "run-tests: two test binaries are named $dups" >&2; exit 1; }

# Every job as "name|weight|group|needs|dir|command", table order first.
jobs_file=$work/jobs
add_job() { echo "$1|$2|$3|$4|$5|$6" >>"$jobs_file"; }
: >"$jobs_file"
while read -r name weight group needs; do
  [[ -n $name ]] || continue
  # The oldest version's run only when named: see the header.
  [[ $name != *@oldest || ${#only[@]} -gt 0 ]] || continue
  base=${name%@oldest}
  line=$(grep "^$base|" "$tests" || true)
  [[ -n $line ]] || { echo "run-tests: the table names $base, which cargo did not build" >&2; exit 1; }
  IFS='|' read -r _ dir exe <<<"$line"
  cmd=$(printf '%q' "$exe")
  [[ $name == *@oldest ]] && cmd="NANO_GPU_K8S_VERSION=$oldest $cmd"
  add_job "$name" "$weight" "$group" "$needs" "$dir" "$cmd"
done <<<"$TABLE"
while IFS='|' read -r name dir exe; do
  grep -q "^$name|" "$jobs_file" || add_job "$name" 1 - - "$dir" "$(printf '%q' "$exe")"
done <"$tests"
if [[ ${#only[@]} -gt 0 ]]; then
  pattern=$(printf '%s\n' "${only[@]}" | sed 's/[.[\*^$]/\\&/g; s/^/^/; s/$/|/')
  grep -f <(echo "$pattern") "$jobs_file" >"$work/only" || { echo "run-tests: no job named ${only[*]}" >&2; exit 1; }
  mv "$work/only" "$jobs_file"
fi

# The background jobs ahead of the tests (weight 0, a little niced; group `build-<lane>`).
: >"$work/builds"
for b in "${BUILDS[@]}" - "${CHECKS[@]}"; do
  if [[ $b == - ]]; then checks=1; continue; fi
  IFS='|' read -r name lane cmd <<<"$b"
  if [[ -n ${checks:-} ]]; then
    [[ ${#only[@]} -eq 0 ]] || continue
  else
    cut -d'|' -f4 "$jobs_file" | tr , '\n' | grep -qx "$name" || continue
  fi
  echo "build:$name|0|build-$lane|-|$ROOT|NANO_GPU_BUILD_NICE=0 nice -n $nice_level bash -c $(printf '%q' "$cmd")" >>"$work/builds"
done
cat "$jobs_file" >>"$work/builds"
mv "$work/builds" "$jobs_file"
dups=$(cut -d'|' -f1 "$jobs_file" | sort | uniq -d)
[[ -z $dups ]] || { echo "run-tests: two jobs are named $dups" >&2; exit 1; }

export LD_LIBRARY_PATH="$target_dir/debug/deps:$target_dir/debug${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
running_weight=0
failed=()
mkdir -p "$work/out" "$work/cpu"

# finish NAME STATUS: frees the job's slots and group, then reports it.
finish() {
  local weight group
  IFS='|' read -r _ weight group _ <<<"$(grep "^$1|" "$jobs_file")"
  running_weight=$((running_weight - weight))
  [[ $group == - ]] || unset "group_busy[$group]"
  report "$1" "$2" "$group"
}

# cpu_seconds NAME: the user and system CPU seconds the job's `times` gave (0 if none).
cpu_seconds() {
  local f=$work/cpu/${1//\//_}
  [[ -s $f ]] || { echo 0; return; }
  # "0m12.345s 0m1.230s": minutes and seconds of user, then of system time.
  tail -1 "$f" | tr 'ms' '  ' | awk '{ printf "%d\n", $1 * 60 + $2 + $3 * 60 + $4 + 0.5 }'
}

# report NAME STATUS GROUP: prints the job's output (a build's only if it failed) and its time.
report() {
  local name=$1 rc=$2 group=$3 cpu
  cpu=$(cpu_seconds "$name")
  {
    echo "== $([[ $group == build-* ]] || echo "test ")$name: $((SECONDS - started_at[$name])) s (CPU $cpu s), $([[ $rc == 0 ]] && echo passed || echo "FAILED (exit $rc)")"
    [[ $group == build-* && $rc == 0 ]] || cat "$work/out/${name//\//_}" || true
  } | tee -a "$log_file"
  [[ $rc == 0 ]] || failed+=("$name")
  status[$name]=$rc
  [[ -z ${NANO_GPU_JOB_TIMES:-} ]] ||
    echo "{\"step\":\"$name\",\"seconds\":$((SECONDS - started_at[$name])),\"cpu_seconds\":$cpu,\"passed\":$([[ $rc == 0 ]] && echo true || echo false)}" >>"$NANO_GPU_JOB_TIMES"
}

pending=$(cut -d'|' -f1 "$jobs_file")
while true; do
  # Start what can start, in order.
  next_pending=
  for name in $pending; do
    IFS='|' read -r _ weight group needs dir cmd <<<"$(grep "^$name|" "$jobs_file")"
    # Its builds: ready when all passed; broken when one failed.
    ready=1 broken=
    if [[ $needs != - ]]; then
      for need in ${needs//,/ }; do
        case ${status[build:$need]:-} in
          0) ;;
          '') ready=0 ;;
          *) broken=$need ;;
        esac
      done
    fi
    if [[ -n $broken ]]; then
      echo "run-tests: the build $broken failed, so $name did not run" >"$work/out/${name//\//_}"
      started_at[$name]=$SECONDS
      report "$name" 1 "$group"
      continue
    fi
    # A job heavier than all slots runs when nothing else does; nothing starts beside an `alone` job.
    fits=$((running_weight == 0 || running_weight + weight <= slots))
    [[ -z ${group_busy[alone]:-} || $group == build-* ]] || fits=0
    [[ $group != alone || $running_weight == 0 ]] || fits=0
    if [[ $ready == 1 && $fits == 1 && ($group == - || -z ${group_busy[$group]:-}) ]]; then
      started_at[$name]=$SECONDS
      running_weight=$((running_weight + weight))
      [[ $group == - ]] || group_busy[$group]=1
      echo "== $([[ $group == build-* ]] || echo "test ")$name: started ($running_weight of $slots slots busy)"
      # A test binary gets the CARGO_MANIFEST_DIR cargo gives it; a build must not: cargo would
      # compile dependencies again (a build script reads it), and undo what the next build reuses.
      # `times` at the end: the CPU the job's processes used (those it waited for: a cluster's
      # daemons run on their own, so a suite's count leaves its cluster out).
      # shellcheck disable=SC2016 # $? and $0 are the inner shell's
      (cd "$dir" && if [[ $group == build-* ]]; then unset CARGO_MANIFEST_DIR; else export CARGO_MANIFEST_DIR=$dir; fi &&
        exec setsid --wait bash -c "$cmd"'; rc=$?; times >"$0"; exit $rc' "$work/cpu/${name//\//_}") \
        >"$work/out/${name//\//_}" 2>&1 &
      pid_of[$!]=$name
    else
      next_pending+="$name "
    fi
  done
  pending=$next_pending
  [[ ${#pid_of[@]} -gt 0 ]] || break
  done_pid=
  rc=0
  wait -n -p done_pid "${!pid_of[@]}" || rc=$?
  finish "${pid_of[$done_pid]}" "$rc"
  unset "pid_of[$done_pid]"
done
if [[ -n $pending ]]; then
  echo "run-tests: FAILED: nothing ran $pending (a build it needs is missing)"
  exit 1
fi

if [[ ${#failed[@]} -gt 0 ]]; then
  echo "run-tests: FAILED: ${failed[*]}"
  exit 1
fi
