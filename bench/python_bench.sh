#!/bin/bash
# Runs the Python benchmark its target is named for (bench/NAME.py for the
# sh_binary NAME: python_push_bench with 1 daemon, python_train_bench with
# 2) under zsrun with 2 ranks, the binaries and the zeroshard package from
# the target's runfiles; its flags go to the script:
#
#   bazel run -c opt --config=clang //bench:python_train_bench -- --steps=20
#
# $PYTHON overrides the interpreter (default /usr/bin/python3, which needs
# torch and numpy).
set -u
if [[ -n "${RUNFILES_DIR:-}" ]]; then
  RUNFILES="$RUNFILES_DIR/zeroshard"
else
  RUNFILES="$0.runfiles/zeroshard"
fi
name="$(basename "$0")"
case "$name" in
  python_push_bench) daemons=1 ;;
  python_train_bench) daemons=2 ;;
  *) echo "python_bench.sh: run it as //bench:python_push_bench or //bench:python_train_bench" >&2
     exit 2 ;;
esac
export PYTHONPATH="$RUNFILES/python${PYTHONPATH:+:$PYTHONPATH}"
exec "$RUNFILES/tools/zsrun" --zeroshardd="$RUNFILES/server/zeroshardd" --daemons="$daemons" \
  --nproc=2 -- "${PYTHON:-/usr/bin/python3}" -u "$RUNFILES/bench/$name.py" "$@"
