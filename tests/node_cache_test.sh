#!/bin/bash
# The node cache (JobSpec.node_cache, gpt_train --node_cache) between two
# hosts: the cross-host gather bytes per host and step fall to about 1/R of
# those without it (R = 3 ranks per host), and training ends with the same
# parameters, bit for bit.
#
# Two hosts on this machine (tests/hosts.sh), one zeroshardd on each (the
# streaming data path, plaintext on the test subnet) and three gpt_train
# ranks on each: ranks 0-2 on host 0, 3-5 on host 1, N_d = 6, stage 3,
# $STEPS steps. The same job runs twice against the same daemons, without
# and with --node_cache. A host's cross-host gather bytes are what its
# interface receives from the other host's daemon port (an nftables counter
# on the host): the parameters the other daemon serves, to the host's ranks
# (without the cache) or to the host's daemon (with it), plus the answers
# to the ranks' control calls and pushes, which are the same in both runs.
# Printed per host: both figures per step and their ratio. Checked: every
# run exits 0, each host's ratio is at most 1/R + 0.05 (the control
# answers and the step's rounding), and rank 0's --dump_params of both
# runs are equal (cmp).
#
# Needs root (network, UTS and mount namespaces) and nft; where they are
# refused the test says so and passes without running.
#
# Usage: node_cache_test.sh ZEROSHARDD GPT_TRAIN (runfiles paths).
set -u
# zs_fail, zs_abspath.
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/hosts.sh"

ZEROSHARDD="$(zs_abspath "$1")"
GPT_TRAIN="$(zs_abspath "$2")"

WORK="$(mktemp -d "${TEST_TMPDIR:-/tmp}/node_cache.XXXXXX")"
export ZS_JOB_TOKEN="node-cache-test-job-token-0123"
STEPS=10
R=3  # ranks per host
TRAINER_FLAGS=(--steps="$STEPS" --stage=3 --layers=4 --width=32 --heads=4 --seq_len=16
  --batch=6 --threads=1 --bucket_bytes=4096 --report=false --progress=lines --rpc_timeout_s=20
  --step_timeout_s=60 --transport=stream)
RUN_TIMEOUT_S=180
DAEMON_ADDRS=()

log() { echo "[node_cache_test] $*"; }
cleanup() { zs_hosts_teardown; }
trap cleanup EXIT
trap 'exit 143' TERM INT
fail() { zs_fail "$@"; }

# nft lives in sbin, which bazel's test PATH leaves out.
PATH="$PATH:/usr/sbin:/sbin"
if ! command -v nft >/dev/null; then
  log "SKIPPED: no nft command (the byte counters)"
  exit 0
fi
if ! zs_hosts_check; then
  log "SKIPPED: cannot make test hosts here: $ZS_HOSTS_ERROR"
  exit 0
fi
zs_hosts_setup 2 || fail "could not set up the test hosts: $ZS_HOSTS_ERROR"

# start_daemon H: zeroshardd on host H at its address; sets DAEMON_ADDRS[H].
start_daemon() {
  local h="$1" out="$WORK/daemon-$1.log"
  zs_on_host "$h" "$ZEROSHARDD" --listen="${ZS_HOST_ADDRS[$h]}:0" --insecure \
    --bulk_transport= >"$out" 2>&1 &
  local pid=$! deadline=$((SECONDS + 30)) got=""
  while ((SECONDS < deadline)); do
    got="$(sed -n 's/^zeroshardd listening on //p' "$out" 2>/dev/null | head -n 1)"
    if [[ -n "$got" ]]; then
      DAEMON_ADDRS[$h]="$got"
      return 0
    fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  cat "$out"
  return 1
}

# count_from H PORT: on host H, counts the bytes eth0 receives from TCP
# port PORT (the other host's daemon).
count_from() {
  zs_on_host "$1" nft add table inet zsnc &&
    zs_on_host "$1" nft add chain inet zsnc in '{ type filter hook input priority 0; }' &&
    zs_on_host "$1" nft add rule inet zsnc in iifname eth0 tcp sport "$2" counter
}
# counted H: the bytes counted on host H so far.
counted() {
  zs_on_host "$1" nft list chain inet zsnc in |
    sed -n 's/.*counter packets [0-9]* bytes \([0-9]*\).*/\1/p' | head -n 1
}

# train TAG FLAGS...: ranks 0..2R-1, rank r on host r / R; rank 0 dumps the
# parameters to $WORK/TAG.f32. 0 iff every rank exited 0.
train() {
  local tag="$1"
  shift
  local r h pids=() rc=0 dump
  for ((r = 0; r < 2 * R; ++r)); do
    h=$((r / R))
    dump=()
    ((r == 0)) && dump=(--dump_params="$WORK/$tag.f32")
    zs_on_host "$h" env ZS_INSECURE=1 timeout -k 5 "$RUN_TIMEOUT_S" \
      "$GPT_TRAIN" "${TRAINER_FLAGS[@]}" --rank="$r" --world_size=$((2 * R)) --job_id="$tag" \
      --daemons="${DAEMON_ADDRS[0]},${DAEMON_ADDRS[1]}" "${dump[@]}" "$@" \
      >"$WORK/$tag.rank$r.log" 2>&1 &
    pids[$r]=$!
  done
  for ((r = 0; r < 2 * R; ++r)); do
    if ! wait "${pids[$r]}"; then
      echo "rank $r of $tag failed:"
      tail -n 20 "$WORK/$tag.rank$r.log"
      rc=1
    fi
  done
  return $rc
}

start=$SECONDS
start_daemon 0 || fail "zeroshardd on h0 did not start"
start_daemon 1 || fail "zeroshardd on h1 did not start"
count_from 0 "${DAEMON_ADDRS[1]##*:}" || fail "nft refused the counter on h0"
count_from 1 "${DAEMON_ADDRS[0]##*:}" || fail "nft refused the counter on h1"
log "daemons ${DAEMON_ADDRS[0]} (h0) and ${DAEMON_ADDRS[1]} (h1), $R ranks per host"

declare -A BYTES
for mode in uncached cached; do
  flags=()
  [[ "$mode" == cached ]] && flags=(--node_cache)
  b0="$(counted 0)"
  b1="$(counted 1)"
  train "nc-$mode" "${flags[@]}" || fail "the $mode run failed"
  BYTES[$mode,0]=$(($(counted 0) - b0))
  BYTES[$mode,1]=$(($(counted 1) - b1))
done
if grep -l "node cache off" "$WORK"/nc-cached.rank*.log; then
  fail "a rank of the cached run gathered without the node cache"
fi
cmp "$WORK/nc-uncached.f32" "$WORK/nc-cached.f32" ||
  fail "the run with the node cache ended with other parameters than the run without"

for h in 0 1; do
  u=${BYTES[uncached,$h]}
  c=${BYTES[cached,$h]}
  ratio="$(awk -v c="$c" -v u="$u" 'BEGIN {printf "%.3f", c / u}')"
  echo "host=h$h ranks=$R steps=$STEPS cross_host_gather_bytes_per_step:" \
    "uncached=$((u / STEPS)) cached=$((c / STEPS)) ratio=$ratio (goal <= 1/$R)"
  awk -v c="$c" -v u="$u" -v r="$R" 'BEGIN {exit !(c <= u * (1 / r + 0.05))}' ||
    fail "host h$h: the node cache cut the cross-host gather bytes only to $ratio of" \
      "those without it (at most 1/$R + 0.05 expected)"
done
log "parameters identical with and without the node cache"
for h in 0 1; do zs_host_kill "$h" || fail "processes are left on host h$h"; done
log "PASSED in $((SECONDS - start)) s"
