#!/bin/bash
# A daemon's checkpoint or spill disk that stops answering stalls training
# for at most the configured waits, not for as long as it hangs, and the job
# ends with the parameters, bit for bit, of the same job undisturbed.
#
# Zeroshardd on loopback; daemon 1's --checkpoint_dir and daemon 2's
# --spill_dir are on an ext4 filesystem of their own (a loop mount of a
# file, in a private mount namespace), which `fsfreeze -f` makes hang: every
# write to it blocks until `fsfreeze -u`, as on a frozen or failing
# filesystem. Two
# gpt_train ranks train a small GPT at ZeRO stage 3 for $STEPS steps over
# the streaming RPCs, rank 0 saving a checkpoint every $EVERY steps, with
# --disk_timeout_seconds=$DISK_TIMEOUT_S on the daemons and
# --checkpoint_wait_s=$WAIT_S on the trainers:
#   clean   nothing disturbed: the parameters to match, the step gaps.
#   write   daemon 1's disk frozen for $FREEZE_S s once rank 0 passed step
#           $FREEZE_AFTER (the job's first save claimed its files there):
#           the next save's part hangs in its write. The save after it
#           waits $WAIT_S s for it, then is skipped (UNAVAILABLE), and every
#           later one at once until the disk answers and the part completes.
#   first   another job (its first save must write the job's owner file on
#           daemon 1's disk) with the disk frozen from the start for
#           $FREEZE_S s: that save is answered UNAVAILABLE after
#           $DISK_TIMEOUT_S s (the daemon's call on its disk timed out) and
#           the next ones at once, until the disk answers.
#   spill   one rank of another job offloading its activation checkpoints to
#           daemon 2, whose arena is too small for a step's (it spills them
#           to $MNT/spill), with that disk frozen for $FREEZE_S s: the
#           daemon stops spilling once a spill write is $DISK_TIMEOUT_S s old
#           and answers offloads that need room UNAVAILABLE; the trainer keeps
#           those checkpoints itself (compared with sclean, the same job
#           undisturbed).
# Checked: every rank exits 0, rank 0's --dump_params equals its reference's, the
# longest wall-clock gap between two of rank 0's steps stays under half the
# freeze (before daemons bounded their disk calls it was the whole freeze),
# the skipped saves and refused offloads say why, and each checkpointing
# run's last checkpoint completes.
# Printed per run: the longest step gap beside its reference's, the skipped
# saves, the refused offloads, and daemons 1 and 2's lines about their disk.
#
# Needs root (mount, fsfreeze) and mkfs.ext4; where any is missing or
# refused, the test says so and passes without running.
#
# Usage: hung_disk_test.sh ZEROSHARDD GPT_TRAIN (runfiles paths).
set -u
# zs_fail, zs_abspath, zs_kill_all, zs_daemon_address, zs_last_step.
source "$(dirname "$0")/lib.sh"

# mount, mkfs.ext4 and fsfreeze live in sbin, which bazel's test
# environment leaves off PATH.
PATH="$PATH:/usr/sbin:/sbin"

log() { echo "[hung_disk_test] $*"; }

skip() {
  log "SKIPPED: $*"
  exit 0
}

# The loop mount lives in a mount namespace of this test's own: it goes
# with the test, whatever way the test ends.
if [[ -z "${ZS_HUNG_DISK_NS:-}" ]]; then
  (($(id -u) == 0)) || skip "needs root (mount, fsfreeze)"
  [[ -n "${EPOCHREALTIME:-}" ]] || skip "needs bash 5 (EPOCHREALTIME)"
  for tool in unshare mount umount mkfs.ext4 fsfreeze setsid; do
    command -v "$tool" >/dev/null || skip "no $tool command here"
  done
  unshare --mount --propagation private true 2>/dev/null ||
    skip "cannot make a mount namespace here"
  ZS_HUNG_DISK_NS=1 exec unshare --mount --propagation private "$0" "$@"
fi

