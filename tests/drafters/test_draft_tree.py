"""Draft-model token trees (``drafters.draft_tree``; EAGLE-2's reranking, Li et al. 2024) for "draft" and
"cascade": float32 greedy output equals target-only decoding at B = 1 and B > 1, fast path on and off;
a tree is built (siblings beside the chain) and a sibling is accepted where the draft's top-1 is wrong
and its top-2 is the target's choice; bad option values are refused."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from conftest import make_tiny_model, make_tiny_tokenizer
from helpers import perturbed_copy
from specdecode import GenerationConfig, SpeculativeDecoder
from specdecode.drafters import CascadeDrafter, DraftModelDrafter
from specdecode.drafters.draft_head import DraftHead
from specdecode.drafters.draft_tree import (
    SHAPE_PRIOR,
    SHAPE_WEIGHT,
    TREE_SHAPES,
    RankEstimates,
    TopK,
    best_nodes,
    default_tree_shape,
    expand_trees,
    grow_trees,
    read_shapes,
    shape_nodes,
    shaped_trees,
)
from specdecode.engine.batched import BatchedSpeculativeDecoder
from specdecode.engine.fast_path import ModelRunner
from specdecode.engine.tree import TokenTree
from specdecode.errors import InvalidArgumentError
from specdecode.models import LoadedModel
from specdecode.pipeline import SpeculativeGenerator

PROMPTS = [[(5 * i + 3 * j) % 40 + 3 for j in range(n)] for i, n in enumerate((9, 4, 14, 6))]
CONFIG = GenerationConfig(max_new_tokens=20, num_speculative_tokens=8, stop_on_eos=False)  # γ: 8 nodes a tree


def _make(method: str, draft, depth: int | None = 3, shape: str = "per-round"):
    drafter = DraftModelDrafter(draft, tree_depth=depth) if method == "draft" else \
        CascadeDrafter(draft, tree_depth=depth)
    drafter.tree_shape = shape
    return drafter


def _spy(drafter) -> list:
    """Every tree the drafter proposes, appended to the returned list."""
    seen, propose = [], drafter.propose

    def spied(*args, **kwargs):
        draft = propose(*args, **kwargs)
        seen.extend(t for t in (draft.trees or []) if t is not None)
        return draft

    drafter.propose = spied
    return seen


class SwapTopTwo(torch.nn.Module):
    """An LM head whose logits swap each position's best and second-best token: a draft with it, on the
    target's weights, always proposes the target's second choice first, and the target's choice second."""

    def __init__(self, head: torch.nn.Module) -> None:
        super().__init__()
        self.head = head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden)
        top = logits.topk(2, dim=-1)
        out = logits.clone()
        out.scatter_(-1, top.indices[..., :1], top.values[..., 1:])
        out.scatter_(-1, top.indices[..., 1:], top.values[..., :1])
        return out


class TwoChoices(torch.nn.Module):
    """An LM head that keeps the target's two best tokens only, swapped: the draft puts about 0.62 on the
    target's second choice and 0.38 on its first, and nearly nothing elsewhere."""

    def __init__(self, head: torch.nn.Module) -> None:
        super().__init__()
        self.head = head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden)
        top = logits.topk(2, dim=-1)
        out = torch.full_like(logits, -30.0)
        out.scatter_(-1, top.indices[..., 1:], 0.0)
        return out.scatter_(-1, top.indices[..., :1], -0.5)


def _sharpened(draft, factor: float = 6.0):
    """The draft with its logits scaled by ``factor``: the same choices, more confident (peaked) distributions."""
    with torch.no_grad():
        draft.lm_head.weight.mul_(factor)
    return draft


def _swapped(target):
    draft = copy.deepcopy(target)
    draft.lm_head = SwapTopTwo(draft.lm_head)
    return draft


# -- exactness ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", TREE_SHAPES)
@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("method", ["draft", "cascade"])
def test_tree_greedy_equals_target_only_one_row(arch, method, fast, shape):
    target = make_tiny_model(arch, num_layers=3, seed=21)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    runner = ModelRunner(target, compile=True, graphs=False, name="target") if fast else None
    drafter = _make(method, draft, shape=shape)
    trees = _spy(drafter)
    accepted = 0
    for prompt in PROMPTS:
        expected = SpeculativeDecoder(target, compile=False).generate(prompt, CONFIG).token_ids
        dec = SpeculativeDecoder(target, drafter, runner=runner, compile=None if fast else False)
        result = dec.generate(prompt, CONFIG)
        assert result.token_ids == expected, (arch, method, fast, prompt)
        assert dec._engine.compile is fast
        accepted += result.stats.num_accepted_tokens
    assert accepted > 0
    assert any(len(t.first_chain()) < t.num_nodes - 1 for t in trees)  # siblings beside the chain


