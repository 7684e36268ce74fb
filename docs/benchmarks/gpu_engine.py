"""Issue 28's GPU figures in one command: forward costs, round overhead, single-sequence and batched tables.

Usage on the GPU machine (H100/H200, torch 2.11 + CUDA 13, transformers 5.17, no hub, no network). It
needs the two GGUF files on the machine's disk and the ``gguf`` wheel; ``src/`` travels with the tree
(the script puts it first on ``sys.path`` itself). From the project root, here:

1. ``pip download --no-deps gguf==0.19.0 -d .whl`` and ``echo /.whl/ >> .git/info/exclude``;
2. copy the GGUF files to /tmp/m/big.gguf (target) and /tmp/m/small.gguf (draft) on a warm machine, as
   ``../shared/gpu/README.md`` says ("Real weights on the GPU": ``split_for_device.sh``, then back-to-back
   calls with ``carry=[".gpu-chunks/cN"]``), and check their sha256;
3. then one call, ``run(carry=[".whl"], timeout_s=600, command=...)`` with the command::

    pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
    PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src python3 docs/benchmarks/gpu_engine.py \
        --target /tmp/m/big.gguf --draft /tmp/m/small.gguf 2>&1 | tee $OUT/gpu_engine.log; \
    exit ${PIPESTATUS[0]}

If a cold machine does not fit it in one call, split it: ``--sections forwards,single,rounds`` then
``--sections batched,baselines`` (each call loads the models again: about 15 s once the dense copies
exist in ~/.cache/specdecode). Fewer prompts: ``--prompts 4 --slow-prompts 1``; shorter outputs:
``--max-new-tokens 64``; ``--methods draft,prompt-lookup``; ``--batch-sizes 8,32``. Here, on CPU, with
the offline models (every section end to end, tiny settings)::

    flock /tmp/specdecode-bench.lock env PYTHONPATH=$PWD/src python docs/benchmarks/gpu_engine.py \
        --device cpu --no-compile --prompts 1 --slow-prompts 1 --max-new-tokens 8 --context 32 \
        --repeats 1 --batch-sizes 1,2 --batch-groups 1 --budget-s 5000

Without the GGUF files (copying 1.6 GB takes about 30 calls): ``--random-weights echo --target DIR --draft DIR``
builds both models on the machine from the ``config.json`` in each folder (the target's with its tokenizer
files; copy them from ``~/.cache/specdecode/dense/<model>-bfloat16/``) with random weights that make each model
repeat the last token: the real shapes' forward and round costs, with full acceptance
(``docs/benchmarks/2026-11-27-gpu-h200.md`` has the command). ``--row-buckets batch`` compiles one rows bucket
per batch size (each bucket compiles in 25-40 s on a cold machine). ``--dynamic-shapes`` compiles each runner's
buckets as at most four functions, rows and widths above 1 symbolic (``FastPath.dynamic_shapes``; on a CPU 6
rows buckets compiled in 141 s against 262 s, ``2026-11-27-dynamic-shapes.md``; not yet run on a GPU).

What it prints (each as a Markdown table; warm-up and compilation seconds apart from timed runs):

1. ``forwards``: ms per forward through the round's runners (``specdecode.engine.batch_runner.BatchRunner``)
   of the ``draft`` method's one-row engine, sized for the longest prompt before ``single`` runs on it:
   the target at its widths 1 and γ + 1 (with the adaptive methods, also the adaptive engine's
   target at its longest block + 1), the draft model at 1 and 2, and on the fast path with ``draft-fused`` in
   ``--methods`` the draft's fused γ - 1 steps (``BatchRunner.draft_steps``: one call, one graph; ms per
   call and per step; 113-124 s to compile cold on an H200). After
   ``--context`` (300) tokens in slot 0; ``--repeats`` calls at the same position (the static cache:
   each call overwrites the last) between ``torch.cuda.synchronize()``s, after 3 untimed ones.
2. ``single``: greedy, ``--max-new-tokens`` (128), ``--prompts`` (8) held-out code prompts
   (HumanEval-style stubs, continued raw) and 8 prose prompts (MT-bench-style, chat template), whole
   prompt timed: ``hf-generate-static`` and our fast-path methods. tok/s, × compiled
   ``autoregressive``, acceptance rate α and τ (tokens per target forward, bonus counted).
   ``draft-tree`` and ``cascade-tree`` (issue 29): ``draft`` and ``cascade`` drafting token trees
   (``specdecode.drafters.draft_tree``): ``--draft-tree-depth`` (5) draft steps, as ``draft``'s γ, and
   ``--tree-nodes`` (16) nodes a round, the chain and its steps' runners-up; α counts every node.
   ``draft-tree-expand``: ``draft`` growing EAGLE-2's dynamic tree, the ``--draft-tree-expand`` (4) best
   nodes of each depth expanded by one draft tree forward (``--draft-tree-depth`` - 1 of them).
   On CUDA the tree rows take its default shapes, chosen from each row's earlier rounds (``tree_shape=
   "previous-round"``, ``drafters.draft_tree.shaped_trees``): no host sync in the drafter, the target's tree
   forward enqueued behind the draft's steps (on a CPU, ``draft-tree`` is ``draft-tree-per-round``).
   ``draft-tree-per-round``: ``draft-tree`` with each tree grown from its round's own values, read back first
   (the CPU default): the A/B of that sync against the older shape's τ.
   ``prompt-lookup-datastore`` (issue 30): ``prompt-lookup`` with the standard library's datastore
   (``prompt_lookup_datastore="python-stdlib"``; its default with a llama.cpp target, none with torch's:
   this row says whether it pays where verification is flat).
   The adaptive draft exit's reads (issue 28 item 3, ``specdecode.engine.draft_exit``): ``draft+adaptive``
   and ``cascade+adaptive`` run the default, "per-step" (each draft step's confidence read on the host,
   one sync per draft token; fastest on a CPU); ``draft+adaptive-masked`` reads nothing between draft
   steps (the whole cap drafted, each block cut after its first unsure token with the round's one read);
   ``...-previous-round`` reads nothing between draft steps either: each block as long as the previous
   round's up to its first unsure token, kept whole. masked can run its draft steps as one graph (the fused
   steps below, with ``draft-fused``'s switch), previous-round where it drafts the longest block. These rows
   say which pays (on the Xeon, per-step: previous-round's τ is 24% lower on code and 6% on prose; masked
   drafts twice the tokens).
   ``draft-fused``: ``draft`` with its drafter's ``fused_draft_steps`` on (off by default since it did not
   pay on an H200), the γ - 1 draft steps after the first as one graph: the A/B of the fused draft steps.
   ``autoregressive-captured``, ``draft-captured``, ``prompt-lookup-captured``: those methods with CUDA graphs
   of specdecode's own (``graphs="captured"``: compiled without torch.compile's graphs, one
   ``torch.cuda.CUDAGraph`` per bucket captured and replayed, ``engine.batch_runner``), the A/B of the host
   time a compiled call costs (about 0.3-0.8 ms on an H200); their buckets compile apart (cold: 25-40 s each).
   Not yet run on a GPU.
   ``autoregressive-serial``: ``autoregressive`` with ``overlap_rounds=False``: each round read back before the
   next forward is enqueued, where the default on CUDA (``engine.overlap``, not yet run on a GPU) enqueues the
   next round's forward on the device's chosen tokens first, so the host's read and emit overlap it: the A/B
   of the overlapped rounds (``--overlap-rounds on`` forces them elsewhere, to run the rows on a CPU). Every other
   ``autoregressive`` row (``-eager``, ``-after-hf``, ``-captured``) overlaps on CUDA too, unlike the H200 run's.
   ``hf-generate-static`` runs after our rows, and ``autoregressive-after-hf`` and ``draft-after-hf`` run our
   engines again after it: on an H200 our rows ran slower after transformers' compiled generate had run in
   the process (``draft`` 30.4 against 15.4 ms a round), cause not found; these rows say whether that holds.
3. ``rounds``: per method, ms per round (decode time / target forwards) and its overhead: the round
   minus the cost of the forwards it ran, each priced at the cost measured as in 1. on the runner that
   ran it, for its width (its compiled bucket). The forwards are counted by wrapping
   ``BatchRunner._forward`` during the timed runs (restored after; about 1 µs a call; prefills do not go
   through it), and ``BatchRunner.draft_steps``, whose call of S fused steps counts as S draft forwards
   of width 1 (priced as such: the ``forwards`` row of the fused steps shows what one call costs); if
   that count disagrees with the stats, it falls back to the stats (target forwards priced by block
   size from ``drafted_by_position``, decode-phase draft forwards at width 1) and says so in the
   table's last column.
4. ``syncs`` (CUDA only): host syncs per round of each fast-path method under
   ``torch.cuda.set_sync_debug_mode("warn")``, one generation of ``--sync-tokens`` (48) on a code prompt,
   greedy and sampling (temperature 0.8, top-p 0.95: speculative sampling on the device, one read a round).
5. ``batched``: total tok/s at B = 1, 8, 32 for autoregressive, draft and prompt-lookup on up to 32
   code prompts (``--batch-groups`` groups of B each), with ``SpeculativeGenerator.batch_decoder``;
   ``compile=True`` is passed on CUDA when ``batch_decoder`` takes it (printed either way). With overlapped
   rounds on (CUDA), ``autoregressive``'s groups run again on the same engine with them off: the A/B table.
6. ``profile``: where the time goes (``gpu_profile.py``, beside this script): ``torch.profiler`` over the
   target's forwards at 1 and γ + 1 tokens and the draft model's at 1 (wall against device busy time, device
   activities, graph and kernel launches, host syncs, per call; the costliest kernels of the target's
   one-token forward), and over one warm generation of the first code prompt per method of ``autoregressive``,
   ``draft``, ``prompt-lookup`` and ``hf-generate-static`` in ``--methods`` (the same per round, and the
   prefill, the rounds and the rest apart, and Python's garbage collections in it, with what a full collection
   costs); ``cProfile`` over ``autoregressive``'s (the host's Python). ``--profile-dir`` (e.g.
   ``$OUT/traces``) keeps each profile's Chrome trace, gzipped. It runs after ``batched``, so that a crash in
   the profiler cannot cost the batched figures. It answers the H200 run's open questions: a 1.5B forward of
   2.60 ms against 0.65 ms of weight traffic, and about 95 ms a prompt outside ``autoregressive``'s rounds.
7. ``baselines``: the slow rows on ``--slow-prompts`` (2) prompts per set: transformers ``generate``
   (eager ``DynamicCache``), ``hf-assisted`` and our eager ``autoregressive``; then the whole
   single-sequence table again.

Time on an H100 (estimated from the 2026-11-25 figures of the GPU README): loading about 15 s once
the dense copies exist, 60-120 s for the first de-quantization; forwards: 6 buckets of 26-43 s of
compilation each with inductor's disk cache cold, 8-14 s warm (a second run on the same machine);
single: 16 prompts x 5 methods x 128 tokens at 190-490 tok/s, about 50 s, plus about 40 s to compile
``hf-generate-static``; batched, eager, about 90 s; baselines about 75 s. Warm about 330 s; all cold
up to 650 s, past the budget. ``--budget-s`` (540) is a deadline from the start, loading included: a
width, prompt or group that would start after it is skipped and named (exit status 2). The sections
run in the order above, so the budget cuts the slow baselines first; a second call, warm, fits.
The rows added since (trees, the datastore, ``draft-fused`` and the three exit-mode rows) add about
10 methods x 16 prompts x 128 tokens, roughly 2 minutes, plus the fused draft steps' graphs (one of
γ - 1 = 4 steps, two of 11 for the adaptive engines, each a whole unrolled draft model: not measured
cold): on a cold machine call ``--sections forwards,single,rounds,syncs`` first, then
``--sections batched,baselines``, or cut ``--methods``.

Exit status: 0 all ran; 1 a section failed (its traceback is printed and the next section runs);
2 none failed but the budget skipped some runs.

On torch releases whose ``torch.compile`` lacks ``isolate_recompiles`` / ``recompile_limit`` (2.11),
the script drops those arguments when specdecode passes them and raises dynamo's recompile limit
to 64, as the issue's own GPU figures were taken; it says so in its header (``--no-compile-shim``:
leave torch.compile alone).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import inspect
import itertools
import logging
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))
if str(Path(__file__).resolve().parent) not in sys.path:  # gpu_profile, beside this script
    sys.path.append(str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import transformers  # noqa: E402

import specdecode  # noqa: E402
from specdecode import DraftControl, GenerationConfig, SpeculativeDecoder, SpeculativeGenerator  # noqa: E402
from specdecode.engine.fast_path import ModelRunner  # noqa: E402

# profile after batched: a crash in the profiler (CUPTI) cannot cost the batched figures
SECTIONS = ("forwards", "single", "rounds", "syncs", "batched", "profile", "baselines")
# name, kind ("ours" | "hf"), base method, adaptive exit (True: per-step, the default; or a DraftControl.exit_mode),
# fast path, slow baseline
METHODS = (
    ("autoregressive", "ours", "autoregressive", False, True, False),
    ("autoregressive-serial", "ours", "autoregressive-serial", False, True, False),
    ("draft", "ours", "draft", False, True, False),
    ("draft-fused", "ours", "draft-fused", False, True, False),
    ("draft+adaptive", "ours", "draft", True, True, False),
    ("cascade+adaptive", "ours", "cascade", True, True, False),
    ("draft+adaptive-previous-round", "ours", "draft", "previous-round", True, False),
    ("draft+adaptive-masked", "ours", "draft", "masked", True, False),
    ("cascade+adaptive-previous-round", "ours", "cascade", "previous-round", True, False),
    ("prompt-lookup", "ours", "prompt-lookup", False, True, False),
    ("prompt-lookup-datastore", "ours", "prompt-lookup-datastore", False, True, False),
    ("token-recycling", "ours", "token-recycling", False, True, False),
    ("draft-tree", "ours", "draft-tree", False, True, False),
    ("draft-tree-per-round", "ours", "draft-tree-per-round", False, True, False),
    ("cascade-tree", "ours", "cascade-tree", False, True, False),
    ("draft-tree-expand", "ours", "draft-tree-expand", False, True, False),
    ("autoregressive-captured", "ours", "autoregressive-captured", False, True, False),
    ("draft-captured", "ours", "draft-captured", False, True, False),
    ("prompt-lookup-captured", "ours", "prompt-lookup-captured", False, True, False),
    # After our rows: our engines ran slower on an H200 once transformers' compiled generate had run.
    ("hf-generate-static", "hf", "hf-generate-static", False, True, False),
    ("autoregressive-after-hf", "ours", "autoregressive", False, True, False),
    ("draft-after-hf", "ours", "draft", False, True, False),
    ("autoregressive-eager", "ours", "autoregressive", False, False, True),
    ("hf-generate", "hf", "hf-generate", False, False, True),
    ("hf-assisted", "hf", "hf-assisted", False, False, True),
)
TABLE_ORDER = ("hf-generate", "hf-generate-static", "hf-assisted", "autoregressive-eager", "autoregressive",
               "autoregressive-serial",
               "draft", "draft-fused", "draft+adaptive", "draft+adaptive-previous-round", "draft+adaptive-masked",
               "cascade+adaptive", "cascade+adaptive-previous-round", "draft-tree", "draft-tree-per-round",
               "cascade-tree", "draft-tree-expand",
               "prompt-lookup", "prompt-lookup-datastore", "token-recycling", "autoregressive-captured",
               "draft-captured", "prompt-lookup-captured", "autoregressive-after-hf", "draft-after-hf")
#: The draft-model tree rows (issue 29): base name -> the method, run with ``draft_tree_depth=--draft-tree-depth``
#: and a budget of ``--tree-nodes`` nodes a round (``specdecode.drafters.draft_tree``); draft-tree-expand also
#: with ``draft_tree_expand=--draft-tree-expand`` (EAGLE-2's expansion, a draft tree forward per depth).
TREE_BASES = {"draft-tree": "draft", "cascade-tree": "cascade", "draft-tree-expand": "draft",
              "draft-tree-per-round": "draft"}
#: Tree rows shaped from each round's own values (``DraftModelDrafter.tree_shape="per-round"``, one host sync more a
#: round), against the other tree rows' CUDA default, shapes from earlier rounds (nothing read before verifying).
PER_ROUND_BASES = {"draft-tree-per-round"}
#: Rows that run another method with options: base name -> (the method, its options).
OPTION_BASES = {"prompt-lookup-datastore": ("prompt-lookup", {"prompt_lookup_datastore": "python-stdlib"})}
#: Rows that run another method with its drafter's fused draft steps on (``fused_draft_steps=True``): the
#: steps after a round's first draft forward one graph each, not one graph in all (``BatchRunner.draft_steps``).
FUSED_BASES = {"draft-fused": "draft"}
#: Rows that run another method with the target's and the drafter's buckets as CUDA graphs of specdecode's own
#: (``graphs="captured"``, ``engine.batch_runner``) rather than torch.compile's: the A/B of the per-call overhead.
CAPTURED_BASES = {"autoregressive-captured": "autoregressive", "draft-captured": "draft",
                  "prompt-lookup-captured": "prompt-lookup"}
#: Rows that run another method with ``overlap_rounds=False`` (``engine.overlap``; on by default on CUDA): each
#: round's read before the next forward is enqueued, the A/B of the overlapped rounds.
SERIAL_BASES = {"autoregressive-serial": "autoregressive"}
OVERLAP = {"auto": None, "on": True, "off": False}  # --overlap-rounds
BATCH_METHODS = ("autoregressive", "draft", "prompt-lookup")
SETS = ("code", "prose")

# Held-out prompts written for this script (none from the repository's data sets).
CODE_PROMPTS = (
    'def run_length_encode(text: str) -> list[tuple[str, int]]:\n    """Return the runs of equal characters in '
    'text as (character, count) pairs, in order.\n    >>> run_length_encode("aaabcc")\n    [(\'a\', 3), (\'b\', 1), '
    '(\'c\', 2)]\n    >>> run_length_encode("")\n    []\n    """\n',
    'def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:\n    """Merge overlapping '
    'closed intervals and return them sorted by start.\n    >>> merge_intervals([(5, 7), (1, 3), (2, 4)])\n    '
    '[(1, 4), (5, 7)]\n    """\n',
    'def is_balanced(expression: str) -> bool:\n    """Return True if every bracket in expression, (), [] or {}, '
    'is closed in the right order; other characters are ignored.\n    >>> is_balanced("f(a[1]) {x}")\n    True\n'
    '    >>> is_balanced("(]")\n    False\n    """\n',
    'def rotate_clockwise(matrix: list[list[int]]) -> list[list[int]]:\n    """Return a new matrix, the given '
    'rectangular matrix turned a quarter clockwise.\n    >>> rotate_clockwise([[1, 2, 3], [4, 5, 6]])\n    '
    '[[4, 1], [5, 2], [6, 3]]\n    """\n',
    'def second_largest_unique(values: list[int]) -> int | None:\n    """Return the second largest distinct value, '
    'or None when there are fewer than two distinct values.\n    >>> second_largest_unique([4, 1, 4, 3])\n    3\n'
    '    >>> second_largest_unique([7, 7])\n    """\n',
    'def top_words(text: str, k: int) -> list[tuple[str, int]]:\n    """Count the words of text (lower-cased, '
    'split on anything that is not a letter) and return the k most frequent as (word, count), ties broken '
    'alphabetically.\n    >>> top_words("The cat and the hat", 2)\n    [(\'the\', 2), (\'and\', 1)]\n    """\n',
    'def spiral_order(grid: list[list[int]]) -> list[int]:\n    """Return the elements of grid read in a '
    'clockwise spiral from the top-left corner.\n    >>> spiral_order([[1, 2, 3], [4, 5, 6], [7, 8, 9]])\n    '
    '[1, 2, 3, 6, 9, 8, 7, 4, 5]\n    """\n',
    'def parse_duration(text: str) -> int:\n    """Return the number of seconds in a duration such as "1h30m", '
    '"45s" or "2h5s" (units h, m, s, each at most once, in that order). Raise ValueError on anything else.\n'
    '    >>> parse_duration("1h30m")\n    5400\n    """\n',
)
PROSE_PROMPTS = (
    "Write a short travel blog post about a weekend in a small coastal town, with its food and one unexpected "
    "encounter.",
    "Explain to a high-school student why the sky is blue and why sunsets are red, in under 200 words.",
    "Draft a polite email to a landlord asking for the repair of a kitchen tap that has leaked for two weeks.",
    "Compare working from home with working in an office: list the advantages and drawbacks of each.",
    "You are a museum guide. Describe a painting of a stormy sea to visitors who cannot see it.",
    "A farmer has 17 sheep and all but 9 run away. How many are left? Reason step by step, then write two "
    "similar puzzles.",
    "Summarize the causes of the French Revolution in three paragraphs for a general audience.",
    "Give me a one-week running plan for a beginner, with a short explanation for each day.",
)
# Shorter stubs: with CODE_PROMPTS, the 32 prompts of the batched table.
_STUBS = (
    ("celsius_to_fahrenheit(celsius: float) -> float", "Convert a temperature from Celsius to Fahrenheit."),
    ("count_vowels(text: str) -> int", "Return how many vowels (a, e, i, o, u, any case) text contains."),
    ("flatten(nested: list[list[int]]) -> list[int]", "Concatenate the inner lists in order."),
    ("is_palindrome(text: str) -> bool", "True if text reads the same backwards, ignoring case and spaces."),
    ("chunk(items: list, size: int) -> list[list]", "Split items into consecutive lists of at most size items."),
    ("gcd(a: int, b: int) -> int", "Greatest common divisor of two non-negative integers (Euclid)."),
    ("transpose(matrix: list[list[int]]) -> list[list[int]]", "Rows become columns."),
    ("unique_in_order(items: list) -> list", "Drop repeated items, keeping the first occurrence of each."),
    ("capitalize_words(sentence: str) -> str", "Upper-case the first letter of every word."),
    ("digits_sum(n: int) -> int", "Sum of the decimal digits of abs(n)."),
    ("moving_average(values: list[float], window: int) -> list[float]", "Means of each full window, in order."),
    ("to_binary(n: int) -> str", "Binary representation of a non-negative integer, without the 0b prefix."),
    ("count_words(text: str) -> dict[str, int]", "How often each whitespace-separated word occurs."),
    ("fibonacci(n: int) -> list[int]", "The first n Fibonacci numbers, starting 0, 1."),
    ("caesar_shift(text: str, shift: int) -> str", "Shift letters by shift places, keeping case; others stay."),
    ("median(values: list[float]) -> float", "Median of a non-empty list (mean of the middle two if even)."),
    ("is_prime(n: int) -> bool", "True if n is a prime number."),
    ("longest_word(sentence: str) -> str", "The longest word; the first one on ties."),
    ("invert_dict(mapping: dict[str, int]) -> dict[int, list[str]]", "Map each value to the sorted keys holding it."),
    ("clamp(x: float, low: float, high: float) -> float", "x limited to the closed range [low, high]."),
    ("snake_to_camel(name: str) -> str", "Convert snake_case to camelCase."),
    ("pairwise_sums(values: list[int], target: int) -> list[tuple[int, int]]", "Index pairs i < j summing to target."),
    ("roman_to_int(numeral: str) -> int", "Value of a Roman numeral such as 'XIV'."),
    ("running_max(values: list[int]) -> list[int]", "Entry i: the largest of values[0..i]."),
)
BATCH_PROMPTS = CODE_PROMPTS + tuple(f'def {sig}:\n    """{doc}"""\n' for sig, doc in _STUBS)
WARMUP_PROMPT = 'def add(a: int, b: int) -> int:\n    """Return the sum of a and b."""\n'


