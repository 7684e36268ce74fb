"""Drafters: what proposes the γ tokens the target model verifies.

The split follows transformers' ``generation/candidate_generator.py``: a drafter
only proposes; verification, acceptance and the target's cache are the decoder's.

The protocol, per generation:

1. ``begin(prompt_ids, sampler, target_cache)`` once, after the target's prefill.
   ``target_cache`` is the target's ``DynamicCache`` holding the prompt; a
   self-speculative drafter may append to it while drafting but must crop it back
   before ``propose`` returns, so the target never reads draft-mode keys/values.
2. Each round, ``propose(sequence, max_tokens)`` with the whole sequence so far
   (prompt + generated tokens; its last token is not yet in any cache).
3. After verification, ``rollback(num_valid)``: the first ``num_valid`` tokens of
   the sequence are confirmed; any state a drafter holds past them is stale.

A drafter whose class sets ``supports_exit_policy = True`` also accepts
``propose(sequence, max_tokens, exit_policy=policy)``: after each drafted token it
asks ``policy.should_stop(top_prob)`` with the draft distribution's top
probability and ends the block when told to (Draft & Verify's adaptive draft
exit, ``specdecode.draft_control.AdaptiveDraftExit``). The decoder passes the
keyword only when adaptive exit is on, so other drafters need not accept it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import DynamicCache, PreTrainedModel

from specdecode import kv_cache
from specdecode.sampling import Sampler, check_finite


@dataclass(frozen=True)
class Draft:
    """One proposed block.

    Attributes:
        tokens: (k,) long, the drafted ids, 0 <= k <= max_tokens.
        probs: (k, V) float32, the distributions they were sampled from when
            sampling, or ``None`` (greedy decoding, or a deterministic drafter).
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


class ExitPolicy(Protocol):
    """Decides, after each drafted token, whether the block ends there (``AdaptiveDraftExit``)."""

    def should_stop(self, top_prob: float) -> bool:
        """``top_prob``: the draft distribution's largest probability, in [0, 1]."""


def draft_token(
    sampler: Sampler, logits: torch.Tensor, probs: list, exit_policy: ExitPolicy | None = None
) -> tuple[torch.Tensor, bool]:
    """Pick one draft token from (1, V') logits; shared by the model-based drafters.

    Greedy: the argmax. Sampling: a draw from ``sampler.probs(logits)``, whose (1, V)
    row is appended to ``probs``. With an ``exit_policy`` the top probability of the
    draft distribution (plain softmax when greedy, the warped one when sampling)
    goes to ``exit_policy.should_stop``, which costs one host sync per token; without
    one there is none.

    Returns:
        The (1,) long token and whether drafting should stop after it.
    """
    if sampler.greedy:
        token = sampler.argmax(logits)
        if exit_policy is None:
            return token, False
        top = float(torch.softmax(logits.float(), dim=-1).amax())
    else:
        q = sampler.probs(logits)
        token = sampler.sample(q)
        probs.append(q)
        if exit_policy is None:
            return token, False
        top = float(q.amax())
    return token, bool(exit_policy.should_stop(top))


def draft_autoregressively(
    model: PreTrainedModel,
    cache: DynamicCache,
    feed: torch.Tensor,
    max_tokens: int,
    sampler: Sampler,
    exit_policy: ExitPolicy | None,
    who: str,
) -> Draft:
    """The draft loop shared by the model-based drafters: up to ``max_tokens`` forwards of ``model``.

    The first forward feeds ``feed`` (1, m), the tokens not yet in ``cache``; each later one
    feeds the token just drafted. A block of k tokens thus runs k forwards and appends
    m + k - 1 positions to ``cache``; the last draft token is not fed.

    Raises:
        NonFiniteLogitsError: If a forward gives NaN or infinite logits (``who`` names the model).
    """
    tokens, probs = [], []
    for _ in range(max_tokens):
        logits = model(feed, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        check_finite(logits, who)
        token, stop = draft_token(sampler, logits, probs, exit_policy)
        tokens.append(token)
        if stop:
            break
        feed = token.view(1, 1)
    return Draft(torch.cat(tokens), torch.cat(probs) if probs else None)


class Drafter(abc.ABC):
    """Base class of every drafter.

    Attributes:
        num_forwards: Model forwards this drafter ran in the current generation.
        supports_exit_policy: Whether ``propose`` takes the ``exit_policy`` keyword
            (drafters that produce distributions); False for deterministic drafters.
    """

    num_forwards: int = 0
    supports_exit_policy: bool = False

    @abc.abstractmethod
    def begin(self, prompt_ids: torch.Tensor, sampler: Sampler, target_cache: DynamicCache) -> None:
        """Start a new sequence. ``prompt_ids``: (1, n) long; ``target_cache`` holds its n positions."""

    @abc.abstractmethod
    def propose(self, sequence: torch.Tensor, max_tokens: int) -> Draft:
        """Propose up to ``max_tokens`` (>= 1) tokens to follow ``sequence`` (1, L)."""

    @abc.abstractmethod
    def rollback(self, num_valid: int) -> None:
        """Forget any state past the first ``num_valid`` tokens of the sequence."""


class DraftModelDrafter(Drafter):
    """A smaller model with the target's vocabulary drafts autoregressively.

    Its KV cache holds every token of the sequence except the ones not yet fed:
    after a block it lacks the pending token (and, after a fully accepted block,
    the last draft token too); the next ``propose`` feeds those in one forward,
    so no extra forward is spent re-syncing after a fully accepted block.

    Args:
        model: The draft model (a transformers causal LM), in eval mode, on the
            target's device. Its vocabulary must map like the target's
            (see ``specdecode.models.check_vocabularies``).
    """

    supports_exit_policy = True

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self._cache = None
        self._num_cached = 0
        self._sampler: Sampler | None = None

    @torch.inference_mode()
    def begin(self, prompt_ids: torch.Tensor, sampler: Sampler, target_cache: DynamicCache) -> None:
        self._sampler = sampler
        self._cache = kv_cache.new_cache(self.model)
        self.model(prompt_ids, past_key_values=self._cache, use_cache=True, logits_to_keep=1)
        n = prompt_ids.shape[1]
        self._num_cached = kv_cache.rollback(self._cache, n, n)  # trims sliding layers, as after every forward
        self.num_forwards = 1

    @torch.inference_mode()
    def propose(self, sequence: torch.Tensor, max_tokens: int, exit_policy: ExitPolicy | None = None) -> Draft:
        """Draft up to ``max_tokens`` tokens; ``exit_policy`` as in the module docstring."""
        feed = sequence[:, self._num_cached :]
        draft = draft_autoregressively(
            self.model, self._cache, feed, max_tokens, self._sampler, exit_policy, "draft model"
        )
        self.num_forwards += len(draft)
        self._num_cached += feed.shape[1] + len(draft) - 1
        return draft

    def rollback(self, num_valid: int) -> None:
        self._num_cached = kv_cache.rollback(self._cache, self._num_cached, num_valid)
