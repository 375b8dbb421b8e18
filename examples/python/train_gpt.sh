#!/bin/bash
# Runs examples/python/train_gpt.py under zsrun with the binaries and the
# zeroshard package from this target's runfiles:
#
#   bazel run --config=clang //examples/python:train_gpt -- \
#       [--daemons=D] [--nproc=N] [--job_id=ID] [--daemon_args=ARGS] [train_gpt.py flags]
#
# --daemons (default 2), --nproc (default 2), --job_id and --daemon_args
# (e.g. --daemon_args=--checkpoint_dir=DIR, for --checkpoint_every and
# --resume, with the same --job_id and ZS_JOB_TOKEN in both runs), when they
# come first, go to zsrun; everything else to train_gpt.py. $PYTHON overrides the interpreter
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
    --daemons=* | --nproc=* | --job_id=* | --daemon_args=*) zsrun_args+=("$1"); shift ;;
    *) break ;;
  esac
done

export PYTHONPATH="$RUNFILES/python${PYTHONPATH:+:$PYTHONPATH}"
exec "$RUNFILES/tools/zsrun" --zeroshardd="$RUNFILES/server/zeroshardd" "${zsrun_args[@]}" -- \
  "${PYTHON:-/usr/bin/python3}" -u "$RUNFILES/examples/python/train_gpt.py" \
  --zsctl="$RUNFILES/tools/zsctl" "$@"