def say(*parts) -> None:
    print(*parts, flush=True)


def table(headers: list[str], rows: list[list]) -> None:
    """Print a Markdown table (first column left-aligned, the others right-aligned)."""
    say("| " + " | ".join(headers) + " |")
    say("|" + "|".join(["---"] + ["---:"] * (len(headers) - 1)) + "|")
    for row in rows:
        say("| " + " | ".join(str(v) for v in row) + " |")


def fmt(value, digits: int = 1, suffix: str = "") -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}{suffix}"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def compile_shim(enabled: bool):
    """On a torch whose ``torch.compile`` lacks ``isolate_recompiles``/``recompile_limit``, drop them from
    every call (and raise dynamo's recompile limit to 64) while the block runs; yields what was dropped."""
    params = inspect.signature(torch.compile).parameters
    missing = [k for k in ("isolate_recompiles", "recompile_limit") if k not in params]
    if not enabled or not missing:
        yield []
        return
    original = torch.compile

    def compat(*args, **kwargs):
        for key in missing:
            kwargs.pop(key, None)
        return original(*args, **kwargs)

    config = torch._dynamo.config
    limit_name = next((n for n in ("recompile_limit", "cache_size_limit") if hasattr(config, n)), None)
    saved = getattr(config, limit_name) if limit_name else None
    torch.compile = compat
    if limit_name:
        setattr(config, limit_name, max(saved, 64))
    try:
        yield missing
    finally:
        torch.compile = original
        if limit_name:
            setattr(config, limit_name, saved)


