"""The engine's interfaces: model runners and caches, the ``Drafter`` protocol, ``Draft``, and draft control.

**Runners and caches.** ``ModelRunnerProtocol`` is what the decoder and the model-based
drafters call for every forward; ``engine.fast_path.ModelRunner`` (transformers models, eager
or on the fast path) and ``models.llama_cpp.LlamaCppModelRunner`` (a GGUF draft in llama.cpp)
implement it (tests/test_interfaces.py checks both); ``TargetRunnerProtocol`` is a target run
outside torch (a GGUF target in llama.cpp), one sequence addressed by position. ``KVCache`` is
what ``kv_cache.rollback`` and ``kv_cache.truncate`` need of a cache that is cropped (transformers' ``DynamicCache``,
``LlamaCppCache``); ``StaticCache`` what they and the fast path need of one rolled back by
moving its write position (``kv_cache.StaticKVCache``; the batched engine's ``BatchKVCache``
says so too). Whether a cache is static is decided once, by the runner that makes it
(``ModelRunnerProtocol.static_cache``: its ``new_cache`` gives a static cache exactly then),
and the cache carries that decision as ``static = True``; ``kv_cache.is_static`` is the one
place that reads it, for code that holds a cache but not its runner (a drafter sharing the
target's cache, the layer-skip hooks).

**Drafting.**

The engine never imports a drafter; drafters (``specdecode.drafters``) implement
this protocol and the decoder calls them only through it.

The split follows transformers' ``generation/candidate_generator.py``: a drafter
only proposes; verification, acceptance and the target's cache are the decoder's.

The protocol, per generation:

1. ``begin(prompt_ids, sampler, target_cache)`` once, after the target's prefill.
   ``target_cache`` is the target's cache holding the prompt. ``SpeculativeDecoder`` runs the
   batched round with one row and drives a ``Drafter`` through ``engine.one_row.OneRowDrafter``:
   it passes the round's ``batch_cache.BatchKVCache`` (slot 0, static: a drafter with a model
   of its own sizes its cache by ``target_cache.capacity``). A self-speculative drafter
   writing into it drafts past the row's confirmed positions, where the verification
   overwrites them; on a cropped cache (``DynamicCache``) it must cut back what it appended
   (``kv_cache.truncate``) before ``propose`` returns, so the target never reads draft-mode
   keys/values. A drafter may instead give a batch-native form (``batch_drafter``).
2. Each round, ``propose(sequence, max_tokens)`` with the whole sequence so far
   (prompt + generated tokens; its last token is not yet in any cache).
3. After verification, ``rollback(num_valid)``: the first ``num_valid`` tokens of
   the sequence are confirmed; any state a drafter holds past them is stale.

A drafter whose class sets ``supports_exit_policy = True`` also accepts
``propose(sequence, max_tokens, exit_policy=policy)``: after each drafted token it
asks ``policy.should_stop(top_prob)`` with the draft distribution's top
probability and ends the block when told to (Draft & Verify's adaptive draft
exit, ``specdecode.drafters.control.AdaptiveDraftExit``). The decoder passes the
keyword only when adaptive exit is on, so other drafters need not accept it.

A drafter whose class sets ``uses_host_sequence = True`` also receives
``propose(..., host_sequence=host)``: the same tokens as an (L,) int64 numpy array, kept by the
decoder from the values it reads back once per round, so that host-side matching (prompt
lookup, the cascade's n-gram part) never reads the device (no host sync). Its ``Draft.tokens``
may then live on the CPU; the decoder copies them to the device with a non-blocking copy (no
device read; from pageable memory, not yet through a pinned staging buffer).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from transformers import DynamicCache

from specdecode.engine.kv_cache import StaticKVCache
from specdecode.engine.sampling import Sampler


@runtime_checkable
class KVCache(Protocol):
    """A cache as ``kv_cache.rollback`` and ``kv_cache.truncate`` see it when it is cropped (not static).

    Attributes:
        layers: Its per-layer entries: ``truncate`` crops each by its own excess and ``rollback``
            checks the sliding-window ones (``is_sliding``, ``keys``, ``sliding_window``); empty
            for a cache with no sliding layer to lose keys (``LlamaCppCache``).
    """

    layers: Sequence[Any]

    def get_seq_length(self) -> int:
        """Positions it holds."""

    def crop(self, max_length: int) -> None:
        """``max_length`` <= 0: drop the last ``-max_length`` positions; > 0: keep that many."""


@runtime_checkable
class StaticCache(Protocol):
    """A static cache: preallocated, rolled back by moving one write position (never cropped).

    Attributes:
        static: Always True: how a cache says it is static (``kv_cache.is_static``).
        capacity: Positions per layer.
        generation: Counts the generations that took it (``ModelRunnerProtocol.check_owner``).
        layers: Its layers (``layers[0].is_initialized`` once a forward allocated them).
    """

    static: Literal[True]
    capacity: int
    generation: int
    layers: Sequence[Any]

    def set_length(self, num_positions: int) -> None:
        """Roll back (or forward) to ``num_positions`` written positions, without a host sync."""

    def advance(self, num_tokens: int) -> None:
        """After a forward over ``num_tokens`` positions: the next one writes after them."""


@runtime_checkable
class ModelRunnerProtocol(Protocol):
    """Runs one model's forwards for the decode loop (``ModelRunner``, ``LlamaCppModelRunner``).

    Attributes:
        name: For messages ("target model", "draft model", "layer-skip draft").
        compile: Whether forwards use the fast path (compiled graphs on a static cache).
        graphs: Whether compiled widths get graphs (False: the static cache, every forward eager).
        buckets: The widths that get a compiled graph, ascending (empty when none).
        compile_time_s: Seconds spent compiling (first calls of compiled widths), over its life.
        num_eager_forwards: Forwards run eagerly.
        static_cache: Whether ``new_cache`` gives a static cache (``StaticCache``; True on the
            fast path) or a cropped one (``KVCache``): the one place this is decided.
        max_bucket: The widest compiled forward, 0 when nothing is compiled.
    """

    name: str
    compile: bool
    graphs: bool
    buckets: tuple[int, ...]
    compile_time_s: float
    num_eager_forwards: int

    @property
    def static_cache(self) -> bool: ...

    @property
    def max_bucket(self) -> int: ...

    def with_buckets(self, buckets: tuple[int, ...]) -> None:
        """Add compiled widths (kept graphs stay); ignored by a runner that compiles nothing."""

    def new_cache(self, num_positions: int) -> KVCache | StaticCache:
        """An empty cache for a generation that writes at most about ``num_positions`` positions."""

    def check_owner(self, cache: KVCache | StaticCache, generation: int) -> None:
        """Raise ``InvalidArgumentError`` unless ``cache``, taken as generation ``generation``, is still
        that generation's (a runner that keeps one cache or context hands it to the newest)."""

    def __call__(self, ids: torch.Tensor, cache: KVCache | StaticCache, logits_to_keep: int) -> torch.Tensor:
        """One forward over ``ids`` (1, w), appended to ``cache``: (1, logits_to_keep, V) logits."""


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

    def __call__(self, ids: torch.Tensor, starts: Sequence[int], logits_to_keep: int) -> torch.Tensor:
        """``batch_runner.BatchRunner``'s call at one row: (1, w) ids at ``starts[0]``; (1, logits_to_keep, V)."""


