#!/usr/bin/env bash
# zeroshard's two entry points for a Debian 12 machine (run as root or with sudo):
#   ./zs demo   the main job: trains a GPT at ZeRO stage 3 on 2 daemons + 2 ranks
#   ./zs test   every test with clang's lock-annotation checks, the concurrency
#               tests under ASan+UBSan, the `stress`-tagged tests repeated,
#               then every fuzz target for a short run
# Each first installs the Debian packages it needs (only those missing) and is
# safe to run again.
set -euo pipefail
cd "$(dirname "$0")"

PACKAGES=(
  g++ bazel-bootstrap clang-14 libclang-rt-14-dev lld-14
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev libabsl-dev
  libucx-dev ucx-utils libcivetweb-dev prometheus-cpp-dev nlohmann-json3-dev
  liburing-dev libssl-dev openssl
  libgtest-dev libgmock-dev libbenchmark-dev
  libtorch-dev python3-torch python3-numpy pybind11-dev python3-pytest
  python3-pip python3-venv python3-yaml
  slurmctld slurmd slurm-client munge
  prometheus curl iproute2 nftables chromium libgloo-dev
)

log() { printf '\033[1m[zs]\033[0m %s\n' "$*" >&2; }

ensure_packages() {
  local missing=()
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  if [ ${#missing[@]} -eq 0 ]; then return; fi
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  log "installing ${#missing[@]} Debian package(s): ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# Runs one `bazel test` phase, teeing its output, and adds the per-target
# results bazel printed to PASSED/FAILED. A test target counts as passed only
# when bazel reports it PASSED (with --runs_per_test: every run passed);
# FAILED, FLAKY, TIMEOUT, NO STATUS, FAILED TO BUILD, INCOMPLETE count as
# failed. A bazel failure that names no test (loading, analysis, a build error
# outside any test) counts as one failure. Exit 4 ("no test targets") is an
# error unless the phase is told it is fine.
PASSED=0
FAILED=0
FAILED_NAMES=()
FAILED_LOGS=()
run_phase() {
  local name="$1" no_tests_ok="$2"
  shift 2
  local out
  out="$(mktemp "${TMPDIR:-/tmp}/zs-test-${name}.XXXXXX")"
  log "[${name}] $*"
  local rc=0
  { "$@" 2>&1 | tee "$out"; rc=${PIPESTATUS[0]}; } || true
  local p f
  local -a failed_lines
  # Bazel's summary: "//pkg:target   [(cached) ]STATUS[ in ...]", one per target.
  p=$(sed 's/\x1b\[[0-9;]*[A-Za-z]//g' "$out" |
      grep -cE '^//[^ ]+ +(\(cached\) )?PASSED( |$)' || true)
  mapfile -t failed_lines < <(sed 's/\x1b\[[0-9;]*[A-Za-z]//g' "$out" |
      grep -E '^//[^ ]+ +(\(cached\) )?(FAILED|FLAKY|TIMEOUT|NO STATUS|INCOMPLETE|REMOTE FAILURE)' || true)
  f=${#failed_lines[@]}
  for l in "${failed_lines[@]}"; do FAILED_NAMES+=("[${name}] ${l%% *}"); done
  # "FAIL: //pkg:target (see .../test.log)", or "TIMEOUT: //pkg:target
  # (Summary)" followed by indented log paths: "target log" per failed run.
  mapfile -t -O "${#FAILED_LOGS[@]}" FAILED_LOGS < <(sed 's/\x1b\[[0-9;]*[A-Za-z]//g' "$out" |
      awk '/^(FAIL|TIMEOUT): \/\// {
             t = $2
             if (match($0, /\(see [^)]*\)$/)) { print t, substr($0, RSTART + 5, RLENGTH - 6); t = "" }
             next
           }
           t != "" && /^ +\/.*\.log$/ { sub(/^ +/, ""); print t, $0; next }
           { t = "" }' || true)
  if [ "$rc" -eq 4 ] && [ "$no_tests_ok" = yes ]; then
    log "[${name}] no test targets matched: nothing to run"
  elif [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
    log "[${name}] bazel exited $rc without naming a failed test; counted as 1 failure"
    f=1
    FAILED_NAMES+=("[${name}] bazel exit $rc")
  fi
  log "[${name}] ${p} passed, ${f} failed (bazel exit ${rc})"
  PASSED=$((PASSED + p))
  FAILED=$((FAILED + f))
  rm -f "$out"
}

cmd_test() {
  ensure_packages
  local runs="${ZS_STRESS_RUNS:-20}"
  # (a) Every test, built with clang-14 and -Werror=thread-safety: a member
  #     read or written without the mutex its ABSL_GUARDED_BY names fails the
  #     build. GPU-tagged tests are skipped on machines without a GPU.
  run_phase clang no bazel test --config=clang -k //... "$@"
  # (b) The concurrency-relevant tests under ASan+UBSan (own output directory).
  #     Tests tagged no_asan say in their BUILD file why they cannot run there.
  run_phase asan no bazel test --config=asan -k --build_tests_only \
    --test_tag_filters=-gpu,-manual,-no_asan \
    //server:all //server/disk:all //server/step:shard_state_disk_test //client:all \
    //transport/... //tests:all "$@"
  # (c) Tests tagged `stress`, each run ${runs} times under ASan+UBSan
  #     (ZS_STRESS_RUNS overrides). None tagged yet is not a failure.
  run_phase stress yes bazel test --config=asan -k --build_tests_only \
    --test_tag_filters=stress,-gpu,-manual,-no_asan --runs_per_test="${runs}" \
    //... "$@"
  # (d) Every libFuzzer target (cc_binary named *_fuzzer) for
  #     ${ZS_FUZZ_SECONDS:-20} s over its seed corpus, built with ASan+UBSan
  #     (tools/fuzz.sh): a crash, a leak or a UBSan report fails it.
  local target
  for target in $(bazel query 'filter("_fuzzer$", kind(cc_binary, //...))' 2>/dev/null); do
    log "[fuzz] ${target}"
    if tools/fuzz.sh "${target}" "${ZS_FUZZ_SECONDS:-20}"; then
      PASSED=$((PASSED + 1))
    else
      FAILED=$((FAILED + 1))
      FAILED_NAMES+=("[fuzz] ${target}")
    fi
  done
  # What each failed run said, at the end of the output where a log's tail
  # shows it: gtest's failures, sanitizer reports and a script's FAILED line.
  # At most two runs of a target (the stress phase repeats them).
  local entry
  local -A shown=()
  for entry in "${FAILED_LOGS[@]}"; do
    [ -f "${entry#* }" ] || continue
    [ "${shown[${entry%% *}]:-0}" -lt 2 ] || continue
    shown[${entry%% *}]=$((${shown[${entry%% *}]:-0} + 1))
    echo "---- why ${entry%% *} failed (${entry#* }) ----"
    { grep -E -A3 'Failure$|^FAILED: |ERROR: AddressSanitizer|runtime error:|LeakSanitizer|^\[  FAILED  \]' \
      "${entry#* }" || tail -n 15 "${entry#* }"; } | head -n 25 || true
  done
  if [ ${#FAILED_NAMES[@]} -gt 0 ]; then
    log "failed:"
    printf '  %s\n' "${FAILED_NAMES[@]}" >&2
  fi
  echo "tests: ${PASSED} passed, ${FAILED} failed"
  [ "$FAILED" -eq 0 ]
}

cmd_demo() {
  ensure_packages
  log "building zeroshardd, zsrun, zsctl and the GPT trainer (the first build takes a while)"
  # --config=clang: the toolchain `./zs test` uses, so neither rebuilds the other.
  bazel build --config=clang //server:zeroshardd //tools:zsrun //tools:zsctl //examples:gpt_train
  log "the ZeRO paper's per-rank memory for a 7.5B-parameter model over 64 ranks"
  bazel-bin/tools/zsctl estimate --params 7.5e9 --dp 64 --device_memory 32GB
  # C_B of 256 KiB: the trainer's constant staging pool (4 buckets) stays
  # below the 16Ψ of a data-parallel rank at this model's size (Ψ = 235K).
  # Activation checkpoints live on the daemons (--activations=daemon): each
  # daemon gets an arena, and spill files under a directory of this run for
  # what does not fit it. After training, the ranks run a short second job
  # alternating daemon and local checkpoints to compare step times.
  local spill_dir
  spill_dir="$(mktemp -d "${TMPDIR:-/var/tmp}/zs-demo-spill.XXXXXX")"
  # Expanded now: the trap runs after this function has returned.
  trap "rm -rf -- '${spill_dir}'" EXIT
  log "training a GPT at ZeRO stage 3: 2 shard daemons, 2 trainer ranks on loopback, activation checkpoints on the daemons"
  bazel-bin/tools/zsrun --daemons=2 --nproc=2 --metrics \
    --daemon_args="--activation_arena_bytes=${ZS_DEMO_ARENA_BYTES:-67108864} --spill_dir=${spill_dir}" -- \
    bazel-bin/examples/gpt_train --stage=3 --steps="${ZS_DEMO_STEPS:-200}" \
    --bucket_bytes="${ZS_DEMO_BUCKET_BYTES:-262144}" --activations=daemon --activation_timing_steps="${ZS_DEMO_TIMING_STEPS:-40}" "$@"
}

case "${1:-}" in
  test) shift; cmd_test "$@" ;;
  demo) shift; cmd_demo "$@" ;;
  *) echo "usage: ./zs demo | ./zs test [bazel test flags]" >&2; exit 2 ;;
esac
