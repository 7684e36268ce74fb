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

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdecode.engine.batch_cache import to_device
from specdecode.engine.sampling import (Sampler, draw_tokens, draw_uniforms, finite_rows, generator_groups,
                                       greedy_tokens, safe_logits, warped_probs)
from specdecode.engine.tree_sampling import tree_rejection_sample_rows
from specdecode.errors import INVALID_DISTRIBUTION, InvalidArgumentError, NonFiniteLogitsError


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
    return torch.stack([greedy_tokens(logits), finite_rows(logits).long()], dim=-1)


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
    """Speculative sampling of one block (Leviathan et al. 2022, Algorithm 1), read back to the host: one row of
    ``rejection_sample_rows`` and one host sync. The generator draws γ uniforms, then one token.

    Args:
        draft_tokens: (γ,) long on ``target_probs``' device, the drafted ids.
        draft_probs: (>= γ, V) float32, the draft distributions q_i the tokens were
            sampled from, or ``None`` for a deterministic drafter (prompt lookup),
            which is treated as a one-hot q.
        target_probs: (γ + 1, V) float32, the target distributions p_i after the
            temperature / top-k / top-p shaping (``Sampler.probs``).
        sampler: Supplies the ``torch.Generator`` for the uniforms and the draws.

    Returns:
        The number of accepted draft tokens and the next token (the replacement drawn from
        ``norm(max(0, p_n - q_n))`` at the first rejection n, or the bonus token from p_γ).

    Raises:
        InvalidArgumentError: If draft_tokens is not 1-d or ``target_probs`` is not (γ + 1, V).
        NonFiniteLogitsError: The distribution the next token is drawn from is not one (NaN, or no mass).
    """
    if draft_tokens.dim() != 1:
        raise InvalidArgumentError(f"rejection_sample: draft_tokens {tuple(draft_tokens.shape)} must be (γ,)")
    gamma = draft_tokens.shape[0]
    q = None if draft_probs is None else draft_probs.unsqueeze(0)
    verdicts, _ = rejection_sample_rows([sampler], target_probs.unsqueeze(0), draft_tokens.view(1, gamma), [gamma], q)
    num_accepted, next_token = verdicts[0].tolist()
    if next_token < 0:
        raise NonFiniteLogitsError(INVALID_DISTRIBUTION)
    return VerificationResult(num_accepted, next_token)


@dataclass
class SampledRows:
    """The rows of a round whose speculative sampling was decided on the device (``sample_rows``).

    Attributes:
        rows: The row indices decided, in order: rows with a linear block, then rows with a token tree.
        verdicts: (len(rows), 2) long on the device, row ``rows[j]``'s accepted draft tokens and next token at
            ``[j]`` (-1: its law was not a distribution, ``sampling.race``; the engine fails the row); None when
            ``rows`` is empty. Nothing is read back: the round reads them with its one sync.
        paths: (t, D) long on the device, the accepted tree nodes after node 0 of the last t rows (tree rows), -1
            past each one's accepted count; None when no tree row was decided.
        errors: Row index -> the message of its sampling, which raised (that row fails alone); the engine adds
            the rows whose verdict is -1.
    """

    rows: list[int] = field(default_factory=list)
    verdicts: torch.Tensor | None = None
    paths: torch.Tensor | None = None
    errors: dict[int, str] = field(default_factory=dict)

    def tokens(self) -> torch.Tensor:
        """(len(rows),) long on the device: each decided row's next token."""
        return self.verdicts[:, 1]

    def to_read(self) -> list[torch.Tensor]:
        """What the round reads back, flattened: the verdicts, then the paths (``read``)."""
        return [t.flatten() for t in (self.verdicts, self.paths) if t is not None]

    def read(self, values: list[int]) -> tuple[dict[int, tuple[int, int]], dict[int, list[int]], int]:
        """``to_read``'s values, read, from the start of ``values``: (row -> (accepted, next token); tree row ->
        its accepted path from node 0; how many values they took)."""
        decided = {b: (values[2 * j], values[2 * j + 1]) for j, b in enumerate(self.rows)}
        depth = self.paths.shape[1] if self.paths is not None else 0
        trees = self.rows[len(self.rows) - self.paths.shape[0]:] if self.paths is not None else []
        at = 2 * len(self.rows)
        paths = {b: [0, *values[at + i * depth : at + i * depth + decided[b][0]]] for i, b in enumerate(trees)}
        return decided, paths, at + depth * len(trees)


