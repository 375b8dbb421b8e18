#!/bin/bash
# Every data path between trainers and daemons on different hosts ends a
# run with the parameters, bit for bit, of the same job on one host.
#
# Two hosts on this machine (tests/hosts.sh: a network namespace each on a
# bridge, 10.77.0.1 and 10.77.0.2, with a hostname and a /dev/shm of its
# own). For each data path, one zeroshardd per host listens on the host's
# address, and one gpt_train rank per host (rank r on host r, N_d = 2)
# trains a small GPT for $STEPS steps against both daemons over the bridge;
# then the same job runs on one host (host 0: both daemons, on loopback, and
# both ranks under zsrun --nproc=2). Paths:
#   stream  the Shard streaming RPCs (zeroshardd --bulk_transport=,
#           gpt_train --transport=stream), plaintext: zeroshardd --insecure
#           and ZS_INSECURE=1 for the trainers; stages 1, 2 and 3.
#   grpc    the gRPC bulk transport (--bulk_transport=grpc, served on and
#           advertising the host's address) with mutual TLS: a throwaway
#           PKI made here, each daemon's certificate naming its host's
#           address (and 127.0.0.1 for the one-host run) and the daemon
#           role, the trainers' the trainer role; stages 1, 2 and 3.
#   ucx     UCX over tcp (zeroshardd --bulk_transport=ucx --ucx_tls=tcp
#           --ucx_trust_peers, gpt_train --transport=ucx --ucx_tls=tcp),
#           plaintext as stream; stages 1, 2 and 3. Where a daemon cannot
#           start UCX, this path says SKIPPED and why.
# Checked: every run exits 0 and rank 0's --dump_params of each two-host
# run equals the one-host run's (cmp).
# Printed for each two-host run, per host: the bytes its link carried
# (received and sent, from its veth pair's counters) beside the paper's
# traffic of one rank, 2Ψ per step at stages 1 and 2 (reduce-scatter and
# all-gather) and 3Ψ at stage 3, in fp32 bytes. With a daemon on each host,
# a host's link carries the half of each rank's traffic that goes to the
# other host's daemon, so the link's bytes (received + sent) compare with
# one rank's traffic; the link's count also
# holds the job's control RPCs, the initial and final parameter transfers
# and TCP/IP headers. Nothing is asserted about the ratio.
#
# Needs root (network, UTS and mount namespaces); where they are refused
# the test says so and passes without running.
#
# Usage: multi_host_test.sh ZSRUN ZEROSHARDD GPT_TRAIN (runfiles paths).
set -u
# zs_fail, zs_abspath.
source "$(dirname "$0")/lib.sh"
# zs_hosts_check, zs_hosts_setup, zs_on_host, zs_host_kill,
# zs_host_link_bytes, zs_hosts_teardown, ZS_HOST_ADDRS.
source "$(dirname "$0")/hosts.sh"

ZSRUN="$(zs_abspath "$1")"
ZEROSHARDD="$(zs_abspath "$2")"
GPT_TRAIN="$(zs_abspath "$3")"

WORK="$(mktemp -d "${TEST_TMPDIR:-/tmp}/multi_host.XXXXXX")"
export ZS_JOB_TOKEN="multi-host-test-job-token-0123"
STEPS=10
STAGES=(1 2 3)
# link_cut_test's model; fp32, so the paper's figures are 4 bytes a value.
TRAINER_FLAGS=(--steps="$STEPS" --layers=4 --width=32 --heads=4 --seq_len=16 --batch=8
  --threads=1 --bucket_bytes=4096 --report=false --progress=lines --rpc_timeout_s=20
  --step_timeout_s=60)
BYTES_PER_VALUE=4
# One trainer run, at most (a hung rank fails the test rather than bazel's
# timeout).
RUN_TIMEOUT_S=120
DAEMON_ADDRS=()

log() { echo "[multi_host_test] $*"; }

