#!/bin/bash
# Runs examples/python/train_gpt.py under zsrun with the binaries and the
# zeroshard package from this target's runfiles:
#
#   bazel run --config=clang //examples/python:train_gpt -- \
#       [--daemons=D] [--nproc=N] [train_gpt.py flags]
#
# --daemons (default 2) and --nproc (default 2), when they come first, go to
# zsrun; everything else to train_gpt.py. $PYTHON overrides the interpreter
# (default /usr/bin/python3, which needs torch and numpy).
set -u

if [[ -n "${RUNFILES_DIR:-}" ]]; then
  RUNFILES="$RUNFILES_DIR/zeroshard"
elif [[ -d "$0.runfiles" ]]; then
  RUNFILES="$0.runfiles/zeroshard"
else
  RUNFILES="${TEST_SRCDIR:?runfiles not found}/zeroshard"
fi

zsrun_args=(--daemons=2 --nproc=2)
while [[ $# -gt 0 ]]; do
  case "$1" in
    --daemons=* | --nproc=*) zsrun_args+=("$1"); shift ;;
    *) break ;;
  esac
done

export PYTHONPATH="$RUNFILES/python${PYTHONPATH:+:$PYTHONPATH}"
exec "$RUNFILES/tools/zsrun" --zeroshardd="$RUNFILES/server/zeroshardd" "${zsrun_args[@]}" -- \
  "${PYTHON:-/usr/bin/python3}" -u "$RUNFILES/examples/python/train_gpt.py" \
  --zsctl="$RUNFILES/tools/zsctl" "$@"