ZEROSHARDD="$(zs_abspath "$1")"
GPT_TRAIN="$(zs_abspath "$2")"
WORK="$(mktemp -d "${TEST_TMPDIR:-/tmp}/hung_disk.XXXXXX")"
export ZS_JOB_TOKEN="hung-disk-test-job-token-0123"
STEPS=1200
EVERY=20
FREEZE_AFTER=25
FREEZE_S=10
DISK_TIMEOUT_S=2
WAIT_S=2
# One run, at most.
RUN_TIMEOUT_S=240
TRAINER_FLAGS=(--stage=3 --steps="$STEPS" --checkpoint_every="$EVERY" --layers=4 --width=32
  --heads=4 --seq_len=16 --batch=8 --transport=stream --threads=1 --report=false
  --progress=lines --world_size=2 --checkpoint_wait_s="$WAIT_S")
# One rank offloading its activation checkpoints to daemon 2, which spills.
SPILL_STEPS=600
SPILL_FLAGS=(--stage=3 --steps="$SPILL_STEPS" --activations=daemon --layers=4 --width=32
  --heads=4 --seq_len=16 --batch=8 --transport=stream --threads=1 --report=false
  --progress=lines)
MNT="$WORK/mnt"
FROZEN=0
FROZEN_AT=0
THAW_PID=0
DAEMON_PIDS=()
DAEMON_ADDRS=()
RUN_PIDS=()

