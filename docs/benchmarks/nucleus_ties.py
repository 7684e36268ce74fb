"""Top-p's kept sets on real logits: ``Sampler.nucleus_probs`` against its own full sort and transformers' warper.

``Sampler.nucleus_probs`` keeps a group of tied logits across the top-p boundary whole; transformers'
``TopPLogitsWarper`` keeps the part of it that ``torch.sort`` (not stable on a CPU) happens to rank first. This
script takes the real Qwen2.5-Coder 1.5B target's bfloat16 logits at every position of 4 HumanEval and 4
Spec-Bench prompts (up to 400 tokens each) and, for temperatures 0.7 and 1.0 and top-p 0.8-0.99, counts the rows
whose kept set differs:

- between the CPU's candidates (``NUCLEUS_CANDIDATES``) and the full sort (``()``): none is expected;
- between ``nucleus_probs`` and transformers' warpers, and how many of those differ only by tokens that share
  the smallest kept logit (a tie group kept whole).

Usage (from the project root; about 2 minutes on a 2-core EPYC)::

    env OMP_NUM_THREADS=2 python docs/benchmarks/nucleus_ties.py
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
from transformers.generation.logits_process import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

if importlib.util.find_spec("specdecode") is None:  # not installed, no PYTHONPATH: this tree's src
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from specdecode import SpeculativeGenerator  # noqa: E402
from specdecode.bench.datasets import load_prompts  # noqa: E402
from specdecode.config import GenerationConfig  # noqa: E402
from specdecode.engine import sampling  # noqa: E402
from specdecode.engine.sampling import Sampler  # noqa: E402


def main() -> None:
    gen = SpeculativeGenerator.from_pretrained(dtype="bfloat16")
    rows = []
    for prompt in [*load_prompts("humaneval", limit=4), *load_prompts("spec-bench", limit_per_category=1, limit=4)]:
        ids = torch.as_tensor(gen.encode(prompt.text, prompt.chat)).view(1, -1)[:, :400]
        with torch.inference_mode():
            rows.append(gen.target.model(ids).logits[0])
    logits = torch.cat(rows)
    vocab = logits.shape[-1]
    print(f"{len(logits)} positions of the real Qwen2.5-Coder 1.5B's bfloat16 logits, V = {vocab}")
    print("| temperature | top-p | rows differing: candidates vs sort | vs transformers | of those, a tie group "
          "kept whole | largest total variation vs transformers | nucleus > 256 | > 4,096 |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    candidates = sampling.NUCLEUS_CANDIDATES
    for temperature in (0.7, 1.0):
        for top_p in (0.8, 0.9, 0.95, 0.99):
            sampler = Sampler(GenerationConfig(temperature=temperature, top_p=top_p), vocab, "cpu")
            reference = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopPLogitsWarper(top_p)])
            chunks = logits.split(64)
            got = torch.cat([sampler.probs(c) for c in chunks])
            try:
                sampling.NUCLEUS_CANDIDATES = ()
                sort = torch.cat([sampler.probs(c) for c in chunks])
            finally:
                sampling.NUCLEUS_CANDIDATES = candidates
            warper = torch.cat([torch.softmax(reference(torch.empty(0, dtype=torch.long), c.float()), -1)
                                for c in chunks])  # transformers' warpers over all V
            ours, theirs = got > 0, warper > 0
            differ = (ours != theirs).any(-1)
            scaled = logits.float() / temperature
            tied = 0
            for r in torch.nonzero(differ).flatten().tolist():
                extra = ours[r] & ~theirs[r]
                tied += bool(not (theirs[r] & ~ours[r]).any() and (scaled[r][extra] == scaled[r][ours[r]].min()).all())
            size = ours.sum(-1)
            tv = 0.5 * (got - warper).abs().sum(-1)
            print(f"| {temperature} | {top_p} | {int((ours != (sort > 0)).any(-1).sum())} | {int(differ.sum())} | "
                  f"{tied} | {tv.max().item():.3f} | {int((size > 256).sum())} | {int((size > 4096).sum())} |")


if __name__ == "__main__":
    main()
