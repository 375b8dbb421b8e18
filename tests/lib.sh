# Shared by the process tests (sourced): paths, killing what a test
# started, failing with the tail of every log under $WORK, and reading
# gpt_train's progress lines.

# zs_kill_all PID...: SIGKILL each one still running (empty ones skipped),
# then reap them.
zs_kill_all() {
  local pid
  for pid in "$@"; do
    [[ -n "$pid" ]] && kill -9 "$pid" 2>/dev/null
  done
  wait 2>/dev/null
}

# zs_free_ports N: N distinct TCP ports free on this host now, drawn from
# below the kernel's ephemeral range (net.ipv4.ip_local_port_range), where
# no port-0 bind and no connection's source port can take one before the
# caller's daemon binds it (which may be many seconds later, or again after
# a restart).
zs_free_ports() {
  python3 - "$1" <<'PY'
import random, socket, sys
n = int(sys.argv[1])
with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
    ephemeral_low = int(f.read().split()[0])
low, high = 10000, ephemeral_low  # [low, high)
if high - low < 1000:
    low, high = 1024, ephemeral_low
if high - low < 1000:  # no room below the ephemeral range: any free port
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("0.0.0.0", 0))
    print(*[s.getsockname()[1] for s in socks])
    sys.exit(0)
ports = []
for _ in range(10000):
    if len(ports) == n:
        break
    p = random.randrange(low, high)
    if p in ports:
        continue
    s = socket.socket()
    try:
        s.bind(("0.0.0.0", p))
        ports.append(p)
    except OSError:
        pass
    finally:
        s.close()
if len(ports) < n:
    sys.exit("no %d free ports below the ephemeral range [%d, %d)" % (n, low, high))
print(*ports)
PY
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

# zs_abspath PATH: PATH made absolute against the current directory.
zs_abspath() { [[ "$1" == /* ]] && echo "$1" || echo "$PWD/$1"; }

# zs_step_times LOG STEPS: the step times in ms that rank 0 reported in LOG
# ("[rank 0] step S/STEPS loss L T ms/step ..."), one per line.
zs_step_times() {
  sed -n "s|^\[rank 0\] step [0-9]*/$2 loss [^ ]* \([0-9.]*\) ms/step.*|\1|p" "$1"
}

# zs_last_step LOG: the last step rank 0 reported in LOG ("[rank 0] step
# S/..." under zsrun, "step S/..." in a rank's own log, either after a
# wall-clock stamp "SECONDS.FRACTION "); 0 if none yet.
zs_last_step() {
  local s
  s="$(sed -n 's|^\([0-9][0-9.]* \)\{0,1\}\(\[rank 0\] \)\{0,1\}step \([0-9]*\)/.*|\3|p' "$1" |
    tail -n 1)"
  echo "${s:-0}"
}

# zs_daemon_address LOG PID: the address zeroshardd PID printed to LOG
# ("zeroshardd listening on ADDR") once it has (at most 30 s); returns 1,
# printing nothing, when the daemon exits or says nothing by then.
zs_daemon_address() {
  local deadline=$((SECONDS + 30)) addr
  while ((SECONDS < deadline)); do
    addr="$(sed -n 's/^zeroshardd listening on //p' "$1" | head -n 1)"
    if [[ -n "$addr" ]]; then
      echo "$addr"
      return 0
    fi
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}

# zs_now_ms: the wall clock in milliseconds.
zs_now_ms() { date +%s%3N; }

# zs_median: the median of the numbers on standard input, one per line.
zs_median() { sort -n | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }
