#!/bin/bash
# deploy/slurm/zeroshard.sbatch on a two-node Slurm cluster of this one
# machine: two test hosts (tests/hosts.sh: a network namespace each on a
# bridge, h0 at 10.77.0.1 and h1 at 10.77.0.2, with a hostname and a
# /dev/shm of its own, and an /etc/hosts naming both), slurmctld and a
# slurmd on h0, a slurmd on h1 (NodeName=h0,h1, NodeAddr their bridge
# addresses), and one munged outside the hosts whose socket, in the shared
# filesystem, both reach. Configuration, state, logs and sockets are in a
# private temporary directory, as in slurm_test.sh; the cluster's ports are
# the hosts' own, so no port is picked at run time.
#
# Submitted from h0 for 2 nodes and one task on each: the script starts a
# zeroshardd on each node, plaintext on the bridge (ZS_INSECURE=1), that
# accepts new jobs only with the registration token (the script gives each
# daemon --registration_token_file from ZS_REGISTRATION_TOKEN, which the
# trainers carry too, from the submitter's environment), and runs a 2-rank gpt_train job at stage 3
# against both. Checked: the job exits 0; its output has rank 0's last step,
# a line from each rank saying it trained to the end on its own host, each
# node's daemon log (listening on 0.0.0.0, serving plaintext, the job
# registered, stopped by SIGTERM), and `zsctl memory` of the job sampled
# while it trained and of the daemons after it, each naming both daemons;
# no process of the job is left on either host. Then the cluster and the
# hosts are torn down and no process, namespace or interface of them may be
# left.
#
# Needs root, network namespaces, and the packages slurmctld, slurmd,
# slurm-client and munge; without them it prints "SKIPPED: ..." and passes.
#
# Usage: slurm_two_node_test.sh SBATCH_SCRIPT ZEROSHARDD GPT_TRAIN ZSCTL
# (runfiles paths).
set -u
# zs_fail, zs_abspath.
source "$(dirname "$0")/lib.sh"
# zs_hosts_check, zs_hosts_setup, zs_hosts_resolve_names, zs_on_host,
# zs_host_pids, zs_hosts_teardown, ZS_HOST_ADDRS, ZS_HOST_NAMES,
# ZS_HOST_HOLDERS, ZS_HOSTS_TAG.
source "$(dirname "$0")/hosts.sh"

SCRIPT="$(zs_abspath "$1")"
ZEROSHARDD="$(zs_abspath "$2")"
GPT_TRAIN="$(zs_abspath "$3")"
ZSCTL="$(zs_abspath "$4")"

# The daemons are in /usr/sbin, which a test's PATH may lack.
PATH="$PATH:/usr/sbin:/sbin"
# A test run inside a Slurm job must not talk to that job's cluster.
for v in $(compgen -e | grep '^SLURM_'); do unset "$v"; done

log() { echo "[slurm_two_node_test] $*"; }
skip() {
  echo "SKIPPED: $*"
  exit 0
}

[[ "$(id -u)" == 0 ]] || skip "needs root (network namespaces; slurmd runs the job's steps as the submitting user)"
for tool in munged slurmctld slurmd sbatch srun scontrol squeue sinfo scancel; do
  command -v "$tool" >/dev/null ||
    skip "$tool is not installed (apt-get install slurmctld slurmd slurm-client munge)"
done
zs_hosts_check || skip "cannot make test hosts here: $ZS_HOSTS_ERROR"

# Slurm and munge put unix sockets under their directories (sun_path holds
# 107 bytes), so the cluster lives in a short directory of its own.
DIR="$(mktemp -d /tmp/zs-slurm2.XXXXXX)" || exit 1
chmod 755 "$DIR"
CONF="$DIR/slurm.conf"
WORK="$DIR"  # zs_fail prints the tail of $WORK/*.log
# In the hosts' own network namespaces: no other listener there.
CTLD_PORT=6817
SLURMD_PORT=6818
ZS_PORT=7070
NODES=(h0 h1)

# Every command that talks to this cluster runs on h0 (slurmctld's host:
# this namespace has no address on the bridge) with SLURM_CONF=$CONF, which
# every process of the cluster carries in its environment.
sl() { zs_on_host 0 env SLURM_CONF="$CONF" "$@"; }

# The processes of this cluster: those whose environment names $CONF.
cluster_pids() {
  grep -lzxF "SLURM_CONF=$CONF" /proc/[0-9]*/environ 2>/dev/null | sed 's|^/proc/\([0-9]*\)/environ$|\1|'
}

