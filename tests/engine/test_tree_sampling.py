"""Sampling over token trees is distributed exactly as target sampling (statistical tests, as
tests/engine/test_verification.py: each cell within Z = 4.5 standard errors, with a negative control
that the same tolerance rejects)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import make_tiny_model
from helpers import perturbed_copy
from selfspec_helpers import exact_marginals, spread_pair, violations
from specdecode import CascadeDrafter, DraftModelDrafter, GenerationConfig, SpeculativeDecoder
from specdecode.drafters.draft_tree import TREE_SHAPES, TREE_TOP_K, TopK, grow_trees
from specdecode.drafters.token_recycling import TokenRecyclingDrafter
from specdecode.engine.batched import BatchedSpeculativeDecoder
from specdecode.engine.sampling import Sampler, race
from specdecode.engine.stats import SpecDecodingStats
from specdecode.engine.tree import TokenTree
from specdecode.engine.tree_sampling import tree_rejection_sample, tree_rejection_sample_rows
from specdecode.errors import InvalidArgumentError
from test_verification import _exact_joint, _verified_cells, _within

# Root candidates: tokens 1, 3 and 1 again (a duplicate must never be accepted twice); node 4 (token 0)
# continues node 2 (token 3).
TREE = TokenTree((-1, 0, 0, 0, 2))
TOKENS = [9, 1, 3, 1, 0]


def test_tree_rejection_sample_emits_the_target_law():
    V, N = 5, 30000
    probs = torch.tensor([
        [0.10, 0.30, 0.15, 0.25, 0.20],  # at the root
        [0.20, 0.20, 0.20, 0.20, 0.20],  # after node 1
        [0.40, 0.10, 0.10, 0.10, 0.30],  # after node 2 (token 3)
        [0.20, 0.20, 0.20, 0.20, 0.20],
        [0.05, 0.05, 0.30, 0.30, 0.30],  # after node 4
    ])
    sampler = Sampler(GenerationConfig(temperature=1.0, seed=0), V, "cpu")
    first, second, after_3 = torch.zeros(V), torch.zeros(V), 0
    for _ in range(N):
        path, token = tree_rejection_sample(sampler, probs, TREE, TOKENS)
        emitted = [TOKENS[n] for n in path[1:]] + [token]
        first[emitted[0]] += 1
        if emitted[0] == 3:
            after_3 += 1
            second[emitted[1]] += 1
    assert _within(first / N, probs[0], N)
    assert _within(second / after_3, probs[2], after_3)  # node 2's continuation, accepted or resampled
    # Negative controls: the candidates' own frequencies (token 1 proposed twice) are not the law, and
    # neither is what a wrong residual emits (a rejected candidate's mass left in p).
    assert not _within(torch.tensor([0.0, 2 / 3, 0.0, 1 / 3, 0.0]), probs[0], N)
    wrong = torch.zeros(V)
    for _ in range(N // 3):
        for child in TREE.children[0]:
            if float(sampler.uniform(1, "cpu")[0]) < float(probs[0, TOKENS[child]]):  # no mass removed
                wrong[TOKENS[child]] += 1
                break
        else:
            wrong[int(sampler.sample(probs[:1])[0])] += 1
    assert not _within(wrong / (N // 3), probs[0], N // 3)


def test_token_recycling_trees_sample_the_target_distribution():
    V, N, steps = 8, 2000, 3
    target = make_tiny_model("llama", num_layers=1, vocab_size=V, hidden_size=16, intermediate_size=32)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(0.25)  # keep distributions spread out
    prompt = torch.tensor([[3, 5, 4]])
    base = dict(temperature=1.0, max_new_tokens=steps, stop_on_eos=False)
    exact = _exact_joint(target, prompt, GenerationConfig(**base), steps)
    keys, want = _verified_cells(exact)
    index = {k: i for i, k in enumerate(keys)}

    class Frozen(TokenRecyclingDrafter):  # a fixed matrix: v -> v+1, v+2, v+3 (mod V), never updated
        observes_target = False

    drafter = Frozen(max_nodes=3, top_k=3, max_depth=1)  # three candidates for the next token
    dec = SpeculativeDecoder(target, drafter)
    dec.generate(prompt, GenerationConfig(**base, seed=0))  # binds: the matrix exists
    drafter.adjacency.copy_((torch.arange(V)[:, None] + torch.arange(1, 4)[None, :]) % V)
    assert drafter.tree(3).children[0] == (1, 2, 3)
    counts = torch.zeros(len(keys))
    accepted = 0
    for seed in range(N):
        res = dec.generate(prompt, GenerationConfig(**base, seed=seed, num_speculative_tokens=3))
        s = res.token_ids
        counts[index[(1, s[1])]] += 1
        counts[index[(2, s[2])]] += 1
        counts[index[("pair", s[1], s[2])]] += 1
        accepted += res.stats.num_accepted_tokens
    assert accepted > N // 10, "candidates must be accepted often for this test to mean anything"
    assert _within(counts / N, want, N)
    # Negative control: the law of "the first candidate, then its first candidate" is rejected.
    shifted = torch.zeros(len(keys))
    for seq, pr in exact.items():
        fake = ((seq[0] + 1) % V, (seq[0] + 2) % V)
        shifted[index[(1, fake[0])]] += pr
        shifted[index[(2, fake[1])]] += pr
        if ("pair", *fake) in index:
            shifted[index[("pair", *fake)]] += pr
    assert not _within(shifted, want, N)


# Node 1 is drawn from the draft's q at the root, nodes 2 and 3 are q's two likeliest other tokens (runners-up
# that depend on the draw, as a draft model's are); node 4, drawn from q after node 1, continues it.
SAMPLED_TREE = TokenTree((-1, 0, 0, 0, 1))
Q_ROOT = torch.tensor([0.40, 0.05, 0.35, 0.10, 0.10])
Q_NODE1 = torch.tensor([0.10, 0.10, 0.10, 0.60, 0.10])


def _draw_tree(generator: torch.Generator) -> list[int]:
    drawn = int(torch.multinomial(Q_ROOT, 1, generator=generator)[0])
    others = [t for t in Q_ROOT.argsort(descending=True).tolist() if t != drawn][:2]
    return [9, drawn, *others, int(torch.multinomial(Q_NODE1, 1, generator=generator)[0])]


def _wrong_root_law(sampler, p0: torch.Tensor, generator: torch.Generator, n: int, wrong: str) -> torch.Tensor:
    """The first token's law under a broken rule: "residual" (a rejected drawn token loses only its own
    mass, not q's) or "order" (the runners-up examined before the drawn token)."""
    law = torch.zeros(p0.shape[0])
    for _ in range(n):
        tokens = _draw_tree(generator)
        p = p0.clone()
        for child in ((1, 2, 3) if wrong == "residual" else (2, 3, 1)):
            x, total, u = tokens[child], float(p.sum()), float(sampler.uniform(1, "cpu")[0])
            if (u * total * float(Q_ROOT[x]) < float(p[x])) if child == 1 else (u * total < float(p[x])):
                law[x] += 1
                break
            if child == 1 and wrong == "order":
                p = torch.clamp(p / total - Q_ROOT, min=0.0)
            else:
                p[x] = 0.0
        else:
            law[int(sampler.sample((p / p.sum()).unsqueeze(0))[0])] += 1
    return law / n


