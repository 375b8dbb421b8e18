#!/bin/bash
# deploy/slurm/zeroshard.sbatch on a real Slurm cluster of this one host:
# munged, slurmctld and slurmd from Debian's packages, each with its
# configuration, state, logs and sockets in a private temporary directory,
# on ports picked free at run time, munge on a private socket
# (AuthInfo=socket=...) with a fresh key; so nothing here talks to, or
# disturbs, another Slurm or munge on the host.
#
# Submitted with `sbatch --wait` for one node and 2 tasks: one zeroshardd,
# two gpt_train ranks at stage 3. Checked: the job exits 0; its output has
# rank 0's last step, the daemon's log (serving plaintext on a unix socket
# in a private directory), the
# `zsctl memory` report of the job sampled while it trained (every ledger
# category of the model states) and of the daemon after it; the daemon was
# stopped by SIGTERM and no process of the job is left.
#
# The cluster is torn down on every exit (trap): the job cancelled, the
# daemons stopped through their pid files, and then every process still
# carrying this cluster's SLURM_CONF (job steps, slurmstepd) killed.
#
# Needs root (slurmd launches jobs as their user) and the packages slurmctld,
# slurmd, slurm-client and munge; without them it prints "SKIPPED: ..." and
# passes.
#
# Usage: slurm_test.sh SBATCH_SCRIPT ZEROSHARDD GPT_TRAIN ZSCTL MAKE_TEST_CERTS
# (runfiles paths).
set -u
source "$(dirname "$0")/lib.sh"

SCRIPT="$(zs_abspath "$1")"
ZEROSHARDD="$(zs_abspath "$2")"
GPT_TRAIN="$(zs_abspath "$3")"
ZSCTL="$(zs_abspath "$4")"
MAKE_TEST_CERTS="$(zs_abspath "$5")"

# The daemons are in /usr/sbin, which a test's PATH may lack.
PATH="$PATH:/usr/sbin:/sbin"
# A test run inside a Slurm job must not talk to that job's cluster.
for v in $(compgen -e | grep '^SLURM_'); do unset "$v"; done

log() { echo "[slurm_test] $*"; }
skip() {
  echo "SKIPPED: $*"
  exit 0
}

[[ "$(id -u)" == 0 ]] || skip "needs root (slurmd runs the job's steps as the submitting user)"
for tool in munged slurmctld slurmd sbatch srun scontrol squeue sinfo scancel; do
  command -v "$tool" >/dev/null ||
    skip "$tool is not installed (apt-get install slurmctld slurmd slurm-client munge)"
done
command -v python3 >/dev/null || skip "python3 (to pick free ports) is not installed"

# Slurm and munge put unix sockets under their directories (sun_path holds
# 107 bytes), so the cluster lives in a short directory of its own.
DIR="$(mktemp -d /tmp/zs-slurm.XXXXXX)" || exit 1
chmod 755 "$DIR"
CONF="$DIR/slurm.conf"
WORK="$DIR"  # zs_fail prints the tail of $WORK/*.log
HOST="$(hostname -s)"
# The node's name in Slurm, which the test certificate names (NodeAddr and
# NodeHostname say where it really is).
NODE=localhost

# Every command that talks to this cluster, and every process of it, carries
# SLURM_CONF=$CONF in its environment; nothing else on the host does.
sl() { SLURM_CONF="$CONF" "$@"; }

# The processes of this cluster: those whose environment names $CONF.
cluster_pids() {
  grep -lzxF "SLURM_CONF=$CONF" /proc/[0-9]*/environ 2>/dev/null | sed 's|^/proc/\([0-9]*\)/environ$|\1|'
}

stop_pidfile() {  # stop_pidfile FILE: SIGTERM, up to 10 s, SIGKILL
  local pid
  pid="$(cat "$1" 2>/dev/null)" || return 0
  [[ -n "$pid" ]] || return 0
  kill -TERM "$pid" 2>/dev/null || return 0
  for _ in $(seq 100); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.1
  done
  kill -KILL "$pid" 2>/dev/null
}

