"""A target run outside torch in the batched round: ``RunnerTargetCache`` and ``RunnerTargetForwards``.

A target that implements ``protocol.TargetRunnerProtocol`` (the target's GGUF file in
llama.cpp, ``models.llama_cpp_target.LlamaCppTargetRunner``) holds one sequence in its own
memory, addressed by position. The batched engine (``engine.batched``) then runs it at one row,
B = 1, with no ``batch_cache.BatchKVCache`` and no ``batch_runner.BatchRunner``:

* the prompt is prefilled by the target (``RunnerTargetCache.prefill``);
* each round's verification is ``target(ids (1, w), [start], keep)``, the call a ``BatchRunner``
  takes, at the row's confirmed length; a rejected draft's positions are dropped by the next
  forward, which starts below them (the rollback is implicit, as in a static cache);
* drafters bind to a ``RunnerTargetCache``: what a ``BatchKVCache`` tells them (one slot, its
  capacity, the CPU, no fast path, the prefill settings, its owner) and nothing to write
  into, so drafters that need the target's torch layers (layer skip, early exit) cannot bind.

``SpeculativeDecoder`` decodes with such a target through the same engine; decoders of one
target share one engine and one ``RunnerTargetCache`` (``forwards_of``), whose ``generation``
tells a stream that a newer one took the target's memory over.

Drafters bind as to a torch target: prompt lookup, and a draft model run by llama.cpp too
(``drafters.draft_model.DraftModelDrafter`` and ``CascadeDrafter`` with a ``runner``, one
sequence: the llama.cpp draft beside the llama.cpp target, ``backend="llama-cpp"`` with a draft).

Where verification is far from flat (llama.cpp on a CPU), each round drafts as many tokens as
the measured costs say pay (``measured_cost_policy``: ``engine.speculation_cost.SpeculationCostPolicy``
on the target's ``measure_forward_costs`` and, for a draft model, its one-token forward).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

import torch

from specdecode.engine.cost_model import DRAFT_MODEL_PRIOR, MEASURED_WIDTHS, PROMPT_LOOKUP_PRIOR, ForwardCosts
from specdecode.engine.protocol import TargetRunnerProtocol
from specdecode.engine.speculation_cost import SpeculationCostPolicy
from specdecode.engine.verification import greedy_epilogue
from specdecode.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

#: Why such an engine has one row (the message of ``max_batch_size`` > 1).
ONE_SEQUENCE = ("llama.cpp's target runs one sequence at a time (one llama.cpp context; its multi-sequence "
                "batches are not built)")


def is_runner_target(target) -> bool:
    """Whether ``target`` is a target run outside torch (``TargetRunnerProtocol``), not a transformers model."""
    return not isinstance(target, torch.nn.Module) and isinstance(target, TargetRunnerProtocol)


@contextlib.contextmanager
def torch_threads(num_threads: int | None):
    """Run the body with torch at ``num_threads`` intra-op threads (None: unchanged), restored in ``finally``.

    A round around a llama.cpp target does only small torch work (the logits' finiteness check,
    argmax, sampling over one row of V), but at torch's 2 threads those small ops wake torch's
    OpenMP pool between llama.cpp's forwards, and the two thread pools contend for the same cores:
    measured on a 2-core EPYC (flags fma avx f16c avx2), Qwen2.5-Coder 1.5B Q4_K_M, 2 llama.cpp
    threads, 40 greedy tokens, 3 repeats (``docs/benchmarks/llama_cpp_torch_threads.py``): a
    decode loop with the engine's per-token torch ops took 70.7-73.9 ms per token at 2 torch
    threads against 62.6-68.3 at 1, and llama.cpp's own ``Llama.generate`` 63.1-70.6.
    """
    before = torch.get_num_threads()
    change = num_threads is not None and num_threads != before
    if change:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        if change:
            torch.set_num_threads(before)


class RunnerTargetCache:
    """What the engine and its drafter see of such a target's memory, in place of a ``BatchKVCache``.

    Args:
        owner: The target (``TargetRunnerProtocol``).
        capacity: Positions a generation may use (prompt + ``max_new_tokens`` + the longest block + 1).
        prefill_chunk_tokens, prefill_pad_multiple: The engine's prefill settings (a drafter with a
            model of its own prefills with them); the target prefills in its own chunks.

    Attributes:
        owner, capacity, prefill_chunk_tokens, prefill_pad_multiple: As given.
        num_slots: Always 1. ``device``: the target's (the CPU). ``fast``: None (nothing compiled).
        static: True: rolled back by position, never cropped. ``layers``: none (no torch layers).
        generation: Counts the generations that took the target's memory (``GenerationStream``).
        shared: Runners a self-speculative drafter would keep with the cache (always empty here).
    """

    static = True
    num_slots = 1
    fast = None
    layers: tuple = ()
    torch_threads = 1  # the engine's torch work around llama.cpp's forwards (``torch_threads``)

    def __init__(self, owner, capacity: int, prefill_chunk_tokens: int, prefill_pad_multiple: int) -> None:
        self.owner = owner
        self.capacity = capacity
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.prefill_pad_multiple = prefill_pad_multiple
        self.device = torch.device(getattr(owner, "device", "cpu"))
        self.generation = 0
        self.shared: dict = {}

    def prefill(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        """The (1, n) prompt at positions 0 .. n - 1 of the target's memory: (1, V) float32 logits after it.

        Raises:
            InvalidArgumentError, UnsupportedModelError: The target's ``prefill``.
        """
        n = int(prompt_ids.shape[-1])
        return self.owner.prefill(prompt_ids, max(0, self.capacity - n)).unsqueeze(0)

    def prefill_row(self, model, prompt_ids: torch.Tensor, slot: int = 0, start: int = 0) -> torch.Tensor:
        """The engine's prefill of its one row: ``prefill(prompt_ids)`` (``model`` is the owner, ``slot`` 0,
        ``start`` 0: a prompt cache is refused at ``load_prefix``)."""
        return self.prefill(prompt_ids)

    def warm_up_shapes(self, model, widths, logit_widths) -> None:
        """Nothing: llama.cpp keeps no per-shape kernels (``BatchKVCache.warm_up_shapes`` runs torch's)."""

    def load_prefix(self, slot: int, prompt_cache) -> int:
        """Refused: a prompt cache holds torch keys and values.

        Raises:
            InvalidArgumentError: Always.
        """
        raise InvalidArgumentError(
            f"a prompt cache holds a torch model's keys and values, but the {self.owner.name} runs outside torch "
            "(llama.cpp): pass the whole prompt, without prompt_cache"
        )

    def move(self, src: int, dst: int, num_valid: int) -> None:
        """Never called: one slot.

        Raises:
            InvalidArgumentError: Always.
        """
        raise InvalidArgumentError(f"{ONE_SEQUENCE}: there is no slot {src} to move")


class RunnerTargetForwards:
    """The engine's ``runner`` for such a target: ``BatchRunner``'s call at one row, nothing compiled.

    Also what ``SpeculativeDecoder`` keeps as its target runner (``compile`` and ``graphs`` False;
    ``one_row_engine``: the engine decoders of this target share).

    Args:
        target: The target (``TargetRunnerProtocol``).
    """

    compile = False
    graphs = False
    takes_trees = False  # llama.cpp's forwards are linear here: a tree draft is verified as its first chain
    compile_time_s = 0.0
    buckets: tuple[int, ...] = ()

    def __init__(self, target) -> None:
        self.target = target
        self.name = target.name
        self.widths: tuple[int, ...] = (1,)
        self.one_row_engine = None

    def __call__(self, ids: torch.Tensor, starts: Sequence[int], logits_to_keep: int, trees=None) -> torch.Tensor:
        """(1, w) ids at ``starts[0]``: (1, logits_to_keep, V) float32 logits (the target's ``__call__``;
        ``trees`` refused there: ``takes_trees`` is False)."""
        return self.target(ids, starts, logits_to_keep, trees)

    def forward_greedy(self, ids: torch.Tensor, starts: Sequence[int], logits_to_keep: int, trees=None,
                       with_logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``__call__``'s logits (or None) and their greedy epilogue (``verification.greedy_epilogue``), computed
        after the forward (``RoundRunnerProtocol.forward_greedy``)."""
        logits = self(ids, starts, logits_to_keep, trees)
        return logits if with_logits else None, greedy_epilogue(logits)

    def warm_up(self) -> None:
        """Nothing: llama.cpp keeps no per-shape kernels (its forward costs are measured by the pipeline)."""


def forwards_of(target) -> RunnerTargetForwards:
    """The one ``RunnerTargetForwards`` of ``target``, kept on it: the decoders of one target share one engine."""
    forwards = getattr(target, "engine_forwards", None)
    if not isinstance(forwards, RunnerTargetForwards) or forwards.target is not target:
        forwards = RunnerTargetForwards(target)
        target.engine_forwards = forwards
    return forwards


def runner_target_parts(target, max_batch_size: int, max_length: int, compile: bool, shared_with,
                        prefill_chunk_tokens: int, prefill_pad_multiple: int
                        ) -> tuple[RunnerTargetCache, RunnerTargetForwards]:
    """The cache descriptor and the runner of a ``BatchedSpeculativeDecoder`` whose target runs outside torch.

    An idle engine ``shared_with`` on the same target gives its ``RunnerTargetCache`` (grown to
    ``max_length`` when shorter), so that a stream sees a newer generation take the target over.

    Raises:
        InvalidArgumentError: ``max_batch_size`` other than 1 (``ONE_SEQUENCE``), or ``compile`` True
            (the fast path compiles torch forwards).
    """
    if max_batch_size != 1:
        raise InvalidArgumentError(f"{ONE_SEQUENCE}: use max_batch_size=1, got max_batch_size={max_batch_size}")
    if compile:
        raise InvalidArgumentError(
            f"compile=True compiles torch forwards, but the {target.name} runs in llama.cpp: use compile=None or False"
        )
    previous = getattr(shared_with, "cache", None)
    if isinstance(previous, RunnerTargetCache) and previous.owner is target:
        previous.capacity = max(previous.capacity, max_length)
        return previous, forwards_of(target)
    return RunnerTargetCache(target, max_length, prefill_chunk_tokens, prefill_pad_multiple), forwards_of(target)


def measured_cost_policy(target, max_tokens: int = MEASURED_WIDTHS[-1] - 1, context_tokens: int = 256,
                         draft_runner=None, prior: float | None = None) -> SpeculationCostPolicy:
    """The draft policy on ``target``: a ``SpeculationCostPolicy`` on its forward costs, measured once in
    llama.cpp at warm-up (kept as ``target.forward_costs``; the engine's ``calibrate`` then times
    nothing more, as ``max_size`` keeps every verification within the widths measured) and logged,
    and on the drafter's fixed cost per token (``draft_node_s``).

    Args:
        target: The target (``TargetRunnerProtocol``).
        max_tokens: The longest draft the policy considers (its ``max_size``; the widest measured
            forward is ``MEASURED_WIDTHS[-1]`` = max_tokens + 1 tokens); a generation's γ caps it too.
        context_tokens: Positions of the context the costs are measured after (a prompt's size:
            attention grows with it).
        draft_runner: The draft model's one-sequence runner (``LlamaCppTargetRunner`` of the
            llama.cpp draft, for "draft" and "cascade"), or None for a drafter that costs nothing
            (prompt lookup). Its one-token forward after the same context is measured once (kept
            as its ``forward_costs``) and is the cost per drafted token (``draft_node_s``): a round
            of k drafted tokens runs k draft forwards, the first of 1-2 tokens (the cascade's
            n-gram tokens cost less; it is charged as a draft model, the cautious side).
        prior: α before any round; None: ``DRAFT_MODEL_PRIOR`` with ``draft_runner``, else
            ``PROMPT_LOOKUP_PRIOR`` (``engine.cost_model``, "The prior").

    The policy learns α by depth across the generations that use it (one decoder's); it probes a
    token every ``probe_every`` plain steps until a round drafts (``SpeculationCostController``).

    The measurements take the target's (and the draft's) memory over: a generation streaming on
    it then stops with ``GenerationStream``'s "taken over" error.

    Raises:
        InvalidArgumentError: As ``TargetRunnerProtocol.measure_forward_costs`` and ``SpeculationCostPolicy``.
    """
    if not target.forward_costs:
        context = [(100 + i) % target.vocab_size for i in range(context_tokens)]
        target.measure_forward_costs(context, MEASURED_WIDTHS, repeats=5, warmup=1)
        engine = forwards_of(target).one_row_engine
        if engine is not None:  # the measurement took the target's memory: a stream in flight says so
            engine.cache.generation += 1
    draft_step_s = 0.0
    if draft_runner is not None:
        if 1 not in draft_runner.forward_costs:
            context = [(100 + i) % draft_runner.vocab_size for i in range(context_tokens)]
            draft_runner.measure_forward_costs(context, (1,), repeats=5, warmup=1)
        draft_step_s = float(draft_runner.forward_costs[1])
    if prior is None:
        prior = DRAFT_MODEL_PRIOR if draft_runner is not None else PROMPT_LOOKUP_PRIOR
    costs = ForwardCosts(dict(target.forward_costs))
    policy = SpeculationCostPolicy(costs, draft_node_s=draft_step_s, prior=prior, max_size=max_tokens)
    logger.info("draft length from measured costs of the %s (%s; a drafted token %.1f ms%s): break-even acceptance "
                "%s; prior %.2f", target.name, ", ".join(f"{w} tok {s * 1e3:.1f} ms" for w, s in costs.seconds.items()),
                draft_step_s * 1e3, f", the {draft_runner.name}'s step" if draft_runner is not None else "",
                ", ".join(f"k={k}: {a:.2f}" if a is not None else f"k={k}: never"
                          for k, a in ((k, policy.break_even(k)) for k in range(1, min(max_tokens, 4) + 1))), prior)
    return policy
