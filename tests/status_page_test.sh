#!/bin/bash
# The status page at "/" of zeroshardd's metrics port, in a browser.
#
# One zeroshardd with --metrics_port=0; two gpt_train ranks train a small GPT
# at ZeRO stage 3 over the streaming RPCs (far more steps than the test
# waits for). Once rank 0 has reported a few steps:
#   http     GET / over a plain socket: 200, text/html; charset=utf-8, the
#            Content-Security-Policy with default-src 'none', the self
#            refresh, and the job's row (id, stage 3, N_d 2, 2 / 2 ranks).
#   browser  headless Chromium (Debian's `chromium`) loads the page:
#            --dump-dom holds the job's row and its memory table, and
#            --screenshot writes status_page.png (non-empty) to the test's
#            undeclared outputs. Where chromium is not installed this part
#            is skipped, and the test says so.
# Everything started is killed on exit.
#
# Usage: status_page_test.sh ZEROSHARDD GPT_TRAIN (runfiles paths).
set -u
# zs_kill_all, zs_fail, zs_abspath.
source "$(dirname "$0")/lib.sh"

ZEROSHARDD="$(zs_abspath "$1")"
GPT_TRAIN="$(zs_abspath "$2")"
export ZS_JOB_TOKEN="status-page-test-job-token-0123"
WORK="$(mktemp -d "${TEST_TMPDIR:-/tmp}/status_page.XXXXXX")"
OUT="${TEST_UNDECLARED_OUTPUTS_DIR:-$WORK}"
JOB=status-page-test
WAIT_STEPS=3
TRAINER_FLAGS=(--stage=3 --steps=100000 --layers=2 --width=32 --heads=4 --seq_len=16 --batch=8
  --threads=1 --transport=stream --report=false --progress=lines --world_size=2 --job_id="$JOB")

DAEMON_PID=""
TRAINER_PIDS=()

log() { echo "[status_page_test] $*"; }

cleanup() { zs_kill_all "${TRAINER_PIDS[@]}" "$DAEMON_PID"; }
trap cleanup EXIT
trap 'exit 143' TERM INT

fail() { zs_fail "$@"; }

# ---- the daemon ----
"$ZEROSHARDD" --listen=127.0.0.1:0 --bulk_transport= --metrics_port=0 >"$WORK/daemon.log" 2>&1 &
DAEMON_PID=$!
ADDR=""
PORT=""
deadline=$((SECONDS + 30))
while ((SECONDS < deadline)); do
  ADDR="$(sed -n 's/^zeroshardd listening on //p' "$WORK/daemon.log" | head -n 1)"
  PORT="$(sed -n 's/^zeroshardd metrics on port //p' "$WORK/daemon.log" | head -n 1)"
  [[ -n "$ADDR" && -n "$PORT" ]] && break
  kill -0 "$DAEMON_PID" 2>/dev/null || fail "zeroshardd exited at start"
  sleep 0.1
done
[[ -n "$ADDR" && -n "$PORT" ]] || fail "zeroshardd printed no address and metrics port within 30 s"
URL="http://127.0.0.1:$PORT/"
log "daemon at $ADDR, status page at $URL"

# ---- the job: two ranks training ----
for r in 0 1; do
  "$GPT_TRAIN" "${TRAINER_FLAGS[@]}" --rank="$r" --daemons="$ADDR" >"$WORK/rank$r.log" 2>&1 &
  TRAINER_PIDS[$r]=$!
done
deadline=$((SECONDS + 180))
while :; do
  step="$(sed -n 's|^step \([0-9]*\)/.*|\1|p' "$WORK/rank0.log" | tail -n 1)"
  ((${step:-0} >= WAIT_STEPS)) && break
  ((SECONDS < deadline)) || fail "rank 0 did not reach step $WAIT_STEPS within 180 s"
  for pid in "${TRAINER_PIDS[@]}"; do
    kill -0 "$pid" 2>/dev/null || fail "a trainer exited before step $WAIT_STEPS"
  done
  sleep 0.2
done
log "rank 0 reported step $step"

# http_get PATH: the raw response (status line, headers, body) to GET PATH.
http_get() {
  local response
  exec 3<>"/dev/tcp/127.0.0.1/$PORT" || return 1
  printf 'GET %s HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' "$1" >&3
  response="$(cat <&3)"
  exec 3<&-
  printf '%s' "$response"
}

# expect_in FILE TEXT WHAT: fails unless FILE contains TEXT (fixed string).
expect_in() {
  grep -qF -- "$2" "$1" || fail "$3: \"$2\" not found in $1"
}

# ---- http ----
http_get / | tr -d '\r' >"$WORK/page.http" || fail "GET / failed"
head -n 1 "$WORK/page.http" | grep -q '^HTTP/1\.[01] 200' || fail "GET / did not answer 200"
expect_in "$WORK/page.http" "Content-Type: text/html; charset=utf-8" "headers"
expect_in "$WORK/page.http" "Content-Security-Policy: default-src 'none'; style-src 'unsafe-inline'" \
  "headers"
expect_in "$WORK/page.http" '<meta http-equiv="refresh" content="5">' "page"
ROW="<tr class=\"job\" id=\"job-$JOB\"><td>$JOB</td><td class=\"n\">3</td><td class=\"n\">2</td><td class=\"n\">2 / 2</td>"
expect_in "$WORK/page.http" "$ROW" "the job's row"
if grep -qF -- "$ZS_JOB_TOKEN" "$WORK/page.http"; then fail "the page shows the job token"; fi
log "GET / serves the job's row with the HTML and CSP headers"

# ---- browser ----
if ! command -v chromium >/dev/null 2>&1; then
  log "chromium is not installed (Debian package chromium): skipping the browser part"
  exit 0
fi
# A second page load at least a second after the first shows steps per second.
sleep 2
# Chromium wants a writable home and profile.
BROWSER=(env HOME="$WORK" timeout 90 chromium --headless --no-sandbox --disable-gpu
  --disable-dev-shm-usage --no-first-run --user-data-dir="$WORK/chromium-profile")
"${BROWSER[@]}" --dump-dom "$URL" >"$WORK/page.dom" 2>"$WORK/chromium-dom.log" ||
  fail "chromium --dump-dom failed"
expect_in "$WORK/page.dom" "id=\"job-$JOB\"" "the rendered DOM"
expect_in "$WORK/page.dom" "<td>$JOB</td>" "the rendered DOM"
expect_in "$WORK/page.dom" "id=\"memory-$JOB\"" "the rendered DOM"
expect_in "$WORK/page.dom" "<td>optim_m</td>" "the rendered DOM"
rm -f "$OUT/status_page.png"
"${BROWSER[@]}" --screenshot="$OUT/status_page.png" --window-size=1200,800 "$URL" \
  >"$WORK/chromium-screenshot.log" 2>&1 || fail "chromium --screenshot failed"
[[ -s "$OUT/status_page.png" ]] || fail "chromium wrote no screenshot"
log "the browser renders the job's row; screenshot status_page.png ($(stat -c %s "$OUT/status_page.png") bytes) in the test's outputs"
