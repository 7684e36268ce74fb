"""Draft-model token trees with no extra draft forward: the draft's chain plus its steps' runners-up.

EAGLE-2 (Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees")
grows a tree from the draft's own probabilities: a node's value is the product of the draft
probabilities along its path from the root (its joint draft probability, a proxy of the
chance that the target accepts the whole path), and the N most valuable candidates form the
tree that the target verifies in one forward. Here the candidates cost no draft forward of
their own: the draft model runs its usual chain of D steps (``tree_depth``; greedy, or drawn from
q when sampling), and at
each step the top-k of that step's distribution (``TREE_TOP_K``) are the candidates at that
depth: the chain's token, and k - 1 siblings whose parent is the chain's previous node (node 0,
the pending token, for the first step). A sibling is a leaf: nothing is drafted after it.
EAGLE-2's own expansion, where the best nodes of each depth are expanded by one draft tree
forward per depth, is ``expand_trees`` (``tree_expand``, a second option; end of this docstring).

**Which nodes.** The round's budget c (the row's ``max_tokens``: γ, or what the engine's policy
gives) is the number of drafted nodes, chain included. Every candidate gets its joint draft
probability (chain node i: q(c_1) .. q(c_i); a sibling s at depth i: q(c_1) .. q(c_{i-1}) q(s)),
and the c most valuable are kept, chain nodes and siblings ranked together as EAGLE-2 reranks its
nodes. With the draft as a stand-in for the target, the expected accepted tokens of a tree
are the sum of its nodes' path probabilities, which these c nodes maximise. A node's value
never exceeds its parent's (a product of probabilities <= 1), so the kept set is a tree; on
equal values the shallower node, then the chain's token, comes first, so parents precede
their children and the chain's kept nodes are the tree's first chain (``TokenTree.first_chain``:
what a row the engine cannot verify as a tree gets, the linear draft). A deep chain node may
lose its place to a shallow sibling: its draft forward is then spent for nothing, as in EAGLE-2
(a greedy row; a sampling row keeps its drawn chain whole, below).

**Host sync.** The draft loop keeps each step's top-k log-probabilities and tokens on the device
(``TopK``); ``grow_trees`` reads them back with the drafted tokens in one host sync per round
(the linear draft of greedy rows reads nothing back until the engine's round), then builds the
trees on the host (a few dozen candidates per row) and moves the rows' tokens back in one copy.

**Shapes chosen before the round** (``tree_shape="previous-round"``, ``DraftModelDrafter.tree_shape``). The
host sync above stalls a GPU's queue: the target's tree forward cannot be launched before the tree is built. So
the shape can be chosen instead from what the host already holds: per row, a running estimate of the draft's
probability at each top-k rank (rank 0: the chain's own token), read with the engine's round sync
(``Draft.readback``, ``read_shapes``) and averaged over rounds (``RankEstimates``). ``shape_nodes`` ranks the
candidates by those estimates as ``best_nodes`` ranks them by their values (chain node d: d times rank 0's log;
a sibling of rank r at depth d: d - 1 times rank 0's, plus rank r's), the draft runs as many steps as the shape is
deep, and ``shaped_trees`` gathers the nodes' tokens on the device: nothing is read back before the verification.
Every row, greedy or sampling, gets a shape fixed before its draft, so a drawn node's verification never depends
on the token drawn; a sampling row keeps its drawn chain whole, as here, and a runner-up is never valued above its
depth's chain node, so every depth the tree reaches has its drawn node. ``sampled_candidates`` and
``shaped_trees``' runners-up are each step's top-k without the chain's token, as here.

**Which rows.** Rows with no logits processors and no adaptive draft exit; the others draft
linearly, as without the option. A greedy row's chain is the draft's argmax. A sampling row's
chain is drawn from the draft's q, as a linear draft's; its candidates are the top-k of each
step's q beside the drawn token, ranked with the drawn token's own q (siblings outside the
sampler's support are left out; "previous-round" shapes keep them, ``shaped_trees``), and ``Draft.prob_nodes`` names
the drawn nodes: the engine verifies
the tree by multi-candidate speculative sampling (``engine.tree_sampling.tree_rejection_sample_rows``), a drawn
node by Chen et al.'s ratio test against its q, a runner-up as a candidate without q. The drawn
chain is kept whole and the runners-up fill the rest of the budget by value: whether a drawn node
is verified must not depend on the token drawn, or the tokens the target tests would not follow q
(ranked with the siblings, a drawn token of low q would be dropped and one of high q kept). The
expansion below is for greedy rows: a round with a sampling row grows the chain's trees.

**Expansion** (``expand_trees``, ``tree_expand=M``; EAGLE-2 section 4): instead of the chain, each
depth's M most valuable candidates are fed, with the tree expanded so far, in one draft tree
forward (``BatchKVCache.prepare(trees=)``, the draft's cache as the target's), whose logits at
those M nodes give the next depth's candidates; after D depths all candidates are reranked as
above. It costs D - 1 draft forwards of 1 + M (d - 1) tokens (cheap where forwards are flat, a
GPU) and one host sync per depth (each depth's tree is built on the host), and finds paths that
leave the draft's greedy choice more than once. The draft cache keeps the sequence only (the
tree forwards write past it), so the next round's first forward feeds the accepted tokens.
It runs when every row of the round grows a tree and the draft runner takes tree forwards (a
torch draft); otherwise the round falls back to the chain's tree.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import torch

from specdecode.engine.batch_cache import to_device
from specdecode.engine.protocol import Draft
from specdecode.engine.sampling import finite_rows
from specdecode.engine.tree import TokenTree
from specdecode.errors import InvalidArgumentError

#: Candidates per draft step: that step's top-k tokens (the chain's and up to k - 1 siblings).
TREE_TOP_K = 8
#: The deepest chain ``tree_depth`` allows (draft forwards per round).
MAX_TREE_DEPTH = 64
#: How a draft-model tree's shape is chosen each round (module docstring): from the round's own draft values, read
#: back by a host sync of the drafter's ("per-round", EAGLE-2's reranking), or from the row's earlier rounds
#: ("previous-round": no read before the verification).
TREE_SHAPES = ("per-round", "previous-round")
#: "previous-round": the draft's probability at each top-k rank assumed for a row before its first tree is read.
SHAPE_PRIOR = (0.6, 0.2, 0.1, 0.05, 0.025, 0.0125, 0.00625, 0.003125)
#: "previous-round": the weight of a round's own probabilities in a row's running estimate (the rest: its last).
SHAPE_WEIGHT = 0.5


def check_tree_shape(value: object) -> str | None:
    """Return ``value`` if it is None (the device's default, ``default_tree_shape``) or one of ``TREE_SHAPES``.

    Raises:
        InvalidArgumentError: Anything else, naming the value and the allowed ones.
    """
    if value is not None and value not in TREE_SHAPES:
        raise InvalidArgumentError(f"draft_tree_shape={value!r} is not a tree shape: allowed {', '.join(TREE_SHAPES)}, "
                                   "or None for the device's default (previous-round on CUDA, per-round elsewhere)")
    return value


def check_tree_flags(depth: int | None, expand: int | None, shape: str | None) -> None:
    """The commands' check, before any model loads: ``--draft-tree-expand`` and ``--draft-tree-shape`` need
    ``--draft-tree-depth``.

    Raises:
        InvalidArgumentError: Either given without the depth, naming the flag and its value.
    """
    for flag, value, what in (("--draft-tree-expand", expand, "expands"), ("--draft-tree-shape", shape, "shapes")):
        if value is not None and depth is None:
            raise InvalidArgumentError(f"{flag} {value} {what} a draft tree: give --draft-tree-depth D too")


def default_tree_shape(device) -> str:
    """The shape a tree takes where none is given: "previous-round" on CUDA, where the drafter's read of each
    round's values would stall the queue of graphs; "per-round" elsewhere, where a read costs no wait and
    per-round's τ measured up to about 1.5% higher (``docs/benchmarks/2026-11-29-tree-shape.md``)."""
    return "previous-round" if torch.device(device).type == "cuda" else "per-round"


def check_tree_depth(value: object) -> int | None:
    """Return ``value`` if it is None (linear drafts) or an integer in 1 .. ``MAX_TREE_DEPTH``.

    Raises:
        InvalidArgumentError: Anything else, naming the value and the range.
    """
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or not 1 <= value <= MAX_TREE_DEPTH):
        raise InvalidArgumentError(
            f"draft_tree_depth={value!r} is out of range: allowed an integer in 1..{MAX_TREE_DEPTH} (the draft "
            "model's chain steps per round; the round's budget, γ, counts the tree's nodes), or None for linear drafts"
        )
    return value