def test_tree_rejection_sample_with_draft_q_emits_the_target_law():
    """A drawn node is tested first against its q (Chen et al.'s ratio and residual), then the runners-up
    that depend on it: the first token follows p at the root, the next p after the drawn node."""
    V, N = 5, 30000
    probs = torch.tensor([
        [0.10, 0.30, 0.15, 0.25, 0.20],  # at the root
        [0.40, 0.10, 0.10, 0.10, 0.30],  # after node 1, whatever it drew
        [0.20, 0.20, 0.20, 0.20, 0.20],
        [0.20, 0.20, 0.20, 0.20, 0.20],
        [0.05, 0.05, 0.30, 0.30, 0.30],
    ])
    sampler = Sampler(GenerationConfig(temperature=1.0, seed=0), V, "cpu")
    drafts = torch.Generator().manual_seed(1)
    first, second, through, runners_up = torch.zeros(V), torch.zeros(V), 0, 0
    for _ in range(N):
        tokens = _draw_tree(drafts)
        path, token = tree_rejection_sample(sampler, probs, SAMPLED_TREE, tokens, {1: Q_ROOT, 4: Q_NODE1})
        emitted = [tokens[n] for n in path[1:]] + [token]
        first[emitted[0]] += 1
        if path[1:2] == [1]:
            through += 1
            second[emitted[1]] += 1
        runners_up += path[1:2] in ([2], [3])
    assert _within(first / N, probs[0], N)
    assert _within(second / through, probs[1], through)
    assert runners_up > N // 10, "runners-up must be accepted often for this test to mean anything"
    # Negative controls, with the same draws: a wrong residual, and the runners-up examined first.
    for wrong in ("residual", "order"):
        assert not _within(_wrong_root_law(sampler, probs[0], drafts, N // 3, wrong), probs[0], N // 3), wrong


@pytest.mark.parametrize("shape", TREE_SHAPES)
@pytest.mark.parametrize("method", ["draft", "cascade"])
def test_draft_model_trees_sample_the_target_distribution(method, shape, monkeypatch):
    """A sampling draft model's tree (its drawn chain and the runners-up of each step) emits the target's
    law, and its runners-up are accepted: the tree is verified as a tree, not as its chain. With
    ``tree_shape="previous-round"`` the shape comes before the draws (a fresh row's: ``SHAPE_PRIOR``'s)."""
    import specdecode.engine.verification as verification

    V, N, steps = 8, 1500, 3
    target = make_tiny_model("llama", num_layers=1, vocab_size=V, hidden_size=16, intermediate_size=32)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(3.0)  # peaked, far from the draft's flatter q
    draft = perturbed_copy(target, noise=0.2, seed=3)
    prompt = torch.tensor([[3, 5, 4]])
    base = dict(temperature=1.0, max_new_tokens=steps, stop_on_eos=False)
    with torch.no_grad():  # a flatter q than p: drawn tokens are often rejected, and the residual
        draft.get_output_embeddings().weight.mul_(0.3)  # max(0, p - q) lies on p's top tokens, q's runners-up
    exact = _exact_joint(target, prompt, GenerationConfig(**base), steps)
    keys, want = _verified_cells(exact)
    index = {k: i for i, k in enumerate(keys)}
    paths = {"drawn": 0, "runner-up": 0}
    verify = verification.tree_rejection_sample_rows

    def counting(samplers, probs, trees, drafted, draft_probs, contain_errors=False):
        assert draft_probs is not None and all(q is not None for q in draft_probs), \
            "a sampling tree row must name its drawn nodes (none: all runners-up)"
        verdicts, failed = verify(samplers, probs, trees, drafted, draft_probs, contain_errors)
        for (accepted, _, *path), q in zip(verdicts.tolist(), draft_probs):
            for node in path[:accepted]:
                paths["drawn" if node in q else "runner-up"] += 1
        return verdicts, failed

    monkeypatch.setattr(verification, "tree_rejection_sample_rows", counting)
    drafter = (DraftModelDrafter(draft, tree_depth=2) if method == "draft"
               else CascadeDrafter(draft, tree_depth=2, max_ngram=1))
    drafter.tree_shape = shape
    dec = SpeculativeDecoder(target, drafter)
    counts = torch.zeros(len(keys))
    longer = {**base, "max_new_tokens": 6}  # room for a 4-node tree in the first round; its first 3 tokens are checked
    for seed in range(N):
        s = dec.generate(prompt, GenerationConfig(**longer, seed=seed, num_speculative_tokens=4)).token_ids
        counts[index[(1, s[1])]] += 1
        counts[index[(2, s[2])]] += 1
        counts[index[("pair", s[1], s[2])]] += 1
    assert paths["runner-up"] > N // 50 and paths["drawn"] > N // 20, paths
    assert _within(counts / N, want, N)
    # Negative control: the draft's own law, which speculative sampling must not follow.
    draft_law = torch.zeros(len(keys))
    for seq, pr in _exact_joint(draft, prompt, GenerationConfig(**base), steps).items():
        draft_law[index[(1, seq[1])]] += pr
        draft_law[index[(2, seq[2])]] += pr
        draft_law[index[("pair", seq[1], seq[2])]] += pr
    assert not _within(draft_law, want, N)


@pytest.mark.parametrize("budget", [1, 3])
def test_a_shape_whose_runner_up_outranks_the_drawn_token_keeps_the_law(budget, monkeypatch):
    """A sampling row's estimates may put its second rank above its first (the drawn token's own q): q = (.4, .3,
    .3) gives .34 to the drawn token and .36 to the best one left. Valued as they are, a budget of one node would
    keep the runner-up alone, a chain that the engine verifies as a linear draft, as if drawn from q: not the
    target's law. A sampling row's shape keeps its drawn chain first (``shape_nodes(keep_chain=True)``), and a
    runner-up is capped at its depth's drawn node: every depth the shape reaches holds its drawn node."""
    from specdecode.drafters import draft_tree

    V, N, steps = 8, 1500, 3
    target = make_tiny_model("llama", num_layers=1, vocab_size=V, hidden_size=16, intermediate_size=32)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(3.0)
    draft = perturbed_copy(target, noise=0.2, seed=3)
    with torch.no_grad():
        draft.get_output_embeddings().weight.mul_(0.3)
    monkeypatch.setattr(draft_tree.RankEstimates, "of", lambda self, slot: [0.3, 0.4, 0.2, 0.1, 0.0, 0.0, 0.0, 0.0])
    prompt = torch.tensor([[3, 5, 4]])
    base = dict(temperature=1.0, max_new_tokens=steps, stop_on_eos=False)
    exact = _exact_joint(target, prompt, GenerationConfig(**base), steps)
    keys, want = _verified_cells(exact)
    index = {k: i for i, k in enumerate(keys)}
    drafter = DraftModelDrafter(draft, tree_depth=2)
    drafter.tree_shape = "previous-round"
    shapes, shape_of = [], drafter._shapes
    monkeypatch.setattr(drafter, "_shapes", lambda *a: (lambda found: shapes.append(found) or found)(shape_of(*a)))
    dec = SpeculativeDecoder(target, drafter)
    counts = torch.zeros(len(keys))
    longer = {**base, "max_new_tokens": 6}  # room for the budget in the first round; its first 3 tokens are checked
    for seed in range(N):
        s = dec.generate(prompt, GenerationConfig(**longer, seed=seed, num_speculative_tokens=budget)).token_ids
        counts[index[(1, s[1])]] += 1
        counts[index[(2, s[2])]] += 1
        counts[index[("pair", s[1], s[2])]] += 1
    first = shapes[0][0]  # the first round's shape of its one row: (nodes, parents)
    assert first == ([(1, 0)], [0]) if budget == 1 else first == ([(1, 0), (2, 0), (1, 1)], [0, 1, 0]), first
    assert _within(counts / N, want, N)


def test_sampling_rows_cut_at_a_masked_exit_on_the_device_keep_the_law(monkeypatch):
    """``exit_mode="masked"``: each row's block is cut at its first unsure token on the device
    (``draft_exit.exit_blocks``) and sampled with the round's other rows, before its one sync. A cut row whose kept
    tokens are all accepted draws its next token from p there, not from a residual: the first three tokens of the
    sampling row follow the target's law, and the greedy row beside it is the target's greedy output."""
    from specdecode.drafters.control import DraftControl
    from specdecode.engine import verification

    vocab, n = 8, 500
    model, draft, prompts = spread_pair(vocab)
    cuts, verify = [], verification.rejection_sample_rows

    def spied(samplers, probs, drafted, num_tokens, draft_probs, contain_errors=False, cut=None):
        cuts.append(cut is not None and bool((cut < torch.tensor(num_tokens, device=cut.device)).any()))  # a cut
        return verify(samplers, probs, drafted, num_tokens, draft_probs, contain_errors, cut)

    monkeypatch.setattr(verification, "rejection_sample_rows", spied)
    blocks, record = [], SpecDecodingStats.record_block
    monkeypatch.setattr(SpecDecodingStats, "record_block", lambda self, kb, a, *r: (
        blocks.append((kb, a)), record(self, kb, a, *r))[1])
    sampling = GenerationConfig(max_new_tokens=6, stop_on_eos=False, temperature=1.0)
    greedy = GenerationConfig(max_new_tokens=6, stop_on_eos=False, temperature=0.0)
    expected = SpeculativeDecoder(model).generate(torch.tensor([prompts[0]]), greedy).token_ids
    control = DraftControl(adaptive_exit=True, exit_mode="masked")
    dec = BatchedSpeculativeDecoder(model, DraftModelDrafter(draft), max_batch_size=2, max_length=32,
                                    num_speculative_tokens=4, draft_control=control)
    firsts = torch.zeros((n, 3), dtype=torch.long)
    for i in range(n):
        rows = dec.generate(prompts, [greedy, dataclasses.replace(sampling, seed=i)])
        assert rows[0].token_ids == expected
        firsts[i] = torch.tensor(rows[1].token_ids[:3])
    assert sum(cuts) > n // 10, "blocks must be cut on the device often for this test to mean anything"
    assert all(a <= kb for kb, a in blocks), "a row accepted tokens past its kept block"
    freq = {f"x{j + 1}": torch.bincount(firsts[:, j], minlength=vocab).double() / n for j in range(3)}
    pairs = torch.bincount(firsts[:, 0] * vocab + firsts[:, 1], minlength=vocab**2)
    freq["x1x2"] = pairs.double().view(vocab, vocab) / n
    config = dataclasses.replace(sampling, max_new_tokens=3)
    assert violations(exact_marginals(model, prompts[1], config, vocab), freq, n) == []


@pytest.mark.parametrize("shape", TREE_SHAPES)
def test_greedy_and_sampling_tree_rows_share_a_batch(shape):
    """B = 2: a greedy row and a sampling row both grow draft trees; the greedy row's tokens are the
    target's own greedy tokens every time, the sampling row's first three follow the target's law."""
    vocab, n = 8, 500
    model, draft, prompts = spread_pair(vocab)
    sampling = GenerationConfig(max_new_tokens=6, stop_on_eos=False, temperature=1.0)
    greedy = GenerationConfig(max_new_tokens=6, stop_on_eos=False, temperature=0.0)
    expected = SpeculativeDecoder(model).generate(torch.tensor([prompts[0]]), greedy).token_ids
    drafter = DraftModelDrafter(draft, tree_depth=2)
    drafter.tree_shape = shape
    dec = BatchedSpeculativeDecoder(model, drafter, max_batch_size=2, max_length=32, num_speculative_tokens=4)
    firsts = torch.zeros((n, 3), dtype=torch.long)
    for i in range(n):
        rows = dec.generate(prompts, [greedy, dataclasses.replace(sampling, seed=i)])
        assert rows[0].token_ids == expected
        firsts[i] = torch.tensor(rows[1].token_ids[:3])
    assert dec.stats.rounds_by_draft_size[3:] and sum(dec.stats.rounds_by_draft_size[3:]) > 0  # trees: > depth 2
    freq = {f"x{j + 1}": torch.bincount(firsts[:, j], minlength=vocab).double() / n for j in range(3)}
    freq["x1x2"] = torch.bincount(firsts[:, 0] * vocab + firsts[:, 1], minlength=vocab**2).double().view(vocab, vocab) / n
    config = dataclasses.replace(sampling, max_new_tokens=3)
    assert violations(exact_marginals(model, prompts[1], config, vocab), freq, n) == []
    # Negative control: the law at another temperature is rejected by the same test.
    other = dataclasses.replace(config, temperature=0.5)
    assert violations(exact_marginals(model, prompts[1], other, vocab), freq, n) != []


def test_a_drawn_token_is_verified_whatever_its_q():
    """A sampling row's tree keeps its drawn chain whole, however unlikely the drawn token, and the runners-up
    fill the rest. Ranked with the siblings (as a greedy chain is), a drawn token of low q would be dropped
    and one of high q kept: the tokens the target tests would not follow q, and with p = q the emitted law
    would put 0.09 instead of 0.3 on the four least likely tokens. Depth 1, a budget of 4 nodes."""
    V, N = 8, 10000
    q = torch.tensor([0.20, 0.20, 0.15, 0.15, 0.10, 0.10, 0.05, 0.05])
    probs = q.expand(5, V)  # p = q at every node (the draft is the target)
    sampler = Sampler(GenerationConfig(temperature=1.0, seed=0), V, "cpu")
    drafts = torch.Generator().manual_seed(1)
    first = torch.zeros(V)
    for _ in range(N):
        x = int(torch.multinomial(q, 1, generator=drafts)[0])
        tops = TopK(TREE_TOP_K)
        tops.add(q.log()[None])
        ids, num, trees, _, sampled = grow_trees(torch.tensor([[x]]), [1], tops, [True], [4], probs=[q[None]])
        nodes = ids[0, : num[0]].tolist()
        assert num == [4] and nodes[sampled[0][0] - 1] == x  # the drawn token and its three best runners-up
        path, token = tree_rejection_sample(sampler, probs, trees[0], [9, *nodes], {sampled[0][0]: q})
        first[nodes[path[1] - 1] if len(path) > 1 else token] += 1
    assert _within(first / N, q, N)
    # Negative control: the law the reviewer worked out for the ranked-with-siblings tree.
    dropped = q.clone()
    dropped[:4] = q[:4] / q[:4].sum() * 0.91
    dropped[4:] = q[4:] / q[4:].sum() * 0.09
    assert not _within(dropped, q, N)


def _walk(probs: torch.Tensor, tree: TokenTree, tokens: list[int], q_of: dict, uniforms: list[float],
          noise: torch.Tensor) -> tuple[list[int], int]:
    """The multi-candidate speculative sampling of one tree written plainly, one candidate at a time (SpecInfer,
    Algorithm 2): candidate i of node t, in the order examined (its drawn child first), uses uniform
    ``uniforms[sum of earlier nodes' children + i]``; the next token races ``noise`` over what is left at the
    last node (p itself where nothing is). Float32 throughout, as the device's."""
    offsets = [sum(len(c) for c in tree.children[:t]) for t in range(tree.num_nodes)]
    node, path = 0, [0]
    while True:
        p, moved, total = probs[node].clone(), False, torch.tensor(1.0)  # p sums to 1
        kids = tree.children[node]
        for i, child in enumerate([c for c in kids if c in q_of] + [c for c in kids if c not in q_of]):
            if not float(total) > 0.0:
                break
            x, q, u = tokens[child], q_of.get(child), torch.tensor(uniforms[offsets[node] + i])
            if bool(u * total < p[x]) if q is None else bool(u * q[x] < p[x]):
                node, moved = child, True
                path.append(child)
                break
            if q is None:
                p[x] = 0.0
            else:
                p = torch.clamp(p - q, min=0.0)
            total = p.sum()
        if not moved:
            if not float(p.sum()) > 0.0:
                p = probs[node]
            return path, int(race(p.view(1, -1), noise.clone().view(1, -1))[0])


def _tree_case(generator: torch.Generator, vocab: int) -> tuple[TokenTree, list[int], torch.Tensor, dict, int]:
    """A random tree of 1..9 nodes (tokens from a small vocabulary, so siblings repeat tokens), its target p, q's
    along a path from node 0 (kinds 1-5 of 0-5), and the kind: a draft's q; p's own (always accepted); one-hot at
    a token p lacks; p's own with p(x) = q(x) = 0 at the drawn token x, p of exact binary fractions summing to
    exactly 1, so the residual max(0, p - q) is exactly 0 and p itself is drawn from; a NaN q (a draft whose
    logits overflowed: its token is rejected, the residual is NaN, and p itself is drawn from)."""
    num = int(torch.randint(1, 10, (1,), generator=generator))
    tree = TokenTree((-1, *(int(torch.randint(0, t, (1,), generator=generator)) for t in range(1, num))))
    tokens = torch.randint(0, vocab, (num,), generator=generator).tolist()
    probs = torch.softmax(torch.randn(num, vocab, generator=generator) * 2.5, -1)
    q_of, kind, node = {}, int(torch.randint(0, 6, (1,), generator=generator)), 0
    while kind and tree.children[node]:
        node = tree.children[node][int(torch.randint(0, len(tree.children[node]), (1,), generator=generator))]
        parent, x = tree.parents[node], tokens[node]
        if kind == 3:  # p(x) = 0
            probs[parent, x] = 0.0
            probs[parent] /= probs[parent].sum()
        if kind == 4:  # exact binary fractions, summing to exactly 1, on the other tokens in a random order
            others = torch.tensor([t for t in range(vocab) if t != x])[torch.randperm(vocab - 1, generator=generator)]
            probs[parent] = torch.zeros(vocab).index_copy(0, others, torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625]))
        q_of[node] = torch.softmax(torch.randn(vocab, generator=generator) * 2.5, -1) if kind == 1 else \
            torch.nn.functional.one_hot(torch.tensor(x), vocab).float() if kind == 3 else \
            torch.full((vocab,), float("nan")) if kind == 5 else probs[parent].clone()
    return tree, tokens, probs, q_of, kind


