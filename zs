#!/usr/bin/env bash
# zeroshard's two entry points for a Debian 12 machine (run as root or with sudo):
#   ./zs demo   the main job: trains a GPT at ZeRO stage 3 on 2 daemons + 2 ranks
#   ./zs test   every test
# Each first installs the Debian packages it needs (only those missing) and is
# safe to run again.
set -euo pipefail
cd "$(dirname "$0")"

PACKAGES=(
  g++ bazel-bootstrap
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev libabsl-dev
  libucx-dev ucx-utils libcivetweb-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libtorch-dev python3-torch python3-numpy pybind11-dev python3-pytest
  prometheus curl
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

cmd_test() {
  ensure_packages
  log "bazel test //...  (GPU-tagged tests are skipped on machines without a GPU)"
  bazel test //... "$@"
}

cmd_demo() {
  ensure_packages
  log "building zeroshardd, zsrun, zsctl and the GPT trainer (the first build takes a while)"
  bazel build //server:zeroshardd //tools:zsrun //tools:zsctl //examples:gpt_train
  log "the ZeRO paper's per-rank memory for a 7.5B-parameter model over 64 ranks"
  bazel-bin/tools/zsctl estimate --params 7.5e9 --dp 64 --device_memory 32GB
  log "training a GPT at ZeRO stage 3: 2 shard daemons, 2 trainer ranks on loopback"
  bazel-bin/tools/zsrun --daemons=2 --nproc=2 --metrics -- \
    bazel-bin/examples/gpt_train --stage=3 --steps="${ZS_DEMO_STEPS:-200}" "$@"
}

case "${1:-}" in
  test) shift; cmd_test "$@" ;;
  demo) shift; cmd_demo "$@" ;;
  *) echo "usage: ./zs demo | ./zs test [bazel test flags]" >&2; exit 2 ;;
esac
