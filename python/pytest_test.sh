#!/bin/bash
# Runs the Python package's pytest suite against the built extension and a
# real zeroshardd. Skips (exit 0) only when the system Python lacks torch or
# pytest; any failure, or no test collected, fails the test.
set -u

PYTHON=/usr/bin/python3
RUNFILES="${TEST_SRCDIR:-$0.runfiles}/zeroshard"

if ! "$PYTHON" -c "import torch, pytest, numpy" 2>/dev/null; then
  echo "SKIPPED: $PYTHON cannot import torch, pytest and numpy"
  exit 0
fi

export PYTHONPATH="$RUNFILES/python"
export ZEROSHARDD="$RUNFILES/server/zeroshardd"
# The secret every test job is registered with; workers and zsctl inherit it.
export ZS_JOB_TOKEN="pytest-job-token-0123456789"
cd "$RUNFILES" || exit 1
# Cache and temp dirs stay inside the test's sandbox.
"$PYTHON" -m pytest -q -p no:cacheprovider \
  --basetemp="${TEST_TMPDIR:-/tmp}/pytest" python/tests
rc=$?
if [[ $rc -eq 5 ]]; then
  echo "FAILED: pytest collected no tests"
  exit 1
fi
exit $rc