cleanup() { zs_hosts_teardown; }
trap cleanup EXIT
trap 'exit 143' TERM INT

fail() { zs_fail "$@"; }

if ! zs_hosts_check; then
  log "SKIPPED: cannot make test hosts here: $ZS_HOSTS_ERROR"
  exit 0
fi
zs_hosts_setup 2 || fail "could not set up the test hosts: $ZS_HOSTS_ERROR"
log "hosts h0 at ${ZS_HOST_ADDRS[0]}, h1 at ${ZS_HOST_ADDRS[1]}"

# make_pki DIR: a CA, daemon<h>.{crt,key} for each host h (its address and
# 127.0.0.1, the daemon role) and trainer<h>.{crt,key} (the trainer role),
# in the style of common/testing/make_test_certs.sh.
make_pki() (
  set -e
  cd "$1"
  subj() { echo "/CN=$1/O=zeroshard-test"; }
  key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1.key"; }
  key ca
  openssl req -x509 -new -key ca.key -subj "$(subj ca)" -days 1 -out ca.crt \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
  # leaf NAME SAN
  leaf() {
    key "$1"
    openssl req -new -key "$1.key" -subj "$(subj "$1")" -out "$1.csr"
    printf 'subjectAltName=%s\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth,clientAuth\n' \
      "$2" >"$1.ext"
    openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 1 \
      -extfile "$1.ext" -out "$1.crt"
  }
  local h
  for h in 0 1; do
    leaf "daemon$h" "IP:${ZS_HOST_ADDRS[$h]},IP:127.0.0.1,URI:urn:zeroshard:role:daemon"
    leaf "trainer$h" "DNS:trainer$h,URI:urn:zeroshard:role:trainer"
  done
)

# start_daemon I HOST ADDRESS FLAGS...: zeroshardd on host HOST listening on
# ADDRESS:0; sets DAEMON_ADDRS[I] once it printed its address (at most
# 30 s). Output in $WORK/$DATA_PATH.daemon-I.log.
start_daemon() {
  local i="$1" h="$2" addr="$3" out="$WORK/$DATA_PATH.daemon-$1.log"
  shift 3
  zs_on_host "$h" "$ZEROSHARDD" --listen="$addr:0" "$@" >"$out" 2>&1 &
  local pid=$! deadline=$((SECONDS + 30)) got=""
  while ((SECONDS < deadline)); do
    got="$(sed -n 's/^zeroshardd listening on //p' "$out" 2>/dev/null | head -n 1)"
    if [[ -n "$got" ]]; then
      DAEMON_ADDRS[$i]="$got"
      return 0
    fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  echo "zeroshardd $i on h$h ($addr) did not start:"
  cat "$out"
  return 1
}

# train_two_hosts TAG DAEMONS STAGE FLAGS...: a 2-rank job, rank r started
# on host r, against DAEMONS (comma-separated); rank 0 dumps the parameters
# to $WORK/TAG.f32. Rank r's environment has ${RANK_ENV[r]} (words) added.
# 0 iff both ranks exited 0 within RUN_TIMEOUT_S.
RANK_ENV=("" "")
train_two_hosts() {
  local tag="$1" daemons="$2" stage="$3"
  shift 3
  local r pids=() rc=0 dump
  for r in 0 1; do
    dump=()
    ((r == 0)) && dump=(--dump_params="$WORK/$tag.f32")
    # shellcheck disable=SC2086  # RANK_ENV: words
    zs_on_host "$r" env ${RANK_ENV[$r]} timeout -k 5 "$RUN_TIMEOUT_S" \
      "$GPT_TRAIN" "${TRAINER_FLAGS[@]}" --stage="$stage" --rank="$r" --world_size=2 \
      --job_id="$tag" --daemons="$daemons" "${dump[@]}" "$@" >"$WORK/$tag.rank$r.log" 2>&1 &
    pids[$r]=$!
  done
  for r in 0 1; do wait "${pids[$r]}" || rc=1; done
  return $rc
}

