"""Per-forward cost of the batched target forward: eager (``batch_forward``, keys sliced to the
longest row) against the batched fast path (``engine.batch_runner``: full-capacity static shapes,
compiled per (rows, width) bucket), on rows that each hold ``--context`` positions.

Usage (CPU; wrap timing runs in ``flock /tmp/specdecode-bench.lock``):

    PYTHONPATH=src python docs/benchmarks/batched_fast_path_cost.py [--rows 1,4,8] [--widths 1,6]
        [--context 300] [--capacity 2048] [--repeats 5] [--threads 2] [--device cpu]
        [--model qwen2.5-coder-1.5b-instruct] [--dynamic-shapes]

Prints one line per (rows, width): eager ms, fast-path ms (static shapes, no torch.compile, with
``--no-graphs``), and the seconds the bucket took to compile. The cache holds ``--capacity``
positions per row, as ``BatchedSpeculativeDecoder(max_length=...)`` would allocate. ``--dynamic-shapes``: rows and
widths above 1 symbolic (``FastPath.dynamic_shapes``), so only the first bucket of each class (rows 1 or more,
width 1 or more) compiles.
"""

from __future__ import annotations

import argparse
import time

import torch

from specdecode.engine.batch_cache import BatchKVCache, batch_prefill
from specdecode.engine.fast_path import FastPath
from specdecode.engine.batch_runner import BatchRunner
from specdecode.models import load_model


def _timed(runner: BatchRunner, ids: torch.Tensor, starts: list[int], repeats: int) -> float:
    device = ids.device
    for _ in range(2):
        runner(ids, starts, 1)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        runner(ids, starts, 1)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--rows", default="1,4,8")
    p.add_argument("--widths", default="1,6")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--capacity", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--no-graphs", action="store_true", help="the fast path's static shapes without torch.compile")
    p.add_argument("--dynamic-shapes", action="store_true", help="FastPath.dynamic_shapes: rows and widths above 1 symbolic")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    widths = [int(w) for w in args.widths.split(",")]
    model = load_model(args.model, dtype=args.dtype, device=args.device).model
    device = model.device
    prompt = torch.randint(100, 20000, (1, args.context), generator=torch.Generator().manual_seed(0)).to(device)
    fast = FastPath(tuple(rows), max(widths), graphs=not args.no_graphs, dynamic_shapes=args.dynamic_shapes)
    caches = {
        "eager": BatchKVCache(model, max(rows), args.capacity),
        "fast": BatchKVCache(model, max(rows), args.capacity, fast=fast),
    }
    runners = {name: BatchRunner(model, cache, widths, "target model") for name, cache in caches.items()}
    with torch.inference_mode():
        for cache in caches.values():
            for slot in range(max(rows)):
                batch_prefill(model, cache, prompt, slot)
    print(f"{args.model} {args.dtype} on {device}, {args.threads} threads, capacity {args.capacity}, "
          f"context {args.context}, torch {torch.__version__}, dynamic shapes {args.dynamic_shapes}", flush=True)
    for r in rows:
        for w in widths:
            ids = prompt[:, :w].expand(r, w).contiguous()
            starts = [args.context] * r
            eager = _timed(runners["eager"], ids, starts, args.repeats)
            before = runners["fast"].compile_time_s
            t0 = time.perf_counter()
            runners["fast"](ids, starts, 1)
            compile_s = time.perf_counter() - t0 if runners["fast"].compile_time_s > before else 0.0
            fast_ms = _timed(runners["fast"], ids, starts, args.repeats)
            print(f"rows {r} width {w}: eager {eager:.1f} ms, fast path {fast_ms:.1f} ms "
                  f"(compiled in {compile_s:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