class TopK:
    """Each draft step's top-k, kept on the device (``base.draft_batch``'s ``tops``).

    Args:
        k: Candidates per step (>= 1).
        ids: A truncated head's (K,) token ids (column j is token ``ids[j]``), or None.

    Attributes:
        log_probs, tokens: Per step, (n, k) float32 log-probabilities and long token ids.
    """

    def __init__(self, k: int, ids: torch.Tensor | None = None) -> None:
        self.k, self.ids = k, ids
        self.log_probs: list[torch.Tensor] = []
        self.tokens: list[torch.Tensor] = []

    def add(self, logits: torch.Tensor) -> None:
        """(n, V') logits of one step, the columns the chain's argmax was taken over."""
        values, index = torch.log_softmax(logits.float(), -1).topk(min(self.k, logits.shape[-1]), dim=-1)
        self.log_probs.append(values)
        self.tokens.append(self.ids[index] if self.ids is not None else index)


def best_nodes(chain: list[int], chain_top: list[list[tuple[int, float]]], budget: int,
               chain_values: list[float] | None = None) -> tuple[list[int], list[int]]:
    """The ``budget`` most valuable nodes of a chain and its steps' top-k, in order (module docstring).

    Args:
        chain: The chain's tokens, depth 1 .. d.
        chain_top: Per depth, that step's top-k as (token, log-probability), best first.
        budget: Nodes to keep (>= 0).
        chain_values: Per depth, the chain token's own log-probability (a sampled chain, whose token
            may be outside the top-k), or None: read from ``chain_top`` (a greedy chain: its first).
            Given, the chain is kept whole (up to ``budget`` nodes, from depth 1) and only the
            siblings compete for the rest: whether a drawn token is verified must not depend on the
            token drawn, or the tokens the target tests would no longer follow the draft's q (a
            drawn node kept only where q gave it a high value). Siblings of log-probability -inf
            (outside the sampler's support) are left out.

    Returns:
        ``(tokens, parents)``: node j + 1 is ``tokens[j]``, its parent the node ``parents[j]`` (0: the
        root), every parent before its children, a greedy chain's kept nodes first among their siblings.
        A NaN log-probability counts as -inf (the engine then refuses the round's non-finite logits).
    """
    candidates = []  # (-value, depth, rank, token, parent chain depth)
    value = 0.0
    chain_top = [[(t, lp if lp == lp else float("-inf")) for t, lp in top] for top in chain_top]
    for depth, (token, top) in enumerate(zip(chain, chain_top), start=1):
        if chain_values is not None:
            own = chain_values[depth - 1]
            own = own if own == own else float("-inf")
        else:
            own = next((lp for t, lp in top if t == token), top[0][1] if top else 0.0)  # the max, if tied past k
        candidates.append((-(value + own), depth, 0, token, depth - 1))
        for rank, (t, lp) in enumerate((c for c in top if c[0] != token), start=1):
            if chain_values is None or lp > float("-inf"):
                candidates.append((-(value + lp), depth, rank, t, depth - 1))
        value += own
    candidates.sort()
    if chain_values is None:
        chosen = candidates[:budget]
    else:  # a drawn chain is kept whole, whatever its values: the siblings fill what is left of the budget
        drawn = sorted((c for c in candidates if c[2] == 0), key=lambda c: c[1])[: max(0, budget)]  # by depth
        chosen = sorted(drawn + [c for c in candidates if c[2] != 0][: max(0, budget - len(drawn))])
    tokens, parents, chain_node = [], [], {0: 0}  # chain depth -> its node index
    for _, depth, rank, token, parent_depth in chosen:
        parents.append(chain_node[parent_depth])
        tokens.append(token)
        if rank == 0:
            chain_node[depth] = len(tokens)
    return tokens, parents


