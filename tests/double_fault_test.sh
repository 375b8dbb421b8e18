#!/bin/bash
# A double fault in a replicated job (--replicas=2) is said at once and ends
# the run, naming the checkpoint to resume from; resuming from it ends where
# an undisturbed run ends.
#
# Two zeroshardd on loopback (fixed ports, so that they can be started again
# at their addresses), each with a --checkpoint_dir, and two gpt_train ranks
# under zsrun (ZeRO stage 3, 30 steps, a checkpoint every 10):
#   U  undisturbed: the parameters to match.
#   B  both daemons killed (SIGKILL) after step 15 and started again, empty:
#      no copy of either replica group is left. The trainers must end within
#      20 s of the kill, saying that a group has no copy left and naming the
#      newest complete checkpoint (step 10), instead of reconnecting for
#      minutes.
#   H  both killed after step 15 and only daemon 1 started again: the only
#      copy of group 0 may be on daemon 0, which does not answer; the run
#      ends after the client's grace (10 s), within 40 s of the kill.
#   R  B's job resumed (--resume=latest) on the restarted daemons: from the
#      step-10 checkpoint to step 30, ending with U's parameters, bit for
#      bit.
#   V  undisturbed, $W_STEPS steps (long enough to outlast W's faults).
#   W  as V, daemon 1 killed after step 10 and started again at once,
#      empty; once daemon 0 (primary of both groups now) reports both
#      backups on daemon 1 current again, daemon 0 is killed too: the run
#      goes on from daemon 1's copies and ends with V's parameters, bit for
#      bit.
# Printed: the seconds from the kills to the run's end, and its message;
# for W the window in which a second fault would have lost a group (from
# daemon 1's restart to both backups current: window_s=) and daemon 0's
# lines that say so.
#
# Usage: double_fault_test.sh ZSRUN ZEROSHARDD GPT_TRAIN (runfiles paths).
set -u
# zs_fail, zs_abspath, zs_free_ports, zs_kill_all, zs_last_step, zs_now_ms.
source "$(dirname "$0")/lib.sh"

ZSRUN="$(zs_abspath "$1")"
ZEROSHARDD="$(zs_abspath "$2")"
GPT_TRAIN="$(zs_abspath "$3")"

WORK="$(mktemp -d "${TEST_TMPDIR:-/tmp}/double_fault.XXXXXX")"
STEPS=30
TRAINER_FLAGS=(--stage=3 --steps="$STEPS" --layers=2 --width=32 --heads=4 --seq_len=16 --batch=8
  --threads=1 --bucket_bytes=4096 --progress=lines --report=false --transport=stream
  --checkpoint_every=10)

log() { echo "[double_fault_test] $*"; }
fail() {
  zs_kill_all "${DAEMON_PIDS[@]}" "${ZSRUN_PID:-}"
  zs_fail "$@"
}

# One job token for every run: a resumed job must bring the token its
# checkpoints were saved with.
export ZS_JOB_TOKEN="$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')"
read -r PORT0 PORT1 <<<"$(zs_free_ports 2)"
[[ -n "$PORT1" ]] || fail "no free ports"
ADDRS=("127.0.0.1:$PORT0" "127.0.0.1:$PORT1")
DAEMON_PIDS=()
ZSRUN_PID=""
trap 'zs_kill_all "${DAEMON_PIDS[@]}" "${ZSRUN_PID:-}"' EXIT

# start_daemon D: zeroshardd D on its fixed address, appending to its log.
start_daemon() {
  local d="$1"
  mkdir -p "$WORK/ckpt$d"
  "$ZEROSHARDD" --listen="${ADDRS[$d]}" --checkpoint_dir="$WORK/ckpt$d" \
    >>"$WORK/daemon$d.log" 2>&1 &
  DAEMON_PIDS[$d]=$!
  local deadline=$((SECONDS + 30))
  until [[ "$(grep -c "zeroshardd listening on ${ADDRS[$d]}" "$WORK/daemon$d.log")" -ge "$2" ]]; do
    kill -0 "${DAEMON_PIDS[$d]}" 2>/dev/null || return 1
    ((SECONDS < deadline)) || return 1
    sleep 0.05
  done
}

wait_step() {
  local deadline=$((SECONDS + 120))
  until (($(zs_last_step "$WORK/$1.log") >= $2)); do
    kill -0 "$ZSRUN_PID" 2>/dev/null || fail "run $1 ended before step $2"
    ((SECONDS < deadline)) || fail "run $1: rank 0 did not reach step $2"
    sleep 0.01
  done
}

# start_run TAG JOB GPT_TRAIN_FLAGS...: in the background.
start_run() {
  local tag="$1" job="$2"
  shift 2
  "$ZSRUN" --daemon_addresses="${ADDRS[0]},${ADDRS[1]}" --nproc=2 --job_id="$job" --grace_s=5 \
    -- "$GPT_TRAIN" "${TRAINER_FLAGS[@]}" --replicas=2 --dump_params="$WORK/$tag.f32" "$@" \
    >"$WORK/$tag.log" 2>&1 &
  ZSRUN_PID=$!
}

# wait_complete JOB NAME: until both daemons have written checkpoint NAME's
# manifest (the trainers complete it in the background, a few steps after
# the save on a loaded machine).
wait_complete() {
  local deadline=$((SECONDS + 60)) d
  for d in 0 1; do
    until grep -q "job $1 checkpoint $2 of step [0-9]* is complete" "$WORK/daemon$d.log"; do
      ((SECONDS < deadline)) || fail "checkpoint $2 of job $1 was not complete within 60 s"
      sleep 0.01
    done
  done
}

