#!/bin/bash
# `./zs demo` with mutual TLS on, and what a daemon serving it refuses.
#
# A throwaway PKI (common/testing/make_test_certs.sh) in $TEST_TMPDIR, then:
#   demo     zsrun --daemons=2 --nproc=2 --metrics as `./zs demo` runs it:
#            the daemons get the server certificate, key and CA, an
#            --admin_token_file, a small activation arena and a spill
#            directory through --daemon_args; ZS_TLS_CERT/KEY/CA name the
#            client certificate, which zsrun's readiness check and the
#            trainers use; zsrun generates the job token. gpt_train trains at
#            ZeRO stage 3 with --activations=daemon and the demo's transport
#            (ucx) for a few steps, runs a short activation-timing job and
#            prints the demo's report. Checked: zsrun exits 0, both daemons
#            logged "zeroshardd serving mutual TLS" (zsrun's --log_dir) and
#            saw the job, rank 0 trained every step, the report holds both
#            daemons' ledgers, and no trainer line carries an error status.
#   refusals against one more TLS daemon started directly:
#     (a) gpt_train with ZS_TLS_* unset (plaintext to a TLS daemon) fails
#         with UNAVAILABLE; zsctl with a certificate from another CA too;
#     (b) while a job is registered there (rank 0 of a 2-rank job, waiting
#         for rank 1 that never comes), zsctl status with the client
#         certificate lists it with the job's token, lists no job without a
#         token or with another token, zsctl memory --job without a token is
#         UNAUTHENTICATED, and the admin token (read last) still lists it, so
#         the job was there throughout.
# Transport: the demo's default (ucx; zeroshardd --ucx_tls=posix,cma,self).
# Where the daemon cannot initialise UCX (it says "serving the streaming data
# path only"), gpt_train --transport=ucx fails, so the demo run then uses
# --transport=stream and says so.
#
# Usage: tls_demo_test.sh ZSRUN ZEROSHARDD GPT_TRAIN ZSCTL MAKE_TEST_CERTS
# (runfiles paths).
set -u
# zs_kill_all, zs_fail, zs_abspath.
source "$(dirname "$0")/lib.sh"

ZSRUN="$(zs_abspath "$1")"
ZEROSHARDD="$(zs_abspath "$2")"
GPT_TRAIN="$(zs_abspath "$3")"
ZSCTL="$(zs_abspath "$4")"
MAKE_TEST_CERTS="$(zs_abspath "$5")"

WORK="$(mktemp -d "${TEST_TMPDIR:-/tmp}/tls_demo.XXXXXX")"
CERTS="$WORK/certs"
ADMIN_TOKEN_FILE="$WORK/admin.token"
STEPS=5
# The demo's model, smaller; one torch thread per rank on 2 cores.
MODEL_FLAGS=(--layers=2 --width=32 --heads=4 --seq_len=16 --batch=8 --threads=1)
start=$SECONDS

DAEMON_PID=""
WAITER_PID=""

log() { echo "[tls_demo_test] $*"; }

cleanup() { zs_kill_all "$WAITER_PID" "$DAEMON_PID"; }
trap cleanup EXIT
trap 'exit 143' TERM INT

fail() { zs_fail "$@"; }

# zsrun splits --daemon_args on whitespace.
[[ "$WORK" != *[[:space:]]* ]] || fail "the test directory $WORK has whitespace in it"

# ---- the PKI, the admin secret; no job token: zsrun makes one ----
mkdir -p "$CERTS"
bash "$MAKE_TEST_CERTS" "$CERTS" >"$WORK/certs.log" 2>&1 || fail "make_test_certs.sh failed"
(umask 077 && echo "tls-demo-test-admin-token-0123456789" >"$ADMIN_TOKEN_FILE")
unset ZS_JOB_TOKEN ZS_TLS_CERT ZS_TLS_KEY ZS_TLS_CA ZS_DAEMONS ZS_JOB_ID ZS_RANK ZS_WORLD_SIZE
CLIENT_TLS=(ZS_TLS_CERT="$CERTS/client.crt" ZS_TLS_KEY="$CERTS/client.key"
  ZS_TLS_CA="$CERTS/ca.crt")
DAEMON_FLAGS=(--tls_cert="$CERTS/server.crt" --tls_key="$CERTS/server.key"
  --tls_ca="$CERTS/ca.crt" --admin_token_file="$ADMIN_TOKEN_FILE"
  --activation_arena_bytes=1048576)

# ---- one TLS daemon of our own (the refusals); it also tells whether UCX
# initialises here ----
"$ZEROSHARDD" --listen=127.0.0.1:0 "${DAEMON_FLAGS[@]}" >"$WORK/daemon.log" 2>&1 &
DAEMON_PID=$!
deadline=$((SECONDS + 30))
ADDR=""
while ((SECONDS < deadline)); do
  ADDR="$(sed -n 's/^zeroshardd listening on //p' "$WORK/daemon.log" | head -n 1)"
  [[ -n "$ADDR" ]] && break
  kill -0 "$DAEMON_PID" 2>/dev/null || break
  sleep 0.05
