#!/bin/bash
# gpt_train at ZeRO stage 3 with its activation checkpoints on the daemons
# (--activations=daemon) ends with the same parameters, bit for bit, as with
# the checkpoints kept in the trainer (--activations=local): the
# --dump_params files are compared with cmp.
#
# Two zeroshardd processes with an activation arena smaller than a step's
# checkpoints and a spill directory, so that the daemon runs spill and read
# back; two gpt_train ranks per run. Runs:
#   local   --activations=local over the streaming RPCs;
#   stream  --activations=daemon over the streaming RPCs;
#   ucx     --activations=daemon over UCX (tcp), when the daemons could
#           initialise UCX (otherwise skipped, said so in the log), without
#           checksums on the bulk transport (the default) and with
#           --activation_checksums.
# Each run uses one torch thread per rank, so the floating-point work is the
# same. The spill directory must hold no spill file at the end.
#
# Usage: activation_oracle_test.sh ZEROSHARDD GPT_TRAIN (runfiles paths).
set -u
# zs_kill_all, zs_fail, zs_daemon_address.
source "$(dirname "$0")/lib.sh"

ZEROSHARDD="$1"
GPT_TRAIN="$2"
# The jobs' secret; the ranks read it from the environment, as under zsrun.
export ZS_JOB_TOKEN="shell-test-job-token-0123"
WORK="$(mktemp -d "${TEST_TMPDIR:-/tmp}/activation_oracle.XXXXXX")"
SPILL="$WORK/spill"
# A step that cannot finish fails within 2 minutes, naming what it waits
# for, rather than running into the test's own timeout.
TRAINER_FLAGS=(--stage=3 --steps=12 --layers=2 --width=32 --heads=4 --seq_len=16 --batch=8
  --threads=1 --report=false --progress=lines --world_size=2 --rpc_timeout_s=30
  --step_timeout_s=120)

DAEMON_PIDS=()
DAEMON_ADDRS=()

cleanup() { zs_kill_all "${DAEMON_PIDS[@]}"; }
trap cleanup EXIT
# Stopped from outside (bazel's timeout): the logs say how far each run got.
trap 'trap - TERM INT; zs_fail "stopped by a signal (the test timed out?)"' TERM INT

fail() { zs_fail "$@"; }

# start_daemon INDEX: a daemon on a free port with a 20 KiB arena (a step
# of one rank checkpoints 3 x 8 KiB plus its tokens; two fetches ahead need
# 16 KiB) and spill files under $SPILL.
start_daemon() {
  local i="$1" out="$WORK/daemon$1.log"
  "$ZEROSHARDD" --listen=127.0.0.1:0 --bulk_transport=ucx --ucx_tls=tcp --ucx_trust_peers \
    --activation_arena_bytes=20480 --spill_dir="$SPILL" >"$out" 2>&1 &
  DAEMON_PIDS[$i]=$!
  DAEMON_ADDRS[$i]="$(zs_daemon_address "$out" "${DAEMON_PIDS[$i]}")"
}

# train TAG FLAGS...: both ranks; rank 0 dumps to $WORK/TAG.f32.
train() {
  local tag="$1" r rc=0
  shift
  local pids=()
  for r in 0 1; do
    "$GPT_TRAIN" "${TRAINER_FLAGS[@]}" --rank="$r" --job_id="$tag" \
      --daemons="${DAEMON_ADDRS[0]},${DAEMON_ADDRS[1]}" --dump_params="$WORK/$tag.f32" "$@" \
      >"$WORK/$tag.rank$r.log" 2>&1 &
    pids+=($!)
  done
  for r in "${pids[@]}"; do wait "$r" || rc=1; done
  return $rc
}

spill_files() {
  find "$SPILL" -maxdepth 1 -name 'zeroshard-spill.*' ! -name '*.lock' 2>/dev/null | wc -l
}

mkdir -p "$SPILL"
start_daemon 0 || fail "daemon 0 did not start"
start_daemon 1 || fail "daemon 1 did not start"

train local --transport=stream --activations=local || fail "the local run failed"
train stream --transport=stream --activations=daemon || fail "the daemon run (stream) failed"
cmp "$WORK/local.f32" "$WORK/stream.f32" ||
  fail "parameters differ: --activations=daemon over stream vs --activations=local"
echo "stream: identical to local ($(stat -c %s "$WORK/local.f32") bytes)"

if grep -q "serving the streaming data path only" "$WORK"/daemon*.log; then
  echo "ucx: skipped, a daemon could not initialise UCX:"
  grep -h "serving the streaming data path only" "$WORK"/daemon*.log | head -n 2
else
  train ucx --transport=ucx --ucx_tls=tcp --activations=daemon ||
    fail "the daemon run (ucx) failed"
  cmp "$WORK/local.f32" "$WORK/ucx.f32" ||
    fail "parameters differ: --activations=daemon over ucx vs --activations=local"
  echo "ucx: identical to local"
  train ucx_checksums --transport=ucx --ucx_tls=tcp --activations=daemon \
    --activation_checksums || fail "the daemon run (ucx, checksums) failed"
  cmp "$WORK/local.f32" "$WORK/ucx_checksums.f32" ||
    fail "parameters differ: --activations=daemon over ucx with checksums vs --activations=local"
  echo "ucx with checksums: identical to local"
fi

n="$(spill_files)"
[[ "$n" -eq 0 ]] || fail "$n spill file(s) left in $SPILL"
echo "PASSED"