@pytest.mark.parametrize("shape", TREE_SHAPES)
@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("method", ["draft", "cascade"])
def test_tree_greedy_equals_target_only_batched(arch, method, fast, shape):
    """4 prompts through 2 slots: rows join mid-flight, each row with its own tree."""
    target = make_tiny_model(arch, num_layers=3, seed=22)
    draft = perturbed_copy(target, noise=0.3, seed=2)
    expected = [SpeculativeDecoder(target, compile=False).generate(p, CONFIG).token_ids for p in PROMPTS]
    drafter = _make(method, draft, shape=shape)
    trees = _spy(drafter)
    dec = BatchedSpeculativeDecoder(target, drafter, max_batch_size=2, max_length=96, num_speculative_tokens=8,
                                    compile=fast, graphs=False)
    results = dec.generate(PROMPTS, CONFIG)
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.num_accepted_tokens for r in results) > 0
    assert any(len(t.first_chain()) < t.num_nodes - 1 for t in trees)
    if fast:
        assert any(tree for (_, _, tree) in dec.runner._buckets)  # a tree bucket ran: (rows, width, tree)


def test_tree_rows_beside_sampling_and_processor_rows_stay_exact():
    """A greedy tree row beside a greedy row with a repetition penalty (linear: processors) and a sampling
    row (linear): the greedy rows equal target-only decoding."""
    target = make_tiny_model("llama", num_layers=3, seed=23)
    draft = perturbed_copy(target, noise=0.3, seed=3)
    plain = CONFIG
    penalised = GenerationConfig(max_new_tokens=20, num_speculative_tokens=8, stop_on_eos=False,
                                 repetition_penalty=1.3)
    sampled = GenerationConfig(max_new_tokens=20, num_speculative_tokens=8, stop_on_eos=False, temperature=0.8,
                               seed=5)
    expected = [SpeculativeDecoder(target, compile=False).generate(p, c).token_ids
                for p, c in ((PROMPTS[0], plain), (PROMPTS[1], penalised))]
    for method in ("draft", "cascade"):
        dec = BatchedSpeculativeDecoder(target, _make(method, draft), max_batch_size=3, max_length=96,
                                        num_speculative_tokens=8, compile=False)
        results = dec.generate(PROMPTS[:3], [plain, penalised, sampled])
        assert [r.token_ids for r in results[:2]] == expected, method
        assert len(results[2].token_ids) == 20


@pytest.mark.parametrize("shape", TREE_SHAPES)
@pytest.mark.parametrize("method", ["draft", "cascade"])
def test_trees_with_a_truncated_head_propose_within_its_tokens(method, shape):
    """FR-Spec's head: the top-k of its K columns are mapped to their token ids; output stays exact."""
    target = make_tiny_model("qwen2", num_layers=3, seed=26)
    draft = perturbed_copy(target, noise=0.3, seed=6)
    ids = list(range(12, 48))
    head = DraftHead.truncated(ids)
    drafter = DraftModelDrafter(draft, head=head, tree_depth=3) if method == "draft" else \
        CascadeDrafter(draft, head=head, tree_depth=3, ngram_check=True)
    drafter.tree_shape = shape
    trees, tokens, propose = _spy(drafter), [], drafter.propose

    def spied(*args, **kwargs):
        draft_ = propose(*args, **kwargs)
        tokens.extend(t for row, k in zip(draft_.tokens.tolist(), draft_.num_tokens) for t in row[:k])
        return draft_

    drafter.propose = spied
    expected = [SpeculativeDecoder(target, compile=False).generate(p, CONFIG).token_ids for p in PROMPTS]
    dec = BatchedSpeculativeDecoder(target, drafter, max_batch_size=2, max_length=96, num_speculative_tokens=8,
                                    compile=False)
    assert [r.token_ids for r in dec.generate(PROMPTS, CONFIG)] == expected
    assert trees
    assert set(tokens) <= set(ids)  # the cascade's n-gram tokens too: checked, they are the draft's choices


