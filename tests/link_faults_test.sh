#!/bin/bash
# Faulty links and a stopped daemon between two hosts: every run ends with
# the parameters, bit for bit, of the same job undisturbed.
#
# Two hosts on this machine (tests/hosts.sh: a network namespace each on a
# bridge, 10.77.0.1 and 10.77.0.2, with a hostname and a /dev/shm of its
# own), one zeroshardd and one gpt_train rank on each (rank r on host r,
# N_d = 2), the streaming RPCs in plaintext (zeroshardd --insecure,
# ZS_INSECURE=1), ZeRO stage 3, $STEPS steps of multi_host_test's small GPT:
#   clean   nothing disturbed: the parameters to match and the step times.
#   lossy   host 1 drops 1% of the TCP segments it sends, at random
#           (nftables: numgen random in an output hook of its namespace);
#           SKIPPED where there is no nft command.
#   slow    host 1's eth0 sends at most $RATE (tc tbf).
#   rclean  --replicas=2, undisturbed, $D_STEPS steps with a
#           ${D_RPC_TIMEOUT_S} s call deadline (gpt_train --rpc_timeout_s; 20 s
#           in the runs above) and the least liveness timeout, 2 s
#           (gpt_train --liveness_timeout_s; the daemons'
#           --liveness_timeout_seconds is 2 for every run): the reference
#           for stopped.
#   stopped as rclean, with daemon 1 (primary of replica group 1, backup of
#           group 0) stopped (SIGSTOP) after step $STOP_AFTER for $STOP_S s,
#           then continued (SIGCONT).
# Checked: every run exits 0 and rank 0's --dump_params equals clean's
# (stopped's: rclean's).
# Printed per run: the median and longest step beside its clean run's
# ("run=slow median_ms=... clean_median_ms=... ratio=..."); for stopped,
# the seconds from the SIGSTOP to the next step rank 0 reported
# (stop_to_next_step_s=) and the logs' lines from the SIGSTOP on, daemon
# 1's after the SIGCONT among them. Nothing is asserted about the figures.
#
# Needs root (network, UTS and mount namespaces); where they are
# refused the test says so and passes without running.
#
# Usage: link_faults_test.sh ZEROSHARDD GPT_TRAIN (runfiles paths).
set -u
# zs_fail, zs_abspath, zs_median, zs_last_step, zs_now_ms.
source "$(dirname "$0")/lib.sh"
# zs_hosts_check, zs_hosts_setup, zs_on_host, zs_host_kill,
# zs_hosts_teardown, ZS_HOST_ADDRS.
source "$(dirname "$0")/hosts.sh"

# tc and nft live in sbin, which bazel's test environment leaves off PATH.
PATH="$PATH:/usr/sbin:/sbin"

ZEROSHARDD="$(zs_abspath "$1")"
GPT_TRAIN="$(zs_abspath "$2")"

WORK="$(mktemp -d "${TEST_TMPDIR:-/tmp}/link_faults.XXXXXX")"
export ZS_JOB_TOKEN="link-faults-test-job-token-0123"
# ZS_INSECURE=1: the trainers send the job token in plaintext to the
# daemons' addresses on the test subnet (as zeroshardd --insecure below).
export ZS_INSECURE=1
STEPS=20
RATE=100mbit
STOP_AFTER=5
STOP_S=30
# Long enough that the job still runs when daemon 1 is continued.
D_STEPS=400
D_RPC_TIMEOUT_S=2
# multi_host_test's model and flags.
TRAINER_FLAGS=(--stage=3 --layers=4 --width=32 --heads=4 --seq_len=16 --batch=8
  --threads=1 --bucket_bytes=4096 --report=false --progress=lines --transport=stream
  --step_timeout_s=60)
# One trainer run, at most.
RUN_TIMEOUT_S=150
DAEMON_ADDRS=()
DAEMON_PIDS=()
# What was put on host 1's link, for cleanup.
NFT_TABLE=""
QDISC=""

log() { echo "[link_faults_test] $*"; }