def chain_path(tree: TokenTree, nodes: list[int], chain: list[int]) -> list[int]:
    """The nodes of ``tree`` (``nodes[t - 1]`` node t's token) that hold ``chain``'s tokens along one
    path from node 0: node i's child holding ``chain[i]``, as far as the tree keeps the chain."""
    out, node = [], 0
    for token in chain:
        node = next((c for c in tree.children[node] if nodes[c - 1] == token), None)
        if node is None:
            break
        out.append(node)
    return out


def grow_trees(tokens: torch.Tensor, num_tokens: list[int], tops: TopK, tree_rows: list[bool],
               budgets: list[int], prefixes: list[list[int]] | None = None,
               probs: list[torch.Tensor | None] | None = None) -> tuple:
    """Per row, its chain and, on tree rows, the best of its steps' runners-up as a ``TokenTree``.

    Args:
        tokens: (n, S) long, the draft loop's tokens (row b's chain: ``tokens[b, :num_tokens[b]]``).
        num_tokens: Per row, its chain's length d_b.
        tops: The loop's ``TopK``, one entry per step (S steps).
        tree_rows: Per row, whether it grows a tree.
        budgets: Per row, the most nodes its tree may have (>= d_b on tree rows).
        prefixes: Per row, tokens before its chain (the cascade's n-gram block: nodes 1 .. m of a
            chain from node 0, always kept, the chain's root being node m), or None.
        probs: Per row, the (>= d_b, V) draft distributions its chain was sampled from (a sampling
            row: its candidates are the top-k of those q, ranked with the chain's own q), or None.

    Returns:
        ``(ids, num, trees, chains, sampled)``: (n, max(1, max(num))) long ids on ``tokens``'s device
        (each row's nodes, then padding), per row its node count, per row its ``TokenTree`` or None (a
        linear row, or a tree that kept no sibling), per row its chain tokens (host ints), and per
        sampling row with a tree the nodes whose tokens its q drew, in order (the prefix's, then the
        chain's: rows 0 .. of its ``probs`` with the prefix's one-hot rows first, ``Draft.prob_nodes``),
        else None (a sampling row's tree keeps its whole drawn chain, ``best_nodes``).

    One host sync: the tokens and the top-k, read back together.
    """
    n, steps = tokens.shape
    prefixes = prefixes if prefixes is not None else [[] for _ in range(n)]
    sampling = [bool(tree_rows[b] and probs is not None and probs[b] is not None) for b in range(n)]
    log_probs, top_ids, own = sampled_candidates(tokens, num_tokens, tops, sampling, probs)  # own: a sampling round's
    k = log_probs.shape[-1]
    parts = [tokens.double().flatten(), top_ids.double().flatten(), log_probs.double().flatten()]
    host = torch.cat(parts if own is None else [*parts, own.flatten()]).tolist()  # the one host sync
    width = n * steps * k
    rows, num, trees, chains, sampled = [], [], [], [], []
    for b in range(n):
        chain = [int(t) for t in host[b * steps : b * steps + num_tokens[b]]]
        chains.append(chain)
        prefix, m = prefixes[b], len(prefixes[b])
        tree, nodes_of_q = None, None
        if tree_rows[b] and chain:
            top = [[(int(host[n * steps + j]), host[n * steps + width + j])
                    for j in range((b * steps + i) * k, (b * steps + i + 1) * k)] for i in range(len(chain))]
            at = n * steps + 2 * width + b * steps
            values = host[at : at + len(chain)] if sampling[b] else None
            nodes, parents = best_nodes(chain, top, budgets[b], values)
            tree = TokenTree((-1, *range(m), *(p + m for p in parents)))
            if sampling[b] and not tree.is_chain:  # a chain is the drawn chain itself: a linear row with its q
                path = chain_path(TokenTree((-1, *parents)), nodes, chain)
                nodes_of_q = [*range(1, m + 1), *(c + m for c in path)]
            rows.append(prefix + nodes)
            tree = None if tree.is_chain else tree
        else:
            rows.append(prefix + chain)
        trees.append(tree)
        sampled.append(nodes_of_q)
        num.append(len(rows[-1]))
    longest = max(1, max(num))
    ids = to_device([r + [0] * (longest - len(r)) for r in rows], tokens.device)
    return ids, num, trees, chains, sampled


