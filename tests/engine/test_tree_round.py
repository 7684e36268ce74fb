"""Tree verification in the batched round (engine.batched with ``Draft.trees``) and the Token Recycling
drafter: greedy output equals target-only decoding in float32, rows that cannot verify a tree verify its
first chain, and an accepted path off the first chain moves its keys into place."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_model
from specdecode import GenerationConfig, SpeculativeDecoder
from specdecode.drafters.prompt_lookup import PromptLookupDrafter
from specdecode.drafters.token_recycling import TokenRecyclingDrafter, static_tree
from specdecode.engine.batch_cache import to_device
from specdecode.engine.batched import BatchedSpeculativeDecoder
from specdecode.engine.protocol import Draft, Drafter
from specdecode.engine.tree import TokenTree
from specdecode.errors import InvalidArgumentError

PROMPTS = [[(5 * i + 3 * j) % 40 + 3 for j in range(n)] for i, n in enumerate((9, 4, 14, 6))]
# The wrong first child, then the right tokens as a chain under the root's second child.
OFF_CHAIN = TokenTree((-1, 0, 0, 2, 3))


def _alone(target, prompts, config):
    dec = SpeculativeDecoder(target)
    return [dec.generate(p, config).token_ids for p in prompts]


class OracleTree(Drafter):
    """Knows each prompt's target-only continuation; drafts ``OFF_CHAIN``: a wrong first child, then the
    right next three tokens down the second branch (so every round accepts a path off the first chain)."""

    who = "oracle tree"

    def __init__(self, continuations: dict[tuple, list[int]], vocab: int) -> None:
        self.continuations, self.vocab = continuations, vocab

    def bind(self, target_cache) -> None:
        self.device = target_cache.device

    def join(self, slot, prompt_ids, sampler) -> None:
        pass

    def _next(self, sequence: list[int], n: int) -> list[int]:
        for prompt, out in self.continuations.items():
            if tuple(sequence[: len(prompt)]) == prompt:
                done = len(sequence) - len(prompt)
                return (out[done : done + n] + [0] * n)[:n]
        raise AssertionError("unknown prompt")

    def propose(self, sequences, max_tokens, exits=None, exit_rule="row") -> Draft:
        rows, counts, trees = [], [], []
        for s, cap in zip(sequences, max_tokens):
            right = self._next(s, 3)
            rows.append([(right[0] + 1) % self.vocab, *right])
            counts.append(4 if cap >= 4 else 0)
            trees.append(OFF_CHAIN if cap >= 4 else None)
        return Draft(to_device(rows, self.device), counts, who=self.who, trees=trees)

    def rollback(self, num_valid) -> None:
        pass

    def move(self, src, dst, num_valid) -> None:
        pass


def test_an_accepted_path_off_the_first_chain_gives_target_only_tokens(arch):
    target = make_tiny_model(arch, seed=6)
    config = GenerationConfig(max_new_tokens=17, stop_on_eos=False)
    expected = _alone(target, PROMPTS, config)
    oracle = OracleTree({tuple(p): e for p, e in zip(PROMPTS, expected)}, target.config.vocab_size)
    dec = BatchedSpeculativeDecoder(target, oracle, max_batch_size=2, max_length=64, num_speculative_tokens=4)
    results = dec.generate(PROMPTS, config)  # 4 prompts through 2 slots: rows join mid-flight
    assert [r.token_ids for r in results] == expected
    stats = results[0].stats
    assert stats.num_accepted_tokens >= 3 * (stats.num_draft_blocks - 1)  # the oracle's branch was accepted
    # Acceptance by depth: OFF_CHAIN has depth 3 (4 nodes), so positions count depths 1..3, not 4 nodes.
    assert len(stats.drafted_by_position) == 3 and stats.drafted_by_position[0] == stats.num_draft_blocks


def test_rows_that_cannot_verify_a_tree_verify_its_first_chain(arch):
    """A row with a logits processor beside a greedy row: the processor row drafts the wrong first chain
    only (nothing accepted), the greedy row accepts the second branch; both equal target-only decoding."""
    target = make_tiny_model(arch, seed=7)
    plain = GenerationConfig(max_new_tokens=12, stop_on_eos=False)
    penalised = GenerationConfig(max_new_tokens=12, stop_on_eos=False, repetition_penalty=1.3)
    expected = [_alone(target, PROMPTS[:1], plain)[0], _alone(target, PROMPTS[1:2], penalised)[0]]
    oracle = OracleTree({tuple(p): e for p, e in zip(PROMPTS[:2], expected)}, target.config.vocab_size)
    dec = BatchedSpeculativeDecoder(target, oracle, max_batch_size=2, max_length=64, num_speculative_tokens=4)
    results = dec.generate(PROMPTS[:2], [plain, penalised])
    assert [r.token_ids for r in results] == expected
    assert results[0].stats.num_accepted_tokens > 0 and results[1].stats.num_accepted_tokens == 0
    assert results[1].stats.num_drafted_tokens == results[1].stats.num_draft_blocks  # one token: the first chain


@pytest.mark.parametrize("rows", [1, 3])
def test_token_recycling_is_exact_and_learns(arch, rows):
    target = make_tiny_model(arch, seed=8)
    config = GenerationConfig(max_new_tokens=40, stop_on_eos=False)
    expected = _alone(target, PROMPTS, config)
    drafter = TokenRecyclingDrafter(max_nodes=8, top_k=3)
    dec = BatchedSpeculativeDecoder(target, drafter, max_batch_size=rows, max_length=96, num_speculative_tokens=8)
    results = dec.generate(PROMPTS, config)
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.num_accepted_tokens for r in results) > 0  # tiny models repeat: recycled tokens hit
    assert int(drafter.adjacency.count_nonzero()) > 0


def test_token_recycling_under_the_one_sequence_decoder_and_sampling_rows():
    target = make_tiny_model("llama", seed=9)
    greedy = GenerationConfig(max_new_tokens=24, stop_on_eos=False)
    expected = _alone(target, PROMPTS[:1], greedy)[0]
    dec = SpeculativeDecoder(target, TokenRecyclingDrafter(max_nodes=6), )
    assert dec.generate(PROMPTS[0], greedy).token_ids == expected
    sampled = dec.generate(PROMPTS[0], GenerationConfig(max_new_tokens=24, temperature=0.8, seed=3, stop_on_eos=False))
    assert len(sampled.token_ids) == 24


def test_static_tree_is_best_first_and_every_prefix_is_a_tree():
    parents, ranks = static_tree(10, 3)
    assert parents[:4] == [-1, 0, 1, 2] and ranks[:4] == [-1, 0, 0, 0]  # rank 0 chain first (0.7, 0.49, 0.34)
    assert ranks[4] == 1 and parents[4] == 0  # then the root's second candidate (0.25)
    for n in range(1, 11):
        TokenTree(tuple(parents[: n + 1]))  # raises unless each parent comes first
    with pytest.raises(InvalidArgumentError, match="top_k must be in 1..8"):
        static_tree(4, 9)
    with pytest.raises(InvalidArgumentError, match="num_nodes must be an integer >= 1, got 0"):
        TokenRecyclingDrafter(max_nodes=0)


def test_a_target_without_tree_forwards_verifies_the_first_chain():
    """A target run outside torch (llama.cpp; here its torch-backed stand-in) takes linear blocks: Token
    Recycling's rows verify their rank-0 chains there, with target-only output."""
    from runner_target_helpers import TorchBackedModel

    from specdecode.models.llama_cpp_target import LlamaCppTargetRunner

    target = make_tiny_model("qwen2", seed=10)
    config = GenerationConfig(max_new_tokens=30, stop_on_eos=False)
    expected = _alone(target, PROMPTS[:1], config)[0]
    backed = LlamaCppTargetRunner(TorchBackedModel(target))
    got = SpeculativeDecoder(backed, TokenRecyclingDrafter(max_nodes=6)).generate(PROMPTS[0], config)
    assert got.token_ids == expected
    chain = len(TokenRecyclingDrafter(max_nodes=6).tree(6).first_chain())
    assert chain < 6 and got.stats.num_draft_blocks > 0
    assert got.stats.num_drafted_tokens <= chain * got.stats.num_draft_blocks  # never the whole tree
    with pytest.raises(InvalidArgumentError, match="linear blocks only"):
        backed(torch.tensor([[1, 2]]), [0], 2, trees=[TokenTree.chain(1)])


