#!/bin/bash
# Token-tree sampling on the device, end to end on the real Qwen pair (2026-11-29): 44e2e91 (before: row-by-row walk
# after the read) against 30ff6c3 (after), 5 HumanEval + 5 Spec-Bench prompts, temperature 0.7, seed 0, 64 new
# tokens, bf16, ABAB across processes, each run alone under the lock.
# Usage: git worktree add /tmp/wt-a 44e2e91 && git worktree add /tmp/wt-b 30ff6c3 && OUT=/tmp/trees bash run.sh
set -u
SB=${SPECDECODE_SPEC_BENCH:-/work/shared/data/spec_bench/question.jsonl}
OUT=${OUT:-/tmp/trees}
VENV=${VENV:-/work/main/.venv}
mkdir -p "$OUT"
i=0
for arm in a b a b; do
  for ds in humaneval spec-bench; do
    i=$((i + 1))
    out=$OUT/$i-$arm-$ds
    ( cd /tmp/wt-$arm && flock /tmp/specdecode-bench.lock env PYTHONPATH=/tmp/wt-$arm/src OMP_NUM_THREADS=2 \
      SPECDECODE_SPEC_BENCH=$SB "$VENV/bin/specdecode" bench --dtype bfloat16 --dataset $ds --limit 5 \
      --max-new-tokens 64 --temperature 0.7 --seed 0 --methods autoregressive \
      "draft:draft_tree_depth=3,num_speculative_tokens=6" "prompt-lookup:prompt_lookup_branches=3" \
      --out "$out" > "$out.log" 2>&1 )
    echo "$i $arm $ds rc=$? $(date +%T)" >> "$OUT/progress"
  done
done