# -- a tree is built, and its siblings are accepted -------------------------------------------------------


@pytest.mark.parametrize("shape", TREE_SHAPES)
@pytest.mark.parametrize("method", ["draft", "cascade"])
def test_a_sibling_is_accepted_where_the_drafts_top_one_is_wrong(arch, method, shape):
    """The draft's first choice is always the target's second: a linear draft accepts nothing, while every
    tree round accepts its depth-1 sibling (the draft's second choice, the target's first), after which the
    draft cache re-feeds the accepted sibling in place of its chain token (else the next round's draft would
    continue a context the sequence does not have, and miss)."""
    target = make_tiny_model(arch, num_layers=3, seed=24)
    draft = _swapped(target)
    expected = [SpeculativeDecoder(target, compile=False).generate(p, CONFIG).token_ids for p in PROMPTS]
    linear = BatchedSpeculativeDecoder(target, _make(method, draft, None), max_batch_size=2, max_length=96,
                                       num_speculative_tokens=8, compile=False).generate(PROMPTS, CONFIG)
    assert [r.token_ids for r in linear] == expected
    assert sum(r.stats.num_accepted_tokens for r in linear) == 0
    drafter = _make(method, draft, 3, shape)
    trees = _spy(drafter)
    results = BatchedSpeculativeDecoder(target, drafter, max_batch_size=2, max_length=96, num_speculative_tokens=8,
                                        compile=False).generate(PROMPTS, CONFIG)
    assert [r.token_ids for r in results] == expected
    assert trees and max(t.num_nodes for t in trees) == 9  # the budget's 8 nodes (fewer near the end)
    assert all(any(len(c) >= 2 for c in t.children) for t in trees)  # siblings (the cascade's: after its n-grams)
    if method == "draft":
        assert all(len(t.children[0]) >= 2 for t in trees)  # a sibling at depth 1
    for r in results:
        if method == "draft":  # each round: exactly the sibling, then the bonus token
            assert r.stats.num_accepted_tokens == r.stats.num_draft_blocks > 0
        else:  # the cascade's kept n-gram tokens are the draft's (wrong) choices: those rounds accept nothing
            assert 0 < r.stats.num_accepted_tokens <= r.stats.num_draft_blocks


@pytest.mark.parametrize("shape", TREE_SHAPES)
def test_after_an_accepted_sibling_the_draft_re_feeds_it(arch, shape):
    """Only the chain is in the draft cache: when the target takes the depth-1 sibling, the next round's first
    draft forward feeds it in place of the chain's token (two tokens: the sibling and the bonus), not the
    bonus alone on top of a chain token the sequence does not have."""
    target = make_tiny_model(arch, num_layers=3, seed=25)
    drafter = _make("draft", _swapped(target), 3, shape)
    dec = BatchedSpeculativeDecoder(target, drafter, max_batch_size=1, max_length=96, num_speculative_tokens=8,
                                    compile=False)
    runner, first_widths, calls = drafter.runner, [], []

    def spied(ids, starts, logits_to_keep, trees=None):
        if not calls:
            first_widths.append(ids.shape[1])
        calls.append(1)
        return runner(ids, starts, logits_to_keep, trees)

    propose = drafter.propose

    def propose_once(*args, **kwargs):
        calls.clear()
        return propose(*args, **kwargs)

    drafter.runner, drafter.propose = spied, propose_once
    result = dec.generate(PROMPTS[:1], CONFIG)[0]
    assert result.stats.num_accepted_tokens == result.stats.num_draft_blocks  # the sibling, every round
    assert first_widths[0] == 1 and first_widths[1:] and set(first_widths[1:]) == {2}


# -- the tree's nodes ---------------------------------------------------------------------------------