# stop_pidfile FILE: SIGTERM, up to 10 s, SIGKILL; FILE removed (a second
# teardown must not signal a process that took its pid since).
stop_pidfile() {
  local pid
  pid="$(cat "$1" 2>/dev/null)" || return 0
  rm -f "$1"
  [[ -n "$pid" ]] || return 0
  kill -TERM "$pid" 2>/dev/null || return 0
  for _ in $(seq 100); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.1
  done
  kill -KILL "$pid" 2>/dev/null
}

# teardown_cluster: jobs cancelled, slurmds, slurmctld and munged stopped
# through their pid files, every process left on the hosts killed and the
# hosts removed, then whatever still carries SLURM_CONF=$CONF killed. Safe
# to call more than once.
teardown_cluster() {
  if [[ -f "$DIR/slurmctld.pid" && -n "${ZS_HOST_HOLDERS[0]:-}" ]]; then
    sl scancel --quiet --user=root 2>/dev/null
    for _ in $(seq 50); do
      [[ -z "$(sl squeue -h 2>/dev/null)" ]] && break
      sleep 0.2
    done
  fi
  local node
  for node in "${NODES[@]}"; do stop_pidfile "$DIR/slurmd-$node.pid"; done
  stop_pidfile "$DIR/slurmctld.pid"
  zs_hosts_teardown
  stop_pidfile "$DIR/munged.pid"
  local left
  left="$(cluster_pids)"
  if [[ -n "$left" ]]; then
    log "killing what is left of the cluster: $(echo $left)"
    kill -KILL $left 2>/dev/null
  fi
}

