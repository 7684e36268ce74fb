#!/bin/bash
# Issue 28's B = 1 CPU check as run on 2026-11-29: 25df2e7 (before) against 4ebefc7 (after; main then),
# 10 HumanEval + 10 Spec-Bench prompts, 64 new tokens, ABAB across processes, each run alone under the lock.
# Usage: git worktree add /tmp/wt-before 25df2e7 && git worktree add /tmp/wt-after <rev> && OUT=/tmp/b1 bash run.sh
set -u
SB=${SPECDECODE_SPEC_BENCH:-/work/shared/data/spec_bench/question.jsonl}
OUT=${OUT:-/tmp/b1}
VENV=${VENV:-/work/main/.venv}
mkdir -p "$OUT"
i=0
for arm in before after before after; do
  for ds in humaneval spec-bench; do
    i=$((i + 1))
    out=$OUT/$i-$arm-$ds
    ( cd /tmp/wt-$arm && flock /tmp/specdecode-bench.lock env PYTHONPATH=/tmp/wt-$arm/src OMP_NUM_THREADS=2 \
      SPECDECODE_SPEC_BENCH=$SB "$VENV/bin/specdecode" bench --dtype bfloat16 --dataset $ds --limit 10 \
      --max-new-tokens 64 --methods autoregressive draft+adaptive cascade+adaptive --out "$out" > "$out.log" 2>&1 )
    echo "$i $arm $ds rc=$? $(date +%T)" >> "$OUT/progress"
  done
done