def test_best_nodes_ranks_chain_and_siblings_by_joint_draft_probability():
    log = torch.tensor([0.6, 0.3, 0.1, 0.9, 0.05, 0.5, 0.4]).log().tolist()
    chain = [10, 11, 12]
    tops = [[(10, log[0]), (20, log[1]), (21, log[2])],  # depth 1: chain 0.6, siblings 0.3, 0.1
            [(11, log[3]), (22, log[4])],  # depth 2: chain 0.6 * 0.9 = 0.54, sibling 0.03
            [(12, log[5]), (23, log[6])]]  # depth 3: chain 0.27, sibling 0.216
    tokens, parents = best_nodes(chain, tops, 5)
    # values: 10: .6, 11: .54, 20: .3, 12: .27, 23: .216 | 21: .1, 22: .03
    assert tokens == [10, 11, 20, 12, 23]
    assert parents == [0, 1, 0, 2, 2]  # 20 hangs from the root, 12 and 23 from 11 (node 2)
    tree = TokenTree((-1, *parents))
    assert [tokens[n - 1] for n in tree.first_chain()] == chain  # the engine's linear fallback: the chain
    # A small budget keeps the shallow sibling 20 (0.3) over the deep chain node 12 (0.27).
    assert best_nodes(chain, tops, 3) == ([10, 11, 20], [0, 1, 0])
    assert best_nodes(chain, tops, 0) == ([], [])


def test_grow_trees_puts_the_tree_after_the_cascades_ngram_block():
    tops = TopK(3)
    logits = torch.full((2, 2, 8), -5.0)
    logits[:, 0, 4], logits[:, 0, 5] = 3.0, 2.9  # step 1: 4 first, 5 a close second
    logits[:, 1, 6], logits[:, 1, 7] = 3.0, -1.0
    for step in range(2):
        tops.add(logits[:, step])
    tokens = torch.tensor([[4, 6], [4, 6]])
    ids, num, trees, chains, sampled = grow_trees(tokens, [2, 2], tops, [True, False], [3, 2], [[9], []])
    assert chains == [[4, 6], [4, 6]]
    assert num == [4, 2] and ids.tolist() == [[9, 4, 6, 5], [4, 6, 0, 0]]
    # 9 (the n-gram, node 1), 4 and 6 (the chain), and 5, 4's sibling, hanging from the n-gram token too
    assert trees[0].parents == (-1, 0, 1, 2, 1) and trees[1] is None


