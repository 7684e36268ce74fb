"""Sampling over token trees is distributed exactly as target sampling (statistical tests, as
tests/engine/test_verification.py: each cell within Z = 4.5 standard errors, with a negative control
that the same tolerance rejects)."""

from __future__ import annotations

import torch

from conftest import make_tiny_model
from specdecode import GenerationConfig, SpeculativeDecoder
from specdecode.drafters.token_recycling import TokenRecyclingDrafter
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