class ForwardLog:
    """Every decode-time forward of the round while ``recording``: (runner, tokens). Wraps
    ``BatchRunner._forward`` (each forward of the target's and a draft model's runners: their calls, the
    verification's ``forward_greedy`` and ``greedy_steps``' steps; prefills bypass it) and
    ``BatchRunner.draft_steps`` (S fused draft steps: S forwards of 1 token), and restores them in ``finally``."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, int]] = []
        try:
            from specdecode.engine.batch_runner import BatchRunner
        except ImportError:
            BatchRunner = None
        self.runner_class = BatchRunner

    @contextlib.contextmanager
    def recording(self):
        if self.runner_class is None:
            yield
            return
        original, calls = self.runner_class._forward, self.calls  # every forward: calls, forward_greedy, greedy_steps
        original_steps = getattr(self.runner_class, "draft_steps", None)

        def call(runner, ids, *args, **kwargs):
            calls.append((runner, int(ids.shape[1])))
            return original(runner, ids, *args, **kwargs)

        def steps(runner, tokens, starts, num_steps, *args, **kwargs):
            calls.extend([(runner, 1)] * num_steps)
            return original_steps(runner, tokens, starts, num_steps, *args, **kwargs)

        self.runner_class._forward = call
        if original_steps is not None:
            self.runner_class.draft_steps = steps
        try:
            yield
        finally:
            self.runner_class._forward = original
            if original_steps is not None:
                self.runner_class.draft_steps = original_steps


def is_target(runner) -> bool:
    """Whether a round's runner runs the target (the engine names it so; a draft's is "draft model")."""
    return getattr(runner, "name", "") == "target model"


def priced_width(runner, width: int) -> int:
    """The width a forward over ``width`` tokens is priced at: its compiled bucket on the fast path (the
    smallest of the runner's widths that holds it), else itself (eager, or wider than every bucket)."""
    if getattr(runner, "fast", None) is not None:
        return next((b for b in getattr(runner, "widths", ()) if b >= width), width)
    return width


@dataclasses.dataclass
class Tally:
    """One method on one prompt set, summed over prompts."""

    prompts: int = 0
    planned: int = 0
    tokens: int = 0
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    target_forwards: int = 0
    tokens_from_forwards: int = 0
    draft_forwards: int = 0
    decode_s: float = 0.0
    prefill_s: float = 0.0
    warmup_s: float = 0.0
    drafted_by_position: list = dataclasses.field(default_factory=list)
    decode_calls: dict = dataclasses.field(default_factory=dict)  # (runner, priced width) -> forwards
    counted_target: int = 0
    per_prompt: list = dataclasses.field(default_factory=list)  # (prompt index, tokens, seconds)
    outputs: dict = dataclasses.field(default_factory=dict)  # prompt index -> its token ids

    @property
    def tok_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None

    def tok_s_on(self, prompts: set[int]) -> float | None:
        """tok/s over the given prompt indices only (a reference on the same prompts as a shorter row)."""
        done = [(n, s) for i, n, s in self.per_prompt if i in prompts]
        seconds = sum(s for _, s in done)
        return sum(n for n, _ in done) / seconds if len(done) == len(prompts) and seconds > 0 else None

    @property
    def alpha(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tau(self) -> float | None:
        return self.tokens_from_forwards / self.target_forwards if self.target_forwards else None


class Run:
    """What the sections share: options, the generator, measured forward costs, results, the budget."""

    def __init__(self, args, gen: SpeculativeGenerator, start: float) -> None:
        self.args, self.gen, self.start = args, gen, start
        self.device = gen.target.model.device
        self.deadline = start + args.budget_s
        self.costs: dict[tuple[int, int], float] = {}  # (id(runner), priced width) -> ms per forward
        self.decoders: dict[tuple, object] = {}  # (base method, adaptive, fast) -> SpeculativeDecoder
        self.tallies: dict[str, dict[str, Tally]] = {}
        self.warmups: dict[str, float] = {}
        self.skipped: list[str] = []
        self.failures: list[str] = []
        self.overheads: dict[tuple[str, str], float] = {}  # (method, set) -> overhead ms per round
        self.batched: dict[tuple[str, int], dict] = {}  # (method, B) -> results
        self.log = ForwardLog()
        self._encoded: dict = {}
        self._runners: dict[str, object] | None = None
        self._captured: ModelRunner | None = None  # the -captured rows' target runner, one for all of them

    def compile(self) -> bool:
        return not self.args.no_compile

    def use_dynamic_shapes(self) -> str:
        """[--dynamic-shapes] Turn on ``dynamic_shapes`` for the fast path's target runner (so each decoder's
        one-row engine, and its draft model's runner, compile one function per width class); says what it did."""
        if not self.compile():
            return "off (no fast path: --no-compile)"
        runner = self.gen.runner(True)
        if not hasattr(runner, "dynamic_shapes"):
            return "off (this specdecode has no dynamic_shapes)"
        runner.dynamic_shapes = True
        return ("on: rows and widths above 1 symbolic, at most four compiled functions per runner, a CUDA graph per "
                "bucket (the -captured rows and the batched engines too)")

    def captures(self) -> bool:
        """Whether the ``-captured`` rows capture anything: the fast path on, on CUDA."""
        return self.compile() and self.device.type == "cuda"

    def over_budget(self, what: str, estimate_s: float = 0.0) -> bool:
        if time.monotonic() + estimate_s <= self.deadline:
            return False
        self.skipped.append(what)
        say(f"SKIPPED (budget of {self.args.budget_s:.0f} s): {what}")
        return True

    def encoded(self, key: str) -> list[torch.Tensor]:
        if key not in self._encoded:
            code_chat = True if self.args.code_chat else False  # code stubs are continued raw, as in HumanEval
            texts = {"code": (CODE_PROMPTS, code_chat), "prose": (PROSE_PROMPTS, None),
                     "batch": (BATCH_PROMPTS, code_chat), "warmup": ((WARMUP_PROMPT,), code_chat)}
            prompts, chat = texts[key]
            self._encoded[key] = [self.gen.encode(p, chat=chat) for p in prompts]
        return self._encoded[key]

    def decoder(self, base: str, adaptive: bool, fast: bool):
        """The ``SpeculativeDecoder`` of a method, made once: its drafter (a draft model's cache and compiled
        widths) and one-row engine serve every section."""
        key = (base, adaptive, fast)
        if key not in self.decoders:
            mode = {"exit_mode": adaptive} if isinstance(adaptive, str) else {}  # the exit's reads (issue 28 item 3)
            control = DraftControl(adaptive_exit=True, **mode) if adaptive else None
            tree = {"draft_tree_depth": self.args.draft_tree_depth} if base in TREE_BASES else {}
            if base == "draft-tree-expand":
                tree["draft_tree_expand"] = self.args.draft_tree_expand
            method, options = OPTION_BASES.get(base, (TREE_BASES.get(base, FUSED_BASES.get(base, base)), {}))
            method = CAPTURED_BASES.get(base, SERIAL_BASES.get(base, method))
            made = self.gen.decoder(method, draft_control=control, compile=fast and self.compile(), **tree, **options)
            if base in SERIAL_BASES:
                made.overlap_rounds = False
            elif OVERLAP[self.args.overlap_rounds] is not None and hasattr(made, "overlap_rounds"):
                made.overlap_rounds = OVERLAP[self.args.overlap_rounds]
            if base in FUSED_BASES:
                made.drafter.fused_draft_steps = True
            if base in PER_ROUND_BASES:
                made.drafter.tree_shape = "per-round"
            if base in CAPTURED_BASES and made.runner.compile:  # a runner of their own: buckets of their own
                if self._captured is None:
                    self._captured = ModelRunner(made.target, compile=True, graphs="captured", name="target model")
                    self._captured.dynamic_shapes = self.gen.runner(True).dynamic_shapes
                made = SpeculativeDecoder(made.target, made.drafter, eos_token_ids=made.eos_token_ids,
                                          tokenizer=made.tokenizer, draft_control=made.draft_control,
                                          runner=self._captured, overlap_rounds=made.overlap_rounds)
            self.decoders[key] = made
            if base in CAPTURED_BASES and made.runner.compile:  # sized as the other rows' (``engine``)
                self.engine(base, adaptive)
        return self.decoders[key]

    def engine(self, base: str, adaptive: bool):
        """The fast-path decoder's one-row engine of a method, made now if need be, sized for the longest
        prompt and ``--max-new-tokens`` (so ``single`` runs on the same engine, cache and graphs)."""
        dec = self.decoder(base, adaptive, True)
        longest = max(int(t.shape[1]) for k in ("code", "prose", "warmup") for t in self.encoded(k))
        config = GenerationConfig(max_new_tokens=self.args.max_new_tokens, num_speculative_tokens=self.args.gamma)
        return dec._engine_for(config, longest)

    def runners(self) -> dict[str, object]:
        """The round's runners ``forwards`` measures: the target's and the draft model's ``BatchRunner`` of
        the ``draft`` method's one-row engine (``autoregressive``'s without a draft model), and with an
        adaptive method, the target's of ``draft+adaptive``'s engine (wider verifications). Made once and
        kept (a later engine of the same decoder has runners of its own; these still measure as they did)."""
        if self._runners is not None:
            return self._runners
        speculative = self.gen.draft is not None
        engine = self.engine("draft" if speculative else "autoregressive", False)
        out = {"target": engine.runner}
        if speculative:
            out["draft"] = engine.drafter.runner
            if any(m in self.args.methods for m in ("draft+adaptive", "cascade+adaptive")):
                adaptive = self.engine("draft", True).runner
                if adaptive is not engine.runner:
                    out["target (adaptive)"] = adaptive
        if self.captures() and any(m in self.args.methods for m in CAPTURED_BASES):  # priced as the others
            captured = self.engine("draft-captured" if speculative else "autoregressive-captured", False)
            out["target (captured)"] = captured.runner
            if speculative:
                out["draft (captured)"] = captured.drafter.runner
        self._runners = out
        return out


# -- forwards -----------------------------------------------------------------------------------


@torch.inference_mode()
def forward_ms(run: Run, runner, width: int, keep: int = 1, steps: int = 0,
               around: Callable = contextlib.nullcontext) -> tuple[float, float]:
    """(ms per forward over ``width`` tokens after ``--context`` cached, seconds of first calls).

    ``around``: a context manager factory entered around the timed calls alone (``profile`` profiles them).

    ``steps`` > 0: ms per call of the runner's ``steps`` fused one-token draft steps instead
    (``BatchRunner.draft_steps``, greedy, the full head).

    ``runner`` is a round's ``BatchRunner``: the context is prefilled into slot 0 of its cache (shortened
    to fit the slot), then each call writes ``width`` tokens at the position after it, overwriting the
    last call's (a static cache: no rollback to run). The slot holds garbage afterwards, which the next
    generation's prefill overwrites.
    """
    from specdecode.engine.batch_cache import batch_prefill

    args, device, cache = run.args, run.device, runner.cache
    vocab = runner.model.config.get_text_config(decoder=True).vocab_size
    context = max(1, min(args.context, cache.capacity - width))
    ids = torch.randint(3, min(vocab, 5000), (1, context), device=device)
    batch_prefill(runner.model, cache, ids, 0)
    keep = min(keep, width)
    x = ids[:, :width].contiguous() if width <= context else ids[:, -1:].expand(1, width).contiguous()
    if steps:
        context = min(context, cache.capacity - steps)
        call = functools.partial(runner.draft_steps, x[:, 0], [context], steps, None, vocab)
    else:
        call = functools.partial(runner, x, [context], keep)
    c0, t0 = runner.compile_time_s, time.perf_counter()
    for _ in range(3):
        call()
    sync(device)
    first_s = runner.compile_time_s - c0 if runner.fast is not None else time.perf_counter() - t0
    with around():
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            call()
        sync(device)
        ms = 1000 * (time.perf_counter() - t0) / args.repeats
    return ms, first_s


def measure(run: Run, runner, width: int) -> float:
    """The cost of a forward over ``width`` tokens on ``runner``: as measured by ``forwards``, else now."""
    key = (id(runner), priced_width(runner, width))
    if key not in run.costs:
        keep = key[1] if is_target(runner) else 1
        run.costs[key], _ = forward_ms(run, runner, key[1], keep)
    return run.costs[key]


def section_forwards(run: Run) -> None:
    args, runners = run.args, run.runners()
    rows = []
    for name, runner in runners.items():
        # its compiled widths; eager, the widths the rounds run most (one step, a verification, a first feed)
        widths = sorted(set(runner.widths) | ({1, args.gamma + 1} if name == "target" else set()))
        for w in widths:
            if run.over_budget(f"forwards: {name} width {w}"):
                continue
            ms, first_s = forward_ms(run, runner, w, w if is_target(runner) else 1)
            run.costs[(id(runner), priced_width(runner, w))] = ms
            rows.append([name, w, fmt(ms, 2), fmt(ms / w, 3), fmt(first_s, 1)])
            say(f"  {name} width {w}: {ms:.2f} ms (first calls {first_s:.1f} s)")
        steps = args.gamma - 1  # a round's draft steps after its first forward, fused (the fast path only)
        if name == "draft" and steps > 0 and "draft-fused" in args.methods \
                and getattr(runner, "fast", None) is not None \
                and hasattr(runner, "draft_steps") and not run.over_budget(f"forwards: {name} fused steps"):
            ms, first_s = forward_ms(run, runner, 1, steps=steps)
            rows.append([name, f"1 x {steps} fused steps", fmt(ms, 2), fmt(ms / steps, 3), fmt(first_s, 1)])
            say(f"  {name} {steps} fused steps: {ms:.2f} ms a call (first calls {first_s:.1f} s)")
    mode = "compiled (fast path)" if run.compile() else "eager (--no-compile)"
    say(f"\nPer forward, {mode}, {args.context} tokens of context, {args.repeats} timed calls:\n")
    table(["model", "tokens", "ms per forward", "ms per token", "first 3 calls (compile, capture), s"], rows)


# -- single sequence ------------------------------------------------------------------------------


def method_runner(run: Run, kind: str, base: str, adaptive: bool, fast: bool) -> Callable:
    """A function (ids, max_new_tokens) -> dict that generates once and times it (warm-up excluded)."""
    gen, args, device = run.gen, run.args, run.device
    if kind == "hf":
        from specdecode.bench.hf_methods import HF_METHODS, _HFRunner
        from specdecode.bench.settings import BenchSettings

        longest = max(int(t.shape[1]) for k in ("code", "prose", "warmup") for t in run.encoded(k))
        hf = _HFRunner(HF_METHODS[base], gen, BenchSettings(max_new_tokens=args.max_new_tokens),
                       max_positions=longest + args.max_new_tokens)

        def generate_hf(ids, max_new_tokens):
            sync(device)
            t0 = time.perf_counter()
            r = hf(ids, max_new_tokens, 0)
            sync(device)
            n = len(r["token_ids"])
            return dict(tokens=n, seconds=time.perf_counter() - t0, drafted=r["drafted"], accepted=r["accepted"],
                        target_forwards=r["target_forwards"], tokens_from_forwards=n, warmup_s=0.0)

        return generate_hf
    dec = run.decoder(base, adaptive, fast)
    gamma = args.tree_nodes if base == "token-recycling" or base in TREE_BASES else args.gamma  # a tree's nodes
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, num_speculative_tokens=gamma)

    def generate_ours(ids, max_new_tokens):
        run.log.calls.clear()
        sync(device)
        t0 = time.perf_counter()
        with run.log.recording():
            r = dec.generate(ids, dataclasses.replace(config, max_new_tokens=max_new_tokens))
        sync(device)
        s = r.stats
        return dict(tokens=len(r.token_ids), token_ids=list(r.token_ids),
                    seconds=time.perf_counter() - t0 - s.warmup_s, warmup_s=s.warmup_s,
                    drafted=s.num_drafted_tokens, accepted=s.num_accepted_tokens, target_forwards=s.num_target_forwards,
                    tokens_from_forwards=s.num_tokens_from_forwards, draft_forwards=s.num_draft_forwards,
                    decode_s=s.decode_time_s, prefill_s=s.prefill_time_s, drafted_by_position=list(s.drafted_by_position),
                    overlap=getattr(dec._engine, "overlap_rounds", None),
                    calls=list(run.log.calls))

    return generate_ours


def add_outcome(t: Tally, out: dict, index: int) -> None:
    t.prompts += 1
    t.per_prompt.append((index, out["tokens"], out["seconds"]))
    if "token_ids" in out:
        t.outputs[index] = out["token_ids"]
    for key in ("tokens", "seconds", "drafted", "accepted", "target_forwards", "tokens_from_forwards",
                "warmup_s"):
        setattr(t, key, getattr(t, key) + out[key])
    t.draft_forwards += out.get("draft_forwards", 0)
    t.decode_s += out.get("decode_s", 0.0)
    t.prefill_s += out.get("prefill_s", 0.0)
    dbp = out.get("drafted_by_position") or []
    t.drafted_by_position += [0] * (len(dbp) - len(t.drafted_by_position))
    for i, v in enumerate(dbp):
        t.drafted_by_position[i] += v
    for runner, width in out.get("calls", ()):  # decode-time forwards only (prefills bypass the runners)
        key = (runner, priced_width(runner, width))
        t.decode_calls[key] = t.decode_calls.get(key, 0) + 1
        if is_target(runner):
            t.counted_target += 1


def run_methods(run: Run, slow: bool) -> None:
    args = run.args
    count = args.slow_prompts if slow else args.prompts
    for name, kind, base, adaptive, fast, is_slow in METHODS:
        if is_slow != slow or name not in args.methods:
            continue
        if name == "autoregressive-eager" and not run.compile():
            say("autoregressive-eager: the same as 'autoregressive' under --no-compile; not run")
            continue
        if name in CAPTURED_BASES and not run.captures():
            say(f"{name}: the same as '{CAPTURED_BASES[name]}' without the fast path on CUDA (nothing to capture); "
                "not run")
            continue
        if base == "hf-generate-static" and run.device.type == "cpu":
            say("note: hf-generate-static compiles on CPU too (transformers' compile_all_devices): slow")
        if run.over_budget(f"single: {name}"):
            continue
        try:
            generate = method_runner(run, kind, base, adaptive, fast)
            t0 = time.perf_counter()
            generate(run.encoded("warmup")[0], args.warmup_tokens)
            run.warmups[name] = time.perf_counter() - t0
            if base == "hf-generate-static":  # transformers keeps its compiled forward on the model
                compiled = getattr(run.gen.target.model, "_compiled_call", None) is not None
                say(f"  hf-generate-static: transformers compiled the forward: {compiled}")
            last, overlap = 0.0, None
            for set_name in SETS:
                tally = run.tallies.setdefault(name, {}).setdefault(set_name, Tally())
                for i, ids in enumerate(run.encoded(set_name)[:count]):
                    tally.planned += 1
                    if run.over_budget(f"single: {name} {set_name} prompt {i}", last):
                        continue
                    out = generate(ids, args.max_new_tokens)
                    last, overlap = out["seconds"], out.get("overlap")
                    add_outcome(tally, out, i)
            say(f"  {name}: warm-up {run.warmups[name]:.1f} s, " + ", ".join(
                f"{s} {fmt(run.tallies[name][s].tok_s)} tok/s" for s in SETS)
                + (f", overlapped rounds {overlap}" if overlap is not None else ""))
        except Exception:
            say(f"FAILED: single-sequence method {name}")
            traceback.print_exc(file=sys.stdout)
            run.tallies.setdefault(name, {})["failed"] = True
            run.failures.append(f"single: {name}")


def single_table(run: Run) -> None:
    args = run.args
    base = run.tallies.get("autoregressive", {})
    say(f"\nSingle sequence, greedy, {args.max_new_tokens} new tokens, {run.gen.target.model.dtype}, whole "
        f"prompts timed, warm-up excluded; × = tok/s over 'autoregressive' "
        f"({'fast path' if run.compile() else 'compile off'}) on the same prompts:\n")
    rows = []
    for name in TABLE_ORDER:
        tallies = run.tallies.get(name)
        if not tallies:
            continue
        if tallies.get("failed"):
            rows.append([name] + ["FAILED"] + [""] * 7)
            continue
        row = [name]
        for s in SETS:
            t, ref = tallies.get(s, Tally()), base.get(s)
            ref_tok_s = ref.tok_s_on({i for i, _, _ in t.per_prompt}) if ref is not None else None
            ratio = t.tok_s / ref_tok_s if t.tok_s and ref_tok_s else None
            row += [fmt(t.tok_s) + (f" ({ratio:.2f}×)" if ratio else ""), fmt(t.alpha and 100 * t.alpha, 1, "%"),
                    fmt(t.tau, 2)]
        warm = run.warmups.get(name)
        extra = sum(t.warmup_s for s, t in tallies.items() if isinstance(t, Tally))
        prompts = "/".join(f"{tallies[s].prompts}" for s in SETS if s in tallies)
        rows.append(row + [prompts, fmt(warm, 1) + (f" + {extra:.1f}" if extra else "")])
    table(["method", "code tok/s (×)", "code α", "code τ", "prose tok/s (×)", "prose α", "prose τ",
           "prompts code/prose", "warm-up s"], rows)


#: Rows that must give their base row's tokens (the same compiled forwards, greedy): a check of the GPU-only paths.
SAME_TOKENS = {**SERIAL_BASES, **CAPTURED_BASES, "autoregressive-after-hf": "autoregressive", "draft-after-hf": "draft"}


def same_tokens(run: Run) -> None:
    """Say, for each row of ``SAME_TOKENS`` that ran with its base, on how many prompts their tokens are equal."""
    for name, base in SAME_TOKENS.items():
        pairs = [(run.tallies.get(name, {}).get(s), run.tallies.get(base, {}).get(s)) for s in SETS]
        pairs = [(a, b) for a, b in pairs if isinstance(a, Tally) and isinstance(b, Tally)]
        both = [(a.outputs[i], b.outputs[i]) for a, b in pairs for i in a.outputs if i in b.outputs]
        if both:
            same = sum(x == y for x, y in both)
            say(f"{name} against {base}: the same tokens on {same} of {len(both)} prompts"
                + ("" if same == len(both) else " (DIFFERENT: greedy decoding on the same forwards should agree)"))


def section_single(run: Run) -> None:
    run_methods(run, slow=False)
    single_table(run)
    same_tokens(run)


def section_baselines(run: Run) -> None:
    run_methods(run, slow=True)
    say("\nThe whole single-sequence table:")
    single_table(run)


# -- rounds ---------------------------------------------------------------------------------------


def section_rounds(run: Run) -> None:
    if not any(isinstance(t, Tally) for n in ("autoregressive", "draft", "prompt-lookup")
               for t in run.tallies.get(n, {}).values()):
        say("no single-sequence runs yet: running the fast-path methods on the prompts first")
        run_methods(run, slow=False)
    rows = []
    for name in ("autoregressive", "autoregressive-serial", "autoregressive-after-hf", "autoregressive-captured",
                 "draft", "draft-after-hf",
                 "draft-captured", "draft-fused", "prompt-lookup-captured",
                 "draft+adaptive", "draft+adaptive-previous-round", "draft+adaptive-masked", "cascade+adaptive", "cascade+adaptive-previous-round", "prompt-lookup"):
        for s in SETS:
            t = run.tallies.get(name, {}).get(s)
            if not isinstance(t, Tally) or not t.target_forwards:
                continue
            round_ms = 1000 * t.decode_s / t.target_forwards
            if run.log.runner_class is not None and t.counted_target == t.target_forwards:
                how = "counted"
                fwd_ms = sum(n * measure(run, r, w) for (r, w), n in t.decode_calls.items())
                draft_n = sum(n for (r, w), n in t.decode_calls.items() if not is_target(r))
                if t.draft_forwards and draft_n != t.draft_forwards:  # stats: decode-phase draft forwards
                    how += f" (stats: {t.draft_forwards} draft forwards)"
            else:  # price from the stats: blocks of k drafted tokens -> a target forward over k + 1 tokens
                how = f"stats (counted {t.counted_target} target forwards, stats {t.target_forwards})"
                runners = run.runners()
                dbp, target = t.drafted_by_position, runners["target"]
                sizes = {k + 1: dbp[k] - (dbp[k + 1] if k + 1 < len(dbp) else 0) for k in range(len(dbp))}
                sizes[0] = t.target_forwards - (dbp[0] if dbp else 0)
                fwd_ms = sum(n * measure(run, target, k + 1) for k, n in sizes.items())
                draft_n = t.draft_forwards  # decode-phase draft forwards (the prefill is not counted)
                if draft_n:
                    fwd_ms += draft_n * measure(run, runners["draft"], 1)
            per_round = fwd_ms / t.target_forwards
            run.overheads[(name, s)] = round_ms - per_round
            rows.append([name, s, t.target_forwards, fmt(round_ms, 2), fmt(draft_n / t.target_forwards, 2),
                         fmt(per_round, 2), fmt(round_ms - per_round, 2), fmt(t.tau, 2),
                         fmt((round_ms - per_round) / t.tau if t.tau else None, 2),
                         fmt(1000 * t.prefill_s / t.prompts if t.prompts else None, 1),
                         fmt(1000 * (t.seconds - t.decode_s - t.prefill_s) / t.prompts if t.prompts else None, 1), how])
    say("\nPer round (decode time / target forwards, after the prefill); forwards priced at the per-forward "
        "costs of their width, measured as in 'forwards'; a prompt's prefill (the stats' prefill_time_s) and "
        "the rest of its time outside the rounds:\n")
    table(["method", "set", "rounds", "ms per round", "draft forwards per round", "forwards, ms per round",
           "overhead, ms per round", "tokens per round τ", "overhead per token, ms", "prefill, ms a prompt",
           "rest outside the rounds, ms a prompt", "forwards from"], rows)


SYNC_METHODS = ("autoregressive", "autoregressive-serial", "draft", "draft-fused", "draft+adaptive",
                "draft+adaptive-previous-round",
                "draft+adaptive-masked", "cascade+adaptive", "prompt-lookup", *CAPTURED_BASES)


def section_syncs(run: Run) -> None:
    """Host syncs per round on CUDA, as ``torch.cuda.set_sync_debug_mode("warn")`` reports them: one greedy and
    one sampling generation of ``--sync-tokens`` on the first code prompt per fast-path method (untimed; the
    prefill's syncs are counted too)."""
    if run.device.type != "cuda" or not hasattr(torch.cuda, "set_sync_debug_mode"):
        say("syncs: CUDA only (torch.cuda.set_sync_debug_mode); not run on this device")
        return
    import warnings

    rows, ids = [], run.encoded("code")[0]
    for (name, kind, base, adaptive, fast, _), sampling in itertools.product(METHODS, (False, True)):
        if name not in SYNC_METHODS or name not in run.args.methods or run.over_budget(f"syncs: {name}"):
            continue
        dec = run.decoder(base, adaptive, fast)
        # sampling (speculative sampling on the device since 2026-11-27): temperature 0.8, top-p 0.95, seed 0
        config = GenerationConfig(max_new_tokens=run.args.sync_tokens, num_speculative_tokens=run.args.gamma,
                                  **(dict(temperature=0.8, top_p=0.95, seed=0) if sampling else {}))
        dec.generate(ids, config)  # compiled and captured before counting
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                stats = dec.generate(ids, config).stats
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchroniz" in str(w.message) for w in caught)
        rows.append([f"{name} (sampling)" if sampling else name, stats.num_target_forwards, syncs,
                     fmt(syncs / max(1, stats.num_target_forwards), 2)])
    say(f"\nHost syncs (torch.cuda.set_sync_debug_mode, {run.args.sync_tokens} tokens, prefill included; overlapped "
        "rounds read through a CUDA event, which this mode does not report: the profile section counts those "
        "cudaEventSynchronize calls):\n")
    table(["method", "rounds", "host syncs", "per round"], rows)


# -- profile --------------------------------------------------------------------------------------


def timed(fn) -> float:
    """Seconds ``fn()`` took."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


PROFILE_METHODS = ("autoregressive", "draft", "prompt-lookup", "hf-generate-static")


def section_profile(run: Run) -> None:
    """Where the time goes (``gpu_profile``): ``torch.profiler`` over the fast path's forwards (target at 1 and
    γ + 1 tokens, the draft model at 1) and over one whole generation per method on the first code prompt
    (warm: run once before), and ``cProfile`` over ``autoregressive``'s. Answers the H200 run's two open
    questions: a 1.5B forward of 2.60 ms against 0.65 ms of weight traffic (device busy against wall), and
    about 95 ms a prompt outside ``autoregressive``'s rounds (the generation's split, its garbage collections
    and the host profile)."""
    import gpu_profile

    args, device = run.args, run.device
    if device.type == "cuda":
        cuda = torch.version.cuda or "?"
        say(f"CUDA {cuda}, torch {torch.__version__}")
        if gpu_profile.old_cuda(cuda):  # torch's CUPTI workaround for graphs, set only under inductor's global flag
            os.environ.setdefault("DISABLE_CUPTI_LAZY_REINIT", "1")
            os.environ.setdefault("TEARDOWN_CUPTI", "0")
            say("CUDA < 12.6: DISABLE_CUPTI_LAZY_REINIT=1, TEARDOWN_CUPTI=0 (profiling with CUDA graphs alive)")
    runners, rows = run.runners(), []
    for name, width in (("target", 1), ("target", args.gamma + 1), ("draft", 1)):
        runner = runners.get(name)
        if runner is None or run.over_budget(f"profile: {name} width {width}"):
            continue
        keep = width if is_target(runner) else 1
        clean, _ = forward_ms(run, runner, width, keep)  # compiled and warm before the profiler starts
        held = {}

        @contextlib.contextmanager
        def around():
            with gpu_profile.profiled(device) as prof:
                yield
            held["prof"] = prof

        ms, _ = forward_ms(run, runner, width, keep, around=around)
        s = gpu_profile.summary(held["prof"], args.repeats)
        rows.append([name, width, fmt(clean, 2), fmt(ms, 2), fmt(s["device_ms"], 2), fmt(s["kernels"], 0),
                     fmt(s["graph_launches"], 1), fmt(s["kernel_launches"], 1), fmt(s["syncs"], 1)])
        if (name, width) == ("target", 1):
            say(f"\nTarget forward of 1 token, {args.repeats} calls, costliest first:\n```")
            say(gpu_profile.top_table(held["prof"], device.type == "cuda"))
            say("```")
            saved = gpu_profile.save_trace(held["prof"], args.profile_dir, "forward-target-1")
            if saved:
                say(f"trace: {saved}")
    say(f"\nPer forward under torch.profiler, {args.repeats} calls after {args.context} tokens (wall: without, "
        "then with the profiler's overhead; device busy: kernels and copies; per call):\n")
    table(["model", "tokens", "wall ms", "wall ms, profiled", "device busy ms", "device activities",
           "graph launches", "kernel launches", "host syncs"], rows)

    rows, ids = [], run.encoded("code")[0]
    for name in PROFILE_METHODS:
        if name not in args.methods or run.over_budget(f"profile: {name}"):
            continue
        hf = name.startswith("hf-")
        generate = method_runner(run, "hf" if hf else "ours", name, False, True)
        generate(ids, args.max_new_tokens)  # compiled and warm
        with gpu_profile.profiled(device) as prof, gpu_profile.gc_pauses() as pauses:
            t0 = time.perf_counter()
            out = generate(ids, args.max_new_tokens)
            sync(device)
            wall = time.perf_counter() - t0
        s, rounds = gpu_profile.summary(prof, 1), max(1, out["target_forwards"])
        inside = out.get("prefill_s", 0.0) + out.get("decode_s", 0.0)
        rows.append([name, out["tokens"], out["target_forwards"], fmt(1000 * wall, 1), fmt(s["device_ms"], 1),
                     fmt(s["device_ms"] and 100 * s["device_ms"] / (1000 * wall), 0, "%"),
                     "–" if hf else fmt(1000 * out["prefill_s"], 1), "–" if hf else fmt(1000 * out["decode_s"], 1),
                     "–" if hf else fmt(1000 * (wall - inside), 1),
                     fmt(s["kernels"] and s["kernels"] / rounds, 0), fmt(s["graph_launches"] / rounds, 2),
                     fmt(s["kernel_launches"] / rounds, 1), fmt(s["syncs"] / rounds, 2),
                     f"{len(pauses)} ({sum(g == 2 for g, _ in pauses)})", fmt(1000 * sum(t for _, t in pauses), 1)])
        saved = gpu_profile.save_trace(prof, args.profile_dir, f"generate-{name}")
        if name == "autoregressive":
            say(f"\n{name}, one generation, costliest first (device time on a GPU, CPU time otherwise):\n```")
            say(gpu_profile.top_table(prof, device.type == "cuda"))
            say("```")
            say(f"\n{name}, one generation under cProfile (the host's Python, cumulative seconds):\n```")
            say(gpu_profile.host_profile(lambda: generate(ids, args.max_new_tokens)))
            say("```")
        if saved:
            say(f"trace: {saved}")
    say(f"\nOne generation under torch.profiler, first code prompt, {args.max_new_tokens} new tokens (ms; "
        "prefill and rounds from the stats, the rest is neither; per round: per target forward, the prefill's "
        "eager kernels and this script's few synchronizations around the call included):\n")
    table(["method", "tokens", "rounds", "wall ms, profiled", "device busy ms", "busy", "prefill ms", "rounds ms",
           "rest ms", "device activities per round", "graph launches per round", "kernel launches per round",
           "host syncs per round", "GC collections (full)", "GC ms"], rows)
    say(f"\nPython objects the garbage collector tracks: {len(gc.get_objects()):,}; a full collection now: "
        f"{1000 * timed(gc.collect):.1f} ms")


# -- batched --------------------------------------------------------------------------------------


def counters(stats) -> dict:
    """The numeric fields of an engine's stats object (a dataclass today)."""
    fields = dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else dict(vars(stats))
    return {k: v for k, v in fields.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def batch_options(args: argparse.Namespace, gen: SpeculativeGenerator, device: torch.device, compiled: bool,
                  b: int) -> dict:
    """``batch_decoder``'s options at batch size ``b``: ``compile=True`` on CUDA with our fast path on
    (``compiled``), else False (none where it takes no ``compile``); with ``--row-buckets batch`` and compiling,
    ``row_buckets=(b,)``, with ``--dynamic-shapes`` ``dynamic_shapes=True`` (where it takes them)."""
    takes = inspect.signature(gen.batch_decoder).parameters
    overlap = OVERLAP[args.overlap_rounds]
    out = {"overlap_rounds": overlap} if overlap is not None and "overlap_rounds" in takes else {}
    if "compile" not in takes:
        return out
    if not (device.type == "cuda" and compiled):
        return out | {"compile": False}
    return out | {"compile": True} | (
        {"row_buckets": (b,)} if args.row_buckets == "batch" and "row_buckets" in takes else {}) | (
        {"dynamic_shapes": True} if args.dynamic_shapes and "dynamic_shapes" in takes else {})


def section_batched(run: Run) -> None:
    args, gen, device = run.args, run.gen, run.device
    takes_compile = "compile" in inspect.signature(gen.batch_decoder).parameters
    options = batch_options(args, gen, device, run.compile(), 1)
    mode = ("compiled (compile=True)" if options.get("compile") else "eager (compile=False)") if takes_compile \
        else "eager (batch_decoder takes no compile option)"
    if args.row_buckets == "batch" and options.get("compile"):
        mode += ", rows buckets B alone (--row-buckets batch)"
    if options.get("dynamic_shapes"):
        mode += ", dynamic shapes (--dynamic-shapes)"
    say(f"batched engine: {mode}")
    prompts = run.encoded("batch")
    longest = max(int(p.shape[1]) for p in prompts)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    results = run.batched
    # Method by method, autoregressive (the reference) first at every B: the budget cuts the speculative rows.
    order = sorted(args.batch_methods, key=lambda m: m != "autoregressive")
    for method, b in ((m, b) for m in order for b in args.batch_sizes):
        n = min(len(prompts), args.batch_prompts, b * args.batch_groups)
        groups = [prompts[i:i + b] for i in range(0, n, b)]
        if run.over_budget(f"batched: {method} B={b}"):
            continue
        try:
            engine = gen.batch_decoder(method, max_batch_size=b, num_speculative_tokens=args.gamma,
                                       max_length=longest + args.max_new_tokens + 64,
                                       **batch_options(args, gen, device, run.compile(), b))
            # A compiled engine warms up on a whole group (its graphs for every row count), eager on a short one.
            warm_tokens = args.max_new_tokens if options.get("compile") else args.warmup_tokens
            t0 = time.perf_counter()
            engine.generate(groups[0], dataclasses.replace(config, max_new_tokens=warm_tokens))
            sync(device)
            warm = time.perf_counter() - t0
            tokens, seconds, done, d = timed_groups(run, engine, groups, config, f"{method} B={b}")
            results[(method, b)] = dict(
                tok_s=tokens / seconds if seconds > 0 else None, warm=warm, prompts=done,
                alpha=d["num_accepted_tokens"] / d["num_drafted_tokens"] if d.get("num_drafted_tokens") else None,
                tau=(d["num_accepted_tokens"] + d["num_row_rounds"]) / d["num_row_rounds"]
                if d.get("num_row_rounds") else None,
                round_ms=1000 * d["decode_time_s"] / d["num_rounds"] if d.get("num_rounds") else None)
            say(f"  {method} B={b}: {fmt(results[(method, b)]['tok_s'])} tok/s in total, warm-up {warm:.1f} s, "
                f"shared prefill {getattr(engine, 'shared_prefill', 'n/a')}, overlapped rounds "
                f"{getattr(engine, 'overlap_rounds', 'n/a')}")
            if getattr(engine, "overlap_rounds", False) and method == "autoregressive":  # the A/B, same engine
                try:  # a failure here must not take the reference row with it
                    serial_groups(run, engine, groups, config, b)
                except Exception:
                    say(f"FAILED: batched autoregressive-serial at B={b}")
                    traceback.print_exc(file=sys.stdout)
                    results[("autoregressive-serial", b)] = {"failed": True}
                    run.failures.append(f"batched: autoregressive-serial B={b}")
            del engine
        except Exception:
            say(f"FAILED: batched {method} at B={b}")
            traceback.print_exc(file=sys.stdout)
            results[(method, b)] = {"failed": True}
            run.failures.append(f"batched: {method} B={b}")
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    say(f"\nBatched engine ({mode}), {args.max_new_tokens} new tokens, greedy, code prompts in groups of B, "
        "total tok/s = all new tokens / all group wall seconds (prefills included), × over autoregressive:\n")
    rows = []
    for b in args.batch_sizes:
        ref = results.get(("autoregressive", b), {}).get("tok_s")
        row = [b]
        for method in args.batch_methods:
            r = results.get((method, b), {})
            v = r.get("tok_s")
            ratio = f" ({v / ref:.2f}×)" if v and ref and method != "autoregressive" else ""
            row.append("FAILED" if r.get("failed") else fmt(v) + ratio)
        row += [" / ".join(f"{fmt(results.get((m, b), {}).get('alpha') and 100 * results[(m, b)]['alpha'], 0, '%')}"
                           f" τ {fmt(results.get((m, b), {}).get('tau'), 2)}" for m in args.batch_methods
                           if m != "autoregressive")]
        row += [" / ".join(fmt(results.get((m, b), {}).get("round_ms"), 1) for m in args.batch_methods)]
        row += [" / ".join(str(results.get((m, b), {}).get("prompts", 0)) for m in args.batch_methods)]
        row += [" / ".join(fmt(results.get((m, b), {}).get("warm"), 1) for m in args.batch_methods)]
        rows.append(row)
    names = " / ".join(args.batch_methods)
    table(["B"] + [f"{m}, total tok/s" for m in args.batch_methods]
          + [f"α, τ ({' / '.join(m for m in args.batch_methods if m != 'autoregressive')})",
             f"ms per round ({names})", f"prompts ({names})", f"warm-up s ({names})"], rows)
    serial = [[b, fmt(results.get(("autoregressive", b), {}).get("tok_s")),
               "FAILED" if r.get("failed") else fmt(r.get("tok_s")),
               fmt(results.get(("autoregressive", b), {}).get("round_ms"), 2), fmt(r.get("round_ms"), 2)]
              for b in args.batch_sizes if (r := results.get(("autoregressive-serial", b)))]
    if serial:
        say("\nBatched autoregressive with its rounds overlapped (the default on CUDA, ``engine.overlap``) and one "
            "after the other (overlap_rounds=False), the same engine and groups:\n")
        table(["B", "overlapped, total tok/s", "serial, total tok/s", "overlapped, ms per round",
               "serial, ms per round"], serial)


def timed_groups(run: Run, engine, groups, config, label: str) -> tuple[int, float, int, dict]:
    """Generate each of ``groups`` on ``engine`` between device syncs, skipping what the budget cuts: (new tokens,
    seconds less the engine's warm-up, prompts run, the engine's counters' change)."""
    before = counters(engine.stats)
    tokens, seconds, last, done = 0, 0.0, 0.0, 0
    for g, group in enumerate(groups):
        if run.over_budget(f"batched: {label} group {g}", last):
            continue
        sync(run.device)
        t0 = time.perf_counter()
        out = engine.generate(group, config)
        sync(run.device)
        last = time.perf_counter() - t0
        seconds += last
        tokens += sum(len(r.token_ids) for r in out)
        done += len(group)
    d = {k: v - before.get(k, 0) for k, v in counters(engine.stats).items()}
    return tokens, seconds - d.get("warmup_s", 0.0), done, d


def serial_groups(run: Run, engine, groups, config, b: int) -> None:
    """Time ``groups`` again on ``engine`` with ``overlap_rounds`` off (results as ("autoregressive-serial", B)),
    then turn it back on."""
    engine.overlap_rounds = False
    try:
        tokens, seconds, _, d = timed_groups(run, engine, groups, config, f"autoregressive-serial B={b}")
    finally:
        engine.overlap_rounds = True
    run.batched[("autoregressive-serial", b)] = dict(
        tok_s=tokens / seconds if seconds > 0 and tokens else None,
        round_ms=1000 * d["decode_time_s"] / d["num_rounds"] if d.get("num_rounds") else None)
    say(f"  autoregressive-serial B={b}: {fmt(run.batched[('autoregressive-serial', b)]['tok_s'])} tok/s in total")


# -- main -----------------------------------------------------------------------------------------


def targets(run: Run) -> None:
    """Issue 28's GPU targets ("Done when"), against what this run measured."""
    rows = []
    for name in ("draft", "prompt-lookup"):
        for s in SETS:
            v = run.overheads.get((name, s))
            rows.append([f"{name} ({s}): overhead per round <= 0.5 ms", fmt(v, 2, " ms"),
                         "–" if v is None else ("yes" if v <= 0.5 else "no")])
    for s in SETS:
        ar, hf = (run.tallies.get(n, {}).get(s) for n in ("autoregressive", "hf-generate-static"))
        v = ar.tok_s / hf.tok_s if isinstance(ar, Tally) and isinstance(hf, Tally) and ar.tok_s and hf.tok_s else None
        rows.append([f"compiled autoregressive >= 1.4x hf-generate-static ({s})", fmt(v, 2, "×"),
                     "–" if v is None else ("yes" if v >= 1.4 else "no")])
    v = run.batched.get(("autoregressive", 32), {}).get("tok_s")
    rows.append(["batched autoregressive at B = 32 >= 3000 tok/s", fmt(v, 0, " tok/s"),
                 "–" if v is None else ("yes" if v >= 3000 else "no")])
    ar8 = run.batched.get(("autoregressive", 8), {}).get("tok_s")
    for m in ("draft", "prompt-lookup"):
        v = run.batched.get((m, 8), {}).get("tok_s")
        v = v / ar8 if v and ar8 else None
        rows.append([f"batched {m} at B = 8 >= 1.2x batched autoregressive (code)", fmt(v, 2, "×"),
                     "–" if v is None else ("yes" if v >= 1.2 else "no")])
    say("\nIssue 28's GPU targets (meaningful on the GPU with the real pair only):\n")
    table(["target", "measured", "met"], rows)


def environment(run_device: torch.device, shim: list[str]) -> list[str]:
    lines = []
    if run_device.type == "cuda":
        p = torch.cuda.get_device_properties(run_device)
        lines.append(f"device: {p.name}, {p.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}")
    else:
        name, flags = platform.processor(), ""
        with contextlib.suppress(OSError):
            info = Path("/proc/cpuinfo").read_text()
            name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), name)
            flags = ", ".join(f for f in ("avx512_bf16", "amx_bf16") if f" {f}" in info) or "no avx512_bf16/amx"
        lines.append(f"device: CPU {name} ({flags}), {torch.get_num_threads()} torch threads")
    commit = "unknown"
    with contextlib.suppress(Exception):
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip() or "unknown"
    lines.append(f"torch {torch.__version__}, transformers {transformers.__version__}, python "
                 f"{platform.python_version()}, specdecode {specdecode.__version__} from {Path(specdecode.__file__).parent}"
                 f" (git {commit})")
    if shim:
        lines.append(f"torch.compile here lacks {', '.join(shim)}: dropped from specdecode's calls, dynamo's "
                     "recompile limit raised to 64 (as for the issue's GPU figures)")
    from specdecode.engine import compat

    lines.append("compiled calls: dynamo's guards on the models' modules "
                 + ("dropped (torch.compiler.skip_guard_on_all_nn_modules_unsafe; 2026-11-28-guard-cost.md)"
                    if compat.module_guard_filter() is not None else "kept (this torch lacks the filter)"))
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help=".gguf path, offline name or folder")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct", help=".gguf path, offline name or folder")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--cache-dir", default=None, help="specdecode's cache folder (dense copies of GGUF files)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {', '.join(SECTIONS)}")
    p.add_argument("--methods", default=",".join(m[0] for m in METHODS), help="single-sequence methods to run")
    p.add_argument("--prompts", type=int, default=8, help="prompts per set (code, prose), 1..8")
    p.add_argument("--slow-prompts", type=int, default=2, help="prompts per set for the slow baselines")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--gamma", type=int, default=5, help="num_speculative_tokens γ")
    p.add_argument("--tree-nodes", type=int, default=16,
                   help="token-recycling's, draft-tree's and cascade-tree's tree size (drafted nodes; issue 29: "
                        "verification is nearly flat up to 64)")
    p.add_argument("--draft-tree-depth", type=int, default=5,
                   help="draft-tree and cascade-tree: the draft model's chain steps per round (its forwards; the "
                        "other --tree-nodes nodes are its steps' runners-up)")
    p.add_argument("--draft-tree-expand", type=int, default=4,
                   help="draft-tree-expand: nodes expanded per depth, each depth one draft tree forward")
    p.add_argument("--context", type=int, default=300, help="cached tokens before a timed forward")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per forward width")
    p.add_argument("--warmup-tokens", type=int, default=16, help="new tokens of each method's warm-up run")
    p.add_argument("--sync-tokens", type=int, default=48, help="new tokens of each method's run in 'syncs'")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--batch-methods", default=",".join(BATCH_METHODS))
    p.add_argument("--batch-prompts", type=int, default=32, help="most prompts per batch size (1..32)")
    p.add_argument("--batch-groups", type=int, default=2, help="most groups of B prompts per batch size")
    p.add_argument("--code-chat", action="store_true", help="wrap code prompts in the chat template")
    p.add_argument("--no-compile", action="store_true", help="our fast path off (eager forwards everywhere)")
    p.add_argument("--no-compile-shim", action="store_true", help="leave torch.compile as it is")
    p.add_argument("--random-weights", default=None, choices=RANDOM_WEIGHTS,
                   help="--target and --draft are folders with a config.json (the target's with its tokenizer): "
                        "models of those shapes with random weights, no GGUF to copy (random_weights_pair)")
    p.add_argument("--row-buckets", default="powers", choices=("powers", "batch"),
                   help="batched engine's rows buckets: 1, 2, 4, .. and B (the default), or B alone (fewer "
                        "compilations on a cold machine: a batch with fewer live rows runs padded to B)")
    p.add_argument("--dynamic-shapes", action="store_true",
                   help="our fast path's dynamic_shapes: rows and widths above 1 symbolic, so each runner compiles "
                        "at most four functions (with --row-buckets powers, B = 8 and 32 compile no more than B = 2)")
    p.add_argument("--overlap-rounds", default="auto", choices=tuple(OVERLAP),
                   help="our engines' overlap_rounds (engine.overlap): auto (the device default: on for CUDA), on, "
                        "off; "
                        "the -serial rows and the batched A/B turn it off whatever this says")
    p.add_argument("--profile-dir", default=None,
                   help="folder for the profile section's Chrome traces (gzipped), e.g. $OUT/traces; none by default")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="deadline in seconds from the start, loading included")
    args = p.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    args.batch_methods = [m.strip() for m in args.batch_methods.split(",") if m.strip()]
    try:
        args.batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",") if b.strip()})
    except ValueError:
        p.error(f"--batch-sizes must be integers >= 1 separated by commas, got {args.batch_sizes!r}")
    for value, allowed, flag in ((args.sections, SECTIONS, "--sections"), (args.methods, [m[0] for m in METHODS],
                                 "--methods"), (args.batch_methods, BATCH_METHODS, "--batch-methods")):
        bad = [v for v in value if v not in allowed]
        if bad:
            p.error(f"{flag}: unknown {bad}; allowed: {', '.join(allowed)}")
    for name, low, high in (("prompts", 1, 8), ("slow_prompts", 1, 8), ("batch_prompts", 1, 32),
                            ("max_new_tokens", 1, 4096), ("gamma", 1, 64), ("tree_nodes", 1, 64),
                            ("draft_tree_depth", 1, 64), ("draft_tree_expand", 1, 64), ("context", 1, 8192),
                            ("repeats", 1, 10_000), ("warmup_tokens", 1, 4096), ("batch_groups", 1, 32),
                            ("sync_tokens", 1, 4096)):
        if not low <= getattr(args, name) <= high:
            p.error(f"--{name.replace('_', '-')} must be in {low}..{high}, got {getattr(args, name)}")
    if any(b < 1 for b in args.batch_sizes):
        p.error(f"--batch-sizes must be >= 1, got {args.batch_sizes}")
    return args