def test_tree_rows_draw_what_a_plain_walk_draws_with_the_same_draws():
    """``tree_rejection_sample_rows`` gives every row, bit for bit, the path and token of a plain one-candidate-at-
    a-time walk (``_walk``) fed the draws the row makes (one uniform per candidate, then the noise of its token),
    and leaves each generator where those draws leave it. Batches of 1..4 rows with seeds of their own or sharing
    one generator, padded to a common width; trees with repeated tokens among siblings, drawn paths with a draft's
    q, with q = p, with a one-hot q at a token p lacks, with q = p of no mass at the drawn token (a residual of
    exactly no mass: p itself is drawn from) and with a NaN q (``_tree_case``)."""
    generator = torch.Generator().manual_seed(7)
    vocab, accepted, fallbacks, drawn_accepted = 6, 0, 0, 0  # vocab: 5 fractions of kind 4, and x
    for trial in range(200):
        m = int(torch.randint(1, 5, (1,), generator=generator))
        cases = [_tree_case(generator, vocab) for _ in range(m)]
        width = max(tree.num_nodes for tree, *_ in cases) + int(torch.randint(0, 3, (1,), generator=generator))
        probs = torch.softmax(torch.randn(m, width, vocab, generator=generator), -1)  # padding: other values
        drafted = torch.randint(0, vocab, (m, width - 1), generator=generator)
        for j, (tree, tokens, p, *_) in enumerate(cases):
            probs[j, : tree.num_nodes] = p
            drafted[j, : tree.num_nodes - 1] = torch.tensor(tokens[1:], dtype=torch.long)
        shared = trial % 2 == 1
        one = torch.Generator().manual_seed(trial)
        samplers = [Sampler(GenerationConfig(temperature=1.0, seed=None if shared else 100 * trial + j), vocab,
                            "cpu", generator=one if shared else None) for j in range(m)]
        verdicts, failed = tree_rejection_sample_rows(samplers, probs, [c[0] for c in cases], drafted,
                                                      [c[3] or None for c in cases])
        assert not failed and verdicts.shape == (m, 2 + max(max(c[0].depths) for c in cases))
        # the same draws, made plainly: uniforms first (rows sharing a generator: W - 1 each in one call; a row
        # alone: one a candidate), then the noise
        if shared:
            again, count = torch.Generator().manual_seed(trial), width - 1 if m > 1 else cases[0][0].num_nodes - 1
            uniforms = torch.rand(m * count, generator=again).view(m, count).tolist()
            reference = Sampler(GenerationConfig(temperature=1.0), vocab, "cpu", generator=again)
            noise = reference.exponential(torch.empty(m, vocab))
            assert torch.equal(again.get_state(), one.get_state())
        else:
            alone = [Sampler(GenerationConfig(temperature=1.0, seed=100 * trial + j), vocab, "cpu") for j in range(m)]
            uniforms = [s.uniform(c[0].num_nodes - 1, torch.device("cpu")).tolist() for s, c in zip(alone, cases)]
            noise = torch.stack([s.exponential(torch.empty(vocab)) for s in alone])
            for a, s in zip(alone, samplers):
                assert torch.equal(a.generator.get_state(), s.generator.get_state())
        for j, (tree, tokens, p, q_of, kind) in enumerate(cases):
            path, token = _walk(p, tree, tokens, q_of, uniforms[j], noise[j])
            a, got_token, *got_path = verdicts[j].tolist()
            assert ([0, *got_path[:a]], got_token) == (path, token), (trial, j)
            assert all(n == -1 for n in got_path[a:])
            accepted += len(path) > 1
            drawn_accepted += any(n in q_of for n in path[1:])
            fallbacks += kind in (4, 5) and any(tree.parents[n] == path[-1] for n in q_of)  # p itself drawn from
    assert accepted > 100 and drawn_accepted > 20 and fallbacks > 10, (accepted, drawn_accepted, fallbacks)