# double_fault TAG JOB RESTART...: kills both daemons after step 15 (once
# the step-10 checkpoint is complete), starts again the ones listed, and
# waits for the run's end: LOST_MS is the time from the kills to it, RC its
# exit.
double_fault() {
  local tag="$1" job="$2"
  shift 2
  wait_step "$tag" 15
  wait_complete "$job" step-10
  kill -9 "${DAEMON_PIDS[0]}" "${DAEMON_PIDS[1]}" 2>/dev/null
  local killed=$(zs_now_ms)
  wait "${DAEMON_PIDS[0]}" "${DAEMON_PIDS[1]}" 2>/dev/null
  log "run $tag: both daemons killed (SIGKILL) after step $(zs_last_step "$WORK/$tag.log")"
  local d
  for d in "$@"; do
    start_daemon "$d" "$((RESTARTS[d] + 1))" || fail "daemon $d did not start again"
    RESTARTS[$d]=$((RESTARTS[d] + 1))
  done
  log "run $tag: started again, empty: daemon(s) $*"
  wait "$ZSRUN_PID"
  RC=$?
  ZSRUN_PID=""
  LOST_MS=$(($(zs_now_ms) - killed))
  log "run $tag: exit $RC, $LOST_MS ms after the kills"
  grep -m 1 "has no copy left" "$WORK/$tag.log" || true
}

RESTARTS=(1 1)
start_daemon 0 1 || fail "daemon 0 did not start"
start_daemon 1 1 || fail "daemon 1 did not start"

start_run U df-u
wait "$ZSRUN_PID" || fail "run U did not finish: $(tail -n 5 "$WORK/U.log")"
ZSRUN_PID=""
[[ -s "$WORK/U.f32" ]] || fail "run U wrote no parameters"

start_run B df-b
double_fault B df-b 0 1
((RC != 0)) || fail "run B finished although no copy of its state was left"
grep -q "has no copy left" "$WORK/B.log" || fail "run B did not say that a group has no copy left"
grep -q "the newest complete checkpoint is step-10 (step 10)" "$WORK/B.log" ||
  fail "run B did not name checkpoint step-10: $(grep -m 1 'no copy left' "$WORK/B.log")"
((LOST_MS <= 20000)) || fail "run B took $LOST_MS ms to end (at most 20000)"

start_run R df-b --resume=latest
wait "$ZSRUN_PID" || fail "run R did not finish: $(tail -n 5 "$WORK/R.log")"
ZSRUN_PID=""
grep -q "resumed from checkpoint step-10" "$WORK/R.log" || fail "run R did not resume from step-10"
cmp -s "$WORK/U.f32" "$WORK/R.f32" || fail "run R ended with other parameters than run U"
log "run R: resumed from step-10, parameters equal to run U's"

# W: one fault, the window until both groups have two copies again, then
# the second fault.
W_STEPS=150
start_run V df-v --steps="$W_STEPS"
wait "$ZSRUN_PID" || fail "run V did not finish: $(tail -n 5 "$WORK/V.log")"
ZSRUN_PID=""
start_run W df-w --steps="$W_STEPS"
wait_step W 10
kill -9 "${DAEMON_PIDS[1]}" 2>/dev/null
wait "${DAEMON_PIDS[1]}" 2>/dev/null
log "run W: daemon 1 killed (SIGKILL) after step $(zs_last_step "$WORK/W.log")"
seen=$(wc -l <"$WORK/daemon0.log")
start_daemon 1 "$((RESTARTS[1] + 1))" || fail "daemon 1 did not start again"
RESTARTS[1]=$((RESTARTS[1] + 1))
restarted=$(zs_now_ms)
deadline=$((SECONDS + 60))
until (($(tail -n +"$((seen + 1))" "$WORK/daemon0.log" | grep -c "job df-w replica group .* is current again") >= 2)); do
  kill -0 "$ZSRUN_PID" 2>/dev/null || fail "run W ended before its backups were current again"
  ((SECONDS < deadline)) || fail "run W: the backups on daemon 1 were not current again within 60 s"
  sleep 0.05
done
echo "window_s=$(awk -v ms=$(($(zs_now_ms) - restarted)) 'BEGIN { printf "%.2f", ms / 1000 }')" \
  "(daemon 1 restarted -> both backups current, step $(zs_last_step "$WORK/W.log"))"
tail -n +"$((seen + 1))" "$WORK/daemon0.log" | grep "job df-w replica group" | cut -c1-240
kill -9 "${DAEMON_PIDS[0]}" 2>/dev/null
wait "${DAEMON_PIDS[0]}" 2>/dev/null
log "run W: daemon 0 killed (SIGKILL) after step $(zs_last_step "$WORK/W.log")"
wait "$ZSRUN_PID" || fail "run W did not finish after the second fault: $(tail -n 5 "$WORK/W.log")"
ZSRUN_PID=""
cmp -s "$WORK/V.f32" "$WORK/W.f32" || fail "run W ended with other parameters than run V"
log "run W: survived the second fault, parameters equal to run V's"
start_daemon 0 "$((RESTARTS[0] + 1))" || fail "daemon 0 did not start again"
RESTARTS[0]=$((RESTARTS[0] + 1))

start_run H df-h
double_fault H df-h 1
((RC != 0)) || fail "run H finished although group 0's only copy was on a daemon that is gone"
grep -q "has no copy left" "$WORK/H.log" || fail "run H did not say that a group has no copy left"
grep -q "does not answer" "$WORK/H.log" || fail "run H did not name the daemon that does not answer"
((LOST_MS <= 40000)) || fail "run H took $LOST_MS ms to end (at most 40000)"
log "all checks passed"
