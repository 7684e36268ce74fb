"""Per-forward cost of the 1.5B target on the static cache: eager against inductor-compiled, widths 1 and 4.

Usage: python docs/benchmarks/compiled_forward_cost.py none|int8|int4   (2 torch threads, bf16 activations)

Measured 2026-11-23 on a 2-core EPYC with AVX512-BF16, int8: width 1 eager 113.5 ms, compiled 137.7 ms;
width 4 eager 138.0 ms, compiled 104.2 ms; about 43 s to compile each width.
"""
import time, sys, torch
from specdecode.models import load_model
from specdecode.engine.fast_path import ModelRunner
torch.set_num_threads(2)
lm = load_model("qwen2.5-coder-1.5b-instruct", dtype="bfloat16", quantize=sys.argv[1])
m = lm.model
ids = torch.randint(0, 1000, (1, 300))
def bench(runner, w, n=8):
    cache = runner.new_cache(400)
    runner(ids, cache, 1)  # prefill (eager)
    x = ids[:, :w]
    for _ in range(2):
        runner(x, cache, 1); cache.set_length(300)
    t = time.perf_counter()
    for _ in range(n):
        runner(x, cache, 1); cache.set_length(300)
    return (time.perf_counter() - t) / n * 1e3
for w in (1, 4):
    eager = ModelRunner(m, compile=True, graphs=False)
    comp = ModelRunner(m, compile=True, buckets=(1, 4))
    e = bench(eager, w)
    c = bench(comp, w)
    print(f"{sys.argv[1]} width {w}: eager static {e:.1f} ms, compiled {c:.1f} ms (compile {comp.compile_time_s:.0f} s)", flush=True)
