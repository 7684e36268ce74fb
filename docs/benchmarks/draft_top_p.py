"""A draft's q under top-p: warped over the whole vocabulary (as before 2026-11-29) or over its top tokens.

``Sampler.draft_probs`` warps a draft model's q over each row's ``sampling.DRAFT_TOP_TOKENS`` most likely
tokens when top-p is on, because transformers' ``TopPLogitsWarper`` sorts all V logits at every draft step.
This script runs the default method (``cascade`` with adaptive draft exit, int4 draft, bf16 target: the CLI's
CPU defaults) on HumanEval and Spec-Bench prompts, sampling with top-p, in one process. Each prompt runs with
the whole-vocabulary q (``DRAFT_TOP_TOKENS`` set past V) and with the default, alternating ABBA. Same seeds for
both. It prints decode tok/s, α and τ per set. Speculative sampling is exact for any q, so only speed and
acceptance can differ.

Usage (from the project root, alone on the machine)::

    flock /tmp/specdecode-bench.lock env OMP_NUM_THREADS=2 python docs/benchmarks/draft_top_p.py \\
        --prompts 5 --top-p 0.95

About 6 minutes on a 2-core EPYC. Per-run lines go to stderr; the table to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import platform
import sys
from pathlib import Path

import torch

if importlib.util.find_spec("specdecode") is None:  # not installed, no PYTHONPATH: this tree's src
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from specdecode import DraftControl, GenerationConfig, SpeculativeGenerator  # noqa: E402
from specdecode.bench.datasets import load_prompts  # noqa: E402
from specdecode.engine import sampling  # noqa: E402

WHOLE = 10**9  # DRAFT_TOP_TOKENS past any vocabulary: the whole-vocabulary q


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=5, help="prompts per set (HumanEval, Spec-Bench)")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--max-new-tokens", type=int, default=96)
    args = p.parse_args(argv)
    default_k = sampling.DRAFT_TOP_TOKENS
    sets = {"humaneval": load_prompts("humaneval", limit=args.prompts),
            "spec-bench": load_prompts("spec-bench", limit_per_category=1, limit=args.prompts)}
    gen = SpeculativeGenerator.from_pretrained(dtype="bfloat16", draft_quantize="int4", draft_quantize_head="int4")
    control = DraftControl(adaptive_exit=True)

    def run(prompt, seed: int, k: int) -> dict:
        sampling.DRAFT_TOP_TOKENS = k
        config = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                  top_p=args.top_p, seed=seed, stop_on_eos=False)
        s = gen.generate(prompt.text, config, method="cascade", chat=prompt.chat, draft_control=control,
                         max_model_prompt_tokens=512).stats
        return dict(decode_s=s.decode_time_s, tokens=s.num_new_tokens, drafted=s.num_drafted_tokens,
                    accepted=s.num_accepted_tokens, target_forwards=s.num_target_forwards)

    try:
        run(sets["humaneval"][0], 0, default_k)  # warm-up
        totals: dict = {}
        for name, prompts in sets.items():
            for i, prompt in enumerate(prompts):
                for k in ((WHOLE, default_k, default_k, WHOLE) if i % 2 == 0 else (default_k, WHOLE, WHOLE, default_k)):
                    res = run(prompt, 100 + i, k)
                    total = totals.setdefault((name, k), dict.fromkeys(res, 0))
                    for key, value in res.items():
                        total[key] += value
                    print(name, i, "whole" if k == WHOLE else f"top {k}", res, file=sys.stderr, flush=True)
    finally:
        sampling.DRAFT_TOP_TOKENS = default_k
    flags = ""
    with contextlib.suppress(OSError, StopIteration):
        line = next(x for x in open("/proc/cpuinfo") if x.startswith("flags"))
        flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in line.split())
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()} ({flags}), "
          f"{torch.get_num_threads()} threads; temperature {args.temperature}, top-p {args.top_p}")
    print("| set | draft q | decode tok/s | α | τ (tokens per target forward) | target forwards | tokens |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for (name, k), t in totals.items():
        print(f"| {name} | {'whole vocabulary' if k == WHOLE else f'top {k}'} | {t['tokens'] / t['decode_s']:.2f} | "
              f"{t['accepted'] / t['drafted']:.1%} | {t['tokens'] / t['target_forwards']:.2f} | "
              f"{t['target_forwards']} | {t['tokens']} |")


if __name__ == "__main__":
    main()
