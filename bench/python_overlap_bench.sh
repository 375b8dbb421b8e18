#!/bin/bash
# Gradient pushes from backward hooks against pushing everything after
# backward, in one run: examples/python/train_gpt.py at stage 3 under zsrun
# (2 daemons, 2 ranks) with --overlap=compare, which alternates the two ways
# step by step on the same model and prints, last, the push wait after
# backward each way and the ratio.
#
#   bazel run -c opt --config=clang //bench:python_overlap_bench -- [train_gpt.py flags]
#
# Defaults: 8 blocks of width 256 (Ψ ≈ 6.4M), 40 steps; later flags win.
set -u
if [[ -z "${RUNFILES_DIR:-}" ]]; then
  export RUNFILES_DIR="$0.runfiles"
fi
exec "$RUNFILES_DIR/zeroshard/examples/python/train_gpt" --daemons=2 --nproc=2 \
  --layers=8 --width=256 --heads=4 --seq_len=64 --batch=8 --steps=40 \
  --log_every=10 --overlap=compare "$@"
