#!/bin/bash
# Checks prometheus.yml (with the rule and file_sd files it names), alerts.yml,
# and runs the alert unit tests in alerts_test.yml. Any promtool warning fails
# the test. Passes with a SKIPPED line when promtool is not installed.
set -euo pipefail

promtool="$(command -v promtool || true)"
if [[ -z "${promtool}" && -x /usr/bin/promtool ]]; then
  promtool=/usr/bin/promtool
fi
if [[ -z "${promtool}" ]]; then
  echo "SKIPPED: promtool not found on PATH or in /usr/bin"
  exit 0
fi

cd "${TEST_SRCDIR:-.}/${TEST_WORKSPACE:-.}/deploy/prometheus" 2>/dev/null ||
  cd "$(dirname "$0")"

run() {
  local output
  if ! output="$("${promtool}" "$@" 2>&1)"; then
    echo "FAILED: promtool $*"
    echo "${output}"
    exit 1
  fi
  echo "${output}"
  if grep -qi 'warning' <<<"${output}"; then
    echo "FAILED: promtool $* printed a warning"
    exit 1
  fi
}

run check config prometheus.yml

# promtool does not read file_sd files; their entries have the format of
# static_configs, so check each as one.
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
for targets in targets/*.yml; do
  {
    printf 'scrape_configs:\n  - job_name: file_sd_check\n    static_configs:\n'
    sed 's/^/      /' "${targets}"
  } >"${tmp}/file_sd_check.yml"
  echo "As static_configs: ${targets}"
  run check config "${tmp}/file_sd_check.yml"
done
run check rules alerts.yml
run test rules alerts_test.yml
echo "PASSED"
