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
from specdecode.drafters.draft_tree import TREE_TOP_K, TopK, grow_trees
from specdecode.drafters.token_recycling import TokenRecyclingDrafter
from specdecode.engine.batched import BatchedSpeculativeDecoder
from specdecode.engine.sampling import Sampler
from specdecode.engine.tree import TokenTree, tree_rejection_sample
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


@pytest.mark.parametrize("method", ["draft", "cascade"])
def test_draft_model_trees_sample_the_target_distribution(method, monkeypatch):
    """A sampling draft model's tree (its drawn chain and the runners-up of each step) emits the target's
    law, and its runners-up are accepted: the tree is verified as a tree, not as its chain."""
    import specdecode.engine.batched as batched

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
    verify = batched.tree_rejection_sample

    def counting(sampler, probs, tree, tokens, draft_probs=None):
        assert draft_probs is not None, "a sampling tree row must name its drawn nodes (none: all runners-up)"
        path, token = verify(sampler, probs, tree, tokens, draft_probs)
        for node in path[1:]:
            paths["drawn" if node in draft_probs else "runner-up"] += 1
        return path, token

    monkeypatch.setattr(batched, "tree_rejection_sample", counting)
    drafter = (DraftModelDrafter(draft, tree_depth=2) if method == "draft"
               else CascadeDrafter(draft, tree_depth=2, max_ngram=1))
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


def test_greedy_and_sampling_tree_rows_share_a_batch():
    """B = 2: a greedy row and a sampling row both grow draft trees; the greedy row's tokens are the
    target's own greedy tokens every time, the sampling row's first three follow the target's law."""
    vocab, n = 8, 500
    model, draft, prompts = spread_pair(vocab)
    sampling = GenerationConfig(max_new_tokens=6, stop_on_eos=False, temperature=1.0)
    greedy = GenerationConfig(max_new_tokens=6, stop_on_eos=False, temperature=0.0)
    expected = SpeculativeDecoder(model).generate(torch.tensor([prompts[0]]), greedy).token_ids
    dec = BatchedSpeculativeDecoder(model, DraftModelDrafter(draft, tree_depth=2), max_batch_size=2, max_length=32,
                                    num_speculative_tokens=4)
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