cleanup() {
  ((FROZEN)) && fsfreeze -u "$MNT" 2>/dev/null
  local f
  # The trainers' timeout wrappers pass SIGTERM on to the trainers.
  for f in "$WORK"/*.pid; do [[ -f "$f" ]] && kill "$(<"$f")" 2>/dev/null; done
  zs_kill_all "${RUN_PIDS[@]}" "${DAEMON_PIDS[@]}"
  umount "$MNT" 2>/dev/null
}
trap cleanup EXIT
trap 'exit 143' TERM INT

fail() { zs_fail "$@"; }

truncate -s 512M "$WORK/disk.img" && mkfs.ext4 -q -F "$WORK/disk.img" >/dev/null 2>&1 ||
  skip "mkfs.ext4 failed"
mkdir -p "$MNT"
mount -o loop "$WORK/disk.img" "$MNT" 2>"$WORK/mount.out" ||
  skip "mount -o loop refused: $(cat "$WORK/mount.out")"
# Whether this filesystem can be frozen at all.
fsfreeze -f "$MNT" 2>"$WORK/freeze.out" || skip "fsfreeze refused: $(cat "$WORK/freeze.out")"
fsfreeze -u "$MNT"

# start_daemon I FLAGS...: daemon I on loopback with FLAGS; sets
# DAEMON_PIDS[I] and DAEMON_ADDRS[I] once it printed its address (30 s).
start_daemon() {
  local i="$1" out="$WORK/daemon$1.log"
  shift
  "$ZEROSHARDD" --listen=127.0.0.1:0 --bulk_transport= --disk_timeout_seconds="$DISK_TIMEOUT_S" \
    "$@" >"$out" 2>&1 &
  DAEMON_PIDS[$i]=$!
  DAEMON_ADDRS[$i]="$(zs_daemon_address "$out" "${DAEMON_PIDS[$i]}")"
}

# stamp: each line of standard input after the wall clock in seconds.
stamp() {
  local line
  while IFS= read -r line; do printf '%s %s\n' "$EPOCHREALTIME" "$line"; done
}

# start_run TAG RANKS DAEMONS FLAGS...: the job hung-disk-TAG of RANKS ranks
# on DAEMONS (addresses) in the background, with FLAGS; each rank's output,
# every line stamped, to $WORK/TAG.rankR.log, ending with its exit status
# ("exit=N"); rank 0 dumps the parameters to $WORK/TAG.f32.
start_run() {
  local tag="$1" ranks="$2" daemons="$3" r dump
  shift 3
  RUN_RANKS=$ranks
  for ((r = 0; r < ranks; ++r)); do
    dump=()
    ((r == 0)) && dump=(--dump_params="$WORK/$tag.f32")
    {
      timeout -k 5 "$RUN_TIMEOUT_S" "$GPT_TRAIN" "$@" --world_size="$ranks" --rank="$r" \
        --job_id="hung-disk-$tag" --daemons="$daemons" "${dump[@]}" 2>&1 &
      echo $! >"$WORK/$tag.rank$r.pid"
      wait $!
      echo "exit=$?"
    } | stamp >"$WORK/$tag.rank$r.log" &
    RUN_PIDS[$r]=$!
  done
}

# start_checkpoint_run TAG: the 2-rank checkpointing job on daemons 0 and 1.
start_checkpoint_run() {
  start_run "$1" 2 "${DAEMON_ADDRS[0]},${DAEMON_ADDRS[1]}" "${TRAINER_FLAGS[@]}"
}

# wait_for_step TAG S: until rank 0 of run TAG reported step S (60 s).
wait_for_step() {
  local deadline=$((SECONDS + 60))
  until (($(zs_last_step "$WORK/$1.rank0.log") >= $2)); do
    kill -0 "${RUN_PIDS[0]}" 2>/dev/null || fail "run $1 ended before step $2"
    ((SECONDS < deadline)) || fail "run $1: rank 0 did not reach step $2"
    sleep 0.05
  done
}

# finish_run TAG REFERENCE: waits for run TAG; every rank must exit 0 and
# rank 0's parameters equal run REFERENCE's (none: no comparison).
finish_run() {
  local tag="$1" reference="$2" r
  for ((r = 0; r < RUN_RANKS; ++r)); do
    wait "${RUN_PIDS[$r]}"
    grep -q ' exit=0$' "$WORK/$tag.rank$r.log" ||
      fail "run $tag: rank $r failed or ran past $RUN_TIMEOUT_S s"
  done
  RUN_PIDS=()
  [[ -s "$WORK/$tag.f32" ]] || fail "run $tag wrote no parameters"
  [[ "$reference" == none ]] && return 0
  cmp -s "$WORK/$reference.f32" "$WORK/$tag.f32" ||
    fail "run $tag ended with other parameters than run $reference"
  log "run $tag: every rank exited 0, parameters identical to run $reference"
}

# finish_checkpoint_run TAG: finish_run TAG clean, and its last checkpoint
# must have completed.
finish_checkpoint_run() {
  finish_run "$1" clean
  grep -q " checkpoint step-$STEPS complete: " "$WORK/$1.rank0.log" ||
    fail "run $1: its last checkpoint, step-$STEPS, did not complete"
}

# max_gap TAG: the longest wall-clock gap in seconds between two
# consecutive steps rank 0 of run TAG reported.
max_gap() {
  awk '$2 == "step" { if (seen) { g = $1 - t; if (g > m) m = g } t = $1; seen = 1 }
       END { printf "%.2f", m }' "$WORK/$1.rank0.log"
}

# check_gap TAG CLEAN: prints TAG's longest step gap beside run CLEAN's;
# fails when it is half the freeze or more.
check_gap() {
  local gap
  gap="$(max_gap "$1")"
  echo "run=$1 max_step_gap_s=$gap clean_max_step_gap_s=$(max_gap "$2") freeze_s=$FREEZE_S" \
    "disk_timeout_s=$DISK_TIMEOUT_S checkpoint_wait_s=$WAIT_S"
  awk -v g="$gap" -v f="$FREEZE_S" 'BEGIN { exit !(g < f / 2) }' ||
    fail "run $1: training stalled ${gap} s with the disk frozen for $FREEZE_S s"
}

# print_skipped TAG: how many saves rank 0 of run TAG skipped, and the
# first two.
print_skipped() {
  log "run $1: $(grep -c ' not saved: ' "$WORK/$1.rank0.log") saves skipped; the first two:"
  grep ' not saved: ' "$WORK/$1.rank0.log" | head -n 2 | cut -d' ' -f2- | cut -c1-400
}

# freeze: the test filesystem frozen. A process of its own thaws it 120 s later
# should this test be killed before it does (a frozen filesystem stays
# frozen, and its writers stuck, until someone thaws it); thaw stops that
# process, so that it cannot thaw a later freeze early.
freeze() {
  fsfreeze -f "$MNT" || fail "fsfreeze -f failed"
  FROZEN=1
  FROZEN_AT=$SECONDS
  setsid sh -c 'sleep 120; fsfreeze -u "$0" 2>/dev/null' "$MNT" </dev/null >/dev/null 2>&1 &
  THAW_PID=$!
  log "the test filesystem frozen"
}

thaw() {
  kill "$THAW_PID" 2>/dev/null
  fsfreeze -u "$MNT" || fail "fsfreeze -u failed"
  FROZEN=0
  log "the test filesystem thawed after $((SECONDS - FROZEN_AT)) s"
}

start_daemon 0 --checkpoint_dir="$WORK/ckpt0" || fail "daemon 0 did not start"
start_daemon 1 --checkpoint_dir="$MNT/ckpt" || fail "daemon 1 did not start"
log "daemons at ${DAEMON_ADDRS[0]} and ${DAEMON_ADDRS[1]} (its --checkpoint_dir on $MNT)"

# ---- clean ----
start_checkpoint_run clean
finish_run clean none
log "run clean: $STEPS steps, parameters dumped"

# ---- write: frozen while a part is written ----
start_checkpoint_run write
wait_for_step write "$FREEZE_AFTER"
freeze
sleep "$FREEZE_S"
thaw
finish_checkpoint_run write
check_gap write clean
grep -q 'was not started: the previous one' "$WORK/write.rank0.log" ||
  fail "run write: no save was skipped while the disk was frozen"
print_skipped write

# ---- first: frozen before the job's first save ----
freeze
start_checkpoint_run first
sleep "$FREEZE_S"
# On a loaded machine the job may take long to reach its second save:
# thawed once a save was refused at once (60 s at most).
deadline=$((SECONDS + 60))
until grep -q "has not returned for" "$WORK/first.rank0.log" || ((SECONDS >= deadline)); do
  sleep 0.2
done
thaw
finish_checkpoint_run first
check_gap first clean
grep -q "did not answer within --disk_timeout_seconds=$DISK_TIMEOUT_S" \
  "$WORK/first.rank0.log" || fail "run first: no save timed out on daemon 1's disk"
grep -q "has not returned for" "$WORK/first.rank0.log" ||
  fail "run first: no save was refused at once while daemon 1's disk hung"
print_skipped first
log "daemon 1 about its disk:"
grep -- '--checkpoint_dir' "$WORK/daemon1.log" | cut -c1-300

# ---- spill: frozen under a daemon's activation spill files ----
# Daemon 2's arena holds fewer activation checkpoints than a step saves:
# every step spills some to $MNT/spill.
start_daemon 2 --activation_arena_bytes=40960 --spill_dir="$MNT/spill" \
  --spill_bytes=67108864 || fail "daemon 2 did not start"
start_run sclean 1 "${DAEMON_ADDRS[2]}" "${SPILL_FLAGS[@]}"
finish_run sclean none
log "run sclean: $SPILL_STEPS steps spilling activations, parameters dumped"
start_run spill 1 "${DAEMON_ADDRS[2]}" "${SPILL_FLAGS[@]}"
wait_for_step spill "$FREEZE_AFTER"
freeze
sleep "$FREEZE_S"
thaw
finish_run spill sclean
check_gap spill sclean
grep -q 'the store refused layer' "$WORK/spill.rank0.log" ||
  fail "run spill: the daemon refused no activation while its spill disk hung"
log "run spill: the trainer about its activations:"
grep 'activation checkpoints: ' "$WORK/spill.rank0.log" | cut -d' ' -f2- | cut -c1-400
log "daemon 2 about its disk:"
grep -- '--spill_dir' "$WORK/daemon2.log" | grep -v 'activation arena of' | head -n 4 | cut -c1-300
log "PASSED"
