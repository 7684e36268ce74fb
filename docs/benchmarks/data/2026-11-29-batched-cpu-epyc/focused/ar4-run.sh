#!/bin/bash
# Focused reruns of single cells (2026-11-29): worktrees /tmp/wt-today (25df2e7) and /tmp/wt-now (ff8335a).
set -u; i=0; mkdir -p /tmp/ar4
for arm in today now today now today now; do
  i=$((i + 1)); out=/tmp/ar4/$i-$arm
  ( cd /tmp/wt-$arm && flock /tmp/specdecode-bench.lock env PYTHONPATH=/tmp/wt-$arm/src OMP_NUM_THREADS=2 \
    /work/main/.venv/bin/specdecode bench --dataset humaneval --limit 8 --batch-size 4 \
    --methods autoregressive prompt-lookup --dtype bfloat16 --max-new-tokens 64 --out "$out" > "$out.log" 2>&1 )
  echo "$i $arm rc=$? $(date +%T) $(grep '^| 4 |' $out/batched_results.md | cut -d'|' -f3,4 | tr '\n' ' ')" >> /tmp/ar4/progress
done
