"""Token trees for tree verification: one target forward checks several candidate continuations.

A tree of T nodes is fed to the target as one block (Medusa, Cai et al. 2024, section 2.1.2;
SpecInfer, Miao et al. 2024, "tree-based parallel decoding"): node 0 is the row's pending
token (the last emitted token, not yet in the cache), every other node is a drafted token
whose parent is an earlier node. Node t is written at cache index ``start + t`` but takes
the position id ``start + depth(t)``, and it attends to the cached context and to its own
ancestors (itself included) only, so its logits are exactly those of a linear forward over
the path root → t. ``TokenTree`` holds the structure; ``BatchKVCache.prepare(..., tree=)``
builds the positions and masks; after verification ``BatchKVCache.keep_path`` moves the
accepted path's keys and values to ``start + 1 ..`` (one gather per layer), and the rest is
overwritten by later forwards.

A linear draft of k tokens is the chain tree ``parents = [-1, 0, 1, .., k - 1]``.

Greedy verification (``greedy_tree_verify``) walks from the root: at node t the target's
choice is ``argmax[t]``; if a child of t holds that token the walk moves there, otherwise it
stops and ``argmax[t]`` is the bonus (or replacement) token. The accepted tokens are exactly
the longest prefix of target-greedy decoding that the tree contains, so the output equals
target-only greedy decoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdecode.engine.cost_model import check_count
from specdecode.errors import InvalidArgumentError


@dataclass(frozen=True)
class TokenTree:
    """The shape of one row's token tree, nodes in topological order (every parent before its children).

    Args:
        parents: T entries; ``parents[0]`` is -1 (node 0, the pending token, whose parent is the
            cached context); ``parents[t]`` for t >= 1 is an index in 0 .. t - 1.

    Attributes:
        parents: As given, a tuple.
        depths: Per node, its distance from node 0 (node 0: 0).
        children: Per node, the indices of its children, in order.

    Raises:
        InvalidArgumentError: No nodes, ``parents[0]`` other than -1, or a parent that is not an
            earlier node.
    """

    parents: tuple[int, ...]
    depths: tuple[int, ...] = field(init=False)
    children: tuple[tuple[int, ...], ...] = field(init=False)

    def __post_init__(self) -> None:
        parents = tuple(int(p) for p in self.parents)
        if not parents or parents[0] != -1:
            raise InvalidArgumentError(
                f"a token tree's parents must start with -1 (node 0, the pending token), got {list(self.parents)!r}"
            )
        depths, children = [0], [[] for _ in parents]
        for t, p in enumerate(parents[1:], start=1):
            if not 0 <= p < t:
                raise InvalidArgumentError(f"node {t}'s parent must be an earlier node, in 0..{t - 1}, got {p}")
            depths.append(depths[p] + 1)
            children[p].append(t)
        object.__setattr__(self, "parents", parents)
        object.__setattr__(self, "depths", tuple(depths))
        object.__setattr__(self, "children", tuple(tuple(c) for c in children))

    @classmethod
    def chain(cls, num_drafted: int) -> TokenTree:
        """The tree of a linear draft of ``num_drafted`` tokens (>= 0): node t's parent is t - 1."""
        check_count("num_drafted", num_drafted, 0)
        return cls((-1, *range(num_drafted)))

    @property
    def num_nodes(self) -> int:
        """T, the nodes (the pending token included)."""
        return len(self.parents)

    def path(self, node: int) -> list[int]:
        """The nodes from 0 to ``node``, both included."""
        out = [node]
        while self.parents[out[-1]] >= 0:
            out.append(self.parents[out[-1]])
        return out[::-1]

    @property
    def is_chain(self) -> bool:
        """Whether every node's parent is the node before it (a linear draft)."""
        return all(p == t - 1 for t, p in enumerate(self.parents))

    def first_chain(self) -> list[int]:
        """The nodes after node 0 along first children (the tree's leading linear draft)."""
        out, node = [], 0
        while self.children[node]:
            node = self.children[node][0]
            out.append(node)
        return out

    def ancestor_mask(self, width: int | None = None) -> torch.Tensor:
        """(W, W) bool on the CPU: [t, j] True iff node j is node t or one of its ancestors.

        ``width`` W >= T pads the block: a padding query t >= T sees itself only, and no real
        node sees a padding key.
        """
        w = self.num_nodes if width is None else width
        if w < self.num_nodes:
            raise InvalidArgumentError(f"width must be at least the tree's {self.num_nodes} nodes, got {w}")
        mask = torch.eye(w, dtype=torch.bool)
        for t in range(1, self.num_nodes):
            mask[t] |= mask[self.parents[t]]
        return mask


