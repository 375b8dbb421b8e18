#!/bin/bash
# Runs the Python package's pytest suite against a real zeroshardd, with the
# package installed the way a user installs it: the wheel ($1, from
# //python:wheel) pip-installed into a fresh venv that sees Debian's torch,
# numpy and pytest through --system-site-packages. The source tree is never
# on the path; the run fails unless `zeroshard` imports from the venv.
#
# Skips (exit 0) only when /usr/bin/python3 lacks torch, pytest or numpy.
# A missing venv module or pip fails with the Debian package to install.
# Any test failure, or no test collected, fails the test.
set -u

PYTHON=/usr/bin/python3
RUNFILES="${TEST_SRCDIR:-$0.runfiles}/zeroshard"
WHEEL="$RUNFILES/$1"

if ! "$PYTHON" -c "import torch, pytest, numpy" 2>/dev/null; then
  echo "SKIPPED: $PYTHON cannot import torch, pytest and numpy"
  exit 0
fi
if ! "$PYTHON" -c "import venv" 2>/dev/null; then
  echo "FAILED: $PYTHON has no venv module (Debian package python3-venv)"
  exit 1
fi
if ! "$PYTHON" -m pip --version >/dev/null 2>&1; then
  echo "FAILED: $PYTHON has no pip to install the wheel with (Debian package python3-pip)"
  exit 1
fi

# Only the wheel and Debian's packages: no user site (it would come before
# the venv's site-packages), no pip configuration or index from outside.
unset PYTHONPATH
export PYTHONNOUSERSITE=1 PIP_CONFIG_FILE=/dev/null
unset PIP_FIND_LINKS PIP_INDEX_URL PIP_EXTRA_INDEX_URL
VENV="${TEST_TMPDIR:-$(mktemp -d)}/venv"
# --without-pip: Debian's pip, seen through the system site packages,
# installs into the venv it runs in.
"$PYTHON" -m venv --system-site-packages --without-pip "$VENV" || {
  echo "FAILED: $PYTHON -m venv could not create $VENV"
  exit 1
}
"$VENV/bin/python" -m pip install --quiet --no-index --no-deps --no-cache-dir \
  --disable-pip-version-check "$WHEEL" || {
  echo "FAILED: pip could not install $WHEEL"
  exit 1
}

export ZEROSHARDD="$RUNFILES/server/zeroshardd"
# The secret every test job is registered with; workers and zsctl inherit it.
export ZS_JOB_TOKEN="pytest-job-token-0123456789"
# From the tests' directory, so their helper modules (binaries.py, the
# workers' common code) import; worker processes start with sys.executable,
# the venv's interpreter.
cd "$RUNFILES/python/tests" || exit 1
"$VENV/bin/python" - <<'EOF' || exit 1
import os, sys
import zeroshard, zeroshard.torch
where = os.path.realpath(zeroshard.__file__)
if not where.startswith(os.path.realpath(sys.prefix) + os.sep):
    sys.exit(f"FAILED: zeroshard imports from {where}, not the venv {sys.prefix}")
print(f"zeroshard {zeroshard.__version__} from {where}")
EOF
# Cache and temp dirs stay inside the test's sandbox.
"$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  --basetemp="${TEST_TMPDIR:-/tmp}/pytest" .
rc=$?
if [[ $rc -eq 5 ]]; then
  echo "FAILED: pytest collected no tests"
  exit 1
fi
exit $rc
