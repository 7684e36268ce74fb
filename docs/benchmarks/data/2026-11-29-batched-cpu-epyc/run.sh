#!/bin/bash
# Issue 28's batched table on CPU (2026-11-29, AMD EPYC with AVX512-BF16): 25df2e7 (the issue's "today") against
# ff8335a (main then), greedy, 8 HumanEval prompts in groups of B = 1, 2, 4, 8, bf16, 64 new tokens, the command of
# the 2026-11-27 record, in separate processes in the order today, now, today, now, each alone under the lock.
# Usage: git worktree add /tmp/wt-today 25df2e7 && git worktree add /tmp/wt-now ff8335a && OUT=/tmp/batched bash run.sh
set -u
OUT=${OUT:-/tmp/batched}
VENV=${VENV:-/work/main/.venv}
mkdir -p "$OUT"
i=0
for arm in today now today now; do
  i=$((i + 1))
  out=$OUT/$i-$arm
  ( cd /tmp/wt-$arm && flock /tmp/specdecode-bench.lock env PYTHONPATH=/tmp/wt-$arm/src OMP_NUM_THREADS=2 \
    "$VENV/bin/specdecode" bench --dataset humaneval --limit 8 --batch-size 1,2,4,8 \
    --methods autoregressive draft prompt-lookup --dtype bfloat16 --max-new-tokens 64 --out "$out" > "$out.log" 2>&1 )
  echo "$i $arm rc=$? $(date +%T)" >> "$OUT/progress"
done
