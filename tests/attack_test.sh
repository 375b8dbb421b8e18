#!/bin/bash
# An attack on a daemon's port while a job trains there, for a reviewer to
# read: every figure is printed as key=value and every check as PASS or FAIL.
#
# One zeroshardd on 127.0.0.1 with a registration token (an owner-only file,
# as zsrun gives its daemons) and a --checkpoint_dir, its other flags at
# their defaults (--max_rpc_threads=256, --stream_idle_timeout_seconds=60).
# stream_flood holds 3,000 Shard/PushGradient streams over 30 connections
# open for 20 s, without a token and without sending a message. Meanwhile:
#   threads   the daemon's thread count (/proc/PID/task), sampled every
#             second, stays at most 300 (threads_max=);
#   status    Admin.Status with the job's token, every 100 ms, never fails
#             (status_p50_ms=, status_max_ms=);
#   training  gpt_train, one rank with the job's token and
#             ZS_REGISTRATION_TOKEN, trains 20 steps and saves a checkpoint;
#   register  64 RegisterJob calls of new jobs with a token but without the
#             registration token are all refused (register_refused=).
# Then:
#   files     the checkpoint's files are mode 600 and its directories 700
#             (their `stat -c '%a %n'` is printed);
#   manifest  that checkpoint's MANIFEST rewritten to claim blocks of 2^62
#             bytes, and VerifyCheckpoint asked of it with the job's token:
#             a clear error (DATA_LOSS or INVALID_ARGUMENT, not UNKNOWN or
#             a crash), and the daemon still answers Admin.Status.
#   promote   two more daemons serving mutual TLS (a throwaway PKI from
#             make_test_certs.sh), a job with replicas = 2 registered on both
#             with a trainer's certificate, and that certificate's Promote
#             of the backup of group 0 while its primary serves: refused
#             (ABORTED), the backup still a backup at epoch 1.
#   arena     one more daemon serving --bulk_transport=grpc with an
#             activation arena: a job's rank takes the arena's key from
#             ExchangeEndpoint and writes with it, the job ends, another job
#             becomes the arena's tenant; the first job's saved key then
#             neither writes nor reads (UNAVAILABLE: the region "no longer
#             exists"), the new tenant's does.
# Everything started is killed on exit; the test fails if any check failed.
#
# Usage: attack_test.sh ZEROSHARDD GPT_TRAIN STREAM_FLOOD MAKE_TEST_CERTS
# (runfiles paths).
set -u
# zs_kill_all, zs_fail, zs_abspath, zs_median.
source "$(dirname "$0")/lib.sh"

ZEROSHARDD="$(zs_abspath "$1")"
GPT_TRAIN="$(zs_abspath "$2")"
STREAM_FLOOD="$(zs_abspath "$3")"
MAKE_TEST_CERTS="$(zs_abspath "$4")"
WORK="$(mktemp -d "${TEST_TMPDIR:-/tmp}/attack.XXXXXX")"
CKPT="$WORK/checkpoints"
JOB=attack-test
STREAMS=3000
CHANNELS=30
HOLD_S=20
STEPS=20
REGISTRATIONS=64
# --max_rpc_threads (256 by default), and the daemon's own threads (optimizer, UCX,
# checkpoint writer, gRPC's pollers) beside them.
MAX_THREADS=300
TRAINER_FLAGS=(--stage=3 --steps="$STEPS" --checkpoint_every="$STEPS" --layers=2 --width=32
  --heads=4 --seq_len=16 --batch=8 --threads=1 --transport=stream --report=false
  --progress=lines --world_size=1 --rank=0 --job_id="$JOB")

DAEMON_PID=""
TRAINER_PID=""
FLOOD_PID=""
STATUS_PID=""
REGISTER_PID=""
OTHER_PIDS=()
FAILED=0

log() { echo "[attack_test] $*"; }