def sampled_candidates(tokens: torch.Tensor, num_tokens: list[int], tops: TopK, sampling: list[bool],
                       probs: list[torch.Tensor | None] | None, every_row: bool = False) -> tuple:
    """Each step's candidates and values: the loop's ``tops``, and on a sampling row the top-k of its own q instead.

    Args:
        tokens, num_tokens, tops, probs: As ``grow_trees``'s.
        sampling: Per row, whether its candidates come from its q (``probs[b]``, (>= d_b, V)).
        every_row: Whether to give every row's chain values (a greedy row's: its top-1's), not only sampling rows'.

    Returns:
        ``(log_probs, top_ids, own)``: (n, S, k) float32 and long, and (n, S) float64 log-probabilities of the
        chain's tokens (a sampling row's under its q), or None where no row samples and not ``every_row``.
    """
    n, steps = tokens.shape
    log_probs, top_ids = torch.stack(tops.log_probs, 1), torch.stack(tops.tokens, 1)  # (n, S, k)
    k = log_probs.shape[-1]
    own = log_probs[..., 0].double() if every_row else None  # greedy: the chain's token is the top-1
    if any(sampling):  # [sampling] the candidates and the chain's values from each row's own q
        own = own.clone() if own is not None else torch.zeros((n, steps), dtype=torch.float64, device=tokens.device)
        log_probs, top_ids = log_probs.clone(), top_ids.clone()
        for b in (b for b in range(n) if sampling[b]):
            d = num_tokens[b]
            q = probs[b][:d].float()
            values, index = q.topk(min(k, q.shape[-1]), dim=-1)
            log_probs[b, :d, : values.shape[-1]] = values.log()
            top_ids[b, :d, : values.shape[-1]] = index
            own[b, :d] = q.gather(1, tokens[b, :d, None]).squeeze(1).double().log()
    return log_probs, top_ids, own