def test_shape_nodes_ranks_as_best_nodes_would_with_the_same_values():
    """A shape chosen from estimates is the tree ``best_nodes`` grows from a round whose every step has those
    probabilities at its ranks: the same nodes, order and parents (depth d, rank r stands for token 10 d + r)."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        k, depth, budget = int(torch.randint(1, 6, (1,), generator=generator)), \
            int(torch.randint(1, 6, (1,), generator=generator)), int(torch.randint(0, 20, (1,), generator=generator))
        probs = torch.rand(k, generator=generator).sort(descending=True).values
        probs = (probs / probs.sum()).tolist()  # rank 0 the chain's (a greedy chain: the draft's top-1)
        chain = [10 * d for d in range(1, depth + 1)]
        tops = [[(10 * d + r, math.log(p)) for r, p in enumerate(probs)] for d in range(1, depth + 1)]
        tokens, parents = best_nodes(chain, tops, budget)
        nodes, shape_parents = shape_nodes(probs, depth, budget)
        assert [10 * d + r for d, r in nodes] == tokens and shape_parents == parents, (probs, depth, budget)
    # Runners-up of a step outrank the chain's deeper nodes: 0.3 > 0.5 * 0.5; a parent always comes first.
    assert shape_nodes([0.5, 0.3, 0.2], 3, 4) == ([(1, 0), (1, 1), (2, 0), (1, 2)], [0, 0, 1, 0])
    assert shape_nodes([0.5, 0.3], 2, 0) == ([], [])
    nodes, parents = shape_nodes([1.0, 1.0, float("nan"), 0.0], 3, 12)  # ties; NaN and 0 count as 1e-9
    assert all(p < j + 1 for j, p in enumerate(parents)) and nodes[:3] == [(1, 0), (1, 1), (2, 0)]
    # A runner-up above its depth's chain node (a sampling row's estimates) is capped at the chain node's value:
    # the chain node comes first, at every depth the shape reaches.
    assert shape_nodes([0.3, 0.4, 0.2], 2, 1) == ([(1, 0)], [0])
    assert shape_nodes([0.3, 0.4, 0.2], 2, 3) == ([(1, 0), (1, 1), (1, 2)], [0, 0, 0])
    assert shape_nodes([0.9, 0.95], 3, 4) == ([(1, 0), (1, 1), (2, 0), (2, 1)], [0, 0, 1, 1])
    # A sampling row's drawn chain comes first, whole (up to the budget); the runners-up fill the rest by value.
    assert shape_nodes([0.3, 0.25, 0.2], 3, 5, keep_chain=True) == ([(1, 0), (2, 0), (3, 0), (1, 1), (1, 2)],
                                                                    [0, 1, 2, 0, 0])
    assert shape_nodes([0.3, 0.25], 3, 2, keep_chain=True) == ([(1, 0), (2, 0)], [0, 1])


def test_shaped_trees_gather_each_nodes_token_and_read_back_the_values():
    """Node (d, r) of a shape holds the chain's token at depth d (r = 0) or the r-th of step d's top-k without the
    chain's token; the cascade's n-gram block comes first; ``read_shapes`` gives back the chains and every
    candidate's probability."""
    torch.manual_seed(0)
    n, steps, vocab, k = 3, 3, 12, 4
    logits = torch.randn(n, steps, vocab)
    tops = TopK(k)
    for i in range(steps):
        tops.add(logits[:, i])
    tokens = logits.argmax(-1)
    tokens[1, 1] = logits[1, 1].argsort(descending=True)[5]  # a chain token outside the top-k (a drawn one)
    shapes = [shape_nodes([0.5, 0.3, 0.15, 0.05], 3, 6), shape_nodes([0.9, 0.05, 0.03, 0.02], 2, 3), None]
    ids, num, trees, sampled, readback = shaped_trees(tokens, [3, 2, 2], tops, shapes, [[], [9, 8], [7]])
    probs = logits.softmax(-1)
    for b in range(n):
        nodes = shapes[b][0] if shapes[b] is not None else [(d, 0) for d in (1, 2)]
        want = [[], [9, 8], [7]][b]
        for d, r in nodes:
            chain = int(tokens[b, d - 1])
            others = [t for t in logits[b, d - 1].topk(k).indices.tolist() if t != chain]
            want.append(chain if r == 0 else others[r - 1])
        assert num[b] == len(want) and ids[b, : num[b]].tolist() == want, b
    assert trees[0].parents == (-1, *shapes[0][1]) and trees[2] is None and sampled == [None] * n
    assert trees[1].parents == (-1, 0, 1, *(p + 2 for p in shapes[1][1]))  # hung from the n-gram block
    chains, read = read_shapes(readback.tolist(), n, steps, k)
    assert chains == tokens.tolist()
    for b, i in ((0, 0), (1, 1), (2, 2)):
        chain = int(tokens[b, i])
        others = [t for t in logits[b, i].topk(k).indices.tolist() if t != chain][: k - 1]
        # rank 0: a greedy chain's own value, its top-1's (row 1's token outside the top-k stands for a drawn one)
        assert read[b][i] == pytest.approx([float(probs[b, i].max()), *(float(probs[b, i, t]) for t in others)],
                                           rel=1e-5)
    with pytest.raises(InvalidArgumentError, match="needs more than its 2 draft steps"):
        shaped_trees(tokens, [2, 2, 2], tops, [shapes[0], None, None])


def test_rank_estimates_start_from_the_prior_and_follow_each_rows_rounds():
    estimates = RankEstimates(3, k=3)
    assert estimates.of(0) == list(SHAPE_PRIOR[:3])
    estimates.update(1, [[0.8, 0.1, 0.05], [0.6, float("nan"), 0.3]])  # per depth; NaN counts 0
    mean = [0.7, 0.05, 0.175]
    assert estimates.of(1) == pytest.approx([SHAPE_WEIGHT * m + (1 - SHAPE_WEIGHT) * p
                                             for m, p in zip(mean, SHAPE_PRIOR)])
    assert estimates.of(0) == list(SHAPE_PRIOR[:3]) and estimates.of(2) == list(SHAPE_PRIOR[:3])  # its own only
    moved = estimates.of(1)
    estimates.move(1, 0)
    assert estimates.of(0) == moved and estimates.of(1) == list(SHAPE_PRIOR[:3])
    estimates.update(0, [[0.5, 0.2]])  # a round with fewer candidates a step: the rest count 0
    assert estimates.of(0)[2] == pytest.approx((1 - SHAPE_WEIGHT) * moved[2])
    estimates.reset(0)
    assert estimates.of(0) == list(SHAPE_PRIOR[:3])


