#!/bin/bash
# A daemon's network link is cut in the middle of a run, and the run ends
# with the parameters, bit for bit, of a run on an uncut link.
#
# Each of the two zeroshardd processes runs in a network namespace of its
# own, reachable only over a veth pair on a private test subnet
# (10.<n>.<d>.0/30: host side .1, daemon side .2); the trainers stay in this
# namespace and reach the daemons over those links alone (the streaming
# RPCs). Two gpt_train ranks train a small GPT at ZeRO stage 3 for 40 steps
# under zsrun --daemon_addresses, with a 2 s deadline on each call.
#   A  the links stay up; rank 0 dumps the final parameters.
#   B  once rank 0 has passed step 10, daemon 1's link goes down for 1 s:
#      shorter than any deadline, so calls stall and the run goes on when
#      the link returns (TCP retransmits what was in flight).
#   C  once rank 0 has passed step 10, daemon 1's link goes down for 6 s:
#      the calls to it fail with a clear error within their deadline, naming
#      the daemon; zsrun --max_restarts restarts the failed ranks, which fail
#      again while the link is down, then rejoin the job and replay the open
#      step once it is back.
# Checked: all three runs end with identical --dump_params files; in C a
# rank's error names daemon 1 and zsrun restarted at least one rank.
# Printed: the longest step of B and of C against A's median, and C's errors.
#
# Needs CAP_NET_ADMIN (ip netns add); where that is refused the test says so
# and passes without running.
#
# Usage: link_cut_test.sh ZSRUN ZEROSHARDD GPT_TRAIN (runfiles paths).
set -u
# zs_kill_all, zs_fail, zs_abspath, zs_step_times, zs_median, zs_last_step.
source "$(dirname "$0")/lib.sh"

ZSRUN="$(zs_abspath "$1")"
ZEROSHARDD="$(zs_abspath "$2")"
GPT_TRAIN="$(zs_abspath "$3")"

WORK="$(mktemp -d "${TEST_TMPDIR:-/tmp}/link_cut.XXXXXX")"
export ZS_JOB_TOKEN="link-cut-test-job-token-0123"
STEPS=40
CUT_AFTER=10
TRAINER_FLAGS=(--stage=3 --steps="$STEPS" --layers=4 --width=32 --heads=4 --seq_len=16 --batch=8
  --threads=1 --bucket_bytes=4096 --report=false --progress=lines --transport=stream
  --rpc_timeout_s=2 --step_timeout_s=60)
# A subnet of this run's own: 10.N.0.0/30 and 10.N.1.0/30.
NET=$((100 + $$ % 150))
TAG="zs$$"
NAMESPACES=()
DAEMON_PIDS=()
DAEMON_ADDRS=()
ZSRUN_PID=""

log() { echo "[link_cut_test] $*"; }

cleanup() {
  zs_kill_all "$ZSRUN_PID" "${DAEMON_PIDS[@]}"
  local ns
  for ns in "${NAMESPACES[@]}"; do ip netns del "$ns" 2>/dev/null; done
  ip link del "${TAG}h0" 2>/dev/null
  ip link del "${TAG}h1" 2>/dev/null
}
trap cleanup EXIT
trap 'exit 143' TERM INT

fail() { zs_fail "$@"; }

if ! ip netns add "${TAG}-probe" 2>/dev/null; then
  log "SKIPPED: cannot create network namespaces here (needs CAP_NET_ADMIN)"
  exit 0
fi
ip netns del "${TAG}-probe"

# setup_namespace D: namespace ${TAG}-D with a veth pair ${TAG}hD (here,
# 10.NET.D.1) -- ${TAG}nD (there, 10.NET.D.2).
setup_namespace() {
  local d="$1" ns="${TAG}-$1"
  ip netns add "$ns" || return 1
  NAMESPACES+=("$ns")
  ip link add "${TAG}h$d" type veth peer name "${TAG}n$d" || return 1
  ip link set "${TAG}n$d" netns "$ns" || return 1
  ip addr add "10.$NET.$d.1/30" dev "${TAG}h$d" || return 1
  ip link set "${TAG}h$d" up || return 1
  ip netns exec "$ns" ip addr add "10.$NET.$d.2/30" dev "${TAG}n$d" || return 1
  ip netns exec "$ns" ip link set "${TAG}n$d" up || return 1
  ip netns exec "$ns" ip link set lo up
}