teardown() {
  local rc=$?
  trap - EXIT INT TERM
  if [[ -f "$DIR/slurmctld.pid" ]]; then
    sl scancel --quiet --user=root 2>/dev/null
    for _ in $(seq 50); do
      [[ -z "$(sl squeue -h 2>/dev/null)" ]] && break
      sleep 0.2
    done
  fi
  stop_pidfile "$DIR/slurmd.pid"
  stop_pidfile "$DIR/slurmctld.pid"
  stop_pidfile "$DIR/munged.pid"
  local left
  left="$(cluster_pids)"
  if [[ -n "$left" ]]; then
    log "killing what is left of the cluster: $(echo $left)"
    kill -KILL $left 2>/dev/null
  fi
  if [[ $rc -ne 0 && -n "${TEST_UNDECLARED_OUTPUTS_DIR:-}" ]]; then
    cp "$DIR"/*.log "$DIR"/*.out "$DIR/slurm.conf" "$TEST_UNDECLARED_OUTPUTS_DIR/" 2>/dev/null
  fi
  rm -rf "$DIR"
  exit "$rc"
}
trap teardown EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

read -r CTLD_PORT SLURMD_PORT ZS_PORT ZS_TLS_PORT <<<"$(zs_free_ports 4)"
[[ -n "$ZS_TLS_PORT" ]] || zs_fail "no free ports"

# --- munge, on a private socket with a fresh key -------------------------------------
mkdir -m 755 "$DIR/munge"
head -c 1024 /dev/urandom >"$DIR/munge/munge.key"
chmod 400 "$DIR/munge/munge.key"
MUNGE_SOCKET="$DIR/munge/munge.socket"
sl munged --force --key-file="$DIR/munge/munge.key" --socket="$MUNGE_SOCKET" \
  --pid-file="$DIR/munged.pid" --log-file="$DIR/munged.log" --seed-file="$DIR/munge/munge.seed" ||
  zs_fail "munged did not start"

# --- slurm.conf ---------------------------------------------------------------------
CPUS="$(nproc)"
[[ "$CPUS" -ge 2 ]] || CPUS=2  # two ranks; SlurmdParameters=config_overrides accepts it
mkdir -p "$DIR/state" "$DIR/spool" "$DIR/job"
: >"$DIR/plugstack.conf"
cat >"$CONF" <<EOF
ClusterName=zstest
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
PlugStackConfig=$DIR/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
InactiveLimit=0
MinJobAge=300
NodeName=$NODE NodeAddr=127.0.0.1 NodeHostname=$HOST CPUs=$CPUS State=UNKNOWN
PartitionName=zstest Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF

# --- slurmctld and slurmd -----------------------------------------------------------------
sl slurmctld -f "$CONF" -i || zs_fail "slurmctld did not start"
sl slurmd -f "$CONF" -N "$NODE" || zs_fail "slurmd did not start"
state=""
for _ in $(seq 150); do
  state="$(sl sinfo -h -n "$NODE" -o %t 2>/dev/null)"
  [[ "$state" == idle ]] && break
  sleep 0.2
done
[[ "$state" == idle ]] || zs_fail "node $NODE is not idle after 30 s (sinfo: '$state')"
log "cluster up: slurmctld on $CTLD_PORT, slurmd on $SLURMD_PORT, node $NODE idle ($CPUS CPUs)"

# --- The jobs ---------------------------------------------------------------------------

# job_pids: the processes of any job of this cluster (its steps, slurmstepd).
job_pids() {
  local p
  for p in $(cluster_pids); do
    [[ "$(cat "/proc/$p/comm" 2>/dev/null)" == slurmstepd ]] ||
      grep -qz '^SLURM_JOB_ID=' "/proc/$p/environ" 2>/dev/null && echo "$p"
  done
}

# run_job NAME PORT [VAR=VALUE...]: the script for 1 node and 2 tasks with
# these variables, training a small model for 400 steps (several seconds:
# several samples of its memory); waits for it, prints its output and checks
# what every job's output must show. Sets OUT and JOB_ID (slurm-N).
run_job() {
  local name="$1" port="$2"
  shift 2
  OUT="$DIR/$name.out"
  local t0=$SECONDS job
  job="$(cd "$DIR/job" &&
    env "$@" ZS_ZEROSHARDD="$ZEROSHARDD" ZS_ZSCTL="$ZSCTL" ZS_PORT="$port" \
      ZS_MEMORY_INTERVAL=0.2 ZS_STOP_TIMEOUT=20 ZS_RUN_DIR="${RUN_DIR:-$DIR/run-$name}" \
      ZS_DAEMON_ARGS="--memory_limit=1G" SLURM_CONF="$CONF" \
      sbatch --parsable --job-name="$name" --nodes=1 --ntasks=2 --time=5 --output="$OUT" \
      "$SCRIPT" "$GPT_TRAIN" --stage=3 --steps=400 --layers=2 --width=32 --heads=4 \
      --seq_len=16 --batch=8 --threads=1 --transport=stream --progress=lines --report=false)" ||
    zs_fail "$name: sbatch did not take the job"
  log "$name: submitted job $job"
  # Polled rather than `sbatch --wait`, which looks only every few seconds;
  # slurmctld keeps the finished job's record for MinJobAge.
  local record="" state=""
  for _ in $(seq 1200); do
    record="$(sl scontrol show job -o "$job" 2>/dev/null)"
    state="$(sed -n 's/.* JobState=\([A-Z_]*\) .*/\1/p' <<<"$record")"
    case "$state" in
      PENDING | CONFIGURING | RUNNING | COMPLETING | SUSPENDED | "") sleep 0.25 ;;
      *) break ;;
    esac
  done
  local exit_code
  exit_code="$(sed -n 's/.* ExitCode=\([0-9:]*\).*/\1/p' <<<"$record")"
  log "$name: job $job $state, exit code $exit_code, $((SECONDS - t0)) s after submission"
  echo "---- output of job $job ($name) ----"
  cat "$OUT" 2>/dev/null
  echo "---- end of the output of job $job ----"
  [[ "$state" == COMPLETED && "$exit_code" == 0:0 ]] ||
    zs_fail "$name: job $job $state, exit code $exit_code"

  JOB_ID="slurm-$job"
  expect() {  # expect PATTERN WHAT: OUT has a line matching PATTERN
    grep -q "$1" "$OUT" || zs_fail "$name: $2"
  }
  expect "^zeroshard.sbatch: [0-9:]* job $JOB_ID: 1 daemon(s) " "no job line"
  expect "^0: step 400/400 loss " "rank 0 did not report step 400/400"
  expect "^zeroshard.sbatch: [0-9:]* trainers exited with code 0$" "the trainers did not exit 0"
  expect "^0: zeroshardd: job $JOB_ID registered: stage 3, N_d 2" "no daemon log in the output"
  expect "^==== zsctl memory: job $JOB_ID while it trained" "no memory report of the job"
  REPORT="$(sed -n "/^==== zsctl memory: job $JOB_ID while it trained/,/^====/p" "$OUT")"
  grep -q "^  job $JOB_ID  stage 3 .* N_d 2  partitions owned 2$" <<<"$REPORT" ||
    zs_fail "$name: the memory report does not show the job at stage 3 with N_d 2"
  local category
  for category in param_master param_half grad optim_m optim_v "model states"; do
    grep -q "^    $category " <<<"$REPORT" || zs_fail "$name: the report has no $category line"
  done
  expect "^==== zsctl memory: the daemons after the job ====" "no memory report after the job"
  expect "^zeroshard.sbatch: [0-9:]* stopping the daemons (SIGTERM)$" "the daemons got no SIGTERM"
  expect "^0: zeroshardd: stopped$" "the daemon did not stop on SIGTERM"
  expect "^zeroshard.sbatch: [0-9:]* exit 0$" "the script did not end with exit 0"
  [[ ! -e "$DIR/run-$name" ]] || zs_fail "$name: the script left its run directory"
  local left
  left="$(sl squeue -h)"
  [[ -z "$left" ]] || zs_fail "$name: jobs left in the queue: $left"
  for _ in $(seq 150); do  # 30 s: slurmstepd lingers on a loaded machine
    left="$(job_pids)"
    [[ -z "$left" ]] && break
    sleep 0.2
  done
  [[ -z "$left" ]] || zs_fail "$name: processes of the job left running: $(ps -o pid,args -p $left)"
}

