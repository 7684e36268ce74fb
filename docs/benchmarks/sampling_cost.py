"""Sampling's cost on a CPU: each change that made it cheaper, against what came before it, end to end.

Three changes of 2026-11-29 cut the host's work of sampling (greedy included) with V = 151,936 logits:

- ``--side nucleus``: ``Sampler.nucleus_probs`` finds a row's nucleus under top-p (the target's p and the
  draft's q) among its ``sampling.NUCLEUS_CANDIDATES`` most likely tokens. Before: the same rule after sorting
  every logit (``NUCLEUS_CANDIDATES = ()``), what a GPU runs. Until e014f5b, ``()`` meant transformers'
  ``TopPLogitsWarper`` instead; tables taken before it compared against that.
- ``--side draws``: ``Sampler.exponential`` fills the race's Exp(1) noise from float64 uniforms, the values
  ``Tensor.exponential_`` gives, bit for bit. Before: ``exponential_`` itself.
- ``--side greedy`` (run it with ``--temperature 0``): ``sampling.greedy_tokens`` and ``sampling.finite_rows``
  take the argmax and the finiteness flags through ``max(-1).indices`` and ``amax``/``amin`` on a CPU. Before:
  ``argmax`` and ``isfinite(...).all(-1)``, switched in every module that imports the two.

Each side changes that one thing; the others are as the tree has them. This script runs the default method
(``cascade`` with adaptive draft exit, int4 draft, bf16 target: the CLI's CPU defaults) on HumanEval and
Spec-Bench prompts, sampling (with top-p unless ``--top-p 1``), in one process. Each prompt runs with each
setting twice, alternating ABBA, with the same seed. It prints decode tok/s, α and τ per set, and how many
prompts gave the same tokens in all four runs.

Usage (from the project root, alone on the machine)::

    flock /tmp/specdecode-bench.lock env OMP_NUM_THREADS=2 python docs/benchmarks/sampling_cost.py \\
        --side nucleus --prompts 5 --top-p 0.95

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
from specdecode.drafters import base, cascade, draft_tree  # noqa: E402
from specdecode.engine import batched, bucket_functions, sampling, verification  # noqa: E402


def _exponential_(self, out: torch.Tensor) -> torch.Tensor:  # ``Sampler.exponential`` before eb2fe0a
    return out.exponential_(generator=self.generator)


def _argmax(logits: torch.Tensor) -> torch.Tensor:  # ``sampling.greedy_tokens`` before 1cc326e
    return logits.argmax(-1)


def _isfinite_all(logits: torch.Tensor) -> torch.Tensor:  # ``sampling.finite_rows`` before 1cc326e
    return torch.isfinite(logits).all(-1)


#: Per side: the table's column, the (object, attribute) pairs switched, and per arm (before, now) its label and
#: the pairs' values; "now" is the attributes as the tree has them.
SIDES = {
    "nucleus": ("nucleus", [(sampling, "NUCLEUS_CANDIDATES")], "sort of all V", [()],
                "top " + ", then ".join(map(str, sampling.NUCLEUS_CANDIDATES))),
    "draws": ("Exp(1) noise", [(sampling.Sampler, "exponential")], "exponential_", [_exponential_],
              "float64 rand, log1p"),
    "greedy": ("greedy choice, finiteness",
               [*((m, name) for m in (sampling, verification, bucket_functions, base, cascade)
                  for name in ("greedy_tokens", "finite_rows")),
                (draft_tree, "finite_rows"), (batched, "greedy_tokens")],
               "argmax, isfinite(...).all(-1)", None, "max(-1).indices, amax/amin"),
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--side", choices=sorted(SIDES), default="nucleus", help="which change to measure (see above)")
    p.add_argument("--prompts", type=int, default=5, help="prompts per set (HumanEval, Spec-Bench)")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--max-new-tokens", type=int, default=96)
    args = p.parse_args(argv)
    column, switched, before_label, before, now_label = SIDES[args.side]
    if before is None:  # the greedy side: each module's two names, as they were
        before = [_argmax if name == "greedy_tokens" else _isfinite_all for _, name in switched]
    now = [owner.__dict__[attribute] for owner, attribute in switched]
    arms = {"before": (before_label, before), "now": (now_label, now)}

    def switch(values: list) -> None:
        for (owner, attribute), value in zip(switched, values):
            setattr(owner, attribute, value)
    sets = {"humaneval": load_prompts("humaneval", limit=args.prompts),
            "spec-bench": load_prompts("spec-bench", limit_per_category=1, limit=args.prompts)}
    gen = SpeculativeGenerator.from_pretrained(dtype="bfloat16", draft_quantize="int4", draft_quantize_head="int4")
    control = DraftControl(adaptive_exit=True)
    outputs: set = set()  # one prompt's token sequences over its four runs

    def run(prompt, seed: int, arm: str) -> dict:
        switch(arms[arm][1])
        config = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                  top_p=args.top_p, seed=seed, stop_on_eos=False)
        result = gen.generate(prompt.text, config, method="cascade", chat=prompt.chat, draft_control=control,
                              max_model_prompt_tokens=512)
        outputs.add(tuple(result.token_ids))
        s = result.stats
        return dict(decode_s=s.decode_time_s, tokens=s.num_new_tokens, drafted=s.num_drafted_tokens,
                    accepted=s.num_accepted_tokens, target_forwards=s.num_target_forwards)

    same = 0  # prompts whose four runs gave the same tokens
    totals: dict = {}
    try:
        run(sets["humaneval"][0], 0, "now")  # warm-up
        for name, prompts in sets.items():
            for i, prompt in enumerate(prompts):
                outputs.clear()
                for arm in ("before", "now", "now", "before") if i % 2 == 0 else ("now", "before", "before", "now"):
                    res = run(prompt, 100 + i, arm)
                    total = totals.setdefault((name, arm), dict.fromkeys(res, 0))
                    for key, value in res.items():
                        total[key] += value
                    print(name, i, arms[arm][0], res, file=sys.stderr, flush=True)
                same += len(outputs) == 1
    finally:
        switch(now)
    flags = ""
    with contextlib.suppress(OSError, StopIteration):
        line = next(x for x in open("/proc/cpuinfo") if x.startswith("flags"))
        flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in line.split())
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()} ({flags}), "
          f"{torch.get_num_threads()} threads; temperature {args.temperature}, top-p {args.top_p}; "
          f"prompts with the same tokens in all four runs: {same} of {sum(map(len, sets.values()))}")
    print(f"| set | {column} | decode tok/s | α | τ (tokens per target forward) | target forwards | tokens |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for (name, arm), t in totals.items():
        print(f"| {name} | {arms[arm][0]} ({arm}) | {t['tokens'] / t['decode_s']:.2f} | "
              f"{t['accepted'] / t['drafted']:.1%} | {t['tokens'] / t['target_forwards']:.2f} | "
              f"{t['target_forwards']} | {t['tokens']} |")


if __name__ == "__main__":
    main()
