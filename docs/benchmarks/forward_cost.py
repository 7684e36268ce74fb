"""Milliseconds per target forward by number of tokens fed, for each --quantize value.

Usage: OMP_NUM_THREADS=2 python docs/benchmarks/forward_cost.py qwen2.5-coder-1.5b-instruct,qwen2.5-coder-0.5b-instruct [QUANTIZE,...] [GROUP_SIZE]
Prints one line per model and quantization: the median of 7 forwards over a 200-token context.
"""
import sys
import time

import torch
from transformers import DynamicCache

from specdecode.models import load_model


@torch.inference_mode()
def forward_ms(model, widths=(1, 2, 3, 4, 5, 6, 8, 16)) -> dict[int, float]:
    ctx = torch.randint(100, 5000, (1, 200), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config)
    model(ctx, past_key_values=cache, use_cache=True, logits_to_keep=1)
    out = {}
    for k in widths:
        x = torch.randint(100, 5000, (1, k))
        times = []
        for i in range(9):
            t = time.perf_counter()
            model(x, past_key_values=cache, use_cache=True)
            if i >= 2:  # two warm-ups
                times.append(time.perf_counter() - t)
            cache.crop(-k)
        out[k] = round(sorted(times)[len(times) // 2] * 1e3, 1)
    return out


if __name__ == "__main__":
    for name in sys.argv[1].split(","):
        for q in (sys.argv[2].split(",") if len(sys.argv) > 2 else ["none", "int8", "int4"]):
            group = int(sys.argv[3]) if len(sys.argv) > 3 and q == "int4" else None
            model = load_model(name, dtype="bfloat16", quantize=q, quantize_group_size=group).model
            print(name, q, f"group {group}" if group else "", "ms per forward by tokens fed:", forward_ms(model), flush=True)
            del model