def shape_nodes(rank_probs: Sequence[float], depth: int, budget: int,
                keep_chain: bool = False) -> tuple[list[tuple[int, int]], list[int]]:
    """A tree's shape chosen before its round ("previous-round", module docstring): the ``budget`` most valuable
    nodes of a chain of ``depth`` steps and its steps' runners-up, valued by estimates as ``best_nodes`` values
    them by the round's own log-probabilities, except that a runner-up is never worth more than its depth's chain
    node. So a shape holds the chain's node wherever it holds a runner-up: a sampling row's drawn token is
    verified at every depth its tree reaches (a runner-up alone, or a chain of runners-up, would be verified as a
    linear draft, as if drawn from q), and the draft never runs a step whose own token goes unused. With a greedy
    row's estimates (rank 0 the top-1's) the cap changes nothing. A sampling row keeps its drawn chain whole
    (``keep_chain``), as ``best_nodes`` does: a runner-up there is tested on what the rejected drawn token left,
    max(0, p - q), so its q overstates its chance, and ranked by q the runners-up would displace drawn nodes
    (before the chain was kept, τ measured 3.32 against per-round's 3.52 on HumanEval and 2.62 against 2.72 on
    Spec-Bench, one seed, 1.3 standard errors each; after, 3.44 against 3.55 and 2.65 against 2.69, two seeds).

    Args:
        rank_probs: k estimates in [0, 1]: the draft's probability at top-k rank r (0: the chain's own token).
        depth: D >= 1, the chain's most steps.
        budget: Nodes to keep (>= 0).
        keep_chain: Whether the chain's nodes come first, from depth 1 (a sampling row's drawn chain), the
            runners-up filling the rest of the budget by value.

    Returns:
        ``(nodes, parents)``: node j + 1 is ``nodes[j] = (d, r)`` (depth d >= 1; rank 0 the chain's token at depth
        d, r >= 1 the r-th runner-up of step d), its parent the node ``parents[j]`` (0: the root); best first (a
        higher value, then shallower, then the lower rank), so every parent comes before its children.
    """
    logs = [math.log(min(1.0, max(p, 1e-9))) if p == p else math.log(1e-9) for p in rank_probs]
    chain = [d * logs[0] for d in range(depth + 1)]  # chain node d's value; a runner-up's: its parent's plus its own,
    candidates = sorted((-(chain[d] if r == 0 else chain[d - 1] + min(logs[r], logs[0])), d, r)  # at most node d's
                        for d in range(1, depth + 1) for r in range(len(logs)))
    if keep_chain:  # the drawn chain first, by depth (its values decrease with depth: the order stands)
        candidates = [c for c in candidates if c[2] == 0] + [c for c in candidates if c[2] != 0]
    nodes, parents, chain_node = [], [], {0: 0}  # chain depth -> its node index
    for _, d, r in candidates[: max(0, budget)]:
        parents.append(chain_node[d - 1])
        nodes.append((d, r))
        if r == 0:
            chain_node[d] = len(nodes)
    return nodes, parents


