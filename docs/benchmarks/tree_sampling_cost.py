"""What sampling token trees on the device costs against the row-by-row walk it replaced (2026-11-29), per round.

Until 44e2e91 the batched engine sampled each tree row after the round's read, alone, with
``engine.tree.tree_rejection_sample``: one candidate at a time, reading the mass left, a uniform, and p and q at
the candidate back to the host for each one examined. Now ``engine.tree_sampling.tree_rejection_sample_rows``
tests every node's candidates at once for all the rows, walks the accepted paths on the device, and reads
nothing; the round reads the verdicts with its one sync. This script times both on the same inputs, alternated
ABAB: the old function (read from ``--before`` with ``git show``, so it needs this repository's history), called
once per row, against one call of the new one followed by the one ``tolist`` of its verdicts that the round's sync
stands for. It counts, per round, the aten operations (``TorchDispatchMode``; views included; on CUDA each that
computes is a kernel launch) and the values read back to the host one by one (``aten._local_scalar_dense``:
``float()``, ``int()``, ``item()``; each is a host sync on CUDA). The two draw differently (the new one draws a
uniform for every candidate, reached or not), so their tokens differ; both laws are the target's
(``tests/engine/test_tree_sampling.py``).

Inputs: V = 151,936 (the Qwen2.5 vocabulary); a target p per node (softmax of N(0, 3²) logits) and
- "draft tree": a draft model's tree, ``--draft-tree-depth 4`` style: a chain of 4 tokens drawn from q (p's logits
  plus N(0, 1²) noise), and at each of its 4 parents q's two likeliest other tokens (13 nodes);
- "lookup tree": prompt lookup's 3 branches of 4 tokens without q (13 nodes), the first branch p's argmax chain;
m = 1, and m = 4 draft-tree rows, each with its own seed or all sharing one generator (requests without a seed).

Usage (from the project root, alone on the machine; the figures name its CPU)::

    flock /tmp/specdecode-bench.lock env OMP_NUM_THREADS=2 python docs/benchmarks/tree_sampling_cost.py

About a minute on a 2-core AMD EPYC. ``--acceptance 4000`` instead compares the mean accepted length of the
two over 4,000 random draft trees over V = 2,000 (about a minute).
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
from specdecode.engine.sampling import Sampler  # noqa: E402
from specdecode.engine.tree import TokenTree  # noqa: E402
from specdecode.engine.tree_sampling import tree_rejection_sample_rows  # noqa: E402

VOCAB, DEPTH = 151_936, 4


def draft_row(generator: torch.Generator):
    """(p (T, V), tree, tokens, {node: q}) of a draft model's tree: chain nodes 1..4, runners-up 5..12."""
    logits = torch.randn(DEPTH + 1 + 2 * DEPTH, VOCAB, generator=generator) * 3.0
    probs = torch.softmax(logits, -1)
    parents, tokens, q_of = [-1, *range(DEPTH)], [0], {}
    for t in range(DEPTH):  # node t + 1, drawn from q at node t
        q = torch.softmax(logits[t] + torch.randn(VOCAB, generator=generator), -1)
        q_of[t + 1] = q
        tokens.append(int(torch.multinomial(q, 1, generator=generator)[0]))
    for t in range(DEPTH):  # the runners-up of the chain's node t
        q = q_of[t + 1]
        parents += [t, t]
        tokens += [x for x in q.topk(3).indices.tolist() if x != tokens[t + 1]][:2]
    return probs, TokenTree(tuple(parents)), tokens, q_of


def lookup_row(generator: torch.Generator):
    """(p, tree, tokens, None) of prompt lookup's 3 branches of 4 tokens, the first p's argmax chain."""
    probs = torch.softmax(torch.randn(1 + 3 * DEPTH, VOCAB, generator=generator) * 3.0, -1)
    parents, tokens = [-1], [0]
    for branch in range(3):
        for i in range(DEPTH):
            node = len(parents)
            parents.append(0 if i == 0 else node - 1)
            tokens.append(int(probs[parents[-1]].argmax()) if branch == 0 else
                          int(torch.randint(0, VOCAB, (1,), generator=generator)))
    return probs, TokenTree(tuple(parents)), tokens, None


def cases(generator: torch.Generator):
    """(name, rows, shared generator?)."""
    yield "m = 1, draft tree", [draft_row(generator)], False
    yield "m = 1, lookup tree", [lookup_row(generator)], False
    four = [draft_row(generator) for _ in range(4)]
    yield "m = 4, draft trees, own seeds", four, False
    yield "m = 4, draft trees, one shared generator", four, True


def samplers_for(rows, shared: bool) -> list[Sampler]:
    one = torch.Generator().manual_seed(0)
    return [Sampler(GenerationConfig(temperature=1.0, seed=None if shared else j), VOCAB, "cpu",
                    generator=one if shared else None) for j in range(len(rows))]