RANDOM_WEIGHTS = {
    "independent": "forward and round costs hold; acceptance (about 0), τ and speculative speedups do not",
    "echo": "each layer's output projections zeroed and the LM head a copy of the embeddings, so each model "
            "repeats the last token: draft rounds accepted in full (prompt-lookup's partly); forward and round costs hold, "
            "acceptance rates, τ and speedups are this setting's, not a real pair's",
}


def random_weights_pair(target: str, draft: str, dtype: str, device: torch.device,
                        mode: str = "independent") -> SpeculativeGenerator:
    """A pair of the shapes that the folders' ``config.json`` give, with random weights (seeded), on ``device``.

    For a GPU machine with no model files: forward costs depend on the shapes alone. The tokenizer is the
    target folder's, shared by the draft. ``mode`` "echo" zeroes every ``o_proj`` and ``down_proj`` weight
    and copies the embeddings into the LM head (``RANDOM_WEIGHTS``): the same matrix products, but the
    residual stream stays the last token's embedding, whose own row scores highest."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from specdecode.models import LoadedModel

    tokenizer = AutoTokenizer.from_pretrained(target)
    loaded = []
    for seed, folder in enumerate((target, draft)):
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=getattr(torch, dtype))
        if mode == "echo":
            with torch.no_grad():
                for name, module in model.named_modules():
                    if name.endswith(("o_proj", "down_proj")):
                        module.weight.zero_()
                model.get_output_embeddings().weight.copy_(model.get_input_embeddings().weight)
        loaded.append(LoadedModel(model.eval(), tokenizer, f"{Path(folder).name} (random weights)"))
    return SpeculativeGenerator(loaded[0], loaded[1])


SECTION_FUNCTIONS = {"forwards": section_forwards, "single": section_single, "rounds": section_rounds,
                     "syncs": section_syncs, "profile": section_profile, "batched": section_batched,
                     "baselines": section_baselines}


def main(argv: list[str] | None = None, generator: SpeculativeGenerator | None = None) -> int:
    """Run the selected sections; returns the exit status (0 ok, 1 a section failed, 2 budget cuts)."""
    args = parse_args(argv)
    start = time.monotonic()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("specdecode").setLevel(logging.INFO)
    with compile_shim(not args.no_compile_shim) as shim:
        say("# specdecode GPU engine figures (docs/benchmarks/gpu_engine.py)\n")
        device = torch.device(args.device)
        for line in environment(device, shim):
            say(f"- {line}")
        if generator is None and args.random_weights:
            t0 = time.perf_counter()
            generator = random_weights_pair(args.target, args.draft, args.dtype, device, args.random_weights)
            say(f"- built both models with random weights ({args.random_weights}) in {time.perf_counter() - t0:.1f} "
                f"s: {RANDOM_WEIGHTS[args.random_weights]}")
        if generator is None:
            t0 = time.perf_counter()
            generator = SpeculativeGenerator.from_pretrained(args.target, args.draft, dtype=args.dtype,
                                                             device=args.device, cache_dir=args.cache_dir)
            say(f"- loaded both models in {time.perf_counter() - t0:.1f} s")
        draft = generator.draft.name if generator.draft is not None else None
        say(f"- target {generator.target.name}, draft {draft}, {generator.target.model.dtype}, γ {args.gamma}, "
            f"{args.max_new_tokens} new tokens, prompts {args.prompts} per set (slow baselines "
            f"{args.slow_prompts}), budget {args.budget_s:.0f} s")
        run = Run(args, generator, start)
        if args.dynamic_shapes:
            say(f"- dynamic shapes (--dynamic-shapes): {run.use_dynamic_shapes()}")
        status = {}
        for name in SECTIONS:
            if name not in args.sections:
                continue
            say(f"\n## {name}\n")
            t0, failures = time.perf_counter(), len(run.failures)
            try:
                SECTION_FUNCTIONS[name](run)
            except Exception:
                say(f"FAILED: section {name}")
                traceback.print_exc(file=sys.stdout)
                run.failures.append(name)
            seconds = time.perf_counter() - t0
            status[name] = ("FAILED: " + "; ".join(run.failures[failures:])) if len(run.failures) > failures else "ok"
            say(f"\nsection {name}: {seconds:.1f} s")
            status[name] = [status[name], f"{seconds:.1f}"]
        say("\n## summary\n")
        targets(run)
        say("")
        table(["section", "status", "seconds"], [[n, s, t] for n, (s, t) in status.items()]
              + [["total, loading included", "", f"{time.monotonic() - start:.1f}"]])
        if run.skipped:
            say(f"\nskipped by the budget: {len(run.skipped)} runs ({'; '.join(run.skipped[:10])})")
    if run.failures:
        return 1
    return 2 if run.skipped else 0


if __name__ == "__main__":
    sys.exit(main())