class RankEstimates:
    """Per slot, a running estimate of the draft's probability at each top-k rank ("previous-round" shapes).

    A row starts from ``SHAPE_PRIOR`` (not from other rows' estimates: a seeded row's tokens must not depend on
    its batch); each round's read probabilities, averaged over the depths it drafted, weigh ``SHAPE_WEIGHT`` in
    its next estimate.

    Args:
        num_slots: The engine's slots.
        k: Ranks (a round with fewer candidates a step, a head of fewer columns, counts the rest 0).
    """

    def __init__(self, num_slots: int, k: int = TREE_TOP_K) -> None:
        self.k = k
        self.slots: list[list[float] | None] = [None] * num_slots

    def of(self, slot: int) -> list[float]:
        """The slot's estimate, k probabilities."""
        estimate = self.slots[slot]
        return estimate if estimate is not None else list(SHAPE_PRIOR[: self.k]) + [0.0] * (self.k - len(SHAPE_PRIOR))

    def update(self, slot: int, probs: Sequence[Sequence[float]]) -> None:
        """Fold in one round of the slot's row: per drafted depth, its k probabilities by rank (NaN counts 0)."""
        if not probs:
            return
        mean = [sum(p[r] for p in probs if r < len(p) and p[r] == p[r]) / len(probs) for r in range(self.k)]
        self.slots[slot] = [SHAPE_WEIGHT * m + (1 - SHAPE_WEIGHT) * e for m, e in zip(mean, self.of(slot))]

    def reset(self, slot: int) -> None:
        """A new row in ``slot``: it starts from ``SHAPE_PRIOR``."""
        self.slots[slot] = None

    def move(self, src: int, dst: int) -> None:
        """The row in ``src`` moves to ``dst``."""
        self.slots[dst], self.slots[src] = self.slots[src], None


def shaped_trees(tokens: torch.Tensor, num_tokens: list[int], tops: TopK,
                 shapes: list[tuple[list[tuple[int, int]], list[int]] | None],
                 prefixes: list[list[int]] | None = None, probs: list[torch.Tensor | None] | None = None) -> tuple:
    """Per row, its tree of a shape chosen before the round (``shape_nodes``), its tokens gathered on the device.

    Args:
        tokens, num_tokens, tops, prefixes, probs: As ``grow_trees``'s; row b's chain ran ``num_tokens[b]`` steps,
            the depth of its shape.
        shapes: Per row, ``shape_nodes``'s ``(nodes, parents)``, or None: a linear row (its chain).

    Returns:
        ``(ids, num, trees, sampled, readback)``: ids, num, trees and sampled as ``grow_trees``'s (a tree that is a
        chain: None), and ``readback``, (n S + n S k,) long on the device for the engine's round sync
        (``Draft.readback``, ``read_shapes``): the chains' tokens, then the float32 bits of every step's k
        candidates' probabilities (rank 0 the chain's token, then its runners-up). Unlike ``grow_trees``, a
        sampling row keeps runners-up outside its sampler's support (q = 0) where its shape has room: candidates
        chosen without the target, they keep the law exact.

    Raises:
        InvalidArgumentError: A shape deeper than its row's draft steps, or of a rank past the steps' k candidates.

    No host sync: the shapes are known, the tokens stay on the device (one host-to-device copy of the index).
    """
    n, steps = tokens.shape
    prefixes = prefixes if prefixes is not None else [[] for _ in range(n)]
    sampling = [bool(shapes[b] is not None and probs is not None and probs[b] is not None) for b in range(n)]
    log_probs, top_ids, own = sampled_candidates(tokens, num_tokens, tops, sampling, probs, every_row=True)
    k = log_probs.shape[-1]
    # each step's runners-up: its top-k without the chain's token, in order (the first k - 1 where it is not there)
    order = (top_ids == tokens[..., None]).to(torch.uint8).argsort(dim=-1, stable=True)[..., : k - 1]
    candidates = torch.cat([tokens[..., None], top_ids.gather(-1, order)], dim=-1).reshape(n, steps * k)
    values = torch.cat([own[..., None], log_probs.double().gather(-1, order)], dim=-1)  # (n, S, k)
    before = max(len(p) for p in prefixes)
    index, num, trees, sampled = [], [], [], []
    for b in range(n):
        m, shape = len(prefixes[b]), shapes[b]
        tree = nodes_of_q = None
        if shape is None or not shape[0]:  # a linear row: its chain
            nodes = [(d, 0) for d in range(1, num_tokens[b] + 1)]
        else:
            nodes, parents = shape
            if max(d for d, _ in nodes) > num_tokens[b] or max(r for _, r in nodes) >= k:
                raise InvalidArgumentError(f"row {b}'s tree shape needs more than its {num_tokens[b]} draft steps of "
                                           f"{k} candidates: {nodes}")
            tree = TokenTree((-1, *range(m), *(p + m for p in parents)))
            if sampling[b] and not tree.is_chain:  # its drawn chain's nodes, by depth (parents come first)
                nodes_of_q = [*range(1, m + 1), *(j + 1 + m for j, (_, r) in enumerate(nodes) if r == 0)]
            tree = None if tree.is_chain else tree
        index.append([*range(m), *(before + (d - 1) * k + r for d, r in nodes)])
        num.append(len(index[-1]))
        trees.append(tree)
        sampled.append(nodes_of_q)
    longest = max(1, max(num))
    packed = to_device([[*p, *[0] * (before - len(p)), *i, *[0] * (longest - len(i))] for p, i in zip(prefixes, index)],
                       tokens.device)
    ids = torch.cat([packed[:, :before], candidates], dim=1).gather(1, packed[:, before:])
    bits = values.exp().float().contiguous().view(torch.int32).long()
    return ids, num, trees, sampled, torch.cat([tokens.reshape(-1), bits.reshape(-1)])


