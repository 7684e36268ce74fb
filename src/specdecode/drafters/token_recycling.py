"""Token Recycling: a tree of candidate tokens from the target's own past top-k, with no draft model.

Luo et al., 2024, "Turning Trash into Treasure: Accelerating Inference of Large Language Models
with Token Recycling" (arXiv:2408.08696): every target forward computes a distribution at each
position it is fed, and its top-k tokens are candidates that decoding throws away. Token
Recycling keeps them in an adjacency matrix ``M`` (V, k): row v holds the k tokens the target
most recently ranked highest after token v. A draft is a tree grown from the row's last token
through ``M`` along a static tree shape (node t is ``M[token of its parent, rank(t)]``), and the
target verifies the whole tree in one forward (``engine.tree``). After each verification every
node the target saw updates ``M`` with the target's top-k there. The matrix is kept across
requests and rows, so it warms up over a server's life.

What is ours (not the paper's): the static tree shape is built best-first from a prior over
ranks (``static_tree``: a node's value is the product of its ranks' prior acceptance along the
path; the N best nodes form the tree, each parent before its children), and a round with a
budget of c tokens drafts the first c nodes of that order, itself a tree. The matrix starts at
zero (token 0 everywhere); it learns from the first verification on.

Every step runs on the device: expansion is one gather per depth, the update one ``topk`` and
one ``index_put_`` per round; the host builds only small index lists (no host sync).
"""

from __future__ import annotations

import heapq

import torch

from specdecode.engine.batch_cache import to_device
from specdecode.engine.cost_model import check_count
from specdecode.engine.protocol import Draft, Drafter
from specdecode.engine.sampling import Sampler, logits_width
from specdecode.engine.tree import TokenTree
from specdecode.errors import InvalidArgumentError

#: Prior acceptance of the target's rank-r candidate (r = 0, 1, ..), for the static tree's shape.
RANK_PRIOR = (0.7, 0.25, 0.13, 0.09, 0.07, 0.05, 0.04, 0.03)


def static_tree(num_nodes: int, top_k: int, max_depth: int = 8,
                rank_prior: tuple[float, ...] = RANK_PRIOR) -> tuple[list[int], list[int]]:
    """A static tree shape of ``num_nodes`` drafted nodes, best first.

    Node values are products of ``rank_prior[rank]`` along the path from the root; the
    ``num_nodes`` most valuable nodes (depth <= ``max_depth``, rank < ``top_k``) are taken in
    order of value, so every prefix of the order is a tree.

    Returns:
        ``(parents, ranks)``: each of ``num_nodes + 1`` entries, node 0 the root (parent -1, rank -1).

    Raises:
        InvalidArgumentError: ``num_nodes`` < 1, ``top_k`` outside 1 .. len(rank_prior), or ``max_depth`` < 1.
    """
    for name, value, low in (("num_nodes", num_nodes, 1), ("max_depth", max_depth, 1), ("top_k", top_k, 1)):
        check_count(name, value, low)
    if top_k > len(rank_prior):
        raise InvalidArgumentError(f"top_k must be in 1..{len(rank_prior)} (the rank prior's length), got {top_k}")
    parents, ranks, depths = [-1], [-1], [0]
    heap = [(-rank_prior[r], r, 0, r) for r in range(top_k)]  # (-value, tie-break, parent, rank)
    counter = top_k
    while heap and len(parents) <= num_nodes:
        value, _, parent, rank = heapq.heappop(heap)
        node = len(parents)
        parents.append(parent)
        ranks.append(rank)
        depths.append(depths[parent] + 1)
        if depths[node] < max_depth:
            for r in range(top_k):
                heapq.heappush(heap, (value * rank_prior[r], counter, node, r))
                counter += 1
    return parents, ranks


