#!/bin/bash
# Replicated partitions (--replicas=2): daemons die mid-run and no committed
# update is lost; the trainers reconnect in their own processes.
#
# Two zeroshardd on loopback (their ports fixed, so that a daemon can be
# started again at its address) and two gpt_train ranks under zsrun (ZeRO
# stage 3, 60 steps, the streaming data path):
#   U  --replicas=1, undisturbed: the parameters to match, the step time and
#      daemon memory without replication.
#   R  --replicas=2, undisturbed: same parameters; its median step time and
#      the replica bytes on each daemon beside U's.
#   D  --replicas=2: daemon 0 is killed (SIGKILL) after step 15, started
#      again (empty) after step 25, and daemon 1 is killed after step 40. The
#      ranks fail over to the backups (the leader promotes them), daemon 1
#      copies both groups' state to the restarted daemon 0, which then takes
#      over both groups when daemon 1 dies. No trainer restarts.
#   T  --replicas=2 under zsrun --max_restarts=1: rank 1 kills itself in
#      step 20 and zsrun restarts it.
# Then with three daemons and three ranks (group g's backup on daemon
# g + 1 mod 3):
#   U3 --replicas=1, undisturbed: the parameters to match.
#   K3 --replicas=2: daemon 1 (primary of group 1, backup of group 0) is
#      killed after step 15 and started again after step 25; daemon 2
#      takes group 1 over, and daemons 0 and 2 copy their groups' state to
#      the restarted daemon 1.
# Checked: every run exits 0, D's and T's trainers were not restarted (D) or
# restarted once (T), the promotions and the state copies happened, the
# four two-daemon parameter dumps are identical, and K3's equals U3's. Printed: kill -9 to the next committed
# step, the state copy's size and time, replication's cost on step time and
# daemon memory.
#
# Usage: replica_failover_test.sh ZSRUN ZEROSHARDD GPT_TRAIN (runfiles paths).
set -u
# zs_fail, zs_abspath, zs_step_times, zs_median, zs_kill_all, zs_last_step,
# zs_now_ms.
source "$(dirname "$0")/lib.sh"

ZSRUN="$(zs_abspath "$1")"
ZEROSHARDD="$(zs_abspath "$2")"
GPT_TRAIN="$(zs_abspath "$3")"

WORK="$(mktemp -d "${TEST_TMPDIR:-/tmp}/replica_failover.XXXXXX")"
STEPS=60
TRAINER_FLAGS=(--stage=3 --steps="$STEPS" --layers=4 --width=32 --heads=4 --seq_len=16 --batch=8
  --threads=1 --bucket_bytes=4096 --progress=lines)

log() { echo "[replica_failover_test] $*"; }
fail() {
  zs_kill_all "${DAEMON_PIDS[@]}"
  zs_fail "$@"
}

# Three free loopback ports.
read -r PORT0 PORT1 PORT2 <<<"$(zs_free_ports 3)"
[[ -n "$PORT2" ]] || fail "no free ports"
ADDRS=("127.0.0.1:$PORT0" "127.0.0.1:$PORT1" "127.0.0.1:$PORT2")
# The daemons the runs use (the three-daemon runs set all three).
RUN_ADDRS="${ADDRS[0]},${ADDRS[1]}"
NPROC=2
DAEMON_PIDS=()

# start_daemon D: zeroshardd D on its fixed address, appending to its log.
start_daemon() {
  local d="$1"
  "$ZEROSHARDD" --listen="${ADDRS[$d]}" --insecure >>"$WORK/daemon$d.log" 2>&1 &
  DAEMON_PIDS[$d]=$!
  local deadline=$((SECONDS + 30))
  until grep -q "zeroshardd listening on ${ADDRS[$d]}" "$WORK/daemon$d.log"; do
    kill -0 "${DAEMON_PIDS[$d]}" 2>/dev/null || return 1
    ((SECONDS < deadline)) || return 1
    sleep 0.05
  done
}

kill_daemon() {
  kill -9 "${DAEMON_PIDS[$1]}" 2>/dev/null
  wait "${DAEMON_PIDS[$1]}" 2>/dev/null
}

