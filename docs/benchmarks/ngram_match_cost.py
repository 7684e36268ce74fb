"""Host time of prompt lookup's n-gram match per row and round: ``drafters.prompt_lookup.match_continuation``.

Prompt lookup (and the cascade's n-gram part) matches each row's last n-gram against its whole sequence on
the host, every round, so at B rows it costs B matches a round, on the host, between the target's graphs.
This times one match, and the ``np.asarray`` of the row's token list that once preceded it in ``propose``, on
random sequences of L tokens from a vocabulary of V (the last 3 tokens copied from the middle, so a 3-gram
matches); then ``PromptLookupDrafter.propose`` itself for B rows of L tokens, round after round as the engine
runs it (each row then takes 3 tokens, and the drafter's ``rollback`` gets each row's confirmed count), per
round and per row; and a token tree's several continuations (``find_continuations``, ``branches`` > 1). With
whichever ``specdecode`` is importable (``PYTHONPATH=<tree>/src`` picks a tree)::

    flock /tmp/specdecode-bench.lock env PYTHONPATH=$PWD/src OMP_NUM_THREADS=1 \\
        python docs/benchmarks/ngram_match_cost.py

About a minute. Prints microseconds per call, the best of ``--repeats`` timings of ``--number`` calls.
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import random
import sys
import timeit
from pathlib import Path

import numpy as np

if importlib.util.find_spec("specdecode") is None:  # not installed, no PYTHONPATH: this tree's src
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from specdecode.drafters.prompt_lookup import PromptLookupDrafter, find_continuations, match_continuation  # noqa: E402


class _Cache:
    device = "cpu"
    num_slots = 64


def propose_us(rows: int, length: int, vocab: int, rounds: int, repeats: int, rng: random.Random) -> float:
    """Microseconds per ``propose`` of ``rows`` rows (``length`` tokens at the start), the best of ``repeats``
    runs of ``rounds`` rounds; each round appends 3 tokens to every row, then calls ``rollback``."""
    best = float("inf")
    for _ in range(repeats):
        drafter = PromptLookupDrafter()
        drafter.bind(_Cache())
        sequences = [[rng.randrange(vocab) for _ in range(length)] for _ in range(rows)]
        for slot, seq in enumerate(sequences):
            drafter.join(slot, None, None)
        seconds = 0.0
        for _ in range(rounds):
            t0 = timeit.default_timer()
            drafter.propose(sequences, [5] * rows)
            seconds += timeit.default_timer() - t0
            for seq in sequences:
                seq += [rng.randrange(vocab) for _ in range(3)]
            drafter.rollback([len(seq) - 1 for seq in sequences])
        best = min(best, seconds / rounds * 1e6)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--lengths", default="100,400,1500")
    p.add_argument("--vocabs", default="256,151936", help="256: the tiny test models; 151936: Qwen2.5's")
    p.add_argument("--number", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rows", default="1,8,32", help="B for the propose table")
    p.add_argument("--rounds", type=int, default=100, help="propose calls a run")
    p.add_argument("--tables", default="match,propose,trees",
                   help="which tables: match (one match), propose (B rows a round), trees (find_continuations)")
    args = p.parse_args()
    flags = [f for f in ("avx512_bf16", "amx_bf16", "avx512f", "avx2") if f in Path("/proc/cpuinfo").read_text()] \
        if Path("/proc/cpuinfo").exists() else []
    print(f"numpy {np.__version__}, {platform.machine()} ({', '.join(flags) or 'flags unknown'}), "
          f"specdecode from {Path(sys.modules['specdecode'].__file__).parents[1]}")
    tables = set(args.tables.split(","))
    rng = random.Random(0)

    def planted(vocab: int, length: int) -> list[int]:
        tokens = [rng.randrange(vocab) for _ in range(length)]
        tokens[-3:] = tokens[length // 2 : length // 2 + 3]  # a 3-gram that matches
        return tokens

    def best(fn) -> float:
        return min(timeit.repeat(fn, number=args.number, repeat=args.repeats)) / args.number * 1e6

    vocabs = [int(v) for v in args.vocabs.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]
    if "match" in tables:
        print("| V | L | np.asarray of the list, us | match_continuation(γ=6, n 3..1), us | n matched |")
        print("|---:|---:|---:|---:|---:|")
        for vocab in vocabs:
            for length in lengths:
                tokens = planted(vocab, length)
                host = np.asarray(tokens, dtype=np.int64)
                as_us = best(lambda: np.asarray(tokens, dtype=np.int64))
                match_us = best(lambda: match_continuation(host, 6, 3, 1))
                print(f"| {vocab} | {length} | {as_us:.1f} | {match_us:.1f} | {match_continuation(host, 6, 3, 1)[1]} |")
    if "propose" in tables:
        print("\n| V | L at the start | B | propose, us a round | us a row |")
        print("|---:|---:|---:|---:|---:|")
        for vocab in vocabs:
            for length in lengths:
                for rows in (int(r) for r in args.rows.split(",")):
                    us = propose_us(rows, length, vocab, args.rounds, args.repeats, rng)
                    print(f"| {vocab} | {length} | {rows} | {us:.1f} | {us / rows:.1f} |")
    if "trees" in tables:
        print("\n| V | L | find_continuations(5 tokens, n 3..1, 3 branches), us | branches found |")
        print("|---:|---:|---:|---:|")
        for vocab in vocabs:
            for length in lengths:
                host = np.asarray(planted(vocab, length), dtype=np.int64)
                us = best(lambda: find_continuations(host, 5, 3, 1, 3))
                print(f"| {vocab} | {length} | {us:.1f} | {len(find_continuations(host, 5, 3, 1, 3))} |")


if __name__ == "__main__":
    main()
