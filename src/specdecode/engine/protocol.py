"""The engine's interfaces: runners, the ``Drafter`` protocol, ``Draft``, and draft control.

**Runners.** ``BatchRunnerProtocol`` is the one forward call of the round: (n, w) ids at
each row's start position, into a cache with a slot per row, giving (n, logits_to_keep, V)
logits. ``batch_runner.BatchRunner`` implements it on a ``batch_cache.BatchKVCache`` (eager,
or the fast path), and ``models.llama_cpp_target.LlamaCppTargetRunner`` at one row (a GGUF
model in llama.cpp, target or draft); tests/test_interfaces.py checks both. Every cache of
the round is static: a row's write position is its start, so a rollback is the next
forward's start, decided by the caller, never by cropping. ``RoundRunnerProtocol`` is the
target's runner in the round: the call and the verification's ``forward_greedy``.
``TargetRunnerProtocol`` is what a target run outside torch adds (prefill, rollback, measured costs).

**Drafting.** One protocol, batch-native (``Drafter``): every drafter drafts for the active
rows of the round at once, B >= 1; ``SpeculativeDecoder`` runs the same round with one row.
The engine never imports a drafter; drafters (``specdecode.drafters``) implement this
protocol and the engine calls them only through it. The split follows transformers'
``generation/candidate_generator.py``: a drafter only proposes; verification, acceptance
and the target's cache are the engine's.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from specdecode.engine.sampling import Sampler
from specdecode.engine.tree import TokenTree


@runtime_checkable
class BatchRunnerProtocol(Protocol):
    """The round's forward call (``batch_runner.BatchRunner``; ``LlamaCppTargetRunner`` at one row).

    Attributes:
        name: For messages ("target model", "draft model", "layer-skip draft").
        compile_time_s: Seconds spent compiling (first calls of compiled widths), over its life;
            0 for a runner that compiles nothing.
        takes_trees: Whether ``__call__`` takes ``trees`` (tree verification, ``engine.tree``).
    """

    name: str
    compile_time_s: float
    takes_trees: bool

    def __call__(self, ids: torch.Tensor, starts: Sequence[int], logits_to_keep: int,
                 trees: Sequence[TokenTree] | None = None) -> torch.Tensor:
        """(n, w) ids, row b written at positions ``starts[b] ..`` of its slot (what a row held from
        ``starts[b]`` on is overwritten): (n, logits_to_keep, V) logits, the last rows. ``trees``: a
        tree forward (``engine.tree``), only where ``takes_trees``."""


@runtime_checkable
class RoundRunnerProtocol(BatchRunnerProtocol, Protocol):
    """The target's runner in the round: ``BatchRunnerProtocol``'s call, and the verification's forward, which
    also gives what a greedy verification reads (``batch_runner.BatchRunner``, where the fast path computes it
    in the forward's graph; ``runner_target.RunnerTargetForwards`` for a target run in llama.cpp)."""

    def forward_greedy(self, ids: torch.Tensor, starts: Sequence[int], logits_to_keep: int,
                       trees: Sequence[TokenTree] | None = None,
                       with_logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``__call__``'s forward: (its logits, or None without ``with_logits``; (n, logits_to_keep, 2) long, each
        position's argmax and finiteness, ``verification.greedy_epilogue``), both safe to keep."""


@runtime_checkable
class TargetRunnerProtocol(Protocol):
    """A target whose forwards run outside torch, one sequence at a time, addressed by position
    (``models.llama_cpp_target.LlamaCppTargetRunner``: the target's GGUF file in llama.cpp).

    Its memory holds the sequence's positions 0 .. ``num_cached`` - 1; a forward at a lower
    ``start`` first drops the positions from ``start`` on (the rollback after a rejected draft
    is implicit in the next forward, as with the batched engine's static cache). Logits are
    float32 CPU tensors.

    Attributes:
        name: For messages ("target model").
        vocab_size: V, the width of the logits.
        context_length: The positions it was trained for, or None (``kv_cache.context_length``).
        forward_costs: Width (tokens in one forward) -> seconds, measured at warm-up
            (``measure_forward_costs``; empty before); what ``engine.cost_model.ForwardCosts`` takes.
        num_forwards: Forwards run, prefills included.
    """

    name: str
    vocab_size: int
    context_length: int | None
    forward_costs: Mapping[int, float]
    num_forwards: int

    @property
    def num_cached(self) -> int:
        """Positions held."""

    def prefill(self, ids, max_new_tokens: int = 0) -> torch.Tensor:
        """A new sequence: the n prompt ids at positions 0 .. n - 1; (V,) logits after the last."""

    def forward(self, ids, start: int, logits_to_keep: int | None = None) -> torch.Tensor:
        """w ids at positions ``start ..`` (0 <= start <= ``num_cached``): (logits_to_keep or w, V) logits,
        the last rows (verification keeps all w)."""

    def rollback(self, num_positions: int) -> None:
        """Keep positions 0 .. ``num_positions`` - 1."""

    def measure_forward_costs(self, context_ids, widths: Sequence[int], repeats: int,
                              warmup: int) -> Mapping[int, float]:
        """Seconds per forward at each width after a context of ``context_ids``; kept as ``forward_costs``."""

    def __call__(self, ids: torch.Tensor, starts: Sequence[int], logits_to_keep: int, trees=None) -> torch.Tensor:
        """``batch_runner.BatchRunner``'s call at one row: (1, w) ids at ``starts[0]``; (1, logits_to_keep, V)
        (``trees`` refused: linear blocks only)."""


class ExitPolicy(Protocol):
    """Decides, after each drafted token, whether the block ends there (``AdaptiveDraftExit``).

    Attributes:
        mode: How the exit reads the draft's confidence (``DRAFT_EXIT_MODES``).
            "per-step": the draft loop reads each step's top probability on the host and stops a row at its
            first unsure token (one host sync per draft step). "previous-round" and "masked": the loop reads
            nothing between draft steps (a sampling row draws from safe logits, its finiteness flag read with
            the round's sync); it drafts every row's ``max_tokens`` and returns the steps' top
            probabilities on the device (``Draft.top_probs``), which the engine reads with the round's one
            sync. "masked" keeps each block up to its first unsure token (the rest is verified but not
            counted); "previous-round" keeps the whole block, and the engine sizes the next round's from
            where this one's confidence first fell below the threshold (``next_length``).
        threshold: The current threshold on the top probability (a token below it is unsure).
        next_length: With "previous-round", the most tokens the next block drafts.
    """

    mode: str
    threshold: float
    next_length: int

    def should_stop(self, top_prob: float) -> bool:
        """``top_prob``: the draft distribution's largest probability, in [0, 1]."""

    def observe(self, exit_point: int | None, num_drafted: int) -> None:
        """Modes other than "per-step": after the round's sync, the block's first unsure position (1-based) or
        None (``engine.draft_exit``)."""


class ConfidenceObserver(Protocol):
    """Target-confidence gating as the decoder sees it (``specdecode.drafters.control.ConfidenceGate``)."""

    def observe(self, target_prob: float) -> None:
        """The target's probability (its own, warped distribution) of the token it just produced."""


class RoundController(Protocol):
    """The per-generation state of a draft-length policy: what the decode loop asks each round.

    Attributes:
        exit: An ``ExitPolicy`` passed to ``Drafter.propose``, or None.
        gate: A ``ConfidenceObserver`` fed after every target forward, or None.
        max_tokens: The longest block ``round_cap`` gives with adaptive exit or a constant
            length (the fast path compiles verification up to it + 1); a heuristic schedule
            without adaptive exit may go past it, and those wider verifications run eagerly.
    """

    exit: ExitPolicy | None
    gate: ConfidenceObserver | None
    max_tokens: int

    @property
    def gated(self) -> bool:
        """True when the next step is a plain target step (no drafting)."""

    def round_cap(self) -> int:
        """Most tokens to draft in the next round (0 when gated)."""

    def record(self, cap: int, num_drafted: int, num_accepted: int) -> None:
        """After verifying a block of ``num_drafted`` >= 1 tokens drafted under ``cap``."""

    def trim(self, num_tokens: int, ngram_size: int, source: str = "sequence") -> int:
        """After the drafter proposed ``num_tokens`` >= 1 tokens for the row, continuing an earlier match of
        its last ``ngram_size`` tokens (``Draft.ngram_sizes``) found in ``source`` (``Draft.match_sources``),
        how many of them to verify (0 .. num_tokens; 0: a plain step). Called before ``record``; the default
        keeps them all."""
        return num_tokens

    def record_round(self, cap: int, num_drafted: int, seconds: float, *, draft_seconds: float = 0.0,
                     depth: int | None = None) -> None:
        """After every round of the row, drafted or not (the engine calls it after ``record``): the row
        was given ``cap``, drafted ``num_drafted`` nodes (0: a plain step) whose structure is ``depth``
        deep (a tree's depth, or ``num_drafted`` for a chain; None when nothing was drafted), the round
        took ``seconds`` (compilation and a deferred draft prefill excluded, ``Drafter.prefill_time_s``)
        of which ``draft_seconds`` in the drafter's ``propose`` (the same excluded; 0.0 exactly when no row
        drafted). With several rows every row is given the whole round's seconds. A policy priced by
        measured rounds learns from it; the default does nothing."""
        return None


#: ``DraftPolicy.calibrate``'s ``measure``: forward widths (tokens per row) -> seconds of one target
#: forward over the round's rows at each width.
MeasureForwards = Callable[[Sequence[int]], Mapping[int, float]]


class DraftPolicy(Protocol):
    """A reusable draft-length policy (``specdecode.drafters.control.DraftControl``): frozen, or holding
    estimates its generations share (``engine.speculation_cost.SpeculationCostPolicy``).

    Attributes:
        adaptive_exit: Whether ``controller`` gives an ``exit`` policy (needs a drafter
            with ``supports_exit_policy``).
        exit_mode: How the exit reads the draft's confidence (``DRAFT_EXIT_MODES``; the engine sets each
            row's exit's ``mode`` to it).
    """

    adaptive_exit: bool
    exit_mode: str

    @property
    def active(self) -> bool:
        """Whether this differs from drafting γ tokens every round."""

    def controller(self, gamma: int) -> RoundController:
        """Fresh per-generation state; ``gamma`` is ``GenerationConfig.num_speculative_tokens``."""

    def calibrate(self, measure: MeasureForwards, max_width: int, drafter: Drafter) -> None:
        """Before an engine's first round (the engine calls it once, with its rows prefilled): a policy
        priced by forward costs times the target with ``measure`` at the widths it needs, up to
        ``max_width`` (the widest verification, longest block + 1), once in its life, and reads what
        it needs of ``drafter``. The default does nothing."""
        return None


#: How an adaptive draft exit reads the draft's confidence (``ExitPolicy.mode``, ``engine.draft_exit``).
DRAFT_EXIT_MODES = ("per-step", "previous-round", "masked")


#: How adaptive draft exit ends a batched block: "row" stops each row at its own first unsure
#: token (the others go on); "batch" goes on until every row has met an unsure token, and every
#: row keeps all it drafted (the verification forward is as wide either way).
BATCH_EXIT_RULES = ("row", "batch")


@dataclass(frozen=True)
class Draft:
    """One proposed block per row of a batch.

    Attributes:
        tokens: (n, K) long on the model's device; row b's draft is ``tokens[b, :num_tokens[b]]``,
            the rest is padding. It may be a view that is not contiguous (``block_ids[:, 1:]``).
        num_tokens: (n,) Python ints, k_b <= the row's ``max_tokens``.
        probs: Per row, the (k_b, V) float32 draft distributions (sampling rows), or None
            (greedy rows, deterministic drafters); None altogether when no row has any.
        finite: 0-dim bool tensor, whether every draft forward gave finite logits (read in the
            round's host sync), or None when already checked or no model ran.
        who: The drafting model, for the error message when ``finite`` is False.
        trees: Per row, the ``engine.tree.TokenTree`` of its block (node 0 the pending token,
            nodes 1 .. k_b the tokens ``tokens[b, :k_b]``), or None for a linear block; None
            altogether for linear drafts. The engine verifies a row's tree in one forward (greedy,
            or multi-candidate speculative sampling, ``engine.tree_sampling.tree_rejection_sample_rows``) and keeps
            the accepted path; a row it cannot verify as a tree (logits processors, banned words, a
            target outside torch) gets the tree's first chain (``first_chain``), or its
            ``prob_nodes`` where it has them.
        prob_nodes: Per tree row with ``probs``, the nodes whose tokens were drawn from its draft
            distributions, in order (row i of ``probs[b]`` is node ``prob_nodes[b][i]``'s q; they
            form a path from node 0); its other nodes are candidates chosen without the target (no
            q). None for other rows; None altogether when no row has them.
        ngram_sizes: Per row of a linear draft without ``probs``, the length n of the n-gram whose
            earlier occurrence the row's block continues (prompt lookup; 0: no match, no block): the
            evidence a cost model prices the block by, as a longer match is accepted more often
            (``RoundController.trim``). None for drafters without one.
        match_sources: Per row with ``ngram_sizes``, where the match was: "sequence" (the row's own
            prompt and output) or "datastore" (a corpus); each source's blocks are priced by their own
            acceptance. None: every row's is "sequence".
        top_probs: (n, K) float32 on the device, the draft distribution's largest probability at each
            block position (1 for tokens not drafted by a model: a cascade's n-gram part), when the exits
            passed to ``propose`` read nothing between steps (``ExitPolicy.mode`` not "per-step"); the
            engine compares them with each row's threshold and reads the result with the round's sync.
            None otherwise.
        block_ids: (n, 1 + K) long on the device, each row's pending token (the last of its sequence) then
            ``tokens``: the verification's input, given whole where the drafter has it on the device (a greedy
            round's steps in the runner, ``base.draft_batch``), so the engine copies no pending token from the
            host; None otherwise. Its ``[:, 1:]`` is ``tokens``: the engine feeds ``block_ids`` as it is and
            does not check it against the sequences, so a drafter that sets it owns its first column.
        probs_block: (n, S, V) float32 on the device, ``probs`` as one tensor where the drafter has them so (every
            row sampled from the draft model, no deterministic tokens before): row b's q is ``[b, :num_tokens[b]]``,
            the rest is padding. The engine's speculative sampling reads it in place of the rows' list
            (``verification.rejection_sample_rows``); None otherwise.
        readback: (m,) long on the device that the drafter wants read with the round's one host sync and handed
            to its ``on_readback`` (a tree whose shape the next round takes from this one's values,
            ``drafters.draft_tree.shaped_trees``); None: nothing.
    """

    tokens: torch.Tensor
    num_tokens: list[int]
    probs: list[torch.Tensor | None] | None = None
    finite: torch.Tensor | None = None
    who: str = "draft model"
    trees: list[TokenTree | None] | None = None
    prob_nodes: list[list[int] | None] | None = None
    ngram_sizes: list[int] | None = None
    match_sources: list[str] | None = None
    top_probs: torch.Tensor | None = None
    block_ids: torch.Tensor | None = None
    probs_block: torch.Tensor | None = None
    readback: torch.Tensor | None = None


class Drafter(abc.ABC):
    """Base class of every drafter: it drafts for the active rows of the round (``engine.batched``), B >= 1.

    Rows live in slots of the target's ``batch_cache.BatchKVCache``; the active rows always
    fill slots 0 .. n - 1. Calls, in the engine's order:

    1. ``bind(target_cache)`` once: a drafter with a model of its own makes a cache with the
       same slots and capacity; a self-speculative one keeps the target's.
    2. ``join(slot, prompt_ids, sampler)`` when a row joins, after the target's prefill.
    3. Each round, ``propose(sequences, max_tokens, exits)`` for all active rows, in slot order; where its
       draft has a ``readback``, ``on_readback(values)`` right after the round's host sync.
    4. After verification, ``rollback(num_valid)``: row b's first ``num_valid[b]`` tokens are
       confirmed.
    5. When a row leaves, ``move(src, dst, num_valid)``: the row in slot ``src`` now lives in
       slot ``dst`` (``src`` is then free).

    A drafter whose model runs one sequence only (the llama.cpp draft) refuses, at ``bind``, a
    cache with more than one slot.

    Attributes:
        num_forwards: Model forwards run since ``bind``.
        supports_exit_policy: Whether ``propose`` honours ``exits`` (drafters that give
            probabilities).
        reports_ngram_sizes: Whether its drafts carry ``Draft.ngram_sizes`` (prompt lookup's chains): a
            cost-model policy then asks it for the longest block and keeps per row what the match pays for.
        who: The drafting model, for messages.
        prefill_time_s: Seconds ``propose`` spent prefilling prompts whose prefill was deferred from
            ``join`` (a draft model's ``_catch_up``), over its life: not drafting, so the engine leaves
            them out of a round's draft seconds (the cost model's s_node), as it does compilation. Host
            seconds: on CUDA the prefill's kernels may still run after it returns, and what they take
            then is charged to the draft forward that waits for them.
    """

    num_forwards: int = 0
    prefill_time_s: float = 0.0
    supports_exit_policy: bool = False
    reports_ngram_sizes: bool = False
    who: str = "draft model"

    @property
    def compile_time_s(self) -> float:
        """Seconds its runner spent compiling fast-path buckets, over its life (0: none)."""
        runner = getattr(self, "runner", None)
        return float(getattr(runner, "compile_time_s", 0.0))

    @abc.abstractmethod
    def bind(self, target_cache) -> None:
        """Attach to the engine's target ``BatchKVCache`` (slot count and capacity)."""

    @abc.abstractmethod
    def join(self, slot: int, prompt_ids: torch.Tensor, sampler: Sampler) -> None:
        """A row starts in ``slot`` with (1, m) ``prompt_ids``; the target's cache holds them."""

    @abc.abstractmethod
    def propose(
        self,
        sequences: list[list[int]],
        max_tokens: list[int],
        exits: list[ExitPolicy | None] | None = None,
        exit_rule: str = "row",
    ) -> Draft:
        """Draft up to ``max_tokens[b]`` (>= 0) tokens after each row's sequence (its last token in no cache).

        ``exits`` (one per row, or None) end a row's block after an unsure token, under
        ``exit_rule`` (``BATCH_EXIT_RULES``); exits whose ``mode`` is not "per-step" end nothing: the
        draft carries ``top_probs`` instead.
        """

    @abc.abstractmethod
    def rollback(self, num_valid: list[int]) -> None:
        """Forget each row's state past its first ``num_valid[b]`` tokens.

        The engine calls it after every round, and after any rewind of a row's tokens (a banned word's)
        before the next ``propose``, so a drafter may keep a copy of each row's first ``num_valid[b]``
        tokens and take only the rest from the next ``propose``'s sequences
        (``drafters.prompt_lookup.HostSequences``)."""

    @abc.abstractmethod
    def move(self, src: int, dst: int, num_valid: int) -> None:
        """The row in slot ``src`` (``num_valid`` confirmed tokens) moves to slot ``dst``."""

    #: Whether the engine calls ``observe`` after each verification (a drafter that learns from the
    #: target's logits: Token Recycling).
    observes_target: bool = False

    def observe(self, ids: torch.Tensor, logits: torch.Tensor, num_nodes: list[int]) -> None:
        """After a verification: (n, W) ids fed (the pending token, then the draft), (n, W, V) the
        target's logits there (after no processor), ``num_nodes[b]`` the real nodes of row b (the
        rest is padding). Called only when ``observes_target``."""

    def on_readback(self, values: list[int]) -> None:
        """After the round's host sync: its draft's ``Draft.readback``, read (Python ints). Called only for a draft
        that has one, before ``rollback``."""

    def check_context(self, num_prompt_tokens: int, max_new_tokens: int) -> None:
        """Before a row joins: raise ``InvalidArgumentError`` where a model of the drafter's own could not hold
        the prompt's ``num_prompt_tokens`` plus ``max_new_tokens`` (its context length, as the engine checks the
        target's); nothing for drafters without one."""

    def warm_up(self, max_rows: int, max_block: int) -> None:
        """Run a model of its own once at every width it can take (after ``bind``, before any
        ``join``; ``batch_cache.warm_up_widths``). Nothing for drafters without one: a
        self-speculative drafter's forwards take the target's shapes."""
