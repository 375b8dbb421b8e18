#!/bin/bash
# A daemon dies mid-run and the job resumes from its last checkpoint to the
# same parameters, bit for bit, as a run that was never interrupted.
#
# Two zeroshardd processes share one --checkpoint_dir; two gpt_train ranks
# train a small GPT at ZeRO stage 3 for 60 steps over the streaming RPCs,
# rank 0 saving a checkpoint every 20 steps.
#   A: uninterrupted; rank 0 dumps the final fp32 parameters.
#   B: another job; once rank 0 has passed step 30, daemon 1 is killed with
#      SIGKILL; a trainer fails, and the other is stopped if it still waits
#      (as zsrun stops the ranks once one fails). Daemon 1 is restarted on
#      its address with the same --checkpoint_dir, both ranks are relaunched
#      with --resume=latest (the surviving daemon still holds the job:
#      registering again is idempotent and the load replaces its state),
#      train to step 60 and dump.
# The two dumps must be identical. Both runs use one torch thread per rank,
# so their floating-point work is the same.
#
# Usage: checkpoint_resume_test.sh ZEROSHARDD GPT_TRAIN (runfiles paths).
set -u
# zs_kill_all, zs_fail, zs_last_step.
source "$(dirname "$0")/lib.sh"

ZEROSHARDD="$1"
GPT_TRAIN="$2"
# The jobs' secret; the ranks read it from the environment, as under zsrun.
export ZS_JOB_TOKEN="shell-test-job-token-0123"
WORK="$(mktemp -d "${TEST_TMPDIR:-/tmp}/checkpoint_resume.XXXXXX")"
CKPT="$WORK/checkpoints"
STEPS=60
EVERY=20
KILL_AFTER=30
TRAINER_FLAGS=(--stage=3 --steps="$STEPS" --checkpoint_every="$EVERY" --layers=2 --width=32
  --heads=4 --seq_len=16 --batch=8 --transport=stream --threads=1 --report=false
  --progress=lines --world_size=2)

DAEMON_PIDS=()
DAEMON_ADDRS=()
TRAINER_PIDS=()

log() { echo "[checkpoint_resume_test] $*"; }

cleanup() { zs_kill_all "${TRAINER_PIDS[@]}" "${DAEMON_PIDS[@]}"; }
trap cleanup EXIT
trap 'exit 143' TERM INT

fail() { zs_fail "$@"; }

# start_daemon INDEX LISTEN: starts daemon INDEX on LISTEN (HOST:PORT, port 0
# picks one) and sets DAEMON_PIDS[INDEX] and DAEMON_ADDRS[INDEX] once it has
# printed its address. Returns 1 if it exits or says nothing within 30 s.
start_daemon() {
  local i="$1" listen="$2" out="$WORK/daemon$1.$RANDOM.log"
  "$ZEROSHARDD" --listen="$listen" --bulk_transport= --checkpoint_dir="$CKPT" \
    >"$out" 2>&1 &
  local pid=$!
  DAEMON_PIDS[$i]=$pid
  local deadline=$((SECONDS + 30)) addr=""
  while ((SECONDS < deadline)); do
    addr="$(sed -n 's/^zeroshardd listening on //p' "$out" | head -n 1)"
    if [[ -n "$addr" ]]; then
      DAEMON_ADDRS[$i]="$addr"
      return 0
    fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  kill -9 "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  DAEMON_PIDS[$i]=""
  echo "daemon $i on $listen did not start:"
  cat "$out"
  return 1
}

# start_trainers JOB TAG EXTRA_FLAGS...: both ranks in the background, output
# to $WORK/TAG.rankR.log; sets TRAINER_PIDS.
start_trainers() {
  local job="$1" tag="$2"
  shift 2
  TRAINER_PIDS=()
  local r
  for r in 0 1; do
    "$GPT_TRAIN" "${TRAINER_FLAGS[@]}" --rank="$r" --job_id="$job" \
      --daemons="${DAEMON_ADDRS[0]},${DAEMON_ADDRS[1]}" "$@" >"$WORK/$tag.rank$r.log" 2>&1 &
    TRAINER_PIDS[$r]=$!
  done
}

# wait_trainers: waits for both ranks; 0 iff both exited 0.
wait_trainers() {
  local rc=0 pid
  for pid in "${TRAINER_PIDS[@]}"; do
    wait "$pid" || rc=1
  done
  TRAINER_PIDS=()
  return $rc
}