def read_shapes(values: Sequence[int], n: int, steps: int, k: int) -> tuple[list[list[int]], list[list[list[float]]]]:
    """``shaped_trees``' ``readback``, read.

    Args:
        values: Its n S (1 + k) Python ints: n S chain tokens, then n S k float32 probabilities as int32 bits.
        n, steps, k: Rows, draft steps S and candidates a step.

    Returns:
        ``(chains, probs)``: per row its S chain tokens; per row and step its k probabilities (rank 0 the chain's).
    """
    chains = [list(values[b * steps : (b + 1) * steps]) for b in range(n)]
    count = n * steps * k
    flat = struct.unpack(f"{count}f", struct.pack(f"{count}i", *values[n * steps : n * steps + count]))
    probs = [[list(flat[(b * steps + i) * k : (b * steps + i + 1) * k]) for i in range(steps)] for b in range(n)]
    return chains, probs


def tree_draft(tokens: torch.Tensor, num: list[int], probs: list[torch.Tensor | None] | None, finite, who: str,
               trees: list[TokenTree | None], sampled: list[list[int] | None],
               readback: torch.Tensor | None = None) -> Draft:
    """The ``Draft`` of rows that ``grow_trees`` or ``shaped_trees`` grew: a sampling tree row's ``probs`` are cut to
    its ``sampled`` nodes' rows (``Draft.prob_nodes``); ``trees`` and ``prob_nodes`` are None where no row has any;
    ``readback`` is ``shaped_trees``' (``Draft.readback``)."""
    if probs is not None:
        probs = [q[: len(nodes)] if q is not None and nodes is not None else q for q, nodes in zip(probs, sampled)]
    return Draft(tokens, num, probs, finite, who, trees if any(t is not None for t in trees) else None,
                 sampled if any(nodes is not None for nodes in sampled) else None, readback=readback)


def check_tree_expand(value: object, depth: int | None) -> int | None:
    """Return ``value`` if it is None or an integer in 1 .. ``MAX_TREE_DEPTH`` given with a ``depth``.

    Raises:
        InvalidArgumentError: Anything else, or a value without ``depth``, naming the value and the range.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TREE_DEPTH:
        raise InvalidArgumentError(
            f"draft_tree_expand={value!r} is out of range: allowed an integer in 1..{MAX_TREE_DEPTH} (nodes expanded "
            "per depth by a draft tree forward), or None for no expansion"
        )
    if depth is None:
        raise InvalidArgumentError(f"draft_tree_expand={value!r} expands a draft tree: give draft_tree_depth too")
    return value


def _node(node: dict[int, int], parent: int) -> int:
    """The tree node of pool index ``parent`` (-1: node 0); a parent outside the tree is a bug: KeyError."""
    return node[parent] if parent >= 0 else 0


def _rank(candidate: tuple) -> tuple:
    """Best first: higher joint draft log-probability, then shallower, then the draft's own rank."""
    value, depth, rank = candidate[:3]
    return -value, depth, rank


