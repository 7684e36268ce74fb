"""Admitting 4 requests at once into the batched engine: prefills shared (``engine.shared_prefill``) or alone.

Times ``BatchedSpeculativeDecoder.step(decode=False)`` (the admission: every prefill and first token) for
4 prompts of different lengths, with ``shared_prefill`` False then True, ``--repeats`` times (the first
pair includes one-off costs). Prints the prompt lengths and seconds per admission.

    flock /tmp/specdecode-bench.lock env OMP_NUM_THREADS=2 python docs/benchmarks/shared_prefill_cost.py \\
        --model qwen2.5-coder-1.5b-instruct --copies 8 --max-tokens 480
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

import torch  # noqa: E402

from specdecode import GenerationConfig, SpeculativeGenerator  # noqa: E402
from specdecode.engine.batched import BatchedSpeculativeDecoder  # noqa: E402

TEXTS = (
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Write a short story about a robot learning to paint, in three paragraphs, with a twist at the end. " * 2,
    'import numpy as np\n\ndef moving_average(x, w):\n    """Moving average of x over windows of w samples, '
    'as a numpy array of len(x) - w + 1."""\n' * 2,
    "Explain the difference between a process and a thread.",
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="offline name, .gguf path or folder")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--copies", type=int, default=1, help="each prompt text repeated this many times")
    p.add_argument("--max-tokens", type=int, default=500, help="each prompt cut to this many tokens")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    gen = SpeculativeGenerator.from_pretrained(args.model, None, dtype=args.dtype, device=args.device)
    prompts = [gen.target.tokenizer(t * args.copies)["input_ids"][: args.max_tokens] for t in TEXTS]
    print(f"{args.model}, {args.dtype}, {args.device}, {torch.get_num_threads()} threads; prompt lengths "
          f"{[len(t) for t in prompts]}")
    config = GenerationConfig(max_new_tokens=1)
    for rep in range(args.repeats):
        for shared in (False, True):
            engine = BatchedSpeculativeDecoder(gen.target.model, None, max_batch_size=4, max_length=1024,
                                               shared_prefill=shared)
            for prompt in prompts:
                engine.add(prompt, config)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.step(decode=False)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            print(f"repeat {rep}, shared_prefill={shared}: admission of 4 in {time.perf_counter() - t0:.3f} s")


if __name__ == "__main__":
    main()