def test_previous_round_shapes_follow_each_rows_own_draft():
    """A confident draft's rows grow deep chains, an unsure one's wide trees: each from its own rounds (the
    prior's shape, depth 4 with 8 nodes, in the first only)."""
    target = make_tiny_model("llama", num_layers=3, seed=27)
    for factor, deep in ((8.0, True), (0.2, False)):
        drafter = _make("draft", _sharpened(perturbed_copy(target, noise=0.3, seed=7), factor), 4, "previous-round")
        trees = _spy(drafter)
        BatchedSpeculativeDecoder(target, drafter, max_batch_size=2, max_length=96, num_speculative_tokens=8,
                                  compile=False).generate(PROMPTS[:2], CONFIG)  # both rows from the first round
        assert max(trees[0].depths) == max(trees[1].depths) == 4
        later = [max(t.depths) for t in trees[2:]]  # (budgets shrink near each row's end)
        mean = sum(later) / max(1, len(later))
        assert len(later) >= 4 and ((mean > 3.0) if deep else (mean < 2.0)), (factor, later)


# -- options ---------------------------------------------------------------------------------------


def test_an_unknown_tree_shape_is_refused():
    target = make_tiny_model("llama", num_layers=1)
    message = "draft_tree_shape='eagle' is not a tree shape: allowed per-round, previous-round, or None"
    with pytest.raises(InvalidArgumentError, match=message):
        DraftModelDrafter(target, tree_depth=2, tree_shape="eagle")
    drafter = _make("draft", perturbed_copy(target, noise=0.3, seed=1), 2, "eagle")  # the attribute: at bind
    with pytest.raises(InvalidArgumentError, match=message):
        BatchedSpeculativeDecoder(target, drafter, max_batch_size=1, max_length=32, compile=False)


def test_the_default_tree_shape_is_the_devices():
    assert default_tree_shape("cuda") == default_tree_shape(torch.device("cuda", 0)) == "previous-round"
    assert default_tree_shape("cpu") == "per-round"
    drafter = DraftModelDrafter(make_tiny_model("llama", num_layers=1), tree_depth=2)
    assert drafter.tree_shape is None  # resolved at bind, on the engine's device


def test_a_tree_shape_set_after_the_engine_binds_takes_effect(monkeypatch):
    """The shape is read each round (as ``gpu_engine.py`` and ``tree_shape_cpu.py`` switch it between runs)."""
    from specdecode.drafters import draft_model

    target = make_tiny_model("llama", num_layers=3, seed=28)
    drafter = _make("draft", perturbed_copy(target, noise=0.3, seed=8), 3, None)  # a CPU's default: per-round
    dec = BatchedSpeculativeDecoder(target, drafter, max_batch_size=1, max_length=96, num_speculative_tokens=8,
                                    compile=False)
    shaped, grown = [], []
    for name, calls in (("shaped_trees", shaped), ("grow_trees", grown)):
        monkeypatch.setattr(draft_model, name, lambda *a, f=getattr(draft_model, name), c=calls, **k: (
            c.append(1), f(*a, **k))[1])
    expected = dec.generate(PROMPTS[:1], CONFIG)[0].token_ids
    assert grown and not shaped
    drafter.tree_shape = "previous-round"
    grown.clear()
    assert dec.generate(PROMPTS[:1], CONFIG)[0].token_ids == expected
    assert shaped and not grown


@pytest.mark.parametrize("bad", [0, 65, -1, True, 2.5, "3"])
def test_bad_tree_depths_are_refused(bad):
    draft = make_tiny_model("llama", num_layers=1)
    with pytest.raises(InvalidArgumentError, match=rf"draft_tree_depth={bad!r} is out of range: allowed an integer "
                                                   r"in 1\.\.64"):
        DraftModelDrafter(draft, tree_depth=bad)
    with pytest.raises(InvalidArgumentError, match=r"in 1\.\.64"):
        CascadeDrafter(draft, tree_depth=bad)


