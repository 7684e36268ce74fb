"""The engine's side of drafting: the ``Drafter`` protocol, ``Draft``, and the draft-control protocol.

The engine never imports a drafter; drafters (``specdecode.drafters``) implement
this protocol and the decoder calls them only through it.

The split follows transformers' ``generation/candidate_generator.py``: a drafter
only proposes; verification, acceptance and the target's cache are the decoder's.

The protocol, per generation:

1. ``begin(prompt_ids, sampler, target_cache)`` once, after the target's prefill.
   ``target_cache`` is the target's cache holding the prompt: a ``DynamicCache``,
   or on the fast path a ``kv_cache.StaticKVCache`` (a drafter with a model of its
   own then sizes its static cache by ``target_cache.capacity``). A
   self-speculative drafter may append to it while drafting but must cut it back
   (``kv_cache.truncate``) before ``propose`` returns, so the target never reads
   draft-mode keys/values.
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
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import DynamicCache

from specdecode.engine.kv_cache import StaticKVCache
from specdecode.engine.sampling import Sampler


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
    """

    num_forwards: int = 0
    supports_exit_policy: bool = False

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