cleanup() {
  # Both go with host 1's namespace anyway; removed first so that nothing
  # is left should the teardown fail.
  [[ -n "$NFT_TABLE" ]] && zs_on_host 1 nft delete table inet "$NFT_TABLE" 2>/dev/null
  [[ -n "$QDISC" ]] && zs_on_host 1 tc qdisc del dev eth0 root 2>/dev/null
  zs_hosts_teardown
}
trap cleanup EXIT
trap 'exit 143' TERM INT

fail() { zs_fail "$@"; }

if ! zs_hosts_check; then
  log "SKIPPED: cannot make test hosts here: $ZS_HOSTS_ERROR"
  exit 0
fi
zs_hosts_setup 2 || fail "could not set up the test hosts: $ZS_HOSTS_ERROR"
log "hosts h0 at ${ZS_HOST_ADDRS[0]}, h1 at ${ZS_HOST_ADDRS[1]}"

# start_daemon H: zeroshardd on host H at its address; sets DAEMON_ADDRS[H]
# and DAEMON_PIDS[H] (the daemon's own pid, for SIGSTOP) once it printed
# its address (at most 30 s).
start_daemon() {
  local h="$1" out="$WORK/daemon$1.log" pid_file="$WORK/daemon$1.pid"
  # shellcheck disable=SC2016  # expanded by sh: its own pid, then the daemon's
  zs_on_host "$h" sh -c 'echo $$ >"$0"; exec "$@"' "$pid_file" \
    "$ZEROSHARDD" --listen="${ZS_HOST_ADDRS[$h]}:0" --insecure --bulk_transport= \
      --liveness_timeout_seconds=2 >"$out" 2>&1 &
  local launcher=$!
  # Killed at teardown with its host: no "Killed" line for it.
  disown "$launcher"
  local deadline=$((SECONDS + 30)) got=""
  while ((SECONDS < deadline)); do
    got="$(sed -n 's/^zeroshardd listening on //p' "$out" 2>/dev/null | head -n 1)"
    if [[ -n "$got" ]]; then
      DAEMON_ADDRS[$h]="$got"
      DAEMON_PIDS[$h]="$(<"$pid_file")"
      return 0
    fi
    kill -0 "$launcher" 2>/dev/null || break
    sleep 0.1
  done
  echo "zeroshardd on h$h did not start:"
  cat "$out"
  return 1
}

# start_run TAG FLAGS...: the 2-rank job TAG in the background, rank r on
# host r; rank 0 dumps the parameters to $WORK/TAG.f32 and logs to
# $WORK/TAG.rank0.log. RUN_PIDS: the ranks.
RUN_PIDS=()
start_run() {
  local tag="$1" r dump
  shift
  for r in 0 1; do
    dump=()
    ((r == 0)) && dump=(--dump_params="$WORK/$tag.f32")
    zs_on_host "$r" timeout -k 5 "$RUN_TIMEOUT_S" "$GPT_TRAIN" "${TRAINER_FLAGS[@]}" \
      --rank="$r" --world_size=2 --job_id="link-faults-$tag" \
      --daemons="${DAEMON_ADDRS[0]},${DAEMON_ADDRS[1]}" "${dump[@]}" "$@" \
      >"$WORK/$tag.rank$r.log" 2>&1 &
    RUN_PIDS[$r]=$!
  done
  RUN_START=$SECONDS
}

# finish_run TAG REFERENCE: waits for run TAG's ranks; both must exit 0 and
# rank 0's parameters equal run REFERENCE's (none: no comparison).
finish_run() {
  local tag="$1" reference="$2" r rc=0
  for r in 0 1; do wait "${RUN_PIDS[$r]}" || rc=1; done
  ((rc == 0)) || fail "run $tag: a rank failed or ran past $RUN_TIMEOUT_S s"
  log "run $tag: both ranks exited 0 in $((SECONDS - RUN_START)) s"
  [[ -s "$WORK/$tag.f32" ]] || fail "run $tag wrote no parameters"
  [[ "$reference" == none ]] && return 0
  cmp -s "$WORK/$reference.f32" "$WORK/$tag.f32" ||
    fail "run $tag ended with other parameters than run $reference"
  log "run $tag: parameters identical to run $reference"
}