cleanup() {
  zs_kill_all "$FLOOD_PID" "$STATUS_PID" "$REGISTER_PID" "$TRAINER_PID" "$DAEMON_PID" \
    "${OTHER_PIDS[@]}"
}
trap cleanup EXIT
trap 'exit 143' TERM INT

fail() { zs_fail "$@"; }

# check OK NAME DETAIL: prints "PASS: NAME (DETAIL)" if OK is 0, else a FAIL
# line, and remembers the failure.
check() {
  if [[ "$1" == 0 ]]; then
    echo "PASS: $2 ($3)"
  else
    echo "FAIL: $2 ($3)"
    FAILED=1
  fi
}

# token: 32 random bytes in hex, as zsrun makes its tokens.
token() { head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n'; }

# value FILE KEY: the value of the line KEY=value in FILE (empty if none).
value() { sed -n "s/^$2=//p" "$1" | tail -n 1; }

threads() { ls "/proc/$DAEMON_PID/task" 2>/dev/null | wc -l; }

# address PID LOG: waits (30 s at most) for the daemon PID to print its
# address in LOG, and prints it; exits non-zero (its reason on stderr) if it
# does not.
address() {
  local addr="" deadline=$((SECONDS + 30))
  while ((SECONDS < deadline)); do
    addr="$(sed -n 's/^zeroshardd listening on //p' "$2" | head -n 1)"
    [[ -n "$addr" ]] && break
    kill -0 "$1" 2>/dev/null || fail "zeroshardd ($2) exited at start" >&2
    sleep 0.1
  done
  [[ -n "$addr" ]] || fail "zeroshardd ($2) printed no address within 30 s" >&2
  echo "$addr"
}

# ---- the daemon ----
export ZS_JOB_TOKEN="$(token)"
export ZS_REGISTRATION_TOKEN="$(token)"
(umask 077 && printf '%s' "$ZS_REGISTRATION_TOKEN" >"$WORK/registration.token")
mkdir -p "$CKPT"
"$ZEROSHARDD" --listen=127.0.0.1:0 --registration_token_file="$WORK/registration.token" \
  --checkpoint_dir="$CKPT" >"$WORK/daemon.log" 2>&1 &
DAEMON_PID=$!
ADDR="$(address "$DAEMON_PID" "$WORK/daemon.log")" || exit 1
log "daemon at $ADDR, pid $DAEMON_PID"
echo "threads_idle=$(threads)"

# ---- the flood, and Admin.Status beside it ----
"$STREAM_FLOOD" --target="$ADDR" --mode=flood --streams="$STREAMS" --channels="$CHANNELS" \
  --hold_s="$HOLD_S" >"$WORK/flood.out" 2>"$WORK/flood.log" &
FLOOD_PID=$!
deadline=$((SECONDS + 30))
until grep -qs "streams open" "$WORK/flood.log"; do
  kill -0 "$FLOOD_PID" 2>/dev/null || fail "stream_flood exited before opening its streams"
  ((SECONDS < deadline)) || fail "stream_flood did not open its streams within 30 s"
  sleep 0.1
done
log "$STREAMS idle PushGradient streams without a token over $CHANNELS connections, for $HOLD_S s"
"$STREAM_FLOOD" --target="$ADDR" --mode=status --token="$ZS_JOB_TOKEN" --hold_s="$HOLD_S" \
  >"$WORK/status.out" 2>"$WORK/status.log" &
STATUS_PID=$!

# ---- a job training meanwhile ----
timeout 150 "$GPT_TRAIN" "${TRAINER_FLAGS[@]}" --daemons="$ADDR" >"$WORK/trainer.log" 2>&1 &
TRAINER_PID=$!

# ---- registrations without the registration token, meanwhile ----
# With a well-formed token, so that what refuses them is the missing
# registration token (metadata x-zeroshard-registration).
"$STREAM_FLOOD" --target="$ADDR" --mode=register --calls="$REGISTRATIONS" --token="$(token)" \
  >"$WORK/register.out" 2>"$WORK/register.log" &
REGISTER_PID=$!

# ---- threads, sampled every second until the flood is over ----
threads_max=0
deadline=$((SECONDS + HOLD_S + 40))
while kill -0 "$FLOOD_PID" 2>/dev/null && ((SECONDS < deadline)); do
  n="$(threads)"
  ((n > threads_max)) && threads_max=$n
  sleep 1
done
kill -0 "$DAEMON_PID" 2>/dev/null || fail "zeroshardd died during the flood"
wait "$FLOOD_PID"
flood_rc=$?
FLOOD_PID=""
wait "$STATUS_PID"
STATUS_PID=""
wait "$REGISTER_PID"
REGISTER_PID=""
wait "$TRAINER_PID"
trainer_rc=$?
TRAINER_PID=""

echo "threads_max=$threads_max"
cat "$WORK/flood.out"
echo "status_p50_ms=$(value "$WORK/status.out" status_p50_ms)"
echo "status_max_ms=$(value "$WORK/status.out" status_max_ms)"
echo "status_calls=$(value "$WORK/status.out" status_calls)"
echo "status_failed=$(value "$WORK/status.out" status_failed)"
refused="$(value "$WORK/register.out" register_refused)"
grep '^register_' "$WORK/register.out"
step_ms="$(sed -n 's|^step [0-9]*/[0-9]* loss [^ ]* \([0-9.]*\) ms/step.*|\1|p' "$WORK/trainer.log" |
  zs_median)"
