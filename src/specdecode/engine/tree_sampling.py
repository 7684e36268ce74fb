"""Speculative sampling over token trees, for m rows at once, on the device.

Multi-candidate speculative sampling (SpecInfer, Miao et al. 2024, Algorithm 2, "multi-step speculative
sampling"; Chen et al. 2023's rejection step for a node drawn from a draft q). At node t with target
distribution p (renormalised as mass is removed), its children are examined drawn one first, then the others in
order:

* a child drawn from the draft's q (``draft_probs``; its token x_c drawn independently of the target) is
  accepted with probability min(1, p(x_c) / q(x_c)); on rejection p <- norm(max(0, p - q));
* any other child (a candidate chosen without the target: n-gram matches, Token Recycling, a draft model's
  top-k runners-up) is accepted with probability p(x_c); on rejection x_c's mass is removed
  (p <- norm(max(0, p - onehot(x_c)))), recursive rejection sampling of candidates without probabilities.

Accepting moves the walk to c; when every child is rejected (or t is a leaf) the next token is drawn from what is
left of p. The drawn child comes first because the runners-up may depend on its token (the draft's top-k without
it): examined before it, they would tell which token was drawn, and the ratio test needs x_c ~ q. After its
rejection what is left is an exact sampler of the residual for any candidates, so each emitted token is
distributed exactly as the target's sampling (tested in tests/engine/test_tree_sampling.py, with the wrong order
as a negative control).

On the device, without reading anything back: what each candidate's test compares depends only on its siblings
examined before it (all rejected, or the walk would not reach it), so every node's tests run at once, each with a
uniform of its own, and the walk then follows each node's first accepted child for the trees' depth. A uniform is
drawn for every candidate, reached or not (``tree_rejection_sample_rows`` says how many), and the round reads the
paths with its one host sync (issue 28). Each node's p is taken to sum to 1, as ``verification.rejection_sample_rows``
takes it (the warped distributions ``Sampler.probs`` gives), so the residual is max(0, p - q) unnormalised.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from specdecode.engine.batch_cache import to_device
from specdecode.engine.sampling import Sampler, draw_tokens, draw_uniforms, generator_groups
from specdecode.engine.tree import TokenTree
from specdecode.errors import INVALID_DISTRIBUTION, InvalidArgumentError, NonFiniteLogitsError


def tree_rejection_sample_rows(samplers: Sequence[Sampler], probs: torch.Tensor, trees: Sequence[TokenTree],
                               drafted: torch.Tensor, draft_probs: Sequence[Mapping[int, torch.Tensor] | None] | None,
                               contain_errors: bool = False) -> tuple[torch.Tensor, dict[int, Exception]]:
    """Speculative sampling of m rows' token trees at once (module docstring), each with its own sampler.

    A row alone on its generator (a seed) draws its T_j - 1 uniforms (one per candidate, in the order examined:
    node by node, the drawn child first), then the noise of its next token (``sampling.draw_tokens``), so its draws
    do not depend on the batch; rows whose samplers share a generator draw together, W - 1 uniforms each (their
    first T_j - 1 used). Nothing is read back.

    Args:
        samplers: Per row, its sampler.
        probs: (m, W, V) float32, the target's warped distributions at each row's nodes (node t at ``[j, t]``), each
            summing to 1; a row's positions past its T_j nodes are padding.
        trees: Per row, its ``TokenTree`` of T_j <= W nodes.
        drafted: (m, W - 1) long on ``probs``' device: row j's node t >= 1 holds ``drafted[j, t - 1]``; past
            T_j - 1, padding, any id in 0..V - 1 (it is gathered, never used).
        draft_probs: Per row, node -> the (V,) float32 q its token was drawn from (at most one drawn child a
            node: a draft model's sampled path), or None (every candidate deterministic); None altogether.
        contain_errors: True: a row whose draws raise is left out and reported; False: the error propagates.

    Returns:
        ((m', 2 + D) long on the device, per row in order: the accepted drafted nodes a, the next token (-1 where
        what it is drawn from is not a distribution, ``sampling.race``), then the accepted nodes along the path
        from node 0 (their first a entries; -1 after), D the trees' largest depth (m = 0: an empty (0, 2)); row j
        -> the exception of each row left out).

    Raises:
        InvalidArgumentError: If the shapes disagree, a tree is wider than W, a node has two drawn children, or a
            q is at a node outside 1..T_j - 1 or not of shape (V,).
    """
    if probs.dim() != 3:
        raise InvalidArgumentError(f"tree_rejection_sample_rows: probs {tuple(probs.shape)} must be (m, W, V)")
    m, width, vocab = probs.shape
    device = probs.device
    if len(samplers) != m or len(trees) != m or tuple(drafted.shape) != (m, width - 1):
        raise InvalidArgumentError(f"tree_rejection_sample_rows: {len(samplers)} samplers, {len(trees)} trees and "
                                   f"drafted {tuple(drafted.shape)} for probs {tuple(probs.shape)}")
    if draft_probs is not None and len(draft_probs) != m:
        raise InvalidArgumentError(f"tree_rejection_sample_rows: {len(draft_probs)} draft_probs for {m} rows")
    if not m:
        return torch.empty((0, 2), dtype=torch.long, device=device), {}
    # host bookkeeping from the trees' shapes: each node's candidates in the order examined
    fan = max([1, *(len(c) for tree in trees for c in tree.children)])
    child = [-1] * (m * width * fan)  # [j, t, i]: node t's i-th candidate, -1 where none
    drawn_at = [-1] * (m * width)  # [j, t]: the index of node t's drawn child's q in ``qs``, -1 where none
    places, qs = [], []  # per row, its candidates' places in (m, W, C) in the order examined; the drawn q's
    for j, tree in enumerate(trees):
        q_of = (draft_probs[j] if draft_probs is not None else None) or {}
        if tree.num_nodes > width or any(not 0 < c < tree.num_nodes or q.shape != (vocab,) for c, q in q_of.items()):
            raise InvalidArgumentError(
                f"tree_rejection_sample_rows: row {j}'s tree of {tree.num_nodes} nodes with q at nodes "
                f"{sorted(q_of)} (shapes {[tuple(q.shape) for q in q_of.values()]}) for width {width} over {vocab}: "
                f"at most {width} nodes, q at nodes 1..{tree.num_nodes - 1} of shape ({vocab},)")
        places.append([])
        for t, kids in enumerate(tree.children):
            drawn = [c for c in kids if c in q_of]
            if len(drawn) > 1:
                raise InvalidArgumentError(f"tree_rejection_sample_rows: row {j}'s node {t} has {len(drawn)} "
                                           f"drawn children {drawn}; at most one is allowed")
            if drawn:
                drawn_at[j * width + t] = len(qs)
                qs.append(q_of[drawn[0]])
            for i, c in enumerate(drawn + [c for c in kids if c not in q_of]):
                child[(j * width + t) * fan + i] = c
                places[j].append((j * width + t) * fan + i)
    # the uniforms: a row alone draws one a candidate; rows sharing a generator W - 1 each, in one call
    groups = generator_groups(samplers)
    counts = [len(places[rows[0]]) if len(rows) == 1 else width - 1 for rows in groups]
    taken, offset = [], 0  # which of the draws (concatenated) each candidate uses, in ``places``' order
    for rows, count in zip(groups, counts):
        taken += [offset + i * count + n for i, j in enumerate(rows) for n in range(len(places[j]))]
        offset += len(rows) * count
    where = [place for rows in groups for j in rows for place in places[j]]
    packed = to_device(child + drawn_at + where + taken, device)
    child_t, drawn_t, where_t, taken_t = packed.split([len(child), len(drawn_at), len(where), len(taken)])
    failed: dict[int, Exception] = {}
    drawn = torch.cat([draw_uniforms(samplers, rows, count, device, failed if contain_errors else None)
                       for rows, count in zip(groups, counts)])
    uniforms = torch.ones(m * width * fan, device=device).index_copy_(0, where_t, drawn.index_select(0, taken_t))
    nodes = probs.reshape(m * width, vocab)  # (m·W, V): node g = j·W + t
    token = _tokens(child_t.view(m * width, fan), drafted)  # (m·W, C): each candidate's token
    next_node, residual = _first_accepted(nodes, child_t.view(m * width, fan), token, drawn_t, qs,
                                          uniforms.view(m * width, fan))
    # the walk: from node 0, each node's first accepted candidate, for the trees' depth
    at = torch.zeros(m, dtype=torch.long, device=device)
    base = torch.arange(m, device=device) * width
    steps = []
    for _ in range(max(max(tree.depths) for tree in trees)):
        step = next_node.index_select(0, base + at)
        steps.append(step)
        at = torch.where(step >= 0, step, at)
    path = torch.stack(steps, 1) if steps else torch.empty((m, 0), dtype=torch.long, device=device)
    end = _left_at(nodes, base + at, child_t.view(m * width, fan), token, drawn_t, residual)
    drawing = [j for j in range(m) if j not in failed]
    drew: dict[int, Exception] = {}
    tokens = draw_tokens([samplers[j] for j in drawing], end, drawing, drew if contain_errors else None)
    failed.update({drawing[i]: exc for i, exc in drew.items()})
    kept = [j for j in range(m) if j not in failed]
    if len(kept) < m:
        path = path.index_select(0, to_device(kept, device))
    if len(drawing) > len(kept):
        tokens = tokens.index_select(0, to_device([i for i, j in enumerate(drawing) if j not in failed], device))
    return torch.cat([(path >= 0).sum(1, keepdim=True), tokens.unsqueeze(1), path], 1), failed


def _tokens(child: torch.Tensor, drafted: torch.Tensor) -> torch.Tensor:
    """(m·W, C) long: the tokens of every node's candidates ``child`` (node g = j·W + t; node c of row j holds
    ``drafted[j, c - 1]``; where there is none, any id)."""
    width = drafted.shape[1] + 1
    flat = drafted if width > 1 else drafted.new_zeros((drafted.shape[0], 1))
    row = torch.arange(child.shape[0], device=child.device) // width
    return flat[row.unsqueeze(1), (child - 1).clamp_min(0)]


def _first_accepted(nodes: torch.Tensor, child: torch.Tensor, token: torch.Tensor, drawn_at: torch.Tensor,
                    qs: list[torch.Tensor], uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every node's candidates tested at once. ``nodes``: (G, V) p, each summing to 1 (as
    ``verification.rejection_sample_rows`` takes them); ``child``, ``token`` (``_tokens``), ``uniforms``: (G, C);
    ``drawn_at`` (G,): the index in ``qs`` of each node's drawn child's q, or -1. Returns ((G,) long, each node's
    first accepted child or -1; the (N, V) residuals max(0, p - q) of the N nodes with a drawn child, in ``qs``'
    order, or None)."""
    p_x = nodes.gather(1, token)  # (G, C): p at each candidate's token
    base, total = p_x, torch.ones_like(p_x[:, 0])  # what the candidates without q are tested against: p, or
    drawn_ok, residual = torch.zeros_like(child, dtype=torch.bool), None  # the residual, and its mass
    free = child >= 0  # the candidates without q
    if qs:
        at = (drawn_at >= 0).nonzero().squeeze(1)  # the nodes with a drawn child, in ``qs``' order
        q, x = torch.stack(qs), token.index_select(0, at)  # (N, V); (N, C), column 0 the drawn token
        # u < p/q  <=>  u * q < p, with no division by a tiny q
        drawn_ok[at, 0] = uniforms[at, 0] * q.gather(1, x[:, :1]).squeeze(1) < p_x[at, 0]
        residual = nodes.index_select(0, at).sub_(q).clamp_min_(0.0)  # Chen et al.'s, unnormalised
        base = p_x.index_copy(0, at, residual.gather(1, x))
        total = total.index_copy(0, at, residual.sum(-1))
        free[at, 0] = False
    # a token an earlier sibling removed has no mass left: it is never accepted and removes nothing
    same = (token.unsqueeze(2) == token.unsqueeze(1)) & free.unsqueeze(1)  # [g, i, i']: i' free, same token
    earlier = torch.ones(same.shape[1:], dtype=torch.bool, device=same.device).tril(-1)  # [i, i']: i' < i
    mass = torch.where(free & ~(same & earlier).any(-1), base, 0.0)
    left = total.unsqueeze(1) - (mass.cumsum(1) - mass)  # the mass left when candidate i is examined
    # the examination stops where nothing is left (rounding; or a NaN): later candidates are rejected
    accepted = drawn_ok | (free & (left > 0) & (uniforms * left < mass))
    first = accepted.int().argmax(1, keepdim=True)  # the first True: argmax returns the first maximum
    return torch.where(accepted.any(1), child.gather(1, first).squeeze(1), -1), residual