class TokenRecyclingDrafter(Drafter):
    """Drafts a token tree per row from the adjacency matrix of the target's recycled top-k (module docstring).

    Deterministic (``Draft.probs`` None): greedy rows verify the tree; rows the engine cannot
    verify as a tree (sampling, logits processors, banned words, a target in llama.cpp) get the
    tree's first chain, the rank-0 path. ``num_forwards`` stays 0.

    Args:
        max_nodes: N, the largest tree (drafted nodes); a round drafts min(N, the row's budget).
        top_k: k, candidates kept per token (columns of the matrix; 1 .. 8).
        max_depth: The tree's deepest level.

    Attributes:
        adjacency: (V, k) long on the target's device after ``bind`` (None before); kept across
            rows, requests and re-binds to a target of the same vocabulary.

    Raises:
        InvalidArgumentError: As ``static_tree``.
    """

    who = "token recycling"
    observes_target = True

    def __init__(self, max_nodes: int = 16, top_k: int = 4, max_depth: int = 8) -> None:
        self.parents, self.ranks = static_tree(max_nodes, top_k, max_depth)
        self.max_nodes = len(self.parents) - 1
        self.top_k = top_k
        self.adjacency: torch.Tensor | None = None
        self._trees: dict[int, TokenTree] = {}
        self._level_cache: dict[int, list] = {}
        self._device = None

    def bind(self, target_cache) -> None:
        vocab = logits_width(target_cache.owner)
        if self._device != target_cache.device:
            self._level_cache = {}
        self._device = target_cache.device
        if self.adjacency is None or self.adjacency.shape[0] != vocab or self.adjacency.device != self._device:
            self.adjacency = torch.zeros((vocab, self.top_k), dtype=torch.long, device=self._device)
        self.num_forwards = 0

    def join(self, slot: int, prompt_ids: torch.Tensor, sampler: Sampler) -> None:
        """Nothing per row: the matrix is shared."""

    def tree(self, num_drafted: int) -> TokenTree:
        """The tree of the first ``num_drafted`` nodes of the static shape (cached)."""
        tree = self._trees.get(num_drafted)
        if tree is None:
            tree = self._trees[num_drafted] = TokenTree(tuple(self.parents[: num_drafted + 1]))
        return tree

    def propose(self, sequences, max_tokens, exits=None, exit_rule="row") -> Draft:
        counts = [min(self.max_nodes, max(0, cap)) for cap in max_tokens]
        width = max(counts)
        if width == 0:
            return Draft(torch.zeros((len(sequences), 1), dtype=torch.long, device=self._device), counts, who=self.who)
        nodes = torch.empty((len(sequences), width + 1), dtype=torch.long, device=self._device)
        nodes[:, 0] = to_device([s[-1] for s in sequences], self._device)
        for index, parents, ranks in self._levels(width):  # one gather per depth: M[parent's token, rank]
            nodes[:, index] = self.adjacency[nodes[:, parents], ranks]
        return Draft(nodes[:, 1:], counts, who=self.who, trees=[self.tree(c) if c else None for c in counts])

    def _levels(self, width: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per depth of the first ``width`` nodes: their indices, their parents' and their ranks, as
        device tensors made once per width (not every round)."""
        levels = self._level_cache.get(width)
        if levels is None:
            tree, levels = self.tree(width), []
            for depth in range(1, max(tree.depths) + 1):
                level = [t for t in range(1, width + 1) if tree.depths[t] == depth]
                levels.append(tuple(torch.tensor(v, device=self._device) for v in (
                    level, [self.parents[t] for t in level], [self.ranks[t] for t in level])))
            self._level_cache[width] = levels
        return levels

    def observe(self, ids: torch.Tensor, logits: torch.Tensor, num_nodes: list[int]) -> None:
        """Recycle the target's top-k at every real node: ``M[ids[b, t]] = top_k(logits[b, t])``."""
        width = ids.shape[1]
        flat = [b * width + t for b, n in enumerate(num_nodes) for t in range(min(n, width))]
        index = to_device(flat, ids.device)
        top = logits.reshape(-1, logits.shape[-1]).index_select(0, index).topk(self.top_k, dim=-1).indices
        self.adjacency[ids.reshape(-1).index_select(0, index)] = top

    def rollback(self, num_valid: list[int]) -> None:
        """Nothing per row."""

    def move(self, src: int, dst: int, num_valid: int) -> None:
        """Nothing per row."""
