"""A/B of overlapped rounds (``engine.overlap``, ``overlap_rounds``) for ``autoregressive``: one request at a time
(``SpeculativeDecoder``) and a batch (``batch_decoder``), the same prompts and settings, each setting twice in
alternation; the outputs must be the same token for token (checked).

On a CPU the forward runs in the calling thread, so nothing can overlap: this says what the option costs there
(an extra forward per request that ends at EOS, dropped). On CUDA ``gpu_engine.py``'s ``autoregressive-serial``
row and batched A/B are the measurement.

    flock /tmp/specdecode-bench.lock env OMP_NUM_THREADS=2 python docs/benchmarks/overlap_rounds_cost.py \\
        --model qwen2.5-coder-1.5b-instruct
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from specdecode import GenerationConfig, SpeculativeGenerator  # noqa: E402

PROMPTS = ('def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n',
           'def is_palindrome(s: str) -> bool:\n    """Whether s reads the same backwards, ignoring case."""\n',
           'def flatten(xs: list) -> list:\n    """Flatten a nested list."""\n')


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = SpeculativeGenerator.from_pretrained(args.model, None, dtype=args.dtype, device=args.device)
    ids = [gen.encode(text, chat=False) for text in PROMPTS]
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    dec = gen.decoder("autoregressive")
    dec.generate(ids[0], GenerationConfig(max_new_tokens=4))  # warm-up
    reference = None
    print(f"{args.model}, {args.dtype}, {args.device}, {args.threads} threads, {args.max_new_tokens} new tokens, "
          f"{len(PROMPTS)} code prompts")
    for overlap in (False, True, False, True):
        dec.overlap_rounds = overlap
        t0, tokens, outs = time.perf_counter(), 0, []
        for x in ids:
            r = dec.generate(x, config)
            tokens += len(r.token_ids)
            outs.append(r.token_ids)
        seconds = time.perf_counter() - t0
        reference = reference or outs
        if outs != reference:
            raise SystemExit("the outputs differ between overlap_rounds settings")
        print(f"B=1 overlap_rounds={overlap}: {tokens / seconds:.2f} tok/s ({tokens} tokens, {seconds:.1f} s), "
              f"dropped forwards {dec._engine.stats.num_discarded_forwards} (engine total)")
    reference = None  # in bf16 a batched forward may round differently from one row's: compared among themselves
    for overlap in (False, True, False, True):
        engine = gen.batch_decoder("autoregressive", max_batch_size=len(ids), overlap_rounds=overlap)
        t0 = time.perf_counter()
        out = engine.generate(ids, config)
        seconds = time.perf_counter() - t0
        reference = reference or [r.token_ids for r in out]
        if [r.token_ids for r in out] != reference:
            raise SystemExit("the batched outputs differ between overlap_rounds settings")
        tokens = sum(len(r.token_ids) for r in out)
        print(f"B={len(ids)} overlap_rounds={overlap}: {tokens / seconds:.2f} tok/s ({tokens} tokens, {seconds:.1f} s), "
              f"dropped forwards {engine.stats.num_discarded_forwards}")


if __name__ == "__main__":
    main()
