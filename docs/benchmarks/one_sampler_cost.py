"""What one speculative sampler costs against the two it replaced (2026-11-29), per call of the verification.

Until 7b57634 ``engine/verification.py`` held two implementations of speculative sampling (Leviathan et al. 2022,
Algorithm 1): ``rejection_sample_device`` for one row, which ``rejection_sample_rows`` called when m = 1, and the
batched body for m > 1. Now ``rejection_sample_rows`` alone runs every m, and picks each row's p_n and q_n by
row index rather than by a ``gather`` over the vocabulary. This script times ``rejection_sample_rows`` of both
versions on the same inputs, alternated ABAB: the version of ``--before`` (read with ``git show``, so it needs
this repository's history) and this tree's.

Inputs: V = 151,936 (the Qwen2.5 vocabulary), γ = 5 drafted tokens a row, every row drafting γ; m = 1 with a
draft's q and with a one-hot q (prompt lookup), and m = 8 rows with a draft's q sharing one generator (requests
without a seed; every row drafting γ with one generator is the new code's best case). It also counts the aten
operations of one call (``TorchDispatchMode``; views included): on CUDA each that computes is a kernel launch,
the cost that matters there. The draws are the same in both versions (``tests/engine/test_verification.py``
checks each row bit for bit against a plain Algorithm 1), so only the time differs.

Usage (from the project root, alone on the machine; the figures name its CPU)::

    flock /tmp/specdecode-bench.lock env OMP_NUM_THREADS=2 python docs/benchmarks/one_sampler_cost.py

Under a minute on a 2-core AMD EPYC.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time

import torch

from revisions import ROOT, OpCount, machine_line, module_at

if importlib.util.find_spec("specdecode") is None:  # not installed, no PYTHONPATH: this tree's src
    sys.path.insert(0, str(ROOT / "src"))

from specdecode import GenerationConfig  # noqa: E402
from specdecode.engine import verification  # noqa: E402
from specdecode.engine.sampling import Sampler  # noqa: E402

VOCAB, GAMMA = 151_936, 5


def cases(generator: torch.Generator):
    """(name, rows m, draft q or None) with the target's p (m, γ + 1, V) and the drafted tokens (m, γ)."""
    for name, m, one_hot in (("m = 1, a draft's q", 1, False), ("m = 1, one-hot q", 1, True),
                             ("m = 8, a draft's q, one shared generator", 8, False)):
        probs = torch.softmax(torch.randn(m, GAMMA + 1, VOCAB, generator=generator) * 3, -1)
        q = None if one_hot else torch.softmax(torch.randn(m, GAMMA, VOCAB, generator=generator) * 3, -1)
        drafted = torch.randint(0, VOCAB, (m, GAMMA), generator=generator)
        yield name, probs, drafted, q


def time_calls(module, probs, drafted, q, calls: int) -> float:
    """ms per call of ``module.rejection_sample_rows`` (after 5 warm-up calls)."""
    m = probs.shape[0]
    shared = torch.Generator().manual_seed(0)
    samplers = [Sampler(GenerationConfig(temperature=0.8), VOCAB, "cpu", generator=shared) for _ in range(m)]
    for _ in range(5):
        module.rejection_sample_rows(samplers, probs, drafted, [GAMMA] * m, q)
    start = time.perf_counter()
    for _ in range(calls):
        module.rejection_sample_rows(samplers, probs, drafted, [GAMMA] * m, q)
    return (time.perf_counter() - start) / calls * 1e3


def count_ops(module, probs, drafted, q) -> int:
    """aten operations in one call of ``module.rejection_sample_rows``."""
    m = probs.shape[0]
    shared = torch.Generator().manual_seed(0)
    samplers = [Sampler(GenerationConfig(temperature=0.8), VOCAB, "cpu", generator=shared) for _ in range(m)]
    with OpCount() as counter:
        module.rejection_sample_rows(samplers, probs, drafted, [GAMMA] * m, q)
    return counter.ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default="7b57634", help="the revision with the two implementations")
    parser.add_argument("--calls", type=int, default=200, help="timed calls per measurement (m = 8: a quarter)")
    parser.add_argument("--repeats", type=int, default=3, help="ABAB pairs per case")
    args = parser.parse_args()
    before = module_at(args.before, "src/specdecode/engine/verification.py", "verification_before")
    print(f"{machine_line()}; before = {args.before}, after = this tree")
    print("| case | before, ms a call | after, ms a call | after ÷ before | aten ops a call, before → after |\n"
          "|---|---:|---:|---:|---:|")
    for name, probs, drafted, q in cases(torch.Generator().manual_seed(0)):
        calls = args.calls if probs.shape[0] == 1 else max(1, args.calls // 4)
        times = {"before": [], "after": []}
        for _ in range(args.repeats):
            times["before"].append(time_calls(before, probs, drafted, q, calls))
            times["after"].append(time_calls(verification, probs, drafted, q, calls))
        b, a = min(times["before"]), min(times["after"])  # the fastest of the repeats
        ops = f"{count_ops(before, probs, drafted, q)} → {count_ops(verification, probs, drafted, q)}"
        print(f"| {name} | {b:.3f} | {a:.3f} | {a / b:.2f} | {ops} |")


if __name__ == "__main__":
    main()
