"""One process start of a compiled ModelRunner: its warm-up per width, with or without a warm compile cache.

Usage: python docs/benchmarks/compile_cache_warmup.py tiny|qwen0.5b
Prints one JSON line: compile_time_s, the first forward's wall seconds per width (1 and 2; the
first call of a width compiles, or loads from the compile cache), a second forward's, and
inductor's FX graph and AOTAutograd cache counters. Run it twice after clearing
~/.cache/specdecode/compile for a first and a second start (docs/benchmarks/2026-11-25-compile-cache.md).
"""
import json, os, sys, time

t_process = time.perf_counter()
import torch
from torch._dynamo.utils import counters
from specdecode.engine.fast_path import ModelRunner

which = sys.argv[1]  # "tiny" or "qwen0.5b"
t0 = time.perf_counter()
if which == "tiny":
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
else:
    from specdecode.models import load_model
    model = load_model("qwen2.5-coder-0.5b-instruct", dtype="bfloat16", device="cpu").model
load_s = time.perf_counter() - t0
widths = (1, 2)
runner = ModelRunner(model, compile=True, buckets=widths, name=which)
cache = runner.new_cache(64)
runner(torch.arange(3, 19).view(1, 16), cache, 1)  # 16-token prefill: eager
first, steady = {}, {}
for w in widths:
    t = time.perf_counter(); runner(torch.full((1, w), 7), cache, 1); first[w] = round(time.perf_counter() - t, 2)
for w in widths:
    t = time.perf_counter(); runner(torch.full((1, w), 7), cache, 1); steady[w] = round(time.perf_counter() - t, 4)
print(json.dumps({
    "model": which, "torch": torch.__version__, "threads": torch.get_num_threads(),
    "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"), "load_s": round(load_s, 1),
    "compile_time_s": round(runner.compile_time_s, 2), "first_forward_s": first, "second_forward_s": steady,
    "fxgraph_cache": {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph")},
    "aot_autograd_cache": {k: v for k, v in counters["aot_autograd"].items() if "cache" in k},
    "process_s": round(time.perf_counter() - t_process, 1)}))
