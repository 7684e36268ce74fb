"""Top-p's cost on a CPU: a draft's q over its top tokens, or the target's nucleus among its top tokens.

Two changes of 2026-11-29 and 2026-11-30 avoid sorting all V logits, which transformers' ``TopPLogitsWarper``
does for every row it warps:

- ``--side draft``: ``Sampler.draft_probs`` warps a draft model's q over each row's
  ``sampling.DRAFT_TOP_TOKENS`` most likely tokens. Compared with the whole-vocabulary q (``DRAFT_TOP_TOKENS``
  set past V). Speculative sampling is exact for any q, so only speed and acceptance can differ.
- ``--side target``: ``Sampler.nucleus_probs`` finds the target's nucleus among each row's
  ``sampling.NUCLEUS_CANDIDATES`` most likely tokens, the same law as the sort. Compared with the sort
  (``NUCLEUS_CANDIDATES = ()``); the draft's q is the default in both.

This script runs the default method (``cascade`` with adaptive draft exit, int4 draft, bf16 target: the CLI's
CPU defaults) on HumanEval and Spec-Bench prompts, sampling with top-p, in one process. Each prompt runs with
each setting twice, alternating ABBA, with the same seed. It prints decode tok/s, α and τ per set.

Usage (from the project root, alone on the machine)::

    flock /tmp/specdecode-bench.lock env OMP_NUM_THREADS=2 python docs/benchmarks/top_p_cost.py \\
        --side target --prompts 5 --top-p 0.95

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

#: Per side: the module constant switched, its value before these changes (labelled as such), and the label of
#: the default.
SIDES = {"draft": ("DRAFT_TOP_TOKENS", 10**9, "whole vocabulary", "draft q"),
         "target": ("NUCLEUS_CANDIDATES", (), "sort of all V", "target nucleus")}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=5, help="prompts per set (HumanEval, Spec-Bench)")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--side", choices=sorted(SIDES), default="draft",
                   help="draft: the draft's q over its top tokens; target: the target's nucleus among its top tokens")
    args = p.parse_args(argv)
    name_of, before, before_label, column = SIDES[args.side]
    default_k = getattr(sampling, name_of)

    def label(k) -> str:
        return before_label if k == before else f"top {k}" if isinstance(k, int) else f"top {'/'.join(map(str, k))}"

    sets = {"humaneval": load_prompts("humaneval", limit=args.prompts),
            "spec-bench": load_prompts("spec-bench", limit_per_category=1, limit=args.prompts)}
    gen = SpeculativeGenerator.from_pretrained(dtype="bfloat16", draft_quantize="int4", draft_quantize_head="int4")
    control = DraftControl(adaptive_exit=True)

    def run(prompt, seed: int, k: int) -> dict:
        setattr(sampling, name_of, k)
        config = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                  top_p=args.top_p, seed=seed, stop_on_eos=False)
        result = gen.generate(prompt.text, config, method="cascade", chat=prompt.chat, draft_control=control,
                              max_model_prompt_tokens=512)
        outputs.add(tuple(result.token_ids))
        s = result.stats
        return dict(decode_s=s.decode_time_s, tokens=s.num_new_tokens, drafted=s.num_drafted_tokens,
                    accepted=s.num_accepted_tokens, target_forwards=s.num_target_forwards)

    outputs: set = set()  # one prompt's token sequences over its four runs
    same = 0  # prompts whose four runs gave the same tokens
    try:
        run(sets["humaneval"][0], 0, default_k)  # warm-up
        totals: dict = {}
        for name, prompts in sets.items():
            for i, prompt in enumerate(prompts):
                outputs.clear()
                order = (before, default_k, default_k, before) if i % 2 == 0 else (default_k, before, before, default_k)
                for k in order:
                    res = run(prompt, 100 + i, k)
                    total = totals.setdefault((name, k), dict.fromkeys(res, 0))
                    for key, value in res.items():
                        total[key] += value
                    print(name, i, label(k), res, file=sys.stderr, flush=True)
                same += len(outputs) == 1
    finally:
        setattr(sampling, name_of, default_k)
    flags = ""
    with contextlib.suppress(OSError, StopIteration):
        line = next(x for x in open("/proc/cpuinfo") if x.startswith("flags"))
        flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in line.split())
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()} ({flags}), "
          f"{torch.get_num_threads()} threads; temperature {args.temperature}, top-p {args.top_p}; "
          f"prompts with the same tokens in all four runs: {same} of {sum(map(len, sets.values()))}")
    print(f"| set | {column} | decode tok/s | α | τ (tokens per target forward) | target forwards | tokens |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for (name, k), t in totals.items():
        print(f"| {name} | {label(k)} | {t['tokens'] / t['decode_s']:.2f} | "
              f"{t['accepted'] / t['drafted']:.1%} | {t['tokens'] / t['target_forwards']:.2f} | "
              f"{t['target_forwards']} | {t['tokens']} |")


if __name__ == "__main__":
    main()