def rejection_sample_rows(samplers: Sequence[Sampler], probs: torch.Tensor, drafted: torch.Tensor,
                          num_tokens: Sequence[int], draft_probs: torch.Tensor | Sequence[torch.Tensor | None] | None,
                          contain_errors: bool = False,
                          cut: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[int, Exception]]:
    """Speculative sampling of m rows at once, each with its own block length k_j and sampler
    (Leviathan et al. 2022, Algorithm 1; the batch layout of vLLM's rejection sampler). The acceptance test,
    the accepted counts, the residual ``norm(max(0, p_n - q_n))`` and the bonus law are computed for every row
    in one set of operations; so are the draws of rows whose samplers share a generator (an engine's requests
    without a seed, ``Sampler``): γ uniforms each in one call, then their tokens in one call. A row with a
    ``torch.Generator`` of its own (a seed) draws its k_j uniforms, then its token, as it would alone (m = 1), from
    distributions equal to its, so a seed's tokens do not depend on the batch (on CPU; on CUDA a batched
    reduction may round a last bit differently, so a draw could rarely differ, the law never). Every choice is
    made on the device (the accepted count indexes the law the next token is drawn from): nothing is read back,
    so a round reads its rows' verdicts with its one host sync (issue 28).

    Args:
        samplers: Per row, its sampler (its generator draws the row's uniforms and token).
        probs: (m, W, V) float32, the target's warped distributions (``Sampler.probs``) at each row's drafted
            positions and after them; W = max(k_j) + 1, a row's positions past k_j are padding.
        drafted: (m, W - 1) long on ``probs``' device, each row's drafted tokens (past k_j: padding, any id in
            0..V - 1: it is gathered, never used).
        num_tokens: Per row, k_j >= 0, its drafted tokens (k_j = 0: one token drawn from ``probs[j, 0]``).
        draft_probs: The draft distributions q the tokens were drawn from: (m, >= W - 1, V) float32, row j's at
            ``[j, :k_j]`` (``Draft.probs_block``); or per row a (>= k_j, V) tensor, or None for a deterministic
            drafter's row (a one-hot q), padded into that layout here; None altogether: every row's is one-hot.
        contain_errors: True: a row whose draws (its uniforms or its token) raise is left out and reported; False:
            the error propagates.
        cut: (m,) long on the device, each row's block as verified, in 0..k_j (a block cut at an exit point
            known only on the device, ``draft_exit.exit_blocks``; its values are not checked: that would read the
            device): tokens past it are neither accepted nor used; the row still draws the uniforms of its k_j
            tokens. None: every row's k_j.

    Returns:
        ((m', 2) long on the device, per row in order the accepted draft tokens and the next token (-1 where the
        law it is drawn from is not a distribution, ``sampling.race``), for the m' rows whose draw did not raise;
        row j -> the exception of each row left out).

    Raises:
        InvalidArgumentError: If a k_j is outside 0..W - 1, or the shapes of ``samplers``, ``num_tokens``,
            ``cut``, ``drafted`` or ``draft_probs`` (a row's q: fewer than k_j positions or another vocabulary) disagree
            with ``probs``.
    """
    if probs.dim() != 3:
        raise InvalidArgumentError(f"rejection_sample_rows: probs {tuple(probs.shape)} must be (m, W, V)")
    m, width = probs.shape[:2]
    gamma, device = width - 1, probs.device
    if len(samplers) != m or len(num_tokens) != m or tuple(drafted.shape) != (m, gamma):
        raise InvalidArgumentError(f"rejection_sample_rows: {len(samplers)} samplers, {len(num_tokens)} block "
                                   f"lengths and drafted {tuple(drafted.shape)} for probs {tuple(probs.shape)}")
    if any(not 0 <= k <= gamma for k in num_tokens):
        raise InvalidArgumentError(f"rejection_sample_rows: block lengths {list(num_tokens)} must lie in 0..{gamma}")
    if cut is not None and tuple(cut.shape) != (m,):
        raise InvalidArgumentError(f"rejection_sample_rows: cut {tuple(cut.shape)} for {m} rows: must be ({m},)")
    block = isinstance(draft_probs, torch.Tensor)
    if block and (draft_probs.dim() != 3 or draft_probs.shape[0] != m or draft_probs.shape[1] < gamma
                  or draft_probs.shape[2] != probs.shape[-1]):
        raise InvalidArgumentError(f"rejection_sample_rows: draft_probs {tuple(draft_probs.shape)} for {m} rows of "
                                   f"up to {gamma} drafted tokens over {probs.shape[-1]}")
    if not block and draft_probs is not None:
        shapes = [None if q is None else tuple(q.shape) for q in draft_probs]
        if len(shapes) != m or any(s is not None and (len(s) != 2 or s[0] < k or s[1] != probs.shape[-1])
                                   for s, k in zip(shapes, num_tokens)):
            raise InvalidArgumentError(f"rejection_sample_rows: draft_probs {shapes} for block lengths "
                                       f"{list(num_tokens)} over {probs.shape[-1]} tokens")
    failed: dict[int, Exception] = {}
    if not gamma:
        num_accepted = torch.zeros(m, dtype=torch.long, device=device)
        p = probs[:, 0]
    else:
        deterministic = [] if block else [j for j in range(m) if draft_probs is None or draft_probs[j] is None]
        q_block = draft_probs[:, :gamma] if block else _padded(draft_probs, num_tokens, gamma, probs)
        # Each generator's draw: a row with its own draws its k_j uniforms; rows sharing one, γ each in one call.
        drawing = [j for j in range(m) if num_tokens[j]]
        draws = [[drawing[i] for i in group] for group in generator_groups([samplers[j] for j in drawing])]
        flat = [j * gamma + i for rows in draws for j in rows
                for i in range(num_tokens[j] if len(rows) == 1 else gamma)]
        full = cut is None and all(k == gamma for k in num_tokens)  # every row drafted γ: nothing to mask
        in_order = bool(flat) and flat == list(range(m * gamma))  # the draws fill the (m, γ) layout as they come
        one_hots = deterministic if q_block is not None else []
        # one copy of what the device needs: k_j per row, the uniforms' places in (m, γ), the one-hot q's rows
        host = ([] if full else list(num_tokens), [] if in_order else flat, one_hots)
        packed = to_device([*host[0], *host[1], *host[2]], device) if any(host) else None
        k, flat_index, one_hot = packed.split([len(h) for h in host]) if packed is not None else (None, None, None)
        k = torch.minimum(k, cut) if cut is not None else k  # the verified blocks
        drawn = [draw_uniforms(samplers, rows, num_tokens[rows[0]] if len(rows) == 1 else gamma, device,
                           failed if contain_errors else None) for rows in draws]
        if in_order:
            uniforms = (drawn[0] if len(drawn) == 1 else torch.cat(drawn)).view(m, gamma)
        else:
            uniforms = torch.ones((m, gamma), device=device)
            if drawn:
                uniforms.view(-1).index_copy_(0, flat_index, torch.cat(drawn))
        column = drafted.unsqueeze(-1)  # (m, γ, 1)
        p_drafted = probs[:, :gamma].gather(2, column).squeeze(-1)  # (m, γ)
        q_drafted = q_block.gather(2, column).squeeze(-1) if q_block is not None else torch.ones_like(p_drafted)
        if deterministic and q_block is not None:
            q_drafted.index_fill_(0, one_hot, 1.0)  # a one-hot q: 1 at its token
        # u < p/q  <=>  u * q < p, with no division by a tiny q; nothing past k_j is accepted
        accepted = uniforms * q_drafted < p_drafted
        if not full:
            accepted &= torch.arange(gamma, device=device) < k.view(m, 1)
        num_accepted = accepted.cumprod(1).sum(1)  # (m,) long
        # the first rejected token's position (when all are accepted: any, its residual is not used)
        last = num_accepted.clamp(max=gamma - 1) if full else torch.minimum(num_accepted, (k - 1).clamp_min(0))
        before = last.view(m, 1)
        rows = torch.arange(m, device=device)
        p = probs[rows, num_accepted]  # (m, V): p_n, or p_γ (the bonus token's law)
        residual = p
        if q_block is not None:  # each row's q there; a one-hot q's row is 0 (padded), its 1 is zeroed below
            residual = p - q_block[rows, before.view(m)]
        # max(0, p - q) and 0 at the rejected token: a one-hot q's residual; a draft's q has 0 there already,
        # since a token is rejected only where q > p
        residual = residual.clamp_min(0.0).scatter_(1, drafted.gather(1, before), 0.0)
        total = residual.sum(-1, keepdim=True)
        # total <= 0 only through rounding when p == q; then p itself is the exact residual law.
        residual = torch.where(total > 0.0, residual / total, p / p.sum(-1, keepdim=True))
        p = torch.where((num_accepted == (gamma if full else k)).view(m, 1), p, residual)
    drawing = [j for j in range(m) if j not in failed]
    drew: dict[int, Exception] = {}
    tokens = draw_tokens([samplers[j] for j in drawing], p, drawing, drew if contain_errors else None)
    failed.update({drawing[i]: exc for i, exc in drew.items()})
    if not failed:
        return torch.stack([num_accepted, tokens], dim=1), failed
    kept = [j for j in range(m) if j not in failed]
    if not kept:
        return torch.empty((0, 2), dtype=torch.long, device=device), failed
    if len(drawing) > len(kept):  # rows whose token draw failed
        tokens = tokens.index_select(0, to_device([i for i, j in enumerate(drawing) if j not in failed], device))
    return torch.stack([num_accepted.index_select(0, to_device(kept, device)), tokens], dim=1), failed


