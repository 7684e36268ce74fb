"""Drafters: what proposes the γ tokens the target model verifies.

The protocol (``Drafter``, ``Draft``, ``ExitPolicy``) is defined by the engine in
``specdecode.engine.protocol`` and re-exported here; see that module for the
calls a drafter receives per generation. This module holds what the model-based
drafters share: ``draft_token`` and ``draft_autoregressively``.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from specdecode.engine.protocol import Draft, Drafter, ExitPolicy
from specdecode.engine.sampling import Sampler, check_finite

__all__ = ["Draft", "Drafter", "ExitPolicy", "draft_autoregressively", "draft_token"]


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