on_exit() {
  local rc=$?
  trap - EXIT INT TERM
  teardown_cluster
  if [[ $rc -ne 0 && -n "${TEST_UNDECLARED_OUTPUTS_DIR:-}" ]]; then
    cp "$DIR"/*.log "$DIR"/*.out "$DIR/slurm.conf" "$TEST_UNDECLARED_OUTPUTS_DIR/" 2>/dev/null
  fi
  rm -rf "$DIR"
  exit "$rc"
}
trap on_exit EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

# --- The hosts --------------------------------------------------------------------
zs_hosts_setup 2 || zs_fail "could not set up the test hosts: $ZS_HOSTS_ERROR"
zs_hosts_resolve_names || zs_fail "could not name the hosts: $ZS_HOSTS_ERROR"
# slurmd's cgroup plugin, which task/none and proctrack/linuxproc otherwise
# leave unused, will not start without the cgroup filesystems.
zs_hosts_mount_cgroups || zs_fail "could not give the hosts /sys/fs/cgroup: $ZS_HOSTS_ERROR"
for i in 0 1; do
  [[ "${ZS_HOST_NAMES[$i]}" == "${NODES[$i]}" ]] || zs_fail "host $i is ${ZS_HOST_NAMES[$i]}, not ${NODES[$i]}"
done
log "hosts h0 at ${ZS_HOST_ADDRS[0]}, h1 at ${ZS_HOST_ADDRS[1]}"

# --- munge, on a private socket with a fresh key, outside the hosts ----------------
mkdir -m 755 "$DIR/munge"
head -c 1024 /dev/urandom >"$DIR/munge/munge.key"
chmod 400 "$DIR/munge/munge.key"
MUNGE_SOCKET="$DIR/munge/munge.socket"
SLURM_CONF="$CONF" munged --force --key-file="$DIR/munge/munge.key" --socket="$MUNGE_SOCKET" \
  --pid-file="$DIR/munged.pid" --log-file="$DIR/munged.log" --seed-file="$DIR/munge/munge.seed" ||
  zs_fail "munged did not start"

# --- slurm.conf ---------------------------------------------------------------------
CPUS="$(nproc)"
[[ "$CPUS" -ge 2 ]] || CPUS=2  # a daemon and a rank; SlurmdParameters=config_overrides accepts it
mkdir -p "$DIR/state" "$DIR/spool" "$DIR/job"
: >"$DIR/plugstack.conf"
cat >"$CONF" <<EOF
ClusterName=zstest2
SlurmctldHost=h0(${ZS_HOST_ADDRS[0]})
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd-%n.log
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
NodeName=h0 NodeAddr=${ZS_HOST_ADDRS[0]} NodeHostname=h0 CPUs=$CPUS State=UNKNOWN
NodeName=h1 NodeAddr=${ZS_HOST_ADDRS[1]} NodeHostname=h1 CPUs=$CPUS State=UNKNOWN
PartitionName=zstest Nodes=h0,h1 Default=YES MaxTime=INFINITE State=UP
EOF

# --- slurmctld on h0, a slurmd on each host -------------------------------------------
sl slurmctld -f "$CONF" -i || zs_fail "slurmctld did not start"
for i in 0 1; do
  mkdir -p "$DIR/spool/${NODES[$i]}"
  zs_on_host "$i" env SLURM_CONF="$CONF" slurmd -f "$CONF" -N "${NODES[$i]}" ||
    zs_fail "slurmd did not start on ${NODES[$i]}"
done
states=""
for _ in $(seq 150); do
  states="$(sl sinfo -h -N -o '%N %t' 2>/dev/null | sort | tr '\n' ' ')"
  [[ "$states" == "h0 idle h1 idle " ]] && break
  sleep 0.2
done
[[ "$states" == "h0 idle h1 idle " ]] || zs_fail "nodes not idle after 30 s (sinfo: '$states')"
log "cluster up: slurmctld on h0:$CTLD_PORT, slurmd on h0 and h1 (:$SLURMD_PORT), both idle ($CPUS CPUs each)"

# --- The job --------------------------------------------------------------------------

# The deployment's registration secret: the daemons demand it of a new job.
(umask 077 && "$ZSCTL" token >"$DIR/registration.token") || zs_fail "zsctl token failed"
REGISTRATION_TOKEN="$(<"$DIR/registration.token")"

# Each rank, after gpt_train exits 0, says so with its host's name. 300
# steps: several seconds, for the script's samples of `zsctl memory` (each
# takes a second or two on a loaded machine) to catch the job.
TRAINER=(bash -c '"$@" && echo "rank $RANK on $(hostname): gpt_train exited 0"' trainer
  "$GPT_TRAIN" --stage=3 --steps=300 --layers=2 --width=32 --heads=4 --seq_len=16 --batch=8
  --threads=1 --transport=stream --progress=lines --report=false)
OUT="$DIR/job.out"
t0=$SECONDS
job="$(cd "$DIR/job" &&
  sl env ZS_INSECURE=1 ZS_REGISTRATION_TOKEN="$REGISTRATION_TOKEN" \
    ZS_ZEROSHARDD="$ZEROSHARDD" ZS_ZSCTL="$ZSCTL" ZS_PORT="$ZS_PORT" \
    ZS_MEMORY_INTERVAL=0.5 ZS_STOP_TIMEOUT=20 ZS_RUN_DIR="$DIR/run" \
    ZS_DAEMON_ARGS="--memory_limit=1G" \
    sbatch --parsable --job-name=two-node --nodes=2 --ntasks-per-node=1 --time=5 \
    --output="$OUT" "$SCRIPT" "${TRAINER[@]}")" || zs_fail "sbatch did not take the job"
log "submitted job $job"
# Polled rather than `sbatch --wait`, which looks only every few seconds;
# slurmctld keeps the finished job's record for MinJobAge.
record=""
state=""
for _ in $(seq 720); do  # 3 min
  record="$(sl scontrol show job -o "$job" 2>/dev/null)"
  state="$(sed -n 's/.* JobState=\([A-Z_]*\) .*/\1/p' <<<"$record")"
  case "$state" in
    PENDING | CONFIGURING | RUNNING | COMPLETING | SUSPENDED | "") sleep 0.25 ;;
    *) break ;;
  esac
done
exit_code="$(sed -n 's/.* ExitCode=\([0-9:]*\).*/\1/p' <<<"$record")"
log "job $job $state, exit code $exit_code, $((SECONDS - t0)) s after submission"
echo "---- output of job $job ----"
cat "$OUT" 2>/dev/null
echo "---- end of the output of job $job ----"
[[ "$state" == COMPLETED && "$exit_code" == 0:0 ]] || zs_fail "job $job $state, exit code $exit_code"

JOB_ID="slurm-$job"
expect() {  # expect PATTERN WHAT: OUT has a line matching PATTERN
  grep -q "$1" "$OUT" || zs_fail "$2"
}
expect "^zeroshard.sbatch: [0-9:]* job $JOB_ID: 2 daemon(s) (plaintext on the network (ZS_INSECURE=1)), 2 trainer rank(s)$" \
  "no job line for 2 plaintext daemons and 2 ranks"
expect "^zeroshard.sbatch: [0-9:]* ZS_DAEMONS=h0:$ZS_PORT,h1:$ZS_PORT$" "the daemons are not h0 and h1 by name"
expect "^0: step 300/300 loss " "rank 0 did not report step 300/300"
for r in 0 1; do
  expect "^$r: rank $r on h$r: gpt_train exited 0$" "rank $r did not finish on h$r"
