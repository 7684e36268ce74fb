"""Where the int4 0.5B draft's 1-token forward spends its time (eager, DynamicCache, 200 tokens of context).

Usage: OMP_NUM_THREADS=2 python profile_draft.py [none|int8|int4] [int8|int4 (the LM head; int4 scheme only)]
Prints the prefill cost (96 and 200 tokens, logits of the last only), the forward cost at widths 1, 2, 4,
and a torch.profiler table of 20 one-token forwards.
"""
import time, sys, torch
from transformers import DynamicCache
from specdecode.models import load_model
torch.set_num_threads(2)
q = sys.argv[1] if len(sys.argv) > 1 else "int4"
head = sys.argv[2] if len(sys.argv) > 2 else None
lm = load_model("qwen2.5-coder-0.5b-instruct", dtype="bfloat16", quantize=q, quantize_head=head)
m = lm.model
ids = torch.randint(0, 1000, (1, 200))
with torch.inference_mode():
    for plen in (96, 200):
        ts = []
        for _ in range(3):
            t = time.perf_counter(); m(ids[:, :plen], past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1); ts.append(time.perf_counter() - t)
        print(f"{q} prefill {plen} tokens: {min(ts)*1e3:.0f} ms", flush=True)
    cache = DynamicCache(); m(ids, past_key_values=cache, use_cache=True)
    x = ids[:, :1]
    def step(w=1):
        m(ids[:, :w], past_key_values=cache, use_cache=True, logits_to_keep=w); cache.crop(-w)
    for w in (1, 2, 4):
        for _ in range(3): step(w)
        t = time.perf_counter()
        for _ in range(20): step(w)
        print(f"{q} width {w}: {(time.perf_counter()-t)/20*1e3:.1f} ms", flush=True)
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(20): step(1)
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
