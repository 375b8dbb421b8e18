#!/bin/bash
# Python stage 1-2 steps with the gradients in push memory against Put, in
# one run: bench/python_push_bench.py under zsrun (1 daemon, 2 ranks).
#
#   bazel run -c opt --config=clang //bench:python_push_bench -- [flags]
#
# Flags go to python_push_bench.py (--layers, --width, --steps, ...).
set -u
if [[ -n "${RUNFILES_DIR:-}" ]]; then
  RUNFILES="$RUNFILES_DIR/zeroshard"
else
  RUNFILES="$0.runfiles/zeroshard"
fi
export PYTHONPATH="$RUNFILES/python${PYTHONPATH:+:$PYTHONPATH}"
exec "$RUNFILES/tools/zsrun" --zeroshardd="$RUNFILES/server/zeroshardd" --daemons=1 --nproc=2 -- \
  "${PYTHON:-/usr/bin/python3}" -u "$RUNFILES/bench/python_push_bench.py" "$@"