# train_one_host TAG DAEMONS STAGE FLAGS...: the same job on host 0 under
# zsrun --nproc=2, with ${RANK_ENV[0]}.
train_one_host() {
  local tag="$1" daemons="$2" stage="$3"
  shift 3
  # shellcheck disable=SC2086  # RANK_ENV: words
  zs_on_host 0 env ${RANK_ENV[0]} timeout -k 5 "$RUN_TIMEOUT_S" \
    "$ZSRUN" --daemon_addresses="$daemons" --nproc=2 --job_id="$tag" --grace_s=2 -- \
    "$GPT_TRAIN" "${TRAINER_FLAGS[@]}" --stage="$stage" --dump_params="$WORK/$tag.f32" "$@" \
    >"$WORK/$tag.log" 2>&1
}

# psi DAEMON_LOG JOB: Ψ of JOB as the daemon logged its registration
# ("job J registered by IDENTITY: stage S, N_d 2, Ψ 67777, ..."; gpt_train
# prints it to three figures only).
psi() { sed -n "s/^zeroshardd: job $2 registered by .*, Ψ \([0-9]*\),.*/\1/p" "$1" | head -n 1; }

# run_path PATH DAEMON_FLAGS_2HOST DAEMON_FLAGS_1HOST -- TRAINER_FLAGS...:
# daemons 0 and 1 on hosts 0 and 1 and daemons 2 and 3 on host 0's
# loopback, then for each stage the two-host and the one-host job, their
# comparison and the link bytes; then every process on the hosts is
# killed. The daemon flags are words; in them "@ADDR@" stands for the
# daemon's listen address and "@H@" for its host's number.
run_path() {
  local path="$1" two="$2" one="$3" t0=$SECONDS
  # start_daemon's log names.
  DATA_PATH="$path"
  shift 4
  local h d flags out addr
  for h in 0 1; do
    flags="${two//@ADDR@/${ZS_HOST_ADDRS[$h]}}"
    flags="${flags//@H@/$h}"
    # shellcheck disable=SC2086  # flags: words
    start_daemon "$h" "$h" "${ZS_HOST_ADDRS[$h]}" $flags || return 1
  done
  for d in 2 3; do
    flags="${one//@ADDR@/127.0.0.1}"
    flags="${flags//@H@/0}"
    # shellcheck disable=SC2086  # flags: words
    start_daemon "$d" 0 127.0.0.1 $flags || return 1
  done
  for d in 0 1 2 3; do
    out="$WORK/$path.daemon-$d.log"
    addr="127.0.0.1"
    ((d < 2)) && addr="${ZS_HOST_ADDRS[$d]}"
    if [[ "$path" == ucx ]] && grep -q "serving the streaming data path only" "$out"; then
      log "path=ucx SKIPPED: daemon $d (on $addr) could not start UCX over tcp:"
      grep -h "serving the streaming data path only" "$out" | head -n 1
      kill_hosts
      return 0
    fi
    if [[ "$path" == grpc ]]; then
      grep -q '^zeroshardd serving mutual TLS$' "$out" || fail "path=grpc: daemon $d serves no TLS"
      grep -q "^zeroshardd: grpc bulk transport on .*, advertised as $addr:" "$out" ||
        fail "path=grpc: daemon $d does not advertise its grpc bulk transport at $addr"
    fi
  done

  local stage tag rx0 tx0 rx1 tx1 before=() after=() psi_n paper rx tx ratio
  for stage in "${STAGES[@]}"; do
    tag="$path-s$stage"
    read -r rx0 tx0 < <(zs_host_link_bytes 0)
    read -r rx1 tx1 < <(zs_host_link_bytes 1)
    before=("$rx0" "$tx0" "$rx1" "$tx1")
    train_two_hosts "$tag-2hosts" "${DAEMON_ADDRS[0]},${DAEMON_ADDRS[1]}" "$stage" "$@" ||
      fail "path=$path stage=$stage: the two-host run failed"
    read -r rx0 tx0 < <(zs_host_link_bytes 0)
    read -r rx1 tx1 < <(zs_host_link_bytes 1)
    after=("$rx0" "$tx0" "$rx1" "$tx1")
    train_one_host "$tag-1host" "${DAEMON_ADDRS[2]},${DAEMON_ADDRS[3]}" "$stage" "$@" ||
      fail "path=$path stage=$stage: the one-host run failed"
    cmp "$WORK/$tag-1host.f32" "$WORK/$tag-2hosts.f32" ||
      fail "path=$path stage=$stage: the two-host run ended with other parameters than" \
        "the one-host run"
    psi_n="$(psi "$WORK/$path.daemon-0.log" "$tag-2hosts")"
    [[ -n "$psi_n" ]] || fail "path=$path stage=$stage: daemon 0 logged no Ψ for the job"
    paper=$(((stage == 3 ? 3 : 2) * psi_n * BYTES_PER_VALUE * STEPS))
    for h in 0 1; do
      rx=$((after[2 * h] - before[2 * h]))
      tx=$((after[2 * h + 1] - before[2 * h + 1]))
      ratio="$(awk -v a=$((rx + tx)) -v b="$paper" 'BEGIN {printf "%.3f", a / b}')"
      echo "host=h$h path=$path stage=$stage link_bytes=$((rx + tx)) rx=$rx tx=$tx" \
        "paper_bytes=$paper ratio=$ratio"
    done
    log "path=$path stage=$stage: parameters identical on two hosts and on one" \
      "(Ψ = $psi_n, $STEPS steps)"
  done
  kill_hosts
  log "path=$path done in $((SECONDS - t0)) s"
}