@dataclass(frozen=True)
class Draft:
    """One proposed block.

    Attributes:
        tokens: (k,) long, the drafted ids, 0 <= k <= max_tokens.
        probs: (k, V) float32, the distributions they were sampled from when
            sampling, or ``None`` (greedy decoding, or a deterministic drafter).
        finite: 0-dim bool tensor, whether every draft forward of the block gave finite
            logits, left on the device so that the decoder reads it in the round's one host
            sync; None when the drafter checked already (or ran no model).
        who: The drafting model, for the error message when ``finite`` is False.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    finite: torch.Tensor | None = None
    who: str = "draft model"

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


class ExitPolicy(Protocol):
    """Decides, after each drafted token, whether the block ends there (``AdaptiveDraftExit``)."""

    def should_stop(self, top_prob: float) -> bool:
        """``top_prob``: the draft distribution's largest probability, in [0, 1]."""


class Drafter(abc.ABC):
    """Base class of every drafter.

    Attributes:
        num_forwards: Model forwards this drafter ran in the current generation.
        supports_exit_policy: Whether ``propose`` takes the ``exit_policy`` keyword
            (drafters that produce distributions); False for deterministic drafters.
        uses_host_sequence: Whether ``propose`` takes the ``host_sequence`` keyword (a CPU copy
            of ``sequence``; module docstring).
    """

    num_forwards: int = 0
    supports_exit_policy: bool = False
    uses_host_sequence: bool = False

    @property
    def compile_time_s(self) -> float:
        """Seconds this drafter's forwards have spent compiling (fast path), over its life; 0 by default."""
        return 0.0

    @abc.abstractmethod
    def begin(self, prompt_ids: torch.Tensor, sampler: Sampler, target_cache: DynamicCache | StaticKVCache) -> None:
        """Start a new sequence. ``prompt_ids``: (1, n) long; ``target_cache`` holds its n positions."""

    @abc.abstractmethod
    def propose(self, sequence: torch.Tensor, max_tokens: int) -> Draft:
        """Propose up to ``max_tokens`` (>= 1) tokens to follow ``sequence`` (1, L)."""

    @abc.abstractmethod
    def rollback(self, num_valid: int) -> None:
        """Forget any state past the first ``num_valid`` tokens of the sequence."""

    def batch_drafter(self) -> BatchDrafter | None:
        """This drafter in batch-native form, for the batched round that ``SpeculativeDecoder`` runs
        (B = 1); None (the default): the round drives this drafter itself (``engine.one_row``)."""
        return None


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


