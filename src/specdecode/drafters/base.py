"""Drafters: what proposes the γ tokens the target model verifies.

The protocol (``Drafter``, ``Draft``, ``ExitPolicy``) is defined by the engine in
``specdecode.engine.protocol`` and re-exported here; see that module for the
calls a drafter receives per generation. This module holds what the model-based
drafters share: ``draft_token`` and ``draft_autoregressively``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch
from transformers import DynamicCache

from specdecode.drafters.draft_head import BoundDraftHead
from specdecode.engine.kv_cache import StaticKVCache
from specdecode.engine.processors import DraftProcessing
from specdecode.engine.protocol import Draft, Drafter, ExitPolicy
from specdecode.engine.sampling import Sampler, check_finite

__all__ = ["Draft", "Drafter", "ExitPolicy", "draft_autoregressively", "draft_token"]


def draft_token(
    sampler: Sampler,
    logits: torch.Tensor,
    probs: list,
    exit_policy: ExitPolicy | None = None,
    head: BoundDraftHead | None = None,
) -> tuple[torch.Tensor, bool]:
    """Pick one draft token from (1, V') logits; shared by the model-based drafters.

    Greedy: the argmax. Sampling: a draw from ``sampler.probs(logits)``, whose (1, V)
    row is appended to ``probs``. With an ``exit_policy`` the top probability of the
    draft distribution (plain softmax when greedy, the warped one when sampling)
    goes to ``exit_policy.should_stop``, which costs one host sync per token; without
    one there is none. With a truncated ``head`` (``specdecode.drafters.draft_head``)
    the logits are (1, K), the token is mapped back to its vocabulary id, and the
    distribution is the one over the K tokens (zero elsewhere in the (1, V) row).

    Returns:
        The (1,) long token and whether drafting should stop after it.
    """
    if sampler.greedy:
        token = sampler.argmax(logits) if head is None else head.token(sampler, logits)
        if exit_policy is None:
            return token, False
        top = float(torch.softmax(logits.float(), dim=-1).amax())
    else:
        q = sampler.probs(logits) if head is None else head.probs(sampler, logits)
        token = sampler.sample(q)
        probs.append(q)
        if exit_policy is None:
            return token, False
        top = float(q.amax())
    return token, bool(exit_policy.should_stop(top))


def draft_autoregressively(
    forward: Callable[[torch.Tensor, object, int], torch.Tensor],
    cache: DynamicCache | StaticKVCache,
    feed: torch.Tensor,
    max_tokens: int,
    sampler: Sampler,
    exit_policy: ExitPolicy | None,
    who: str,
    head: BoundDraftHead | None = None,
    first_logits: torch.Tensor | None = None,
    processing: DraftProcessing | None = None,
) -> Draft:
    """The draft loop shared by the model-based drafters: up to ``max_tokens`` forwards.

    ``forward(ids, cache, logits_to_keep)`` is the draft model's ``engine.fast_path.ModelRunner``
    (eager, or the fast path on a static cache). The first forward feeds ``feed`` (1, m), the
    tokens not yet in ``cache``; each later one feeds the token just drafted. A block of k
    tokens thus runs k forwards and appends m + k - 1 positions to ``cache``; the last draft
    token is not fed. ``head`` (bound to the draft model) restricts the logits to its K tokens
    (FR-Spec); None: the model's full head.

    ``first_logits`` ((1, V') or (1, K)): the first token's logits, already computed (the
    cascade's n-gram check, ``DraftModelDrafter.check``); the first token then costs no
    forward and ``feed`` (usually (1, 0)) is fed together with it. A block of k tokens then
    runs k - 1 forwards and appends m + k - 1 positions (none for k = 1: nothing is fed).

    ``processing`` (``Sampler.drafting``; full heads only): the target's processors applied to each
    draft step's logits on the draft's own context (penalties, ``logit_bias``), so q follows the
    processed target; None: the raw logits.

    Raises:
        NonFiniteLogitsError: If a forward gives NaN or infinite logits (``who`` names the model);
            greedy without ``exit_policy``, the flag goes to ``Draft.finite`` for the decoder.
        UnsupportedModelError: If a truncated head could not be applied (see ``BoundDraftHead.check_logits``).
    """
    tokens, probs = [], []
    # Greedy without an exit policy: finiteness is kept on the device (no host sync per draft
    # forward) and read by the decoder with the round's other values; otherwise checked here.
    deferred = sampler.greedy and exit_policy is None
    finite = None
    with head.applied() if head is not None else nullcontext():
        for i in range(max_tokens):
            logits = first_logits if i == 0 and first_logits is not None else forward(feed, cache, 1)[:, -1]
            if deferred:
                ok = torch.isfinite(logits).all()
                finite = ok if finite is None else finite & ok
            else:
                check_finite(logits, who)
            if head is not None:
                head.check_logits(logits)
            if processing is not None:  # [processors] the draft's q on its own context
                logits = processing.apply(logits)
            token, stop = draft_token(sampler, logits, probs, exit_policy, head)
            if processing is not None:
                processing.push(token)
            tokens.append(token)
            if stop:
                break
            fed_with_first = i == 0 and first_logits is not None and feed.shape[1]
            feed = torch.cat([feed, token.view(1, 1)], dim=1) if fed_with_first else token.view(1, 1)
    return Draft(torch.cat(tokens), torch.cat(probs) if probs else None, finite, who)
