"""Tables of the finished Spec-Bench run: tok/s, speedup, α and τ per category, ÷ hf-assisted, the 5% rule, accepted per round.
Usage: python tables.py results.json"""
import json, sys
r = json.load(open(sys.argv[1])); s = r["summary"]; cats = r["categories"]
names = {"cascade:draft_vocab_size=32768+adaptive": "`cascade+adaptive`, K = 32768"}
print("| tok/s | " + " | ".join(cats) + " | all | α | τ (incl. bonus) |")
print("|---|" + "---:|" * (len(cats) + 3))
for m in r["methods"]:
    row = [f'{s[m][c]["tokens_per_s"]:.2f}' for c in cats]
    o = s[m]["overall"]
    a = o.get("acceptance_rate"); t = o.get("mean_accepted_tokens")
    print(f"| {names.get(m, '`'+m+'`')} | " + " | ".join(row) + f' | {o["tokens_per_s"]:.2f} ({o["speedup"]:.2f}×) | '
          + (f"{a:.1%}" if a is not None else "–") + " | " + (f"{t:.2f}" if t is not None else "1.00") + " |")
print()
print("baseline:", r.get("baselines_used"))
for m in ("cascade+adaptive", "cascade:draft_vocab_size=32768+adaptive"):
    print(m, "÷ hf-assisted:", ", ".join(f'{c} {s[m][c]["tokens_per_s"]/s["hf-assisted"][c]["tokens_per_s"]:.2f}' for c in cats + ["overall"]))
    worst = []
    for c in cats:
        ref = max(s["draft+adaptive"][c]["tokens_per_s"], s["prompt-lookup"][c]["tokens_per_s"])
        worst.append((s[m][c]["tokens_per_s"] / ref - 1, c))
    print(m, "vs better of draft+adaptive/prompt-lookup:", ", ".join(f"{c} {d:+.1%}" for d, c in worst), "worst:", min(worst))
    print(m, "speedup per category:", ", ".join(f'{c} {s[m][c]["speedup"]:.2f}' for c in cats))
# mean accepted per round counted directly, and draft forwards
from pathlib import Path
recs = r.get("records") or [json.loads(l) for l in open(Path(sys.argv[1]).with_name("records.jsonl"))]
for m in ("cascade+adaptive", "cascade:draft_vocab_size=32768+adaptive", "draft+adaptive", "draft"):
    rr = [x for x in recs if x["method"] == m]
    acc = sum(x["accepted"] or 0 for x in rr); vf = sum(x["verify_forwards"] or 0 for x in rr)
    df = sum(x["draft_forwards"] or 0 for x in rr); dr = sum(x["drafted"] or 0 for x in rr)
    print(m, f"accepted/round {acc/vf:.2f}, drafted {dr}, draft forwards {df}, verify forwards {vf}")
print()
print("| α / τ (incl. bonus) | " + " | ".join(cats) + " |")
print("|---|" + "---:|" * len(cats))
for m in ("hf-assisted", "draft", "draft+adaptive", "cascade+adaptive", "cascade:draft_vocab_size=32768+adaptive"):
    cells = []
    for c in cats:
        a, t = s[m][c].get("acceptance_rate"), s[m][c].get("mean_accepted_tokens")
        cells.append(f"{a:.0%} / {t:.2f}" if a is not None else "–")
    print(f"| {names.get(m, '`'+m+'`')} | " + " | ".join(cells) + " |")