# One node: the daemon serves plaintext on a unix socket in a directory
# only the job's user can enter, not on a TCP port another user could take.
# The job's directory has a path longer than a socket's address holds, so
# the socket goes to a directory of its own under /tmp.
RUN_DIR="$DIR/$(printf 'd%.0s' {1..100})/run-loopback"
run_job loopback "$ZS_PORT"
unset RUN_DIR
SOCK="$(sed -n 's/^zeroshard.sbatch: [0-9:]* ZS_DAEMONS=\(unix:\/.*\)$/\1/p' "$OUT")"
[[ -n "$SOCK" ]] || zs_fail "loopback: ZS_DAEMONS is not a unix socket"
[[ "$SOCK" == unix:/tmp/zeroshard-sock-* ]] ||
  zs_fail "loopback: the socket $SOCK is not in a directory of its own under /tmp"
grep -qxF "0: zeroshardd listening on $SOCK" "$OUT" ||
  zs_fail "loopback: the daemon did not listen on $SOCK"
grep -q "^0: zeroshardd serving plaintext$" "$OUT" || zs_fail "loopback: the daemon did not serve plaintext"
grep -qF "daemon $SOCK  total " <<<"$REPORT" || zs_fail "loopback: the report names no daemon"
[[ ! -e "${SOCK#unix:}" && ! -e "$(dirname "${SOCK#unix:}")" ]] ||
  zs_fail "loopback: the socket's directory was left behind"

# Mutual TLS, as on several nodes: the daemon on every interface with the
# certificate of its node ("%n", the node being called localhost here, which
# the test certificate names), the trainers and zsctl with the client's.
mkdir "$DIR/certs"
bash "$MAKE_TEST_CERTS" "$DIR/certs" >"$DIR/certs.log" 2>&1 || zs_fail "make_test_certs.sh failed"
ln -s server.crt "$DIR/certs/$NODE.crt"
ln -s server.key "$DIR/certs/$NODE.key"
run_job tls "$ZS_TLS_PORT" ZS_DAEMON_TLS_CERT="$DIR/certs/%n.crt" \
  ZS_DAEMON_TLS_KEY="$DIR/certs/%n.key" ZS_TLS_CA="$DIR/certs/ca.crt" \
  ZS_TLS_CERT="$DIR/certs/client.crt" ZS_TLS_KEY="$DIR/certs/client.key"
grep -q "^zeroshard.sbatch: [0-9:]* ZS_DAEMONS=$NODE:$ZS_TLS_PORT$" "$OUT" ||
  zs_fail "tls: the daemon is not named by its node"
grep -q "^0: zeroshardd listening on 0.0.0.0:$ZS_TLS_PORT$" "$OUT" ||
  zs_fail "tls: the daemon did not listen on 0.0.0.0:$ZS_TLS_PORT"
grep -q "^0: zeroshardd serving mutual TLS$" "$OUT" || zs_fail "tls: the daemon did not serve mutual TLS"
grep -q "^daemon $NODE:$ZS_TLS_PORT  total " <<<"$REPORT" || zs_fail "tls: the report names no daemon"

log "PASSED"