echo "train_step_p50_ms=$step_ms"

check "$flood_rc" "flood" "stream_flood ran and every one of its $STREAMS streams ended, exit $flood_rc"
((threads_max <= MAX_THREADS))
check $? "threads" "threads_max=$threads_max, at most $MAX_THREADS allowed"
[[ "$(value "$WORK/status.out" status_failed)" == 0 ]]
check $? "status" "Admin.Status answered every call: $(value "$WORK/status.out" status_calls) calls"
last="$(sed -n 's|^step \([0-9]*\)/.*|\1|p' "$WORK/trainer.log" | tail -n 1)"
[[ "$trainer_rc" == 0 && "${last:-0}" == "$STEPS" ]]
check $? "training" "gpt_train exit $trainer_rc, last step ${last:-none} of $STEPS"
((${refused:-0} == REGISTRATIONS))
check $? "register" "$refused of $REGISTRATIONS RegisterJob calls refused"

# ---- the checkpoint's files ----
(cd "$CKPT" && find . -mindepth 1 -exec stat -c '%a %n' {} +)
saved="$(find "$CKPT" -mindepth 1 -type f | wc -l)"
loose="$(find "$CKPT" -mindepth 1 \( -type f ! -perm 600 -o -type d ! -perm 700 \) | wc -l)"
((saved > 0 && loose == 0))
check $? "files" "$saved files, $loose not owner-only (600 files, 700 directories)"

# ---- a hostile manifest ----
# The checkpoint gpt_train saved (and completed: it has a MANIFEST).
saved_name="$(cd "$CKPT/$JOB" 2>/dev/null && ls -d */MANIFEST 2>/dev/null | head -n 1)"
saved_name="${saved_name%/MANIFEST}"
"$STREAM_FLOOD" --target="$ADDR" --mode=manifest --token="$ZS_JOB_TOKEN" \
  --checkpoint_dir="$CKPT" --job="$JOB" --name="$saved_name" >"$WORK/manifest.out" \
  2>"$WORK/manifest.log"
manifest_rc=$?
cat "$WORK/manifest.out" "$WORK/manifest.log"
verify="$(value "$WORK/manifest.out" manifest_verify)"
[[ "$manifest_rc" == 0 && ("$verify" == DATA_LOSS || "$verify" == INVALID_ARGUMENT) &&
  "$(value "$WORK/manifest.out" manifest_alive)" == 1 ]] && kill -0 "$DAEMON_PID" 2>/dev/null
