#!/bin/bash
# Builds a libFuzzer target with --config=fuzz (ASan + UBSan) and runs it over
# its seed corpus for SECONDS; exits non-zero on a crash, a leak or a UBSan
# report (the reproducer is left in the working corpus directory, printed).
#
#   tools/fuzz.sh //common:job_spec_fuzzer 20          # what ./zs test runs
#   tools/fuzz.sh //common:job_spec_fuzzer 3600        # a longer run
#
# The seed corpus is <package>/fuzz_corpus/<name without _fuzzer>; new inputs
# the run finds go to a scratch copy, not into the checked-in seeds.
set -euo pipefail

if [[ $# -ne 2 ]]; then
  echo "usage: tools/fuzz.sh //PACKAGE:NAME_fuzzer SECONDS" >&2
  exit 2
fi
target="$1"
seconds="$2"
package="${target#//}"
package="${package%%:*}"
name="${target##*:}"
seeds="${package}/fuzz_corpus/${name%_fuzzer}"
cd "$(dirname "$0")/.."
if [[ ! -d "${seeds}" ]]; then
  echo "tools/fuzz.sh: no seed corpus ${seeds}" >&2
  exit 2
fi

bazel build --config=fuzz "${target}" >&2
binary="$(bazel info --config=fuzz bazel-bin 2>/dev/null)/${package}/${name}"

work="$(mktemp -d "${TMPDIR:-/tmp}/zs-fuzz-${name}.XXXXXX")"
cp -r "${seeds}/." "${work}/"
echo "tools/fuzz.sh: ${name} for ${seconds}s over ${seeds} (working corpus ${work})" >&2
cd "${work}"
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
# The fuzzer's own exit status decides (not grep's, which finds nothing to
# show in a quiet run).
set +e +o pipefail
"${binary}" -max_total_time="${seconds}" -print_final_stats=1 -max_len=65536 \
  -timeout=10 -rss_limit_mb=2048 "${work}" 2>&1 | tee "${work}/fuzz.log" |
  grep -E "^#[0-9]+.*(DONE|pulse)|stat::|ERROR|SUMMARY|runtime error|Test unit written"
status=${PIPESTATUS[0]}
set -e -o pipefail
if [[ ${status} -ne 0 ]]; then
  echo "tools/fuzz.sh: ${name} FAILED (exit ${status}); log and reproducer in ${work}" >&2
  exit 1
fi
cd /
rm -rf "${work}"
echo "tools/fuzz.sh: ${name} passed" >&2