def test_tree_rejection_sample_rows_refuses_bad_input():
    sampler = Sampler(GenerationConfig(temperature=1.0, seed=0), 5, "cpu")
    probs = torch.full((1, 3, 5), 0.2)
    chain, fork = TokenTree((-1, 0, 1)), TokenTree((-1, 0, 0))
    drafted = torch.tensor([[1, 2]])
    q = torch.full((5,), 0.2)
    with pytest.raises(InvalidArgumentError, match=r"must be \(m, W, V\)"):
        tree_rejection_sample_rows([sampler], probs[0], [chain], drafted, None)
    with pytest.raises(InvalidArgumentError, match=r"1 samplers, 2 trees and drafted \(1, 2\)"):
        tree_rejection_sample_rows([sampler], probs, [chain, chain], drafted, None)
    with pytest.raises(InvalidArgumentError, match="tree of 4 nodes"):
        tree_rejection_sample_rows([sampler], probs, [TokenTree((-1, 0, 1, 2))], drafted, None)
    with pytest.raises(InvalidArgumentError, match=r"q at nodes \[0\] .* q at nodes 1..2 of shape \(5,\)"):
        tree_rejection_sample_rows([sampler], probs, [chain], drafted, [{0: q}])
    with pytest.raises(InvalidArgumentError, match=r"shapes \[\(4,\)\]"):
        tree_rejection_sample_rows([sampler], probs, [chain], drafted, [{1: q[:4]}])
    with pytest.raises(InvalidArgumentError, match=r"node 0 has 2 drawn children \[1, 2\]; at most one"):
        tree_rejection_sample_rows([sampler], probs, [fork], drafted, [{1: q, 2: q}])
    with pytest.raises(InvalidArgumentError, match="2 draft_probs for 1 rows"):
        tree_rejection_sample_rows([sampler], probs, [chain], drafted, [None, None])
    with pytest.raises(InvalidArgumentError, match="2 tokens and target_probs"):
        tree_rejection_sample(sampler, probs[0], chain, [0, 1])
    empty, failed = tree_rejection_sample_rows([], probs[:0], [], drafted[:0], None)
    assert empty.shape == (0, 2) and not failed