done
[[ -n "$ADDR" ]] || fail "the TLS daemon did not start"
grep -q '^zeroshardd serving mutual TLS$' "$WORK/daemon.log" ||
  fail "the daemon with --tls_cert/--tls_key/--tls_ca does not say it serves mutual TLS"
TRANSPORT=ucx
if grep -q "serving the streaming data path only" "$WORK/daemon.log"; then
  TRANSPORT=stream
  log "UCX does not initialise here; the demo run uses --transport=stream:"
  grep -h "serving the streaming data path only" "$WORK/daemon.log" | head -n 1
fi

# ---- the demo with TLS ----
mkdir -p "$WORK/spill"
log "demo: zsrun --daemons=2 --nproc=2, mutual TLS, transport $TRANSPORT, $STEPS steps"
env "${CLIENT_TLS[@]}" "$ZSRUN" --zeroshardd="$ZEROSHARDD" --daemons=2 --nproc=2 --metrics \
  --log_dir="$WORK/logs" --startup_timeout_s=60 \
  --daemon_args="${DAEMON_FLAGS[*]} --spill_dir=$WORK/spill" -- \
  "$GPT_TRAIN" --stage=3 --steps="$STEPS" --activations=daemon --activation_timing_steps=8 \
  --transport="$TRANSPORT" --progress=lines "${MODEL_FLAGS[@]}" >"$WORK/demo.log" 2>&1
rc=$?
demo_s=$((SECONDS - start))
((rc == 0)) || fail "the demo with TLS: zsrun exited $rc"
for d in 0 1; do
  out="$WORK/logs/daemon-$d.stdout.log" err="$WORK/logs/daemon-$d.stderr.log"
  [[ -f "$out" ]] || fail "zsrun kept no daemon-$d.stdout.log in --log_dir"
  grep -q '^zeroshardd serving mutual TLS$' "$out" || fail "daemon $d did not serve mutual TLS"
  grep -q 'registered: stage 3, N_d 2' "$err" || fail "daemon $d did not see the job register"
  grep -q 'removed: every rank has left' "$err" || fail "daemon $d: the job's ranks did not leave"
done
grep -q "^\[rank 0\] step $STEPS/$STEPS loss " "$WORK/demo.log" ||
  fail "rank 0 did not report step $STEPS/$STEPS"
grep -q '^\[rank 0\] Loss on a held-out batch after' "$WORK/demo.log" ||
  fail "rank 0 printed no report"
# 8 steps: medians of the 2 daemon and 2 local steps left after each one's 2
# warm-up steps.
grep -Eq '^\[rank 0\] Step time over 8 steps alternating daemon and local .*: daemon [0-9.]+ ms, local [0-9.]+ ms' \
  "$WORK/demo.log" || fail "rank 0 printed no activation step times"
# The report's ledger table (Admin.MemoryReport, as zsctl memory prints it):
# one "daemon HOST:PORT  total ..." line per daemon.
ledgers="$(grep -c '^\[rank 0\] daemon 127\.0\.0\.1:[0-9]*  total ' "$WORK/demo.log")"
((ledgers == 2)) ||
  fail "the report shows $ledgers daemon ledgers, not 2 (its memory table did not reach the daemons)"
bad="$(grep -E '\[rank [01]\].*(UNAVAILABLE|UNAUTHENTICATED|PERMISSION_DENIED|INVALID_ARGUMENT|INTERNAL):' \
  "$WORK/demo.log" | head -n 5)"
[[ -z "$bad" ]] || fail "the demo's output carries error statuses:"$'\n'"$bad"
log "demo: trained $STEPS steps over mutual TLS in ${demo_s} s; both daemons served mutual TLS"

# ---- replicated partitions over mutual TLS ----
# Each primary reaches its backup with its own certificate as the client
# side (server.crt allows clientAuth): the state copy, the forwarded
# gradients and the commits must all pass the peer's mutual TLS.
log "replicas: zsrun --daemons=2 --nproc=2 gpt_train --replicas=2, mutual TLS, $STEPS steps"
env "${CLIENT_TLS[@]}" "$ZSRUN" --zeroshardd="$ZEROSHARDD" --daemons=2 --nproc=2 \
  --log_dir="$WORK/replica-logs" --startup_timeout_s=60 --daemon_args="${DAEMON_FLAGS[*]}" -- \
  "$GPT_TRAIN" --stage=3 --steps="$STEPS" --replicas=2 --transport="$TRANSPORT" \
  --progress=lines --report=false "${MODEL_FLAGS[@]}" >"$WORK/replicas.log" 2>&1 ||
  fail "the replicated run over mutual TLS: zsrun exited $?"
grep -q "^\[rank 0\] step $STEPS/$STEPS loss " "$WORK/replicas.log" ||
  fail "the replicated run: rank 0 did not report step $STEPS/$STEPS"
