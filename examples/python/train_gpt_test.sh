#!/bin/bash
# Runs the Python GPT-2 example with 2 daemons and 2 ranks under zsrun on a
# tiny model: a 30-step run stopped after 20 at stage 3, saving a
# checkpoint every 10, alternating
# gradient pushes from backward hooks with pushes in step()
# (--overlap=compare); then a second run of the same job that resumes from
# the newest checkpoint, trains to step 30 and compares its loss curve with
# a single-process torch.optim.AdamW run (--compare_torch). Checks that both
# ranks finished (over the data path zsrun's daemons serve), that the
# held-out loss fell, that rank 0 printed the
# memory report with the daemons' ledger and the overlap comparison, that
# the resumed run started at step 20, and that its losses stay within 1e-3
# of torch's. Skips (exit 0) only when the system Python lacks torch or
# numpy.
set -u

PYTHON=/usr/bin/python3
RUNFILES="${TEST_SRCDIR:-$0.runfiles}/zeroshard"

if ! "$PYTHON" -c "import torch, numpy" 2>/dev/null; then
  echo "SKIPPED: $PYTHON cannot import torch and numpy"
  exit 0
fi

tmp="${TEST_TMPDIR:-$(mktemp -d)}"
out="$tmp/train_gpt.out"
resumed="$tmp/train_gpt_resumed.out"
export RUNFILES_DIR="${TEST_SRCDIR:-$0.runfiles}"
export PYTHON
export TMPDIR="${TEST_TMPDIR:-${TMPDIR:-/tmp}}"
# A job's checkpoints belong to its token: both runs share one.
export ZS_JOB_TOKEN="train-gpt-test-token-0123456789"
tiny=(--layers=2 --width=32 --heads=2 --seq_len=32 --batch=8 --lr=1e-2 --warmup=5
      --eval_batch=16 --log_every=5 --threads=1)
zsrun=(--daemons=2 --nproc=2 --job_id=train-gpt-test)
# The first run's daemons serve the grpc bulk transport, which the trainers
# take from zsrun (ZS_TRANSPORT); the resumed run's zeroshardd's default.
"$RUNFILES/examples/python/train_gpt" "${zsrun[@]}" \
  "--daemon_args=--checkpoint_dir=$tmp/ck --bulk_transport=grpc" --steps=30 --stop_at=20 "${tiny[@]}" \
  --checkpoint_every=10 --overlap=compare 2>&1 | tee "$out"
rc=${PIPESTATUS[0]}
if [[ $rc -ne 0 ]]; then
  echo "FAILED: zsrun exited $rc"
  exit 1
fi
"$RUNFILES/examples/python/train_gpt" "${zsrun[@]}" "--daemon_args=--checkpoint_dir=$tmp/ck" \
  --steps=30 "${tiny[@]}" \
  --resume --compare_torch="$tmp/loss.svg" 2>&1 | tee "$resumed"
rc=${PIPESTATUS[0]}
if [[ $rc -ne 0 ]]; then
  echo "FAILED: the resumed run's zsrun exited $rc"
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
  check "rank $rank finished" "^\[rank $rank\] finished: 20 steps"
done
check "a progress bar with loss, ms/step and bytes moved" \
  '^\[rank 0\] \[#+\] step 20/20  loss [0-9.]+ +[0-9.]+ ms/step  eta +[0-9]+ s  moved [0-9.]+ [kMG]?B/step'
check "the daemons' data path" '^\[rank 0\] GPT-2: .* 2 daemon\(s\) over grpc; '
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

if ! grep -q '^\[rank 0\] resumed from checkpoint step-20 at step 20$' "$resumed"; then
  echo "FAILED: the second run did not resume from step-20"
  fail=1
fi
diff=$(sed -nE 's/^\[rank 0\] loss curves written to .*: the largest difference .* is ([0-9.e+-]+) .*$/\1/p' "$resumed")
if [[ -z "$diff" || ! -s "$tmp/loss.svg" ]]; then
  echo "FAILED: no loss curves written"
  fail=1
elif ! awk -v d="$diff" 'BEGIN { exit !(d < 1e-3) }'; then
  echo "FAILED: the loss differs from torch's by $diff"
  fail=1
else
  echo "resumed run's loss vs single-process torch: largest difference $diff"
fi

if [[ $ranks_checked -ne 2 ]]; then
  echo "FAILED: read a held-out loss of $ranks_checked rank(s), expected 2"
  fail=1
fi
if [[ $fail -ne 0 ]]; then exit 1; fi
echo "PASSED"