class DraftPolicy(Protocol):
    """A frozen, reusable draft-length policy (``specdecode.drafters.control.DraftControl``).

    Attributes:
        adaptive_exit: Whether ``controller`` gives an ``exit`` policy (needs a drafter
            with ``supports_exit_policy``).
    """

    adaptive_exit: bool

    @property
    def active(self) -> bool:
        """Whether this differs from drafting γ tokens every round."""

    def controller(self, gamma: int) -> RoundController:
        """Fresh per-generation state; ``gamma`` is ``GenerationConfig.num_speculative_tokens``."""


# --- Batched decoding (``engine.batched``) ----------------------------------------------------

#: How adaptive draft exit ends a batched block: "row" stops each row at its own first unsure
#: token (the others go on); "batch" goes on until every row has met an unsure token, and every
#: row keeps all it drafted (the verification forward is as wide either way).
BATCH_EXIT_RULES = ("row", "batch")


@dataclass(frozen=True)
class BatchDraft:
    """One proposed block per row of a batch.

    Attributes:
        tokens: (n, K) long on the model's device; row b's draft is ``tokens[b, :num_tokens[b]]``,
            the rest is padding.
        num_tokens: (n,) Python ints, k_b <= the row's ``max_tokens``.
        probs: Per row, the (k_b, V) float32 draft distributions (sampling rows), or None
            (greedy rows, deterministic drafters); None altogether when no row has any.
        finite: 0-dim bool tensor, whether every draft forward gave finite logits (read in the
            round's host sync), or None when already checked or no model ran.
        who: The drafting model, for the error message when ``finite`` is False.
    """

    tokens: torch.Tensor
    num_tokens: list[int]
    probs: list[torch.Tensor | None] | None = None
    finite: torch.Tensor | None = None
    who: str = "draft model"


class BatchDrafter(abc.ABC):
    """Base class of drafters for the batched engine (``engine.batched.BatchedSpeculativeDecoder``).

    Rows live in slots of the target's ``batch_cache.BatchKVCache``; the active rows always
    fill slots 0 .. n - 1. Calls, in the engine's order:

    1. ``bind(target_cache)`` once: a drafter with a model of its own makes a cache with the
       same slots and capacity; a self-speculative one keeps the target's.
    2. ``join(slot, prompt_ids, sampler)`` when a row joins, after the target's prefill.
    3. Each round, ``propose(sequences, max_tokens, exits)`` for all active rows, in slot order.
    4. After verification, ``rollback(num_valid)``: row b's first ``num_valid[b]`` tokens are
       confirmed.
    5. When a row leaves, ``move(src, dst, num_valid)``: the row in slot ``src`` now lives in
       slot ``dst`` (``src`` is then free).

    Attributes:
        num_forwards: Model forwards run since ``bind``.
        supports_exit_policy: Whether ``propose`` honours ``exits`` (drafters that give
            probabilities).
    """

    num_forwards: int = 0
    supports_exit_policy: bool = False
    who: str = "draft model"

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
    ) -> BatchDraft:
        """Draft up to ``max_tokens[b]`` (>= 0) tokens after each row's sequence (its last token in no cache).

        ``exits`` (one per row, or None) end a row's block after an unsure token, under
        ``exit_rule`` (``BATCH_EXIT_RULES``).
        """

    @abc.abstractmethod
    def rollback(self, num_valid: list[int]) -> None:
        """Forget each row's state past its first ``num_valid[b]`` tokens."""

    @abc.abstractmethod
    def move(self, src: int, dst: int, num_valid: int) -> None:
        """The row in slot ``src`` (``num_valid`` confirmed tokens) moves to slot ``dst``."""

    def warm_up(self, max_rows: int, max_block: int) -> None:
        """Run a model of its own once at every width it can take (after ``bind``, before any
        ``join``; ``batch_cache.warm_up_widths``). Nothing for drafters without one: a
        self-speculative drafter's forwards take the target's shapes."""