def test_the_tree_option_reaches_draft_and_cascade_only():
    target = LoadedModel(make_tiny_model("qwen2", num_layers=2), make_tiny_tokenizer(), "tiny-qwen2")
    draft = LoadedModel(make_tiny_model("qwen2", num_layers=1, seed=1), make_tiny_tokenizer(), "tiny-draft")
    gen = SpeculativeGenerator(target, draft)
    assert gen.make_drafter("draft", draft_tree_depth=4).tree_depth == 4
    assert gen.batch_decoder("cascade", draft_tree_depth=5).drafter.tree_depth == 5
    assert gen.decoder("draft", draft_tree_depth=2, compile=False).drafter.tree_depth == 2
    assert gen.make_drafter("draft").tree_depth is None  # off by default
    for method in ("prompt-lookup", "token-recycling", "autoregressive"):
        with pytest.raises(InvalidArgumentError, match=rf"draft_tree_depth=4 \(--draft-tree-depth\) applies to the "
                                                       rf"methods with a draft model, 'draft' and 'cascade', not to "
                                                       rf"'{method}'"):
            gen.make_drafter(method, draft_tree_depth=4)
    assert gen.decoder("draft", draft_tree_depth=3, draft_tree_expand=2, compile=False).drafter.tree_expand == 2
    with pytest.raises(InvalidArgumentError, match=r"draft_tree_expand=2 \(--draft-tree-expand\) applies to the "
                                                   r"method 'draft', not to 'cascade'"):
        gen.batch_decoder("cascade", draft_tree_depth=3, draft_tree_expand=2)
    shaped = gen.batch_decoder("cascade", draft_tree_depth=3, draft_tree_shape="previous-round").drafter
    assert shaped.tree_shape == shaped._tree_shape() == "previous-round"
    unset = gen.batch_decoder("draft", draft_tree_depth=3).drafter
    assert unset.tree_shape is None and unset._tree_shape() == "per-round"  # a CPU's default, at bind
    with pytest.raises(InvalidArgumentError, match=r"draft_tree_shape='previous-round' \(--draft-tree-shape\) "
                                                   r"applies to the methods with a draft model"):
        gen.make_drafter("prompt-lookup", draft_tree_shape="previous-round")
    with pytest.raises(InvalidArgumentError, match="draft_tree_shape='per-round' shapes a draft tree: give "
                                                   "draft_tree_depth too"):
        gen.make_drafter("draft", draft_tree_shape="per-round")


# -- EAGLE-2's expansion (tree_expand) -------------------------------------------------------------------


@pytest.mark.parametrize("fast", [False, True])
def test_expanded_trees_equal_target_only(arch, fast):
    """One draft tree forward per depth over the expanded tree: exact at B = 1 and with rows joining."""
    target = make_tiny_model(arch, num_layers=3, seed=27)
    draft = _sharpened(perturbed_copy(target, noise=0.3, seed=7))  # confident: deep trees as well as wide
    expected = [SpeculativeDecoder(target, compile=False).generate(p, CONFIG).token_ids for p in PROMPTS]
    runner = ModelRunner(target, compile=True, graphs=False, name="target") if fast else None
    one = SpeculativeDecoder(target, DraftModelDrafter(draft, tree_depth=3, tree_expand=2), runner=runner,
                             compile=None if fast else False)
    assert [one.generate(p, CONFIG).token_ids for p in PROMPTS] == expected
    drafter = DraftModelDrafter(draft, tree_depth=3, tree_expand=2)
    trees = _spy(drafter)
    dec = BatchedSpeculativeDecoder(target, drafter, max_batch_size=2, max_length=96, num_speculative_tokens=8,
                                    compile=fast, graphs=False)
    results = dec.generate(PROMPTS, CONFIG)
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.num_accepted_tokens for r in results) > 0
    assert any(max(t.depths) == 3 and len(t.children[0]) >= 2 for t in trees)  # deep and wide