start=$SECONDS
mkdir -p "$CKPT"
start_daemon 0 127.0.0.1:0 || fail "daemon 0 did not start"
start_daemon 1 127.0.0.1:0 || fail "daemon 1 did not start"
log "daemons at ${DAEMON_ADDRS[0]} and ${DAEMON_ADDRS[1]}, checkpoints in $CKPT"

# ---- A: uninterrupted ----
start_trainers ckpt-a a --dump_params="$WORK/A.f32"
wait_trainers || fail "run A did not finish"
saves="$(grep -c '^checkpoint step-[0-9]*:' "$WORK/a.rank0.log")"
log "run A: $STEPS steps in $((SECONDS - start)) s; $saves checkpoints saved"
[[ -s "$WORK/A.f32" ]] || fail "run A wrote no parameters"
for s in 20 40 60; do
  [[ -f "$CKPT/ckpt-a/step-$s/MANIFEST" ]] || fail "run A: checkpoint step-$s has no MANIFEST"
done

# ---- B: daemon 1 dies after step 30 ----
start_trainers ckpt-b b1
deadline=$((SECONDS + 120))
while :; do
  step="$(zs_last_step "$WORK/b1.rank0.log")"
  ((step > KILL_AFTER)) && break
  ((SECONDS < deadline)) || fail "run B did not pass step $KILL_AFTER within 120 s"
  kill -0 "${TRAINER_PIDS[0]}" 2>/dev/null || fail "run B rank 0 exited before step $KILL_AFTER"
  sleep 0.02
done
kill -9 "${DAEMON_PIDS[1]}"
wait "${DAEMON_PIDS[1]}" 2>/dev/null
DAEMON_PIDS[1]=""
log "run B: daemon 1 killed after rank 0 reported step $step"
# A trainer fails once it reaches the dead daemon; as zsrun does, the ranks
# still waiting for it (up to their step timeout) are then stopped.
deadline=$((SECONDS + 90))
while kill -0 "${TRAINER_PIDS[0]}" 2>/dev/null && kill -0 "${TRAINER_PIDS[1]}" 2>/dev/null; do
  ((SECONDS < deadline)) || fail "run B: no trainer failed within 90 s of the daemon's death"
  sleep 0.1
done
sleep 1
for r in 0 1; do
  if kill -0 "${TRAINER_PIDS[$r]}" 2>/dev/null; then
    log "run B: rank $r still waiting; stopping it"
    kill -9 "${TRAINER_PIDS[$r]}"
  fi
done
wait_trainers && fail "run B's trainers exited 0 although daemon 1 died"
last_b1="$(zs_last_step "$WORK/b1.rank0.log")"
((last_b1 < STEPS)) || fail "run B reached step $STEPS before the daemon died"
log "run B: rank 0 stopped at step $last_b1"
grep -h '^gpt_train rank' "$WORK"/b1.rank*.log

# Restart daemon 1 on its address (the job's spec names it): retried for a
# while in case the port is not yet free.
addr1="${DAEMON_ADDRS[1]}"
for attempt in 1 2 3 4 5 6 7 8 9 10; do
  start_daemon 1 "$addr1" && break
  ((attempt < 10)) || fail "daemon 1 could not listen on $addr1 again"
  sleep 1
done
[[ "${DAEMON_ADDRS[1]}" == "$addr1" ]] ||
  fail "daemon 1 came back on ${DAEMON_ADDRS[1]}, not $addr1"

start_trainers ckpt-b b2 --resume=latest --dump_params="$WORK/B.f32"
wait_trainers || fail "resumed run B did not finish"
resumed="$(grep -h '^resumed from checkpoint' "$WORK/b2.rank0.log")"
[[ -n "$resumed" ]] || fail "resumed run B did not report a resume"
resumed_step="$(echo "$resumed" | sed -n 's/.* at step \([0-9]*\) .*/\1/p')"
first_step="$(sed -n 's|^step \([0-9]*\)/.*|\1|p' "$WORK/b2.rank0.log" | head -n 1)"
[[ -n "$resumed_step" && "$first_step" == $((resumed_step + 1)) ]] ||
  fail "resumed run B started at step $first_step after resuming at step $resumed_step"
((resumed_step >= EVERY && resumed_step <= last_b1)) ||
  fail "resumed at step $resumed_step: not a checkpoint of run B before the failure"
log "run B: $resumed; trained steps $first_step..$STEPS"

cmp "$WORK/A.f32" "$WORK/B.f32" ||
  fail "the resumed run's parameters differ from the uninterrupted run's"
log "PASSED: $(stat -c %s "$WORK/A.f32") bytes of parameters identical;" \
  "$((SECONDS - start)) s in all"
rm -rf "$WORK"
exit 0