def _padded(rows: Sequence[torch.Tensor | None] | None, num_tokens: Sequence[int], gamma: int,
            probs: torch.Tensor) -> torch.Tensor | None:
    """Per-row draft distributions ((>= k_j, V) or None) as one (m, γ, V) float32 block, zero where a row has
    none (a one-hot q, set by the caller) and past k_j; None when no row has any."""
    if rows is None or all(q is None or not k for q, k in zip(rows, num_tokens)):
        return None
    out = probs.new_zeros((len(num_tokens), gamma, probs.shape[-1]))
    for j, (q, k) in enumerate(zip(rows, num_tokens)):
        if q is not None and k:
            out[j, :k] = q[:k]
    return out


def sample_rows(rows, logits: torch.Tensor, finite: torch.Tensor, ids: torch.Tensor, num_tokens: list[int], trees,
                draft_probs, contain_errors: bool, probs_block: torch.Tensor | None = None,
                prob_nodes: Sequence[list[int] | None] | None = None, cut: torch.Tensor | None = None) -> SampledRows:
    """The batched round's speculative sampling on the device, for each sampling row: linear blocks by
    ``rejection_sample_rows``, token trees by ``tree_sampling.tree_rejection_sample_rows``. Rows that share their
    warpers' settings are warped in one call (``warped_probs``; if that raises, each row alone, so only a row
    whose warping fails ends). Nothing is read back: the round reads the verdicts with its one host sync. A row
    with banned words samples its whole block too and keeps all it drew; its words are matched after the read, and
    a completed one rolls the row back to where it begins (``banned_rows.BannedRow.check``), as when the tokens come
    one at a time. Cutting the block before a word its draft spells would bias the law: the cut depends on draft
    tokens past the ones kept.

    Args:
        rows: The round's rows (``engine.batch_rows.BatchRow``: ``sampler``, ``request_id``).
        logits: (n, K + 1, V') the target's logits, processed as the rows' verification sees them.
        finite: (n, K + 1) bool (or long, 1 for True), whether each position's raw logits were all finite: a row
            with non-finite ones draws safely (``safe_logits``) and fails once the round reads the flags.
        ids: (n, K + 1) the verification's input: each row's pending token, then its draft (or its tree's nodes).
        num_tokens: Per row, k_b, its drafted tokens.
        trees: Per row, a ``TokenTree`` or None, or None altogether.
        draft_probs: Per row, the (k_b, V) draft distributions q or None, or None altogether.
        contain_errors: False: a sampling that raises propagates.
        probs_block: ``draft_probs`` as one (n, S, V) tensor (``Draft.probs_block``), read in their place; or None.
        prob_nodes: Per tree row, the nodes whose q's are its ``draft_probs`` rows (``Draft.prob_nodes``); None.
        cut: (n,) long on the device, each linear row's block as verified, at most k_b (exits read with the sync,
            ``draft_exit.exit_blocks``; ``rejection_sample_rows``), or None: k_b.

    Returns:
        The rows decided, their verdicts (accepted draft tokens, next token) and tree paths, and the message of
        each row whose sampling raised (it fails alone).
    """
    out = SampledRows()
    live = [b for b, row in enumerate(rows) if not row.sampler.greedy]
    if not live:
        return out
    width = max(num_tokens[b] for b in live) + 1
    live_logits, live_finite, live_ids = logits[:, :width], finite[:, :width].bool(), ids[:, 1:width]
    if len(live) < len(rows):
        index = to_device(live, logits.device)  # pinned, non-blocking: no wait for the device
        live_logits, live_finite = live_logits.index_select(0, index), live_finite.index_select(0, index)
        live_ids = live_ids.index_select(0, index)
    safe = safe_logits(live_logits, live_finite)
    samplers = [rows[b].sampler for b in live]

    def failure(b: int, exc: Exception) -> str:
        return f"request {rows[b].request_id} failed in its sampling: {type(exc).__name__}: {exc}"

    try:  # rows sharing their warpers' settings are warped in one call
        probs = warped_probs(samplers, safe)
    except Exception:  # noqa: BLE001 -- each row is warped alone below, so only a row that fails ends
        warped = []
        for j, b in enumerate(live):
            try:
                warped.append(samplers[j].probs(safe[j]))
            except Exception as exc:  # noqa: BLE001 -- this row ends ("error", logged); the others go on
                if not contain_errors:
                    raise
                out.errors[b] = failure(b, exc)
        if not warped:
            return out
        probs = torch.stack(warped)
    kept = [j for j, b in enumerate(live) if b not in out.errors]
    linear = [j for j in kept if trees is None or trees[live[j]] is None]
    grown = [j for j in kept if trees is not None and trees[live[j]] is not None]
    parts = []  # (rows, verdicts) of the linear rows, then of the tree rows

    def subset(js: list[int], tensor: torch.Tensor, among: list[int] | None = None) -> torch.Tensor:
        among = kept if among is None else among
        return tensor if js == among else tensor.index_select(0, to_device([among.index(j) for j in js], tensor.device))

    if linear:
        at = [live[j] for j in linear]
        q = [draft_probs[b] for b in at] if draft_probs is not None else None
        if probs_block is not None:  # in place when every row of the block is sampled here, in order
            q = probs_block if at == list(range(probs_block.shape[0])) else \
                probs_block.index_select(0, to_device(at, logits.device))
        verdicts, failed = rejection_sample_rows([samplers[j] for j in linear], subset(linear, probs),
                                                 subset(linear, live_ids, list(range(len(live)))),
                                                 [num_tokens[live[j]] for j in linear], q, contain_errors,
                                                 None if cut is None else cut if at == list(range(len(cut)))
                                                 else cut.index_select(0, to_device(at, cut.device)))
        parts.append(([live[j] for j in linear], verdicts, failed))
    if grown:
        q = [_by_node(probs_block, draft_probs, prob_nodes, live[j]) for j in grown]
        verdicts, failed = tree_rejection_sample_rows([samplers[j] for j in grown], subset(grown, probs),
                                                      [trees[live[j]] for j in grown],
                                                      subset(grown, live_ids, list(range(len(live)))), q,
                                                      contain_errors)
        parts.append(([live[j] for j in grown], verdicts, failed))
        out.paths = verdicts[:, 2:]
    for decided, verdicts, failed in parts:
        for i, exc in failed.items():
            out.errors[decided[i]] = failure(decided[i], exc)
        out.rows += [b for i, b in enumerate(decided) if i not in failed]
    if out.rows:
        out.verdicts = torch.cat([verdicts[:, :2] for _, verdicts, _ in parts])
    if out.paths is not None and not out.paths.shape[0]:
        out.paths = None
    return out


def _by_node(probs_block: torch.Tensor | None, draft_probs, prob_nodes, b: int) -> dict[int, torch.Tensor] | None:
    """Row b's draft distributions by tree node (``Draft.prob_nodes``), or None: every node is a candidate without q
    (deterministic drafters)."""
    nodes = prob_nodes[b] if prob_nodes is not None else None
    q = draft_probs[b] if draft_probs is not None else probs_block[b] if probs_block is not None else None
    if nodes is None or q is None:
        return None
    return {node: q[i] for i, node in enumerate(nodes)}
