"""Report of the complete prompts of a stopped (resumable) Spec-Bench run, through specdecode's own report code.

Usage: python partial_report.py RECORDS.jsonl TEMPLATE_RESULTS.json OUT_DIR
"""
import json, sys, collections
from specdecode.bench.report import write_reports
from specdecode.bench.datasets import spec_bench_path
recs = [json.loads(l) for l in open(sys.argv[1])]
tmpl = json.load(open(sys.argv[2]))
methods = list(tmpl["methods"])
by = collections.defaultdict(set)
for r in recs:
    by[r["prompt_id"]].add(r["method"])
done = {p for p, ms in by.items() if set(methods) <= ms}
keep = [r for r in recs if r["prompt_id"] in done]
cats = list(dict.fromkeys(json.loads(l)["category"] for l in open(spec_bench_path())))
info = {k: tmpl[k] for k in ("environment", "identity", "settings", "methods", "skipped_methods")}
info["categories"] = [c for c in cats if any(r["category"] == c for r in keep)]
info["num_prompts"] = len(done)
info["run_info"] = dict(tmpl["run_info"], dataset="spec-bench", note=f"{len(done)} complete prompts of a stopped, resumed run")
res = write_reports(sys.argv[3], keep, info)
print(len(done), "prompts complete;", collections.Counter(r["category"] for r in keep if r["method"] == methods[0]))
s = res["summary"]
print("method | " + " | ".join(info["categories"] + ["overall"]))
for m in methods:
    print(m, " | ".join(f'{s[m][c]["tokens_per_s"]:.2f} ({s[m][c]["speedup"]:.2f}x)' if c in s[m] else "-" for c in info["categories"] + ["overall"]))
