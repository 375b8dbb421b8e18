#!/bin/bash
# Trainer ranks die mid-step and zsrun --max_restarts brings them back: the
# run completes with the parameters, bit for bit, of a run where nothing
# failed.
#
# zsrun starts 2 daemons and 2 gpt_train ranks (ZeRO stage 3, 60 steps,
# 4 KiB buckets so that every layer's gradient is several pushes):
#   A  undisturbed; rank 0 dumps the final fp32 parameters.
#   B  --max_restarts=2: rank 1 kills itself (SIGKILL) in step 20, once half
#      of its layers' gradients are applied on the daemons (gpt_train
#      --kill_at_step). zsrun restarts it; the new process joins as a new
#      incarnation, the daemons drop what the old one left in their
#      out-of-order buffers (their log says "replacing incarnation"), its
#      pushes of what was applied are answered ALREADY_EXISTS (equal CRC-32C),
#      and rank 0 waits in its step barrier meanwhile.
#   C  --max_restarts=1: the same with rank 0 (the leader) in step 40.
# Checked: every run exits 0, zsrun restarted the killed rank once, the
# daemons saw it replaced, and the three dumps are identical. Printed: each run's time
# and step 20's time (the follower's restart) beside the median step.
# Transport: ucx where the daemons can start it, else the streaming RPCs.
#
# Usage: trainer_restart_test.sh ZSRUN ZEROSHARDD GPT_TRAIN (runfiles paths).
set -u
# zs_fail, zs_abspath, zs_step_times, zs_median.
source "$(dirname "$0")/lib.sh"

ZSRUN="$(zs_abspath "$1")"
ZEROSHARDD="$(zs_abspath "$2")"
GPT_TRAIN="$(zs_abspath "$3")"

WORK="$(mktemp -d "${TEST_TMPDIR:-/tmp}/trainer_restart.XXXXXX")"
STEPS=60
TRAINER_FLAGS=(--stage=3 --steps="$STEPS" --layers=4 --width=32 --heads=4 --seq_len=16 --batch=8
  --threads=1 --bucket_bytes=4096 --report=false --progress=lines)

log() { echo "[trainer_restart_test] $*"; }
fail() { zs_fail "$@"; }

# run TAG TRANSPORT ZSRUN_FLAGS... -- GPT_TRAIN_FLAGS...: one zsrun job, its
# output in $WORK/TAG.log and its daemon logs under $WORK/logs/TAG.
run() {
  local tag="$1" transport="$2"
  shift 2
  local zsrun_flags=()
  while [[ $# -gt 0 && "$1" != "--" ]]; do
    zsrun_flags+=("$1")
    shift
  done
  shift
  mkdir -p "$WORK/logs/$tag"
  local t0=$SECONDS
  "$ZSRUN" --zeroshardd="$ZEROSHARDD" --daemons=2 --nproc=2 --job_id="restart-$tag" \
    --log_dir="$WORK/logs/$tag" --grace_s=5 "${zsrun_flags[@]}" -- \
    "$GPT_TRAIN" "${TRAINER_FLAGS[@]}" --transport="$transport" "$@" >"$WORK/$tag.log" 2>&1
  local rc=$?
  log "run $tag ($transport): exit $rc in $((SECONDS - t0)) s"
  return $rc
}

start=$SECONDS
TRANSPORT=ucx
if ! run A ucx -- --dump_params="$WORK/A.f32"; then
  if grep -qs "serving the streaming data path only" "$WORK"/logs/A/daemon-*.stderr.log; then
    log "the daemons cannot start UCX here: both runs use --transport=stream"
    TRANSPORT=stream
    run A stream -- --dump_params="$WORK/A.f32" || fail "run A did not finish"
  else
    fail "run A did not finish"
  fi
fi
[[ -s "$WORK/A.f32" ]] || fail "run A wrote no parameters"

run B "$TRANSPORT" --max_restarts=2 -- --kill_at_step=20 --kill_rank=1 \
  --dump_params="$WORK/B.f32" || fail "run B did not finish"
grep -q "rank 1 exited with code 137; restarting it (restart 1 of 2)" "$WORK/B.log" ||
  fail "run B: zsrun did not restart rank 1"
grep -q "rank 1 restarted (ZS_RESTART_COUNT=1): continuing at step 20" "$WORK/B.log" ||
  fail "run B: the restarted rank 1 did not continue at step 20"
grep -qs "rank 1 joined as incarnation [0-9]*, replacing incarnation" \
  "$WORK"/logs/B/daemon-*.stderr.log || fail "run B: no daemon saw rank 1 replaced"
cmp -s "$WORK/A.f32" "$WORK/B.f32" ||
  fail "run B (rank 1 killed in step 20) ended with other parameters than run A"
log "run B: rank 1 killed in step 20 and restarted; step 20 took" \
  "$(zs_step_times "$WORK/B.log" "$STEPS" | sed -n 20p) ms (median step" \
  "$(zs_step_times "$WORK/B.log" "$STEPS" | zs_median) ms); parameters identical to run A"

run C "$TRANSPORT" --max_restarts=1 -- --kill_at_step=40 --kill_rank=0 \
  --dump_params="$WORK/C.f32" || fail "run C did not finish"
grep -q "rank 0 exited with code 137; restarting it (restart 1 of 1)" "$WORK/C.log" ||
  fail "run C: zsrun did not restart rank 0"
grep -q "rank 0 restarted (ZS_RESTART_COUNT=1): continuing at step 40" "$WORK/C.log" ||
  fail "run C: the restarted rank 0 did not continue at step 40"
grep -qs "rank 0 joined as incarnation [0-9]*, replacing incarnation" \
  "$WORK"/logs/C/daemon-*.stderr.log || fail "run C: no daemon saw rank 0 replaced"
cmp -s "$WORK/A.f32" "$WORK/C.f32" ||
  fail "run C (rank 0 killed in step 40) ended with other parameters than run A"
log "run C: rank 0 (the leader) killed in step 40 and restarted; parameters identical to run A"
log "PASSED in $((SECONDS - start)) s"
