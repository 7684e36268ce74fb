"""Probes behind the serve soak's memory diagnosis (docs/benchmarks/2026-11-24-serve-soak.md).

    OMP_NUM_THREADS=2 python docs/benchmarks/serve_memory_probes.py shapes 400     # RSS per new token count
    OMP_NUM_THREADS=2 python docs/benchmarks/serve_memory_probes.py prefill         # chunked prefill timing
    OMP_NUM_THREADS=2 python docs/benchmarks/serve_memory_probes.py embedding       # mapped embedding rows

``shapes``: three bf16 linears of Qwen2.5-1.5B's sizes over token counts 1..N-1; resident memory
after every 50 (oneDNN JIT-compiles kernels per shape; try ONEDNN_PRIMITIVE_CACHE_CAPACITY=0).
``prefill``: the bf16 target prefilled in one forward against chunks of 256/512/128/64 padded to a
multiple, through the batched engine's cache. ``embedding``: file-backed RSS while looking up
random embedding rows of the memory-mapped dense model.
"""

from __future__ import annotations

import argparse
import time

import torch


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def shapes(n: int) -> None:
    linears = [torch.nn.Linear(1536, 8960, bias=False), torch.nn.Linear(8960, 1536, bias=False),
               torch.nn.Linear(1536, 256)]
    up, down, kv = (lin.to(torch.bfloat16) for lin in linears)
    with torch.inference_mode():
        up(torch.randn(1, 5, 1536, dtype=torch.bfloat16))
        start, t0 = rss_mb(), time.perf_counter()
        for m in range(1, n):
            x = torch.randn(1, m, 1536, dtype=torch.bfloat16)
            down(up(x))
            kv(x)
            if m % 50 == 0:
                print(f"token counts 1..{m}: +{rss_mb() - start:.1f} MB, {time.perf_counter() - t0:.1f} s", flush=True)


def prefill() -> None:
    from specdecode.engine.batch_cache import BatchKVCache, batch_forward
    from specdecode.models.loading import load_model
    from specdecode.pipeline import DEFAULT_TARGET

    model = load_model(DEFAULT_TARGET, dtype="bfloat16").model

    def run(cache, ids, chunk, multiple):
        n, start, logits = ids.shape[1], 0, None
        while start < n:
            real = min(chunk, n - start)
            width = -(-real // multiple) * multiple
            x = ids[:, start : start + real]
            if width > real:
                x = torch.cat([x, x[:, -1:].expand(1, width - real)], 1)
            logits = batch_forward(model, cache, x, 0, [start], width - real + 1)[:, 0]
            start += real
        return logits

    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for n in (100, 400, 1000):
            ids = torch.randint(0, 150000, (1, n), generator=g)
            ref = None
            for chunk, multiple in ((1 << 20, 1), (512, 32), (256, 16), (128, 16), (64, 8)):
                cache = BatchKVCache(model, 1, 2048, prefill_chunk_tokens=chunk, prefill_pad_multiple=multiple)
                run(cache, ids[:, :50], chunk, multiple)  # warm
                t0 = time.perf_counter()
                out = run(cache, ids, chunk, multiple)
                seconds = time.perf_counter() - t0
                ref = out if ref is None else ref
                print(f"{n} tokens, chunk {chunk}, multiple {multiple}: {seconds:.2f} s, "
                      f"same first token {int(out.argmax()) == int(ref.argmax())}", flush=True)


def embedding() -> None:
    from specdecode.models.loading import load_model
    from specdecode.pipeline import DEFAULT_TARGET

    def rollup() -> dict:
        keep = ("Rss", "Anonymous", "Private_Clean")
        with open("/proc/self/smaps_rollup") as f:
            pairs = (line.split(":", 1) for line in f if ":" in line)
            return {k: int(v.split()[0]) // 1024 for k, v in pairs if k in keep}

    model = load_model(DEFAULT_TARGET, dtype="bfloat16").model
    emb = model.get_input_embeddings()
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3]]))
        print("after one forward (MB):", rollup())
        for i in range(5):
            emb(torch.randint(0, emb.num_embeddings, (1, 5000), generator=g))
            print(f"after {5000 * (i + 1)} random ids (MB):", rollup())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("probe", choices=("shapes", "prefill", "embedding"))
    p.add_argument("n", nargs="?", type=int, default=400)
    args = p.parse_args()
    {"shapes": lambda: shapes(args.n), "prefill": prefill, "embedding": embedding}[args.probe]()


if __name__ == "__main__":
    main()
