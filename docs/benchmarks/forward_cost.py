"""Milliseconds per target forward by number of tokens fed, for each --quantize value.

Usage: OMP_NUM_THREADS=2 [DTYPE=float32] python docs/benchmarks/forward_cost.py qwen2.5-coder-1.5b-instruct,qwen2.5-coder-0.5b-instruct [QUANTIZE,...] [GROUP_SIZE]
QUANTIZE is none, int8, int4, or int4-head-int4 (an int4 draft's LM head, as from_pretrained gives it).
DTYPE (environment) is the compute dtype: bfloat16 (the default), float32 or auto (the commands' choice:
bfloat16 with native bf16 instructions, float32 otherwise). WIDTHS (environment, e.g. 1,8) limits the widths.
PREPACK (environment): 1 = unquantized float32 linears on oneDNN's kernel (``models.prepacked_linear``), 0 = stock
``nn.Linear``, unset = ``load_model``'s default (on for an unquantized float32 model on an AVX2 CPU). Each line says
which ran and how long loading (with the prepacking) took.
Prints one line per model and quantization: the median of 7 forwards over a 200-token context.
"""
import os
import sys
import time

import torch
from transformers import DynamicCache

from specdecode.models import load_model
from specdecode.models.prepacked_linear import has_prepacked_linears


WIDTHS = (1, 2, 3, 4, 5, 6, 8, 16)


def median_ms(forward, rollback, widths=WIDTHS) -> dict[int, float]:
    """Median ms of 7 timed calls ``forward(x)`` per width (after two warm-ups), ``rollback(k)`` after each."""
    out = {}
    for k in widths:
        x = torch.randint(100, 5000, (1, k))
        times = []
        for i in range(9):
            t = time.perf_counter()
            forward(x)
            if i >= 2:  # two warm-ups
                times.append(time.perf_counter() - t)
            rollback(k)
        out[k] = round(sorted(times)[len(times) // 2] * 1e3, 1)
    return out


@torch.inference_mode()
def forward_ms(model, widths=WIDTHS) -> dict[int, float]:
    ctx = torch.randint(100, 5000, (1, 200), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config)
    model(ctx, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return median_ms(lambda x: model(x, past_key_values=cache, use_cache=True), lambda k: cache.crop(-k), widths)


if __name__ == "__main__":
    for name in sys.argv[1].split(","):
        for q in (sys.argv[2].split(",") if len(sys.argv) > 2 else ["none", "int8", "int4"]):
            scheme, _, head = q.partition("-head-")  # "int4-head-int4": an int4 model with an int4 LM head
            group = int(sys.argv[3]) if len(sys.argv) > 3 and scheme == "int4" else None
            prepack = {"1": True, "0": False}.get(os.environ.get("PREPACK", ""))
            t0 = time.perf_counter()
            loaded = load_model(name, dtype=os.environ.get("DTYPE", "bfloat16"), quantize=scheme, quantize_head=head or None,
                                quantize_group_size=group, prepack_linears=prepack if scheme == "none" else None)
            model, load_s = loaded.model, time.perf_counter() - t0
            del loaded
            print(name, q, f"group {group}" if group else "", f"prepacked={has_prepacked_linears(model)} load {load_s:.1f} s",
                  "ms per forward by tokens fed:",
                  forward_ms(model, tuple(int(w) for w in os.environ.get("WIDTHS", "").split(",") if w) or WIDTHS), flush=True)
            del model
