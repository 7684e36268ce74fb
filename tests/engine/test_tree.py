"""Token trees (specdecode.engine.tree) on the batched static cache: a tree forward gives every node the
logits of a linear forward over its path, and ``keep_path`` leaves the cache as if the accepted path had
been fed linearly (float32, the five tiny architectures; two rows at different lengths)."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_model
from specdecode.engine.batch_cache import BatchKVCache, batch_forward, batch_prefill
from specdecode.engine.tree import TokenTree, greedy_tree_verify, tree_inputs
from specdecode.errors import InvalidArgumentError

# Node 0 is the pending token; two branches at depth 1, three at depth 2, one node at depth 3.
TREE = TokenTree((-1, 0, 0, 1, 1, 2, 3))
PROMPTS = ([5, 9, 14, 3, 22, 7, 31, 8, 2, 40, 11], [6, 12, 3, 30, 17])


def _linear_logits(model, prompt, path_tokens):
    """The logits after each token of ``path_tokens``, fed linearly after ``prompt`` (a fresh cache)."""
    cache = BatchKVCache(model, 1, 64)
    batch_prefill(model, cache, torch.tensor([prompt]), 0)
    ids = torch.tensor([path_tokens])
    return batch_forward(model, cache, ids, 0, [len(prompt)], len(path_tokens))[0]


@pytest.mark.parametrize("rows", [1, 2])
def test_each_node_gets_the_logits_of_its_path_fed_linearly(arch, rows):
    model = make_tiny_model(arch, seed=3)
    prompts = PROMPTS[:rows]
    cache = BatchKVCache(model, rows, 64)
    starts, trees, blocks = [], [], []
    for b, prompt in enumerate(prompts):
        batch_prefill(model, cache, torch.tensor([prompt[:-1]]), b)  # the last prompt token is pending
        starts.append(len(prompt) - 1)
        tokens = [prompt[-1]] + [(13 * t + 5 * b) % 44 + 3 for t in range(1, TREE.num_nodes)]
        trees.append(TREE)
        blocks.append(tokens)
    logits = batch_forward(model, cache, torch.tensor(blocks), 0, starts, TREE.num_nodes, trees)
    for b, prompt in enumerate(prompts):
        for node in range(TREE.num_nodes):
            path = TREE.path(node)
            expected = _linear_logits(model, prompt[:-1], [blocks[b][n] for n in path])[-1]
            torch.testing.assert_close(logits[b, node], expected, rtol=1e-4, atol=1e-4)


def test_a_padded_tree_row_beside_a_wider_one_keeps_its_logits(arch):
    model = make_tiny_model(arch, seed=4)
    small = TokenTree((-1, 0, 0))
    cache = BatchKVCache(model, 2, 64)
    for b, prompt in enumerate(PROMPTS):
        batch_prefill(model, cache, torch.tensor([prompt[:-1]]), b)
    starts = [len(p) - 1 for p in PROMPTS]
    blocks = [[PROMPTS[0][-1], 4, 9, 10, 11, 12, 13], [PROMPTS[1][-1], 8, 4, 0, 0, 0, 0]]  # row 1: 3 nodes + padding
    logits = batch_forward(model, cache, torch.tensor(blocks), 0, starts, 7, [TREE, small])
    for node in range(small.num_nodes):
        expected = _linear_logits(model, PROMPTS[1][:-1], [blocks[1][n] for n in small.path(node)])[-1]
        torch.testing.assert_close(logits[1, node], expected, rtol=1e-4, atol=1e-4)


def test_keep_path_leaves_the_cache_of_the_path_fed_linearly(arch):
    """After ``keep_path``, the next forward from the accepted path's end equals a linear decode's."""
    model = make_tiny_model(arch, seed=5)
    prompt = PROMPTS[0]
    cache = BatchKVCache(model, 1, 64)
    batch_prefill(model, cache, torch.tensor([prompt[:-1]]), 0)
    start = len(prompt) - 1
    tokens = [prompt[-1], 20, 21, 22, 23, 24, 25]
    batch_forward(model, cache, torch.tensor([tokens]), 0, [start], 1, [TREE])
    path = TREE.path(6)  # 0 -> 1 -> 3 -> 6: not a prefix of the block, so keys must move
    assert path == [0, 1, 3, 6]
    cache.keep_path(0, start, path)
    following = [30, 31]
    got = batch_forward(model, cache, torch.tensor([following]), 0, [start + len(path)], 2)[0]
    expected = _linear_logits(model, prompt[:-1], [tokens[n] for n in path] + following)[-2:]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_greedy_tree_verify_follows_the_targets_choices():
    tokens = [0, 7, 8, 9, 7, 5, 6]  # node 1 (7) and node 2 (8) under the root; 3 (9) and 4 (7) under node 1
    argmax = [7, 7, 5, 6, 2, 1, 3]
    path, nxt = greedy_tree_verify(TREE, tokens, argmax)
    assert (path, nxt) == ([0, 1, 4], 2)  # root wants 7 (node 1); node 1 wants 7 (node 4); node 4 wants 2: none
    assert greedy_tree_verify(TREE, tokens, [3, 0, 0, 0, 0, 0, 0]) == ([0], 3)  # the root's choice is not drafted
    chain = TokenTree.chain(3)
    assert greedy_tree_verify(chain, [0, 4, 5, 6], [4, 5, 6, 9]) == ([0, 1, 2, 3], 9)  # all accepted + bonus


def test_tree_shapes_and_bad_trees():
    assert TREE.depths == (0, 1, 1, 2, 2, 2, 3)
    assert TREE.children[0] == (1, 2) and TREE.path(5) == [0, 2, 5]
    mask = TREE.ancestor_mask(8)
    assert mask[6].tolist() == [True, True, False, True, False, False, True, False]
    assert mask[7].tolist() == [False] * 7 + [True]  # padding sees itself only
    positions, ancestors = tree_inputs([TREE], [10], 8, "cpu")
    assert positions.tolist() == [[10, 11, 11, 12, 12, 12, 13, 17]]
    with pytest.raises(InvalidArgumentError, match="must start with -1"):
        TokenTree((0, 0))
    with pytest.raises(InvalidArgumentError, match="node 2's parent must be an earlier node, in 0..1, got 2"):
        TokenTree((-1, 0, 2))
    with pytest.raises(InvalidArgumentError, match="does not fit a block of width 4"):
        tree_inputs([TREE], [0], 4, "cpu")
    cache = BatchKVCache(make_tiny_model("llama"), 1, 16)
    with pytest.raises(InvalidArgumentError, match="starts at node 0 and increases"):
        cache.keep_path(0, 3, [0, 2, 1])