@pytest.mark.parametrize("drafter", ["oracle", "recycling", "lookup-branches"])
def test_tree_rounds_on_the_fast_path_buckets(arch, drafter):
    """The fast path's static-shape forwards (graphs off: the same buckets and buffers, eagerly) run
    tree verifications in buckets of their own, with target-only output."""
    target = make_tiny_model(arch, seed=11)
    config = GenerationConfig(max_new_tokens=20, stop_on_eos=False)
    expected = _alone(target, PROMPTS, config)
    made = {
        "oracle": lambda: OracleTree({tuple(p): e for p, e in zip(PROMPTS, expected)}, target.config.vocab_size),
        "recycling": lambda: TokenRecyclingDrafter(max_nodes=6, top_k=3),
        "lookup-branches": lambda: PromptLookupDrafter(max_ngram=2, branches=3),
    }[drafter]()
    dec = BatchedSpeculativeDecoder(target, made, max_batch_size=2, max_length=64, num_speculative_tokens=6,
                                    compile=True, graphs=False)
    assert [r.token_ids for r in dec.generate(PROMPTS, config)] == expected
    if drafter != "lookup-branches":  # prompt lookup's trees need repeats in the text, which it may not have
        assert any(tree for (_, _, tree) in dec.runner._buckets)  # a tree bucket ran: (rows, width, tree)
