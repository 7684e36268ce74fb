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

from specdecode.engine.batch_cache import to_device
from specdecode.engine.sampling import Sampler, safe_logits, warped_probs


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


def greedy_epilogue(logits: torch.Tensor) -> torch.Tensor:
    """What a greedy verification reads of each position: (..., 2) long, ``[..., 0]`` the argmax over the last
    dimension (V), ``[..., 1]`` 1 where all V logits are finite, else 0. The fast path computes it inside the
    forward's graph (``batch_runner.BatchRunner.forward_greedy``); other runners after their forward."""
    return torch.stack([logits.argmax(-1), torch.isfinite(logits).all(-1).long()], dim=-1)


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
    """Speculative sampling of one block (Leviathan et al. 2022, Algorithm 1), read back to the host
    (``rejection_sample_device`` and one host sync).

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
    num_accepted, next_token = rejection_sample_device(draft_tokens, draft_probs, target_probs, sampler).tolist()
    return VerificationResult(num_accepted, next_token)


def rejection_sample_device(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    sampler: Sampler,
) -> torch.Tensor:
    """``rejection_sample`` with nothing read back: every choice is made on the device (the accepted count
    indexes the distribution the next token is drawn from), so a round can read its rows' outcomes with
    its one host sync (issue 28: speculative sampling stays on the device). The generator draws γ
    uniforms, then one token, as ``rejection_sample`` always did, so a seed gives the same tokens.

    Args:
        As ``rejection_sample`` (γ >= 0).

    Returns:
        (2,) long on the probabilities' device: the number of accepted draft tokens and the next token
        (the replacement drawn from ``norm(max(0, p_n - q_n))`` at the first rejection n, or the bonus
        token from p_γ when all are accepted).
    """
    gamma, device = draft_tokens.shape[0], target_probs.device
    rows = torch.arange(gamma, device=device)
    p_drafted = target_probs[rows, draft_tokens]
    q_drafted = torch.ones_like(p_drafted) if draft_probs is None else draft_probs[rows, draft_tokens]
    uniforms = sampler.uniform(gamma, device)
    # u < p/q  <=>  u * q < p, with no division by a tiny q.
    num_accepted = (uniforms * q_drafted < p_drafted).cumprod(0).sum()  # 0-dim long, on the device
    at = num_accepted.view(1)
    p = target_probs.index_select(0, at)  # (1, V): p_n, or p_γ (the bonus token's law)
    if gamma:
        before = at.clamp(max=gamma - 1)  # where the rejected token was (ignored when all are accepted)
        if draft_probs is None:  # a one-hot q: p without the rejected token
            residual = p.scatter(1, draft_tokens.index_select(0, before).view(1, 1), 0.0)
        else:
            residual = (p - draft_probs.index_select(0, before)).clamp_min_(0.0)
        total = residual.sum(-1, keepdim=True)
        # total <= 0 only through rounding when p == q; then p itself is the exact residual law.
        residual = torch.where(total > 0.0, residual / total, p / p.sum(-1, keepdim=True))
        p = torch.where(num_accepted == gamma, p, residual)
    return torch.cat([at, sampler.sample(p)])


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
    num_accepted, next_token = sample_block_device(sampler, sampler.probs(logits), proposed, draft_probs).tolist()
    return num_accepted, drafted[:num_accepted] + [next_token]


def sample_block_device(sampler: Sampler, probs: torch.Tensor, proposed: torch.Tensor,
                        draft_probs: torch.Tensor | None) -> torch.Tensor:
    """``sample_block`` with nothing read back (``rejection_sample_device``), from the target's (k + 1, V)
    warped ``probs`` (``Sampler.probs``): (2,) long on their device, the accepted draft tokens and the next
    token. Other arguments as ``sample_block``."""
    if not proposed.shape[0]:
        return torch.cat([torch.zeros(1, dtype=torch.long, device=probs.device), sampler.sample(probs[:1])])
    return rejection_sample_device(proposed, draft_probs, probs, sampler)


def sample_rows(rows, logits: torch.Tensor, finite: torch.Tensor, ids: torch.Tensor, num_tokens: list[int], trees,
                draft_probs, contain_errors: bool) -> dict[int, torch.Tensor | str]:
    """The batched round's speculative sampling on the device (``sample_block_device``), for each sampling row
    whose block is final before the round's read: no token tree, no banned words (whose cut needs the draft
    on the host). Rows that share their warpers' settings are warped in one call (``warped_probs``; if that
    raises, each row alone, so only a row whose warping fails ends).
    Nothing is read back; the round reads the verdicts with its one host sync.

    Args:
        rows: The round's rows (``engine.batch_rows.BatchRow``: ``sampler``, ``banned``, ``request_id``).
        logits: (n, K + 1, V') the target's logits, processed as the rows' verification sees them.
        finite: (n, K + 1) bool (or long, 1 for True), whether each position's raw logits were all finite: a row with non-finite
            ones draws safely (``safe_logits``) and fails once the round reads the flags.
        ids: (n, K + 1) the verification's input: each row's pending token, then its draft.
        num_tokens: Per row, k_b, its drafted tokens.
        trees: Per row, a ``TokenTree`` or None, or None altogether.
        draft_probs: Per row, the (k_b, V) draft distributions q or None, or None altogether.
        contain_errors: False: a sampling that raises propagates.

    Returns:
        Row index -> its (2,) long verdict (accepted draft tokens, next token), or the message of a sampling
        that raised (the row fails alone).
    """
    out: dict[int, torch.Tensor | str] = {}
    live = [b for b, row in enumerate(rows) if not row.sampler.greedy and row.banned is None
            and (trees is None or trees[b] is None)]
    if not live:
        return out
    width = max(num_tokens[b] for b in live) + 1
    live_logits, live_finite = logits[:, :width], finite[:, :width].bool()
    if len(live) < len(rows):
        index = to_device(live, logits.device)  # pinned, non-blocking: no wait for the device
        live_logits, live_finite = live_logits.index_select(0, index), live_finite.index_select(0, index)
    safe = safe_logits(live_logits, live_finite)
    try:  # rows sharing their warpers' settings are warped in one call
        probs = warped_probs([rows[b].sampler for b in live], safe)
    except Exception:  # noqa: BLE001 -- each row is warped alone below, so only a row that fails ends
        probs = None
    for j, b in enumerate(live):
        try:
            k, q = num_tokens[b], draft_probs[b] if draft_probs is not None else None
            p = probs[j, : k + 1] if probs is not None else rows[b].sampler.probs(safe[j, : k + 1])
            out[b] = sample_block_device(rows[b].sampler, p, ids[b, 1 : k + 1], q)
        except Exception as exc:  # noqa: BLE001 -- this row ends ("error", logged); the others go on
            if not contain_errors:
                raise
            out[b] = f"request {rows[b].request_id} failed in its sampling: {type(exc).__name__}: {exc}"
    return out