check $? "manifest" "checkpoint $saved_name's MANIFEST with 2^62-byte blocks: VerifyCheckpoint $verify, daemon alive"

# ---- a trainer certificate's Promote ----
CERTS="$WORK/certs"
mkdir -p "$CERTS"
bash "$MAKE_TEST_CERTS" "$CERTS" >"$WORK/certs.log" 2>&1 || fail "make_test_certs.sh failed"
TLS_ADDRS=()
for d in 0 1; do
  "$ZEROSHARDD" --listen=127.0.0.1:0 --tls_cert="$CERTS/server.crt" \
    --tls_key="$CERTS/server.key" --tls_ca="$CERTS/ca.crt" >"$WORK/tls$d.log" 2>&1 &
  OTHER_PIDS+=($!)
  addr="$(address "${OTHER_PIDS[$d]}" "$WORK/tls$d.log")" || exit 1
  TLS_ADDRS+=("$addr")
done
"$STREAM_FLOOD" --target="${TLS_ADDRS[0]}" --peer="${TLS_ADDRS[1]}" --mode=promote \
  --job=attack-replicated --token="$(token)" --tls_cert="$CERTS/client.crt" \
  --tls_key="$CERTS/client.key" --tls_ca="$CERTS/ca.crt" >"$WORK/promote.out" \
  2>"$WORK/promote.log"
promote_rc=$?
cat "$WORK/promote.out" "$WORK/promote.log"
[[ "$promote_rc" == 0 && "$(value "$WORK/promote.out" promote_code)" == ABORTED &&
  "$(value "$WORK/promote.out" promote_backup_role)" == BACKUP &&
  "$(value "$WORK/promote.out" promote_backup_epoch)" == 1 ]]
check $? "promote" "a trainer certificate's Promote of a live primary: $(value "$WORK/promote.out" promote_code), the backup still $(value "$WORK/promote.out" promote_backup_role) at epoch $(value "$WORK/promote.out" promote_backup_epoch)"

# ---- an old tenant's arena key ----
"$ZEROSHARDD" --listen=127.0.0.1:0 --bulk_transport=grpc --activation_arena_bytes=1048576 \
  --registration_token_file="$WORK/registration.token" >"$WORK/arena.log" 2>&1 &
OTHER_PIDS+=($!)
arena_addr="$(address "${OTHER_PIDS[-1]}" "$WORK/arena.log")" || exit 1
"$STREAM_FLOOD" --target="$arena_addr" --mode=arena_key --job=attack-arena --token="$(token)" \
  --next_token="$(token)" --registration_token="$ZS_REGISTRATION_TOKEN" >"$WORK/arena.out" \
  2>"$WORK/arena.err"
arena_rc=$?
cat "$WORK/arena.out" "$WORK/arena.err"
[[ "$arena_rc" == 0 && "$(value "$WORK/arena.out" arena_first_put)" == OK &&
  "$(value "$WORK/arena.out" arena_old_key_put)" == UNAVAILABLE &&
  "$(value "$WORK/arena.out" arena_old_key_get)" == UNAVAILABLE &&
  "$(value "$WORK/arena.out" arena_new_key_put)" == OK &&
  "$(value "$WORK/arena.out" arena_new_key_get)" == OK &&
  "$(value "$WORK/arena.out" arena_keys_differ)" == 1 ]] &&
  (($(grep -c "no longer exists" "$WORK/arena.err") == 2))
check $? "arena" "a former tenant's arena key: put $(value "$WORK/arena.out" arena_old_key_put), get $(value "$WORK/arena.out" arena_old_key_get); the next tenant's: put $(value "$WORK/arena.out" arena_new_key_put)"

if ((FAILED)); then
  fail "a check failed"
fi
log "all checks passed"