# step_times TAG: rank 0's step times in ms ("step S/N loss L T ms/step ...").
step_times() {
  sed -n 's|^step [0-9]*/[0-9]* loss [^ ]* \([0-9.]*\) ms/step.*|\1|p' "$WORK/$1.rank0.log"
}

# report TAG CLEAN: TAG's median and longest step beside run CLEAN's.
report() {
  local median max clean_median clean_max
  median="$(step_times "$1" | zs_median)"
  max="$(step_times "$1" | sort -n | tail -n 1)"
  clean_median="$(step_times "$2" | zs_median)"
  clean_max="$(step_times "$2" | sort -n | tail -n 1)"
  echo "run=$1 median_ms=$median max_ms=$max clean_median_ms=$clean_median" \
    "clean_max_ms=$clean_max ratio=$(awk -v a="$median" -v b="$clean_median" \
      'BEGIN { printf "%.2f", a / b }')"
}

start=$SECONDS
for h in 0 1; do start_daemon "$h" || fail "zeroshardd on h$h did not start"; done
log "daemons at ${DAEMON_ADDRS[0]} and ${DAEMON_ADDRS[1]}"

# ---- clean ----
start_run clean --steps="$STEPS" --rpc_timeout_s=20
finish_run clean none
report clean clean

# ---- lossy: 1% of host 1's outgoing TCP segments dropped ----
# add_loss_rule: table $NFT_TABLE in host 1's namespace, dropping (and
# counting) 1% of the TCP segments it sends, picked at random.
add_loss_rule() {
  zs_on_host 1 nft add table inet "$NFT_TABLE" &&
    zs_on_host 1 nft add chain inet "$NFT_TABLE" out '{ type filter hook output priority 0 ; }' &&
    zs_on_host 1 nft add rule inet "$NFT_TABLE" out meta l4proto tcp numgen random mod 100 lt 1 \
      counter drop
}
if ! command -v nft >/dev/null; then
  log "run=lossy SKIPPED: no nft command (nftables is not installed here)"
else
  NFT_TABLE=zsloss
  if ! add_loss_rule >"$WORK/nft.out" 2>&1; then
    log "run=lossy SKIPPED: nft refused the rule: $(cat "$WORK/nft.out")"
  else
    start_run lossy --steps="$STEPS" --rpc_timeout_s=20
    finish_run lossy clean
    dropped="$(zs_on_host 1 nft list table inet "$NFT_TABLE" |
      sed -n 's/.*counter packets \([0-9]*\).*/\1/p')"
    log "run lossy: host 1 dropped ${dropped:-?} TCP segments"
    report lossy clean
  fi
  zs_on_host 1 nft delete table inet "$NFT_TABLE" 2>/dev/null
  NFT_TABLE=""
fi

# ---- slow: host 1's link at $RATE ----
QDISC=tbf
if ! command -v tc >/dev/null; then
  log "run=slow SKIPPED: no tc command"
  QDISC=""
elif ! zs_on_host 1 tc qdisc add dev eth0 root tbf rate "$RATE" burst 32kbit latency 50ms \
  >"$WORK/tc.out" 2>&1; then
  log "run=slow SKIPPED: tc refused the tbf qdisc: $(cat "$WORK/tc.out")"
else
  start_run slow --steps="$STEPS" --rpc_timeout_s=20
  finish_run slow clean
  zs_on_host 1 tc -s qdisc show dev eth0 | sed -n 's/^ *\(Sent .*\)/host 1 tbf: \1/p'
  report slow clean
fi
[[ -n "$QDISC" ]] && zs_on_host 1 tc qdisc del dev eth0 root 2>/dev/null
QDISC=""

# ---- rclean and stopped: --replicas=2, daemon 1 stopped for $STOP_S s ----
start_run rclean --steps="$D_STEPS" --replicas=2 --rpc_timeout_s="$D_RPC_TIMEOUT_S" \
  --liveness_timeout_s=2
finish_run rclean none
report rclean rclean

start_run stopped --steps="$D_STEPS" --replicas=2 --rpc_timeout_s="$D_RPC_TIMEOUT_S" \
  --liveness_timeout_s=2