def _left_at(nodes: torch.Tensor, end: torch.Tensor, child: torch.Tensor, token: torch.Tensor,
             drawn_at: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """(m, V): what is left of p at each row's last node ``end`` (m,) once its candidates are all rejected: p, or
    its residual after the drawn child, with the candidates' tokens zeroed (the drawn one's is 0 already: it is
    rejected only where q > p), not normalised (the race does not need it); p itself where nothing is left
    (rounding, as when p == q: then p is the exact law)."""
    p = nodes.index_select(0, end)
    if residual is None:
        out = p.clone()
    else:
        drawn = drawn_at.index_select(0, end)
        out = torch.where((drawn >= 0).unsqueeze(1), residual.index_select(0, drawn.clamp_min(0)), p)
    vocab = nodes.shape[1]
    removed = torch.where(child.index_select(0, end) >= 0, token.index_select(0, end), vocab)  # vocab: dropped
    removed = torch.zeros((end.shape[0], vocab + 1), dtype=torch.bool, device=p.device).scatter_(1, removed, True)
    out.masked_fill_(removed[:, :vocab], 0.0)
    return torch.where(out.sum(-1, keepdim=True) > 0, out, p, out=out)


def tree_rejection_sample(sampler: Sampler, target_probs: torch.Tensor, tree: TokenTree, tokens: Sequence[int],
                          draft_probs: Mapping[int, torch.Tensor] | None = None) -> tuple[list[int], int]:
    """Speculative sampling of one row's token tree (``tree_rejection_sample_rows`` with m = 1, read back).

    Args:
        sampler: The row's sampler (its ``torch.Generator``).
        target_probs: (T, V) float32, the target's warped distributions at the tree's nodes, each summing to 1.
        tree: The row's tree.
        tokens: T token ids, node by node (``tokens[0]``, the pending token, is not checked).
        draft_probs: Node -> (V,) float32 q that node's token was drawn from (a sampling draft model's chain), or
            None: every candidate is deterministic.

    Returns:
        ``(path, next_token)`` as ``tree.greedy_tree_verify``: the accepted nodes from node 0 on, and the next
        token.

    Raises:
        NonFiniteLogitsError: If what the next token is drawn from is not a distribution.
        InvalidArgumentError: As ``tree_rejection_sample_rows``, or ``tokens`` not of T entries.
    """
    if len(tokens) != tree.num_nodes or target_probs.dim() != 2 or target_probs.shape[0] != tree.num_nodes:
        raise InvalidArgumentError(f"tree_rejection_sample: {len(tokens)} tokens and target_probs "
                                   f"{tuple(target_probs.shape)} for a tree of {tree.num_nodes} nodes")
    drafted = torch.tensor([list(tokens[1:])], dtype=torch.long).view(1, -1).to(target_probs.device)
    verdicts, _ = tree_rejection_sample_rows([sampler], target_probs.unsqueeze(0), [tree], drafted, [draft_probs])
    accepted, token, *path = verdicts[0].tolist()
    if token < 0:
        raise NonFiniteLogitsError(INVALID_DISTRIBUTION)
    return [0, *path[:accepted]], token