def expand_trees(forward, first_logits: torch.Tensor, pending: list[int], starts: list[int], depth: int,
                 expand: int, budgets: list[int], ids: torch.Tensor | None = None, vocab: int | None = None,
                 k: int = TREE_TOP_K) -> tuple:
    """EAGLE-2's dynamic draft tree (Li et al. 2024, section 4: expansion, then reranking) on the draft model.

    Depth 1's candidates are the top-k after each row's pending token. At each further depth, the
    ``expand`` best candidates of the latest depth (by joint draft log-probability) join the
    expanded tree, and one draft tree forward over the whole expanded tree (node 0 the pending
    token, written again at its own index; ``BatchKVCache.prepare(trees=)``) gives their
    children's top-k, the next depth's candidates. After ``depth`` depths, every candidate is
    ranked by its joint draft log-probability and the row's ``budgets[b]`` best form its tree
    (a node never outranks its parent, so they form a tree, parents first).

    Args:
        forward: The draft runner: ``forward(ids (n, W), starts, keep, trees)`` -> (n, keep, V') logits.
        first_logits: (n, V') logits after each row's pending token.
        pending: Per row, its pending token id (node 0).
        starts: Per row, the draft-cache index of its pending token.
        depth: D >= 1 (D - 1 tree forwards).
        expand: M >= 1, candidates expanded per depth.
        budgets: Per row, the most nodes of its tree (>= 1).
        ids: A truncated head's (K,) token ids (column j is ``ids[j]``), or None.
        vocab: Columns of the full head that are tokens (None: all).
        k: Children per expanded node.

    Returns:
        ``(tokens, num, trees, finite, forwards)``: (n, max(num)) long on the logits' device, per row
        its node count and ``TokenTree``, a 0-dim bool (every draft logit finite), and the tree
        forwards run. One host sync per depth (its top-k, from which the next tree is built).
    """
    n, device = len(pending), first_logits.device
    pools: list[list[tuple]] = [[] for _ in range(n)]  # per row: (value, depth, rank, token, parent pool index)
    frontier: list[list[int]] = [[-1] for _ in range(n)]  # pool indices whose children come next (-1: node 0)
    expanded: list[list[int]] = [[] for _ in range(n)]  # pool indices, the tree forward's nodes 1 ..
    logits = (first_logits if ids is not None or vocab is None else first_logits[:, :vocab])[:, None]
    finite, forwards = finite_rows(first_logits).all(), 0
    for d in range(1, depth + 1):
        top = torch.log_softmax(logits.float(), -1).topk(min(k, logits.shape[-1]), dim=-1)  # (n, m, k)
        tokens = ids[top.indices] if ids is not None else top.indices
        m, kk = top.indices.shape[1:]
        host = torch.cat([tokens.double().flatten(), top.values.double().flatten()]).tolist()  # the depth's sync
        latest: list[list[int]] = []
        for b in range(n):
            pool, mine = pools[b], []
            for j, parent in enumerate(frontier[b]):
                base = pool[parent][0] if parent >= 0 else 0.0
                for r in range(kk):
                    at = (b * m + j) * kk + r
                    lp = host[n * m * kk + at]
                    pool.append((base + (lp if lp == lp else float("-inf")), d, r, int(host[at]), parent))
                    mine.append(len(pool) - 1)
            latest.append(mine)
        if d == depth:
            break
        frontier = [sorted(mine, key=lambda i, b=b: _rank(pools[b][i]))[:expand] for b, mine in enumerate(latest)]
        rows, trees, where = [], [], []
        for b in range(n):
            expanded[b] += frontier[b]
            node = {p: j + 1 for j, p in enumerate(expanded[b])}
            trees.append(TokenTree((-1, *(_node(node, pools[b][p][4]) for p in expanded[b]))))
            rows.append([pending[b], *(pools[b][p][3] for p in expanded[b])])
            where.append([node[p] for p in frontier[b]])
        width, wide = max(len(r) for r in rows), max(len(w) for w in where)
        out = forward(to_device([r + r[-1:] * (width - len(r)) for r in rows], device), starts, width, trees)
        forwards += 1
        finite = finite & finite_rows(out).all()
        index = to_device([w + w[-1:] * (wide - len(w)) for w in where], out.device)
        logits = out[torch.arange(n, device=out.device)[:, None], index]  # (n, M, V'): the frontier's
        logits = logits if ids is not None or vocab is None else logits[..., :vocab]
    rows, trees = [], []
    for b in range(n):
        pool = pools[b]
        chosen = sorted(range(len(pool)), key=lambda i: (*_rank(pool[i]), i))[: max(0, budgets[b])]
        node = {p: j + 1 for j, p in enumerate(chosen)}
        trees.append(TokenTree((-1, *(_node(node, pool[p][4]) for p in chosen))))
        rows.append([pool[p][3] for p in chosen])
    num = [len(r) for r in rows]
    longest = max(1, max(num))
    return to_device([r + [0] * (longest - len(r)) for r in rows], device), num, trees, finite, forwards