@pytest.mark.parametrize("method, broken_row", [("exponential", 1), ("uniform", 0)])
@pytest.mark.parametrize("shared", [False, True], ids=["own-seeds", "shared"])
def test_tree_rows_fail_only_the_row_whose_draws_raise(method, broken_row, shared):
    """A row whose draw of its token (``exponential``) or of its uniforms (``uniform``) raises is left out and
    reported (``contain_errors``); the others get the walk their own draws give (``_walk``). "shared": the rows
    share one generator and draw through row 0's sampler, which raises; the draw is retried row by row
    (``sampling.draw_or_retry``), so only row 0 fails. Without ``contain_errors`` the error propagates."""
    broken_row = 0 if shared else broken_row
    generator = torch.Generator().manual_seed(3)
    cases = [_tree_case(generator, 6) for _ in range(3)]
    while any(c[0].num_nodes < 2 for c in cases):  # candidates in every row
        cases = [_tree_case(generator, 6) for _ in range(3)]
    width = max(c[0].num_nodes for c in cases)
    probs, drafted = torch.full((3, width, 6), 1 / 6), torch.zeros((3, width - 1), dtype=torch.long)
    for j, (tree, tokens, p, *_) in enumerate(cases):
        probs[j, : tree.num_nodes], drafted[j, : tree.num_nodes - 1] = p, torch.tensor(tokens[1:])
    one, again = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    samplers = [Sampler(GenerationConfig(temperature=1.0, seed=None if shared else s), 6, "cpu",
                        generator=one if shared else None) for s in range(3)]
    alone = [Sampler(GenerationConfig(temperature=1.0, seed=None if shared else s), 6, "cpu",
                     generator=again if shared else None) for s in range(3)]

    def broken(*args):
        raise RuntimeError(f"{method} failed")

    setattr(samplers[broken_row], method, broken)
    trees, qs = [c[0] for c in cases], [c[3] or None for c in cases]
    verdicts, failed = tree_rejection_sample_rows(samplers, probs, trees, drafted, qs, contain_errors=True)
    assert list(failed) == [broken_row] and str(failed[broken_row]) == f"{method} failed"
    others = [j for j in range(3) if j != broken_row]
    cpu = torch.device("cpu")
    if not shared:  # each row its own: its uniforms, then its noise
        uniforms = {j: alone[j].uniform(cases[j][0].num_nodes - 1, cpu).tolist() for j in others}
        noise = {j: alone[j].exponential(torch.empty(6)) for j in others}
    elif method == "uniform":  # retried row by row (W - 1 each); then rows 1 and 2's noise in one draw
        uniforms = {j: alone[j].uniform(width - 1, cpu).tolist() for j in others}
        noise = dict(zip(others, alone[1].exponential(torch.empty(2, 6))))
    else:  # the uniforms in one draw; the noise retried row by row
        together = alone[0].uniform(3 * (width - 1), cpu).tolist()
        uniforms = {j: together[j * (width - 1) : (j + 1) * (width - 1)] for j in others}
        noise = {j: alone[j].exponential(torch.empty(6)) for j in others}
    for row, j in zip(verdicts.tolist(), others):
        tree, tokens, p, q_of, _ = cases[j]
        path, token = _walk(p, tree, tokens, q_of, uniforms[j], noise[j])
        assert ([0, *row[2 : 2 + row[0]]], row[1]) == (path, token)
    with pytest.raises(RuntimeError, match=f"{method} failed"):
        tree_rejection_sample_rows(samplers, probs, trees, drafted, qs)
