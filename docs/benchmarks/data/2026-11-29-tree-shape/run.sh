#!/bin/sh
# The runs of 2026-11-29-tree-shape.md, from the project root, alone on the machine.
# sampled-runners-up-ranked.log: the sampled command below with --seeds 1, run before a sampling row's shape kept its
# drawn chain whole (shape_nodes(keep_chain=True)); its runners-up were ranked with the chain by their estimates.
set -e
out=docs/benchmarks/data/2026-11-29-tree-shape
export OMP_NUM_THREADS=2 SPECDECODE_SPEC_BENCH=${SPECDECODE_SPEC_BENCH:-../shared/data/spec_bench/question.jsonl}
run() { flock /tmp/specdecode-bench.lock python docs/benchmarks/tree_shape_cpu.py --prompts 10 --max-new-tokens 64 "$@"; }
[ "$1" = "--rest" ] || run > $out/greedy.log 2>&1
run --temperature 0.7 --seeds 2 > $out/sampled.log 2>&1
run --depth 5 --nodes 16 > $out/greedy-d5-n16.log 2>&1
