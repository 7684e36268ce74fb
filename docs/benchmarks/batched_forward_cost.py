"""Target and draft forward cost against the number of tokens a batched round feeds.

Why batched speculation stops paying as B grows: a round verifies B x (k + 1) tokens in one
target forward. While the forward is bound by reading the weights, extra tokens are nearly
free; once it is compute-bound, its cost grows with the token count and the draft's work is
no longer hidden. This probe times one forward of the Qwen2.5-Coder 1.5B target (and the 0.5B
draft) on the batched cache, for B rows of w tokens each, after a 200-token context.

Run alone on the machine::

    python docs/benchmarks/batched_forward_cost.py [--dtype bfloat16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode.engine.batch_cache import BatchKVCache, batch_forward
from specdecode.models import load_model


def forward_ms(model, rows: int, width: int, context: int, repeats: int) -> float:
    """Median milliseconds of one forward over ``rows`` x ``width`` tokens after ``context`` cached."""
    cache = BatchKVCache(model, rows, context + width + 1)
    with torch.inference_mode():
        for b in range(rows):
            batch_forward(model, cache, torch.randint(100, 5000, (1, context)), b, [0], 1)
        ids = torch.randint(100, 5000, (rows, width))
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            batch_forward(model, cache, ids, 0, [context] * rows, width)
            times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--context", type=int, default=200)
    args = parser.parse_args()
    for name in ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"):
        model = load_model(name, dtype=args.dtype).model
        print(f"{name} ({args.dtype}, {torch.get_num_threads()} threads), context {args.context}")
        print("| rows B | tokens per row w | tokens B*w | ms per forward | ms per token |")
        print("|---:|---:|---:|---:|---:|")
        for rows in (1, 2, 4, 8):
            for width in (1, 4, 6):
                ms = forward_ms(model, rows, width, args.context, args.repeats)
                print(f"| {rows} | {width} | {rows * width} | {ms:.1f} | {ms / (rows * width):.2f} |", flush=True)
        del model


if __name__ == "__main__":
    main()