# wait_step TAG S: until rank 0 reported step S of run TAG, or a later one
# (a step committed just before a daemon died is not reported again after
# the reconnect).
wait_step() {
  local deadline=$((SECONDS + 120))
  until (($(zs_last_step "$WORK/$1.log") >= $2)); do
    if ! kill -0 "$ZSRUN_PID" 2>/dev/null; then
      (($(zs_last_step "$WORK/$1.log") >= $2)) && return
      fail "run $1 ended before step $2"
    fi
    ((SECONDS < deadline)) || fail "run $1: rank 0 did not reach step $2"
    sleep 0.01
  done
}

# start_run TAG REPLICAS ZSRUN_FLAGS... -- GPT_TRAIN_FLAGS...: in the
# background; ZSRUN_PID is its zsrun.
start_run() {
  local tag="$1" replicas="$2"
  shift 2
  local zsrun_flags=()
  while [[ $# -gt 0 && "$1" != "--" ]]; do
    zsrun_flags+=("$1")
    shift
  done
  shift
  "$ZSRUN" --daemon_addresses="$RUN_ADDRS" --nproc="$NPROC" --job_id="failover-$tag" \
    --grace_s=5 "${zsrun_flags[@]}" -- \
    "$GPT_TRAIN" "${TRAINER_FLAGS[@]}" --transport="$TRANSPORT" --replicas="$replicas" \
    --dump_params="$WORK/$tag.f32" "$@" >"$WORK/$tag.log" 2>&1 &
  ZSRUN_PID=$!
  RUN_START=$SECONDS
}

# finish_run TAG [REFERENCE]: waits for run TAG; its parameters must equal
# run REFERENCE's (default U).
finish_run() {
  wait "$ZSRUN_PID"
  local rc=$?
  local reference="${2:-U}"
  log "run $1: exit $rc in $((SECONDS - RUN_START)) s"
  ((rc == 0)) || {
    tail -n 30 "$WORK/$1.log" >&2
    fail "run $1 did not finish"
  }
  cmp -s "$WORK/$reference.f32" "$WORK/$1.f32" ||
    fail "run $1 ended with other parameters than run $reference"
}

# category_bytes TAG D CATEGORY: the bytes daemon D held in CATEGORY in run
# TAG's report ("[rank 0]     replica   551 kB  (550912 B)").
category_bytes() {
  awk -v d="daemon ${ADDRS[$2]} " -v c="$3" '
    index($0, d) { on = 1; next }
    /daemon [0-9.]*:[0-9]* / { on = 0 }
    on && $3 == c { gsub(/[()]/, "", $6); print $6; exit }' "$WORK/$1.log"
}

start=$SECONDS
start_daemon 0 || fail "daemon 0 did not start"
start_daemon 1 || fail "daemon 1 did not start"
# The data path: ucx where the daemons could start it, else the streaming RPCs.
TRANSPORT=ucx
if grep -qs "serving the streaming data path only" "$WORK"/daemon*.log; then TRANSPORT=stream; fi
log "daemons at ${ADDRS[0]} and ${ADDRS[1]}; data path $TRANSPORT"

start_run U 1 -- --report=true
ZSRUN_U=$ZSRUN_PID
wait "$ZSRUN_U" || fail "run U did not finish: $(tail -n 5 "$WORK/U.log")"
log "run U: exit 0 in $((SECONDS - RUN_START)) s"
[[ -s "$WORK/U.f32" ]] || fail "run U wrote no parameters"

start_run R 2 -- --report=true
finish_run R
grep -qs "replica group 0: copied the state of step 0" "$WORK/daemon0.log" ||
  fail "run R: daemon 0 did not copy its group's state to its backup"
median_u="$(zs_step_times "$WORK/U.log" "$STEPS" | zs_median)"
median_r="$(zs_step_times "$WORK/R.log" "$STEPS" | zs_median)"
for d in 0 1; do
  replica="$(category_bytes R "$d" replica)"
  master="$(category_bytes R "$d" param_master)"
  [[ -n "$replica" && "$replica" -gt 0 ]] || fail "run R: daemon $d booked no replica bytes"
  log "run R: daemon $d holds $replica B of replica beside its own group's $master B of" \
    "fp32 masters (run U: replica $(category_bytes U "$d" replica) B)"
done
log "run R: median step ${median_r} ms replicated against ${median_u} ms unreplicated" \
  "(ratio $(awk -v a="$median_r" -v b="$median_u" 'BEGIN { printf "%.2f", a / b }'))"

start_run D 2 -- --report=false
wait_step D 15
kill_daemon 0
killed_at=$(zs_now_ms)
log "run D: daemon 0 killed (SIGKILL) after step 15"
wait_step D 16
log "run D: kill -9 to the next committed step: $(($(zs_now_ms) - killed_at)) ms"
wait_step D 25
start_daemon 0 || fail "daemon 0 did not start again"
log "run D: daemon 0 started again, empty, after step 25"
# Daemon 1 copies both groups to the restarted daemon 0 at its first step
# after the retry interval; daemon 1 dies once that has happened and rank 0
# has passed step 40.
deadline=$((SECONDS + 60))
for g in 0 1; do
  until grep -qs "replica group $g: copied the state of step [2-9][0-9] to the backup" \
    "$WORK/daemon1.log"; do
    ((SECONDS < deadline)) || fail "run D: daemon 1 did not copy group $g to the restarted daemon 0"
    kill -0 "$ZSRUN_PID" 2>/dev/null || fail "run D ended before daemon 0 had both groups"
    sleep 0.01
  done
done
wait_step D 40
last="$(zs_last_step "$WORK/D.log")"
((last < STEPS)) || fail "run D reached its last step before daemon 1 could be killed"
kill_daemon 1
killed_at=$(zs_now_ms)
log "run D: daemon 1 killed (SIGKILL) after step $last"
wait_step D $((last + 1))
log "run D: kill -9 to the next committed step: $(($(zs_now_ms) - killed_at)) ms"
finish_run D
grep -q "restarting it" "$WORK/D.log" && fail "run D: zsrun restarted a trainer"
for g in "group 0 on ${ADDRS[1]} to primary (epoch 2)" "group 0 on ${ADDRS[0]} to primary (epoch 3)" \
  "group 1 on ${ADDRS[0]} to primary (epoch 2)"; do
  grep -q "promoted the backup of replica $g" "$WORK/D.log" || fail "run D: no promotion of $g"
done
grep "copied the state of step [1-9]" "$WORK/daemon1.log" | sed 's/^zeroshardd: /  /'
log "run D: both daemons killed in turn; parameters identical to run U"

start_daemon 1 || fail "daemon 1 did not start again"
start_run T 2 --max_restarts=1 -- --report=false --kill_at_step=20 --kill_rank=1
finish_run T
grep -q "rank 1 exited with code 137; restarting it (restart 1 of 1)" "$WORK/T.log" ||
  fail "run T: zsrun did not restart rank 1"
log "run T: rank 1 killed in step 20 and restarted; parameters identical to run U"

start_daemon 2 || fail "daemon 2 did not start"
RUN_ADDRS="${ADDRS[0]},${ADDRS[1]},${ADDRS[2]}"
NPROC=3
start_run U3 1 -- --report=false --batch=12
finish_run U3 U3
start_run K3 2 -- --report=false --batch=12
wait_step K3 15
kill_daemon 1
killed_at=$(zs_now_ms)
log "run K3: daemon 1 of 3 killed (SIGKILL) after step 15"
wait_step K3 16
log "run K3: kill -9 to the next committed step: $(($(zs_now_ms) - killed_at)) ms"
wait_step K3 25
start_daemon 1 || fail "daemon 1 did not start again"
log "run K3: daemon 1 started again, empty, after step 25"
finish_run K3 U3
grep -q "restarting it" "$WORK/K3.log" && fail "run K3: zsrun restarted a trainer"
grep -q "promoted the backup of replica group 1 on ${ADDRS[2]} to primary (epoch 2)" \
  "$WORK/K3.log" || fail "run K3: group 1 was not promoted on daemon 2"
for d in 0 2; do
  g=$d
  ((d == 2)) && g=1
  grep -qs "job failover-K3 replica group $g: copied the state of step [2-9][0-9] to the backup on ${ADDRS[1]}" \
    "$WORK/daemon$d.log" || fail "run K3: daemon $d did not copy group $g to the restarted daemon 1"
  grep "job failover-K3 replica group $g: copied the state of step [2-9][0-9]" "$WORK/daemon$d.log" |
    sed 's/^zeroshardd: /  /'
done
log "run K3: 3 daemons, daemon 1 killed and restarted; parameters identical to run U3"

zs_kill_all "${DAEMON_PIDS[@]}"
log "PASSED in $((SECONDS - start)) s"
