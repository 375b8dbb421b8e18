#!/bin/bash
# Runs the Python GPT example for 30 steps of a tiny model with 2 daemons
# and 2 ranks under zsrun, alternating gradient pushes from backward hooks
# with pushes in step() (--overlap=compare), and checks that both ranks
# finished, that the held-out loss fell, and that rank 0 printed the memory
# report with the daemons' ledger and the overlap comparison. Skips (exit
# 0) only when the system Python lacks torch or numpy.
set -u

PYTHON=/usr/bin/python3
RUNFILES="${TEST_SRCDIR:-$0.runfiles}/zeroshard"

if ! "$PYTHON" -c "import torch, numpy" 2>/dev/null; then
  echo "SKIPPED: $PYTHON cannot import torch and numpy"
  exit 0
fi

out="${TEST_TMPDIR:-$(mktemp -d)}/train_gpt.out"
export RUNFILES_DIR="${TEST_SRCDIR:-$0.runfiles}"
export PYTHON
export TMPDIR="${TEST_TMPDIR:-${TMPDIR:-/tmp}}"
"$RUNFILES/examples/python/train_gpt" --daemons=2 --nproc=2 \
  --steps=30 --layers=2 --width=32 --heads=2 --seq_len=32 --batch=8 \
  --lr=1e-2 --eval_batch=16 --log_every=5 --threads=1 --overlap=compare 2>&1 | tee "$out"
rc=${PIPESTATUS[0]}
if [[ $rc -ne 0 ]]; then
  echo "FAILED: zsrun exited $rc"
  exit 1
fi

fail=0
check() {  # check DESCRIPTION PATTERN: one line of the output matches
  if ! grep -Eq -- "$2" "$out"; then
    echo "FAILED: $1 (no line matches /$2/)"
    fail=1
  fi
}
for rank in 0 1; do
  check "rank $rank finished" "^\[rank $rank\] finished: 30 steps"
done
check "progress lines with loss, ms/step and bytes moved" \
  '^\[rank 0\] step 30/30  loss [0-9.]+ +[0-9.]+ ms/step  moved [0-9.]+ [kMG]?B/step'
check "the memory report" '^\[rank 0\] ==== zeroshard memory report'
check "the trainer's memory" '^\[rank 0\] Trainer rank 0 holds: staging buffers'
check "the daemons' ledger" '^\[rank 0\]   daemon 127\.0\.0\.1:[0-9]+  total'
check "the paper's formula in the ledger" 'model states .* paper formula'
check "the overlap comparison" \
  '^\[rank 0\] push wait after backward: hooks [0-9.]+ ms, in step\(\) [0-9.]+ ms, ratio [0-9.]+'

# "finished: 30 steps, held-out loss A -> B" on each rank: B < A.
ranks_checked=0
while read -r rank before after; do
  if ! awk -v a="$before" -v b="$after" 'BEGIN { exit !(b < a) }'; then
    echo "FAILED: rank $rank's held-out loss did not fall: $before -> $after"
    fail=1
  else
    echo "rank $rank: held-out loss $before -> $after"
  fi
  ranks_checked=$((ranks_checked + 1))
done < <(sed -nE 's/^\[rank ([0-9]+)\] finished: .* held-out loss ([0-9.]+) -> ([0-9.]+)$/\1 \2 \3/p' "$out")

if [[ $ranks_checked -ne 2 ]]; then
  echo "FAILED: read a held-out loss of $ranks_checked rank(s), expected 2"
  fail=1
fi
if [[ $fail -ne 0 ]]; then exit 1; fi
echo "PASSED"
