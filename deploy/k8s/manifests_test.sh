#!/bin/bash
# Runs manifests_test.py with Debian's python3 (python3-yaml) in the
# directory of the manifests. Arguments: zeroshardd, gpt_train,
# tools/zsrun_lib.cc, deploy/prometheus/alerts.yml (runfiles paths).
set -euo pipefail
root="${TEST_SRCDIR:-$PWD/..}/${TEST_WORKSPACE:-zeroshard}"
args=()
for a in "$@"; do args+=("${root}/${a}"); done
cd "${root}/deploy/k8s"
exec /usr/bin/python3 manifests_test.py "${args[@]}"
