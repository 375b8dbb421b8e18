#!/usr/bin/env bash
# The checks that need the GPU machine, as one script: builds the CUDA
# targets, runs the GPU-tagged tests, the optimizer tests (the AVX-512 path
# runs only on CPUs that have it) and the benchmarks, and writes every log
# under $OUT (or ./gpu-check-logs). Run it from the repository root.
set -uo pipefail
out="${OUT:-gpu-check-logs}"
mkdir -p "$out"
./zs test --nobuild >/dev/null 2>&1 || true   # installs the Debian packages if missing
status=0
run() {
  local name=$1; shift
  echo "== $name: $*"
  if ! "$@" >"$out/$name.log" 2>&1; then status=1; echo "   FAILED (see $name.log)"; fi
  tail -n 3 "$out/$name.log"
}
nvidia-smi >"$out/nvidia-smi.log" 2>&1 || true
run build bazel build //cuda/... //bench/...
run gpu_tests bazel test --test_tag_filters=gpu --test_output=all //...
run nccl_collective bazel test --test_output=all //client:nccl_collective_test
run optimizer_tests bazel test --test_output=all //server/optimizer/...
run optimizer_bench bazel run -c opt //bench:optimizer_bench -- --params=50000000 --threads=4
run device_bench bazel run -c opt //bench:device_bench -- --bytes=268435456
run device_bench_fp32 bazel run -c opt //bench:device_bench -- --bytes=268435456 --precision=fp32
if bazel query //bench:transport_bench >/dev/null 2>&1; then
  run transport_bench bazel run -c opt //bench:transport_bench -- --bytes=268435456
fi
bazel shutdown >/dev/null 2>&1 || true
exit $status
