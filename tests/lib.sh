# Shared by the process tests (sourced): killing what a test started, and
# failing with the tail of every log under $WORK.

# zs_kill_all PID...: SIGKILL each one still running (empty ones skipped),
# then reap them.
zs_kill_all() {
  local pid
  for pid in "$@"; do
    [[ -n "$pid" ]] && kill -9 "$pid" 2>/dev/null
  done
  wait 2>/dev/null
}

# zs_fail MESSAGE...: prints "FAILED: MESSAGE" and the last 40 lines of each
# $WORK/*.log and $WORK/logs/*.log, then exits 1.
zs_fail() {
  echo "FAILED: $*"
  local f
  for f in "$WORK"/*.log "$WORK"/logs/*.log; do
    [[ -f "$f" ]] || continue
    echo "---- ${f#"$WORK"/} (last 40 lines) ----"
    tail -n 40 "$f"
  done
  exit 1
}
