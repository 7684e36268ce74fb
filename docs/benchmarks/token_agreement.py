"""Token agreement of autoregressive greedy outputs between bench runs on the same prompts.

Usage: python docs/benchmarks/token_agreement.py REFERENCE_RUN OTHER_RUN [...] (bench --out folders).
"""
import json, sys
from pathlib import Path
def load(folder, method="autoregressive"):
    out = {}
    for line in (Path(folder) / "records.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["method"] == method and r.get("repeat", 0) == 0:
            out[r.get("prompt_id") or r.get("id") or r.get("question_id") or len(out)] = r["token_ids"]
    return out
ref = load(sys.argv[1])
for other in sys.argv[2:]:
    o = load(other)
    common = [k for k in ref if k in o]
    prefix, pos, tot, exact = [], 0, 0, 0
    for k in common:
        a, b = ref[k], o[k]
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(n)
        m = min(len(a), len(b)); pos += sum(x == y for x, y in zip(a[:m], b[:m])); tot += max(len(a), len(b))
        exact += a == b
    print(f"{other}: {len(common)} prompts, identical outputs {exact}/{len(common)}, "
          f"tokens before first difference {prefix} (mean {sum(prefix)/max(len(prefix),1):.1f}), "
          f"same token at same position {pos}/{tot} = {pos/max(tot,1):.1%}")