# start_daemon D: zeroshardd in namespace D on 10.NET.D.2; sets
# DAEMON_ADDRS[D] once it printed its address.
start_daemon() {
  local d="$1" out="$WORK/daemon$1.log"
  # --insecure: a test subnet that only this test's processes reach.
  ip netns exec "${TAG}-$d" "$ZEROSHARDD" --listen="10.$NET.$d.2:0" --insecure \
    --bulk_transport= >"$out" 2>&1 &
  DAEMON_PIDS[$d]=$!
  local deadline=$((SECONDS + 30)) addr=""
  while ((SECONDS < deadline)); do
    addr="$(sed -n 's/^zeroshardd listening on //p' "$out" | head -n 1)"
    if [[ -n "$addr" ]]; then
      DAEMON_ADDRS[$d]="$addr"
      return 0
    fi
    kill -0 "${DAEMON_PIDS[$d]}" 2>/dev/null || break
    sleep 0.1
  done
  return 1
}

# run TAG CUT_SECONDS: one job under zsrun; with CUT_SECONDS > 0, daemon 1's
# link goes down for that long once rank 0 has passed step CUT_AFTER.
run() {
  local tag="$1" cut="$2" t0=$SECONDS
  # ZS_INSECURE=1: the trainers send the job token in plaintext to the
  # daemons' non-loopback addresses on the test subnet (as --insecure above).
  ZS_INSECURE=1 "$ZSRUN" --daemon_addresses="${DAEMON_ADDRS[0]},${DAEMON_ADDRS[1]}" --nproc=2 \
    --job_id="link-cut-$tag" --max_restarts=20 --grace_s=5 -- \
    "$GPT_TRAIN" "${TRAINER_FLAGS[@]}" --dump_params="$WORK/$tag.f32" >"$WORK/$tag.log" 2>&1 &
  ZSRUN_PID=$!
  if ((cut > 0)); then
    local deadline=$((SECONDS + 120))
    while (($(zs_last_step "$WORK/$tag.log") <= CUT_AFTER)); do
      kill -0 "$ZSRUN_PID" 2>/dev/null || break
      ((SECONDS < deadline)) || fail "run $tag: rank 0 did not pass step $CUT_AFTER"
      sleep 0.05
    done
    ip link set "${TAG}h1" down
    log "run $tag: daemon 1's link down after step $(zs_last_step "$WORK/$tag.log")"
    sleep "$cut"
    ip link set "${TAG}h1" up
    log "run $tag: daemon 1's link up again after ${cut} s"
  fi
  wait "$ZSRUN_PID"
  local rc=$?
  ZSRUN_PID=""
  log "run $tag: zsrun exit $rc in $((SECONDS - t0)) s"
  return $rc
}

start=$SECONDS
for d in 0 1; do
  setup_namespace "$d" || fail "could not set up namespace $d"
  start_daemon "$d" || fail "daemon $d did not start in its namespace"
done
log "daemons at ${DAEMON_ADDRS[0]} and ${DAEMON_ADDRS[1]}, each in its own namespace"

run A 0 || fail "run A did not finish"
median_a="$(zs_step_times "$WORK/A.log" "$STEPS" | zs_median)"
run B 1 || fail "run B (1 s cut) did not finish"
cmp -s "$WORK/A.f32" "$WORK/B.f32" || fail "run B ended with other parameters than run A"
grep -q "restarting it" "$WORK/B.log" && log "run B: zsrun restarted a rank"
log "run B: longest step $(zs_step_times "$WORK/B.log" "$STEPS" | sort -n | tail -n 1) ms against A's median" \
  "$median_a ms; parameters identical to run A"

run C 6 || fail "run C (6 s cut) did not finish"
cmp -s "$WORK/A.f32" "$WORK/C.f32" || fail "run C ended with other parameters than run A"
grep -q "restarting it" "$WORK/C.log" || fail "run C: no rank failed while the link was down"
grep -q "${DAEMON_ADDRS[1]}" "$WORK/C.log" || fail "run C: no error named daemon 1"
log "run C: what the ranks said while the link was down:"
grep "gpt_train rank" "$WORK/C.log" | head -n 4 | cut -c1-300
grep "\[zsrun\]" "$WORK/C.log" | head -n 6
log "run C: longest step $(zs_step_times "$WORK/C.log" "$STEPS" | sort -n | tail -n 1) ms; parameters" \
  "identical to run A"
log "PASSED in $((SECONDS - start)) s"