for d in 0 1; do
  err="$WORK/replica-logs/daemon-$d.stderr.log"
  grep -q 'copied the state of step 0 to the backup' "$err" ||
    fail "daemon $d did not copy its group's state to its backup over mutual TLS"
  if grep -Eq 'the backup (fell behind|is still not current)' "$err"; then
    fail "daemon $d lost its backup over mutual TLS: $(grep -Em1 'the backup (fell behind|is still not current)' "$err")"
  fi
done
log "replicas: both groups copied to their backups and kept current over mutual TLS"

# ---- (a) plaintext to a TLS daemon ----
ZS_JOB_TOKEN="tls-demo-test-job-token-0123" "$GPT_TRAIN" --daemons="$ADDR" --world_size=1 \
  --rank=0 --job_id=tls-plaintext --stage=3 --steps=2 --activations=daemon --transport=stream \
  --progress=none --report=false "${MODEL_FLAGS[@]}" >"$WORK/plaintext.log" 2>&1 &&
  fail "gpt_train without ZS_TLS_* trained against a TLS daemon"
grep -q 'UNAVAILABLE' "$WORK/plaintext.log" ||
  fail "gpt_train without ZS_TLS_* failed, but not with UNAVAILABLE"
log "(a) gpt_train with ZS_TLS_* unset: $(grep -m1 -o 'UNAVAILABLE: .*RegisterJob[^;]*' "$WORK/plaintext.log")"
env ZS_TLS_CERT="$CERTS/stranger.crt" ZS_TLS_KEY="$CERTS/stranger.key" ZS_TLS_CA="$CERTS/ca.crt" \
  "$ZSCTL" status --daemons="$ADDR" >"$WORK/stranger.log" 2>&1 &&
  fail "zsctl with a certificate of another CA was answered"
grep -q 'UNAVAILABLE' "$WORK/stranger.log" ||
  fail "zsctl with a certificate of another CA failed, but not with UNAVAILABLE"
log "(a) zsctl status with a certificate signed by another CA: UNAVAILABLE"

# ---- (b) a job's existence is its token holders' (and the admin's) ----
JOB=tls-waiting
JOB_TOKEN="tls-demo-test-job-token-4567"
# Rank 0 of two registers the job and waits for rank 1, which never comes.
env "${CLIENT_TLS[@]}" ZS_JOB_TOKEN="$JOB_TOKEN" "$GPT_TRAIN" --daemons="$ADDR" --world_size=2 \
  --rank=0 --job_id="$JOB" --stage=3 --steps=2 --transport=stream --progress=none \
  --report=false "${MODEL_FLAGS[@]}" >"$WORK/waiter.log" 2>&1 &
WAITER_PID=$!
zsctl() { env "${CLIENT_TLS[@]}" "$ZSCTL" "$@" --daemons="$ADDR"; }
deadline=$((SECONDS + 60))
until ZS_JOB_TOKEN="$JOB_TOKEN" zsctl status >"$WORK/status.owner.log" 2>&1 &&
  grep -q "^  job $JOB " "$WORK/status.owner.log"; do
  ((SECONDS < deadline)) || fail "job $JOB was not listed with its token within 60 s"
  kill -0 "$WAITER_PID" 2>/dev/null || fail "rank 0 of $JOB exited before its job was listed"
  sleep 0.2
done
log "(b) with the job's token: $(grep -m1 "^  job $JOB " "$WORK/status.owner.log" | tr -s ' ')"
zsctl status >"$WORK/status.none.log" 2>&1 || fail "zsctl status without a token failed"
grep -q "  jobs 0$" "$WORK/status.none.log" && ! grep -q "job $JOB" "$WORK/status.none.log" ||
  fail "zsctl status without a token shows a job"
ZS_JOB_TOKEN="tls-demo-test-other-token-89" zsctl status >"$WORK/status.other.log" 2>&1 ||
  fail "zsctl status with another job's token failed"
grep -q "  jobs 0$" "$WORK/status.other.log" && ! grep -q "job $JOB" "$WORK/status.other.log" ||
  fail "zsctl status with another job's token shows $JOB"
zsctl memory --job="$JOB" >"$WORK/memory.none.log" 2>&1 &&
  fail "zsctl memory --job=$JOB without a token was answered"
grep -q UNAUTHENTICATED "$WORK/memory.none.log" ||
  fail "zsctl memory --job=$JOB without a token failed, but not with UNAUTHENTICATED"
zsctl status --token_file="$ADMIN_TOKEN_FILE" >"$WORK/status.admin.log" 2>&1 ||
  fail "zsctl status with the admin token failed"
grep -q "^  job $JOB " "$WORK/status.admin.log" ||
  fail "job $JOB was gone before the checks without a token ended; they prove nothing"
kill -0 "$WAITER_PID" 2>/dev/null || fail "rank 0 of $JOB exited during the checks"
log "(b) without a token and with another job's token: jobs 0; zsctl memory without a token:" \
  "UNAUTHENTICATED; the admin token lists $JOB"
kill -9 "$WAITER_PID" 2>/dev/null
wait "$WAITER_PID" 2>/dev/null
WAITER_PID=""

log "PASSED in $((SECONDS - start)) s"
rm -rf "$WORK"
exit 0