def before_round(module, samplers, rows) -> None:
    for sampler, (probs, tree, tokens, q_of) in zip(samplers, rows):
        module.tree_rejection_sample(sampler, probs, tree, tokens, q_of)


def after_inputs(rows):
    width = max(tree.num_nodes for _, tree, _, _ in rows)
    probs = torch.zeros(len(rows), width, VOCAB)
    drafted = torch.zeros(len(rows), width - 1, dtype=torch.long)
    for j, (p, tree, tokens, _) in enumerate(rows):
        probs[j, : tree.num_nodes], drafted[j, : tree.num_nodes - 1] = p, torch.tensor(tokens[1:])
    return probs, drafted, [tree for _, tree, _, _ in rows], [q for *_, q in rows]


def after_round(samplers, inputs) -> None:
    probs, drafted, trees, qs = inputs
    verdicts, _ = tree_rejection_sample_rows(samplers, probs, trees, drafted, qs)
    verdicts.tolist()  # what the round's one sync reads


def timed(run, calls: int) -> float:
    for _ in range(3):
        run()
    start = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - start) / calls * 1e3


def acceptance(before, trees: int, vocab: int) -> None:
    """The mean accepted drafted nodes a round, old walk against new, over ``trees`` random draft trees over
    ``vocab`` tokens (each its own p, q and drawn chain): the same algorithm, so the same mean up to chance."""
    global VOCAB
    VOCAB = vocab
    generator = torch.Generator().manual_seed(0)
    old, new = samplers_for([0], False)[0], samplers_for([0], False)[0]
    new.generator.manual_seed(123)
    counts = {"before": [], "after": []}
    for _ in range(trees):
        rows = [draft_row(generator)]
        probs, tree, tokens, q_of = rows[0]
        counts["before"].append(len(before.tree_rejection_sample(old, probs, tree, tokens, q_of)[0]) - 1)
        probs, drafted, trees_, qs = after_inputs(rows)
        counts["after"].append(int(tree_rejection_sample_rows([new], probs, trees_, drafted, qs)[0][0, 0]))
    for name, values in counts.items():
        t = torch.tensor(values, dtype=torch.float64)
        print(f"{name}: mean accepted nodes {t.mean():.3f} ± {t.std() / len(values) ** 0.5:.3f} (standard error), "
              f"rounds by accepted count {torch.bincount(t.long(), minlength=DEPTH + 1).tolist()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default="44e2e91", help="the revision with the row-by-row walk")
    parser.add_argument("--calls", type=int, default=40, help="timed rounds per measurement (m = 4: a quarter)")
    parser.add_argument("--repeats", type=int, default=3, help="ABAB pairs per case")
    parser.add_argument("--acceptance", type=int, default=0, metavar="N",
                        help="instead of timing: the mean accepted length of both over N draft trees, V = 2,000")
    args = parser.parse_args()
    before = module_at(args.before, "src/specdecode/engine/tree.py", "tree_before")
    if args.acceptance:
        acceptance(before, args.acceptance, 2000)
        return
    print(f"{machine_line()}; before = {args.before}, after = this tree")
    print("| case | before, ms a round | after | after ÷ before | aten ops a round, before → after "
          "| scalar reads a round, before → after |\n|---|---:|---:|---:|---:|---:|")
    for name, rows, shared in cases(torch.Generator().manual_seed(0)):
        calls = args.calls if len(rows) == 1 else max(1, args.calls // 4)
        inputs = after_inputs(rows)
        old_samplers, new_samplers = samplers_for(rows, shared), samplers_for(rows, shared)
        times = {"before": [], "after": []}
        for _ in range(args.repeats):
            times["before"].append(timed(lambda: before_round(before, old_samplers, rows), calls))
            times["after"].append(timed(lambda: after_round(new_samplers, inputs), calls))
        b, a = min(times["before"]), min(times["after"])  # the fastest of the repeats
        counts = []
        for run in (lambda: before_round(before, old_samplers, rows), lambda: after_round(new_samplers, inputs)):
            per_round = []
            for _ in range(20):  # the old walk's work depends on its draws: the mean over 20 rounds
                with OpCount() as counter:
                    run()
                per_round.append((counter.ops, counter.reads))
            counts.append(tuple(sum(c[i] for c in per_round) / len(per_round) for i in range(2)))
        print(f"| {name} | {b:.3f} | {a:.3f} | {a / b:.2f} | {counts[0][0]:.0f} → {counts[1][0]:.0f} "
              f"| {counts[0][1]:.1f} → {counts[1][1]:.1f} |")


if __name__ == "__main__":
    main()