deadline=$((SECONDS + 60))
until (($(zs_last_step "$WORK/stopped.rank0.log") >= STOP_AFTER)); do
  kill -0 "${RUN_PIDS[0]}" 2>/dev/null || fail "run stopped ended before step $STOP_AFTER"
  ((SECONDS < deadline)) || fail "run stopped: rank 0 did not reach step $STOP_AFTER"
  sleep 0.01
done
# The logs' lines from the SIGSTOP on, each with the seconds since it as
# the poll below first saw it (every 50 ms), in $WORK/timeline.txt.
declare -A SEEN
TIMELINE_LOGS=(stopped.rank0 stopped.rank1 daemon0 daemon1)
for f in "${TIMELINE_LOGS[@]}"; do SEEN[$f]=$(wc -l <"$WORK/$f.log"); done
# timeline_poll: appends the lines added to each log since the last poll.
timeline_poll() {
  local f n t
  t="$(awk -v ms=$(($(zs_now_ms) - stopped_at)) 'BEGIN { printf "%6.2f", ms / 1000 }')"
  for f in "${TIMELINE_LOGS[@]}"; do
    n=$(wc -l <"$WORK/$f.log")
    ((n > SEEN[$f])) || continue
    sed -n "$((SEEN[$f] + 1)),${n}p" "$WORK/$f.log" | cut -c1-240 | sed "s|^|+$t s $f: |" \
      >>"$WORK/timeline.txt"
    SEEN[$f]=$n
  done
}
kill -STOP "${DAEMON_PIDS[1]}"
stopped_at=$(zs_now_ms)
at="$(zs_last_step "$WORK/stopped.rank0.log")"
log "run stopped: daemon 1 stopped (SIGSTOP) after step $at"
next_ms=""
continued=0
deadline=$((SECONDS + RUN_TIMEOUT_S))
# Until the run ended and daemon 1 was continued.
while { ((!continued)) || kill -0 "${RUN_PIDS[0]}" 2>/dev/null; } && ((SECONDS < deadline)); do
  if [[ -z "$next_ms" ]] && (($(zs_last_step "$WORK/stopped.rank0.log") > at)); then
    next_ms=$(($(zs_now_ms) - stopped_at))
  fi
  if ((!continued && $(zs_now_ms) - stopped_at >= STOP_S * 1000)); then
    timeline_poll
    kill -CONT "${DAEMON_PIDS[1]}"
    continued=1
    echo "+$STOP_S s: daemon 1 continued (SIGCONT), rank 0 at step $(zs_last_step "$WORK/stopped.rank0.log")" \
      >>"$WORK/timeline.txt"
  fi
  timeline_poll
  sleep 0.05
done
((continued)) || kill -CONT "${DAEMON_PIDS[1]}"
finish_run stopped rclean
timeline_poll
# Both figures from the SIGSTOP; ${next_ms}: to the first step rank 0
# reported after the one it had reported at the stop.
if [[ -n "$next_ms" ]]; then
  echo "stop_to_next_step_s=$(awk -v ms="$next_ms" 'BEGIN { printf "%.2f", ms / 1000 }')" \
    "stop_s=$STOP_S rpc_timeout_s=$D_RPC_TIMEOUT_S"
else
  echo "stop_to_next_step_s=none stop_s=$STOP_S rpc_timeout_s=$D_RPC_TIMEOUT_S"
fi
report stopped rclean
log "run stopped: the logs from the SIGSTOP on (seconds since it; rank 0's step lines" \
  "after step $((at + 1)) left out):"
awk -v last=$((at + 1)) '!/ stopped\.rank0: step [0-9]/ { print; next }
  { split($6, s, "/"); if (s[1] + 0 <= last) print }' "$WORK/timeline.txt" | head -n 40
after_cont="$(sed -n '/daemon 1 continued/,$p' "$WORK/timeline.txt" | grep ' daemon1: ')"
if [[ -n "$after_cont" ]]; then
  log "run stopped: daemon 1 after SIGCONT: see the daemon1 lines above"
else
  log "run stopped: daemon 1 after SIGCONT: logged nothing until the run ended"
fi

for h in 0 1; do zs_host_kill "$h" || fail "processes are left on host h$h"; done
log "PASSED in $((SECONDS - start)) s"