# kill_hosts: every process on both hosts (the daemons), gone.
kill_hosts() {
  local h
  for h in 0 1; do zs_host_kill "$h" || fail "processes are left on host h$h"; done
}

start=$SECONDS

# ---- stream: plaintext on the test subnet ----
# --insecure / ZS_INSECURE=1: plaintext to the hosts' addresses, which only
# this test's processes reach.
RANK_ENV=("ZS_INSECURE=1" "ZS_INSECURE=1")
run_path stream "--insecure --bulk_transport=" "--bulk_transport=" -- --transport=stream ||
  fail "path=stream: a daemon did not start"

# ---- grpc bulk transport, mutual TLS ----
mkdir -p "$WORK/pki"
make_pki "$WORK/pki" >"$WORK/pki.log" 2>&1 || fail "could not make the test PKI"
P="$WORK/pki"
RANK_ENV=("ZS_TLS_CERT=$P/trainer0.crt ZS_TLS_KEY=$P/trainer0.key ZS_TLS_CA=$P/ca.crt"
  "ZS_TLS_CERT=$P/trainer1.crt ZS_TLS_KEY=$P/trainer1.key ZS_TLS_CA=$P/ca.crt")
TLS_FLAGS="--tls_cert=$P/daemon@H@.crt --tls_key=$P/daemon@H@.key --tls_ca=$P/ca.crt"
run_path grpc \
  "$TLS_FLAGS --bulk_transport=grpc --bulk_listen_address=@ADDR@:0 --advertise_address=@ADDR@" \
  "$TLS_FLAGS --bulk_transport=grpc" -- --transport=grpc ||
  fail "path=grpc: a daemon did not start"

# ---- UCX over tcp, plaintext ----
RANK_ENV=("ZS_INSECURE=1" "ZS_INSECURE=1")
UCX_FLAGS="--bulk_transport=ucx --ucx_tls=tcp --ucx_trust_peers"
run_path ucx "--insecure $UCX_FLAGS" "$UCX_FLAGS" -- --transport=ucx --ucx_tls=tcp ||
  fail "path=ucx: a daemon did not start"

log "PASSED in $((SECONDS - start)) s"