def tree_inputs(trees: Sequence[TokenTree], starts: Sequence[int], width: int, device) -> tuple:
    """Per-row position ids and ancestor masks of a tree forward (``BatchKVCache.prepare``).

    Args:
        trees: One ``TokenTree`` per row (b rows), each of at most ``width`` nodes.
        starts: Per row, its cached length: node t is written at index ``start + t``.
        width: W, the block's width (rows with fewer nodes are padded on the right; a padding
            node sits at depth ``t``, past every real node's position, and sees only itself).
        device: Where the model runs.

    Returns:
        ``(positions, ancestors)``: (b, W) long position ids ``start + depth``, and (b, W, W) bool.

    Raises:
        InvalidArgumentError: A tree wider than ``width``, or trees and starts of different lengths.
    """
    if len(trees) != len(starts):
        raise InvalidArgumentError(f"got {len(trees)} trees for {len(starts)} rows")
    depth_rows, masks = [], []
    for tree, start in zip(trees, starts):
        if tree.num_nodes > width:
            raise InvalidArgumentError(f"a tree of {tree.num_nodes} nodes does not fit a block of width {width}")
        depths = list(tree.depths) + list(range(tree.num_nodes, width))  # padding: positions past the tree
        depth_rows.append([start + d for d in depths])
        masks.append(tree.ancestor_mask(width))
    positions = torch.tensor(depth_rows, dtype=torch.long).to(device)
    return positions, torch.stack(masks).to(device)


def greedy_tree_verify(tree: TokenTree, tokens: Sequence[int], target_argmax: Sequence[int]) -> tuple[list[int], int]:
    """Greedy verification of one row's tree: the accepted path and the bonus (or replacement) token.

    Args:
        tree: Its shape.
        tokens: T token ids, node by node (``tokens[0]``, the pending token, is not checked).
        target_argmax: T ids: entry t is the target's greedy choice after the path root → t.

    Returns:
        ``(path, next_token)``: the accepted nodes from node 0 on (``path[1:]`` are the accepted
        drafted nodes, their tokens the accepted tokens, in order), and ``target_argmax`` at the
        path's last node. Among children holding the same token the first in order is taken.
    """
    node, path = 0, [0]
    while True:
        wanted = target_argmax[node]
        child = next((c for c in tree.children[node] if tokens[c] == wanted), None)
        if child is None:
            return path, int(wanted)
        node = child
        path.append(child)


def round_trees(draft, k: list[int], rows: Sequence, takes_trees: bool) -> tuple:
    """The trees a round of the batched engine verifies (``draft``: the round's ``protocol.Draft``, ``rows``:
    its ``BatchRow``s; ``takes_trees``: whether the target's runner takes tree forwards): ``(trees, tokens,
    probs)``, trees None when no row has one. A sampling row's tree is verified with its
    ``Draft.prob_nodes`` (its draft-sampled path; without them, with draft probabilities, only as a chain).
    A row that cannot be verified as a tree (logits processors, banned words, a runner without tree
    forwards) keeps its tree's first chain, or its draft-sampled path: its tokens (and draft
    probabilities) are gathered into place and ``k[b]`` shrinks to the chain's length."""
    if draft.trees is None:
        return None, draft.tokens, draft.probs
    trees, tokens, probs = [], draft.tokens, draft.probs
    for b, (row, tree) in enumerate(zip(rows, draft.trees)):
        sampled = draft.prob_nodes[b] if draft.prob_nodes is not None else None
        with_q = probs is not None and probs[b] is not None
        if tree is None or tree.is_chain or not k[b]:
            trees.append(None)
        elif takes_trees and row.sampler.processors is None and row.banned is None and (
                row.sampler.greedy or not with_q or sampled is not None):
            trees.append(tree)
        else:
            chain = sampled if sampled is not None else tree.first_chain()
            index = torch.tensor([c - 1 for c in chain], dtype=torch.long, device=tokens.device)
            tokens = tokens.clone() if tokens is draft.tokens else tokens
            tokens[b, : len(index)] = draft.tokens[b, index]
            if with_q and sampled is None:  # with prob_nodes, row i of q is already the chain's node i
                probs = list(probs)
                probs[b] = probs[b][index]
            k[b] = len(index)
            trees.append(None)
    return (trees if any(t is not None for t in trees) else None), tokens, probs