def test_expansion_follows_the_drafts_second_choice_down_the_tree(arch):
    """With the draft's top-1 always the target's second choice, the chain's tree accepts one sibling a round;
    expanding the 4 best nodes of each depth keeps every path of first and second choices (2 + 4 + 8 = 14
    nodes, the budget), the target's among them: D = 3 tokens a round, from 2 draft tree forwards."""
    target = make_tiny_model(arch, num_layers=3, seed=28)
    draft = copy.deepcopy(target)
    draft.lm_head = TwoChoices(draft.lm_head)
    config = GenerationConfig(max_new_tokens=33, num_speculative_tokens=14, stop_on_eos=False)
    expected = SpeculativeDecoder(target, compile=False).generate(PROMPTS[0], config).token_ids
    chain = SpeculativeDecoder(target, DraftModelDrafter(draft, tree_depth=3), compile=False).generate(
        PROMPTS[0], config)
    drafter = DraftModelDrafter(draft, tree_depth=3, tree_expand=4)
    caps, propose = [], drafter.propose

    def spied(sequences, max_tokens, *args, **kwargs):
        caps.append(max_tokens[0])
        return propose(sequences, max_tokens, *args, **kwargs)

    drafter.propose = spied
    expanded = SpeculativeDecoder(target, drafter, compile=False).generate(PROMPTS[0], config)
    assert chain.token_ids == expanded.token_ids == expected
    # a depth-1 sibling a round (but the last, whose budget of 1 node is the chain's)
    assert chain.stats.num_accepted_tokens == chain.stats.num_draft_blocks - 1
    s = expanded.stats
    full = caps.count(14)  # rounds with the whole budget (later ones are cut to the tokens left)
    assert full >= 4 and s.num_accepted_tokens >= 3 * full  # 3 tokens in each of them: the most a depth-3 tree gives
    # a full-budget round: the first feed and 2 tree forwards; a round whose budget is below the widest
    # tree forward (4 x 2 nodes) draws the chain's tree instead (up to 3 forwards)
    assert 3 * full <= s.num_draft_forwards <= 3 * s.num_draft_blocks


def test_expansion_falls_back_where_a_row_cannot_grow_a_tree():
    """A sampling row in the batch: the greedy rows draw the chain's tree (no tree forward), still exact."""
    target = make_tiny_model("qwen2", num_layers=3, seed=29)
    draft = perturbed_copy(target, noise=0.3, seed=8)
    sampled = GenerationConfig(max_new_tokens=20, num_speculative_tokens=8, stop_on_eos=False, temperature=0.8,
                               seed=5)
    expected = SpeculativeDecoder(target, compile=False).generate(PROMPTS[0], CONFIG).token_ids
    dec = BatchedSpeculativeDecoder(target, DraftModelDrafter(draft, tree_depth=3, tree_expand=2), max_batch_size=2,
                                    max_length=96, num_speculative_tokens=8, compile=False)
    results = dec.generate(PROMPTS[:2], [CONFIG, sampled])
    assert results[0].token_ids == expected and len(results[1].token_ids) == 20


@pytest.mark.parametrize("bad, message", [
    (0, r"draft_tree_expand=0 is out of range: allowed an integer in 1\.\.64"),
    (True, r"draft_tree_expand=True is out of range"),
])
def test_bad_expansions_are_refused(bad, message):
    draft = make_tiny_model("llama", num_layers=1)
    with pytest.raises(InvalidArgumentError, match=message):
        DraftModelDrafter(draft, tree_depth=3, tree_expand=bad)
    with pytest.raises(InvalidArgumentError, match=r"draft_tree_expand=2 expands a draft tree: give draft_tree_depth"):
        DraftModelDrafter(draft, tree_expand=2)


def test_expand_trees_gives_each_node_the_logits_of_its_own_path():
    """A stand-in draft whose logits rank tokens from a hash of the whole path (node 0 to the node): every
    node of the expanded tree must be among the top-k after its parent's path, so each tree forward must
    give every node its own ancestors (a wrong parent there gives children of another path)."""
    vocab, k = 48, 3

    def scores(path: list[int]) -> torch.Tensor:  # best h(path), then h + 1, h + 2, ..
        h = sum((i + 1) * 7 * t for i, t in enumerate(path)) % vocab
        return -((torch.arange(vocab) - h) % vocab).float()

    def forward(ids, starts, keep, trees):
        out = torch.stack([torch.stack([scores([int(ids[b, j]) for j in tree.path(t)]) if t < tree.num_nodes
                                        else torch.zeros(vocab) for t in range(ids.shape[1])])
                           for b, tree in enumerate(trees)])
        return out[:, -keep:]

    pending = [5, 9]
    first = torch.stack([scores([p]) for p in pending])
    tokens, num, trees, finite, forwards = expand_trees(forward, first, pending, [0, 0], 3, 2, [10, 10], k=k)
    assert forwards == 2 and bool(finite) and num == [10, 10]
    for b, tree in enumerate(trees):
        row = [pending[b], *tokens[b, : num[b]].tolist()]
        assert max(tree.depths) == 3 and len(tree.children[0]) >= 2
        for t in range(1, tree.num_nodes):
            best = scores([row[j] for j in tree.path(tree.parents[t])]).topk(k).indices.tolist()
            assert row[t] in best, (b, t)
