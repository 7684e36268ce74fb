"""Verification of drafted tokens against the target model's distributions.

Greedy verification accepts the longest prefix of the draft that equals the
target's argmax, so the output is exactly target-only greedy decoding.

Speculative sampling follows Leviathan et al. 2022 ("Fast Inference from
Transformers via Speculative Decoding", Algorithm 1) and Chen et al. 2023
("Accelerating Large Language Model Decoding with Speculative Sampling"):
draft token ``d_i`` is accepted with probability ``min(1, p_i(d_i) / q_i(d_i))``;
at the first rejection a replacement is drawn from ``norm(max(0, p_i - q_i))``;
when all γ are accepted a bonus token is drawn from ``p_γ``. The output is then
distributed exactly as sampling from the target. The names follow vLLM's
rejection sampler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.engine.sampling import Sampler


@dataclass(frozen=True)
class VerificationResult:
    """Outcome of verifying one draft block.

    Attributes:
        num_accepted: How many leading draft tokens were accepted (0..γ).
        next_token: The token the target adds after them: the replacement for the
            first rejected draft token, or the bonus token when all were accepted.
    """

    num_accepted: int
    next_token: int


def greedy_verify(draft_tokens: list[int], target_argmax: list[int]) -> VerificationResult:
    """Accept the longest draft prefix that matches the target's argmax.

    Args:
        draft_tokens: γ drafted token ids.
        target_argmax: γ + 1 target argmax ids; entry i is the target's choice
            after the context plus the first i draft tokens.

    Returns:
        The number accepted and the target's token at the first mismatch (or the
        bonus token after a fully accepted block).
    """
    n = 0
    for drafted, wanted in zip(draft_tokens, target_argmax):
        if drafted != wanted:
            break
        n += 1
    return VerificationResult(n, target_argmax[n])


def rejection_sample(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    sampler: Sampler,
) -> VerificationResult:
    """Speculative sampling of one block (Leviathan et al. 2022, Algorithm 1).

    Args:
        draft_tokens: (γ,) long, the drafted ids.
        draft_probs: (γ, V) float32, the draft distributions q_i the tokens were
            sampled from, or ``None`` for a deterministic drafter (prompt lookup),
            which is treated as a one-hot q.
        target_probs: (γ + 1, V) float32, the target distributions p_i after the
            same temperature / top-k / top-p shaping.
        sampler: Supplies the ``torch.Generator`` for the uniforms and the draws.

    Returns:
        The number of accepted draft tokens and the next token.
    """
    gamma = draft_tokens.shape[0]
    rows = torch.arange(gamma, device=target_probs.device)
    p_drafted = target_probs[rows, draft_tokens]
    if draft_probs is None:
        q_drafted = torch.ones_like(p_drafted)
    else:
        q_drafted = draft_probs[rows, draft_tokens]
    uniforms = sampler.uniform(gamma, target_probs.device)
    # u < p/q  <=>  u * q < p, with no division by a tiny q.
    accepted = uniforms * q_drafted < p_drafted
    num_accepted = int(accepted.cumprod(0).sum())  # the one host sync of the round
    if num_accepted == gamma:
        return VerificationResult(gamma, int(sampler.sample(target_probs[gamma : gamma + 1])[0]))
    p = target_probs[num_accepted]
    if draft_probs is None:
        residual = p.clone()
        residual[draft_tokens[num_accepted]] = 0.0
    else:
        residual = (p - draft_probs[num_accepted]).clamp_min_(0.0)
    total = residual.sum()
    if float(total) <= 0.0:
        # Only reachable through rounding when p == q; then p itself is the exact residual law.
        residual, total = p, p.sum()
    next_token = int(sampler.sample((residual / total).unsqueeze(0))[0])
    return VerificationResult(num_accepted, next_token)


def sample_block(
    sampler: Sampler, logits: torch.Tensor, proposed: torch.Tensor, draft_probs: torch.Tensor | None,
    drafted: list[int],
) -> tuple[int, list[int]]:
    """Speculative sampling of one row's block from the target's logits (``rejection_sample``).

    Args:
        sampler: The row's sampler (its warpers and ``torch.Generator``).
        logits: (k + 1, V') the target's logits at the k drafted tokens and after them.
        proposed: (k,) long, the drafted tokens (k may be 0: one token sampled from row 0).
        draft_probs: (k, V) the draft's q, or None for a deterministic drafter (one-hot q).
        drafted: ``proposed`` as a list.

    Returns:
        (accepted draft tokens, the new tokens: the accepted ones and the replacement or bonus).
    """
    probs = sampler.probs(logits)
    if not proposed.shape[0]:
        return 0, [int(sampler.sample(probs[:1])[0])]
    verdict = rejection_sample(proposed, draft_probs, probs, sampler)
    return verdict.num_accepted, drafted[: verdict.num_accepted] + [verdict.next_token]