done
expect "^zeroshard.sbatch: [0-9:]* trainers exited with code 0$" "the trainers did not exit 0"
for n in 0 1; do
  expect "^$n: zeroshardd listening on 0.0.0.0:$ZS_PORT$" "daemon $n did not listen on 0.0.0.0:$ZS_PORT"
  expect "^$n: zeroshardd serving plaintext$" "daemon $n did not serve plaintext"
  expect "^$n: zeroshardd: job $JOB_ID registered: stage 3, N_d 2" "daemon $n did not log the job's registration"
  expect "^$n: zeroshardd: stopped$" "daemon $n did not stop on SIGTERM"
done
expect "^==== zsctl memory: job $JOB_ID while it trained" "no memory report of the job"
# The reports without their headers; the script's own lines, between the
# second report and the logs, left out.
REPORT="$(sed -n "/^==== zsctl memory: job $JOB_ID while it trained/,/^====/{/^====/!p}" "$OUT")"
AFTER="$(sed -n "/^==== zsctl memory: the daemons after the job ====/,/^====/{/^====/!p}" "$OUT" |
  grep -v '^zeroshard.sbatch: ')"
[[ -n "$AFTER" ]] || zs_fail "no memory report after the job"
for node in h0 h1; do
  grep -q "^daemon $node:$ZS_PORT  total " <<<"$REPORT" ||
    zs_fail "the report while it trained does not name daemon $node:$ZS_PORT"
  grep -q "^daemon $node:$ZS_PORT  total " <<<"$AFTER" ||
    zs_fail "the report after the job does not name daemon $node:$ZS_PORT"
done
[[ "$(grep -c "^  job $JOB_ID  stage 3 .* N_d 2  partitions owned 1$" <<<"$REPORT")" == 2 ]] ||
  zs_fail "the report does not show the job on both daemons at stage 3, one partition each"
for category in param_master param_half grad optim_m optim_v "model states"; do
  [[ "$(grep -c "^    $category " <<<"$REPORT")" == 2 ]] ||
    zs_fail "the report has no $category line for each daemon"
done
expect "^zeroshard.sbatch: [0-9:]* stopping the daemons (SIGTERM)$" "the daemons got no SIGTERM"
expect "^zeroshard.sbatch: [0-9:]* exit 0$" "the script did not end with exit 0"
[[ ! -e "$DIR/run" ]] || zs_fail "the script left its run directory"

echo "---- zsctl memory of job $JOB_ID while it trained, both nodes' daemons ----"
echo "$REPORT"
echo "---- zsctl memory of the daemons after the job ----"
echo "$AFTER"

left="$(sl squeue -h)"
[[ -z "$left" ]] || zs_fail "jobs left in the queue: $left"
pids_args() {  # pids_args PID...: " PID: COMMAND LINE" for each
  local p
  for p in "$@"; do printf ' %s: %s' "$p" "$(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null)"; done
}
# job_pids: the processes on the hosts but the namespaces' holders, the
# slurmds, slurmctld and its children (slurmscriptd): the job's
# (slurmstepd, daemons, trainers).
job_pids() {
  local i pid keep ctld
  ctld="$(cat "$DIR/slurmctld.pid" 2>/dev/null)"
  for i in 0 1; do
    keep=" ${ZS_HOST_HOLDERS[$i]} $(cat "$DIR/slurmd-${NODES[$i]}.pid" 2>/dev/null) $ctld "
    for pid in $(zs_host_pids "$i"); do
      [[ "$keep" == *" $pid "* ]] && continue
      # The 4th field of /proc/PID/stat is the parent's pid (the 2nd, the
      # command name in parentheses, has no space here).
      [[ "$(cut -d ' ' -f 4 "/proc/$pid/stat" 2>/dev/null)" == "$ctld" ]] && continue
      echo "$pid"
    done
  done
}
for _ in $(seq 150); do  # 30 s: slurmstepd lingers on a loaded machine
  left="$(job_pids)"
  [[ -z "$left" ]] && break
  sleep 0.2
done
[[ -z "$left" ]] || zs_fail "processes of the job left running:$(pids_args $left)"

# --- Teardown --------------------------------------------------------------------------
tag="$ZS_HOSTS_TAG"
teardown_cluster
left="$(cluster_pids)"
[[ -z "$left" ]] || zs_fail "processes of the cluster left after teardown:$(pids_args $left)"
left="$(ip netns list | grep -F "$tag-")"
[[ -z "$left" ]] || zs_fail "namespaces left after teardown: $left"
left="$(ip -o link show | grep -F "$tag")"
[[ -z "$left" ]] || zs_fail "interfaces left after teardown: $left"
log "torn down: no process, namespace or interface of the cluster left"
log "PASSED"
