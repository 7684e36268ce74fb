"""The cascade drafter: n-gram match first, then the draft model; exact greedy and sampling."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import make_tiny_model
from helpers import perturbed_copy
from selfspec_helpers import (  # noqa: F401  (one_thread is a fixture)
    REPETITIVE,
    DraftSpy,
    autoregressive,
    exact_marginals,
    one_thread,
    sample_counts,
    violations,
)
from specdecode import DraftControl, GenerationConfig, InvalidArgumentError, SpeculativeDecoder
from specdecode.drafters import CascadeDrafter
from specdecode.engine.batch_cache import BatchKVCache
from specdecode.engine.sampling import Sampler

pytestmark = pytest.mark.usefixtures("one_thread")



class Spy(CascadeDrafter):
    """Records how each block was made: (n-gram tokens kept, model tokens), and where it started."""

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.blocks: list[tuple[int, int]] = []
        self.drafts: list[tuple[int, list[int]]] = []  # (position of the first draft token, tokens)

    def propose(self, sequences, max_tokens, exits=None, exit_rule="row"):
        before = self.num_ngram_tokens
        draft = super().propose(sequences, max_tokens, exits, exit_rule)
        m = self.num_ngram_tokens - before  # one row
        k = draft.num_tokens[0]
        self.blocks.append((m, k - m))
        self.drafts.append((len(sequences[0]), draft.tokens[0, :k].tolist()))
        return draft


def test_unchecked_ngram_tokens_come_first_and_the_model_continues_after_them():
    target = make_tiny_model("llama", num_layers=2)
    draft = make_tiny_model("llama", num_layers=1, seed=4)
    drafter = CascadeDrafter(draft, max_ngram=2, ngram_check=False)
    seq = torch.tensor([[5, 6, 7, 8, 5, 6]])
    sampler = Sampler(GenerationConfig(), target.config.vocab_size, "cpu")
    drafter.bind(BatchKVCache(target, 1, 64))
    drafter.join(0, seq[:, :4], sampler)
    block = drafter.propose([seq[0].tolist()], [5])
    tokens = block.tokens[0, : block.num_tokens[0]]
    # (5, 6) occurred at 0, followed by 7, 8, 5, 6: all four come from the match, then one from the model.
    assert tokens[:4].tolist() == [7, 8, 5, 6]
    with torch.no_grad():  # the model's token is its greedy choice after the match
        expected = int(draft(torch.cat([seq, tokens[:4].view(1, -1)], dim=1)).logits[0, -1].argmax())
    assert tokens[4:].tolist() == [expected]
    # one draft forward; the deferred prompt prefill is not a decode-phase forward (DraftModelDrafter._catch_up)
    assert drafter.num_ngram_tokens == 4 and drafter.num_forwards == 1


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_greedy_equals_autoregressive_unchecked(arch, gamma):
    """Blocks mix n-gram and model tokens, and some are rejected in the n-gram part."""
    target = make_tiny_model(arch, num_layers=2)
    draft = perturbed_copy(target, noise=0.5, seed=gamma)
    prompt = torch.tensor([REPETITIVE])
    config = GenerationConfig(max_new_tokens=30, num_speculative_tokens=gamma, stop_on_eos=False)
    drafter = Spy(draft, ngram_check=False)
    result = SpeculativeDecoder(target, drafter).generate(prompt, config)
    assert result.token_ids == autoregressive(target, prompt, config), (arch, gamma)
    assert any(m for m, _ in drafter.blocks) and any(k for _, k in drafter.blocks)
    if arch == "llama" and gamma > 1:  # this model follows the repeats: blocks start with n-gram tokens
        assert any(m and k for m, k in drafter.blocks), "no block mixed n-gram and model tokens"


@pytest.mark.parametrize("gamma,noise", [(1, 0.5), (3, 0.0), (3, 0.5), (8, 0.0), (8, 0.5)])
def test_checked_blocks_are_drafts_blocks_with_fewer_forwards(arch, gamma, noise):
    """The n-gram check keeps only tokens the draft model would draft itself: greedy, every block
    equals ``draft``'s, output equals autoregressive, and kept n-gram tokens save draft forwards."""
    target = make_tiny_model(arch, num_layers=2)
    draft = perturbed_copy(target, noise=noise, seed=gamma)
    prompt = torch.tensor([REPETITIVE])
    config = GenerationConfig(max_new_tokens=40, num_speculative_tokens=gamma, stop_on_eos=False)
    cascade, plain = Spy(draft), DraftSpy(draft)
    result = SpeculativeDecoder(target, cascade).generate(prompt, config)
    assert result.token_ids == autoregressive(target, prompt, config), (arch, gamma)
    reference = SpeculativeDecoder(target, plain).generate(prompt, config)
    assert cascade.drafts == plain.drafts
    kept = sum(m for m, _ in cascade.blocks)
    if gamma == 3 and noise == 0.0:  # a copy of the target agrees with the repeats it makes itself
        assert kept > 0, "the check kept no n-gram token"
        assert cascade.num_forwards < reference.stats.num_draft_forwards
        assert result.stats.num_draft_forwards < reference.stats.num_draft_forwards


@pytest.mark.parametrize("ngram_check", [False, True])
def test_greedy_exact_when_the_ngram_part_is_rejected(ngram_check):
    """n-gram tokens the target does not follow get rejected, output stays exact. Unchecked: a
    prompt whose repeats the target does not follow. Checked: a draft model that follows the
    repeats of its own output more often than the (perturbed) target does."""
    if ngram_check:
        draft = make_tiny_model("llama", num_layers=2)
        target = perturbed_copy(draft, noise=0.4, seed=0)
        prompt = torch.tensor([REPETITIVE])
        max_new_tokens = 30
    else:
        target = make_tiny_model("qwen2", num_layers=2, seed=1)
        draft = perturbed_copy(target, noise=0.5, seed=7)
        prompt = torch.tensor([[30, 31, 32, 33, 34, 35, 30, 31, 32, 33, 34, 35, 30]])
        max_new_tokens = 24
    config = GenerationConfig(max_new_tokens=max_new_tokens, num_speculative_tokens=4, stop_on_eos=False)
    drafter = Spy(draft, ngram_check=ngram_check)
    result = SpeculativeDecoder(target, drafter).generate(prompt, config)
    assert result.token_ids == autoregressive(target, prompt, config)
    full = prompt[0].tolist() + result.token_ids
    rejected_ngram_first = [
        (start, tokens) for (start, tokens), (m, _) in zip(drafter.drafts, drafter.blocks)
        if m and start < len(full) and tokens[0] != full[start]
    ]
    assert rejected_ngram_first, "no block had its first (n-gram) token rejected"


def test_adaptive_exit_applies_to_the_model_part():
    target = make_tiny_model("mistral", num_layers=2)
    draft = perturbed_copy(target, noise=0.5, seed=2)
    prompt = torch.tensor([REPETITIVE])
    config = GenerationConfig(max_new_tokens=30, stop_on_eos=False)
    dec = SpeculativeDecoder(target, CascadeDrafter(draft), draft_control=DraftControl(adaptive_exit=True))
    assert dec.generate(prompt, config).token_ids == autoregressive(target, prompt, config)


@pytest.mark.parametrize("ngram_check", [True, False])
def test_sampling_preserves_target_distribution(ngram_check):
    """Mixed blocks: one-hot rows for the n-gram part, the model's q for the rest."""
    vocab, n = 8, 600
    model = make_tiny_model("qwen2", num_layers=1, vocab_size=vocab, seed=2)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(0.25)  # spread-out distributions: rejections happen
    draft = perturbed_copy(model, noise=2.0, seed=3)
    prompt = [5, 3, 6, 5, 3, 4, 6, 5, 7]
    # Tokens 2-3 come out of one verified block of up to 3 tokens; the lookup after the first
    # token gives at most 2 (the prompt's last occurrence of it is near the end), the model the rest.
    config = GenerationConfig(max_new_tokens=4, num_speculative_tokens=3, stop_on_eos=False, temperature=1.0)
    dec = SpeculativeDecoder(model, CascadeDrafter(draft, max_ngram=2, ngram_check=ngram_check))
    freq = sample_counts(dec, prompt, config, n, vocab)
    exact = exact_marginals(model, prompt, config, vocab)
    assert violations(exact, freq, n) == []
    # Negative control: the draft model's own law is rejected by the same test.
    assert violations(exact_marginals(draft, prompt, config, vocab), freq, n) != []
    spy = Spy(draft, max_ngram=2, ngram_check=ngram_check)
    spied = SpeculativeDecoder(model, spy)
    runs = [spied.generate(prompt, dataclasses.replace(config, seed=s)).stats for s in range(30)]
    drafted = sum(r.num_drafted_tokens for r in runs)
    assert 0 < sum(r.num_accepted_tokens for r in runs) < drafted
    assert any(m and k for m, k in spy.blocks), "no block mixed n-gram and model tokens"


def test_bad_check_arguments_are_refused():
    draft = make_tiny_model("llama", num_layers=1)
    with pytest.raises(InvalidArgumentError, match="ngram_check must be True or False, got 'yes'"):
        CascadeDrafter(draft, ngram_check="yes")


def test_bad_ngram_sizes_are_refused():
    with pytest.raises(InvalidArgumentError, match="min_ngram \\(3\\) must be <= max_ngram \\(2\\)"):
        CascadeDrafter(make_tiny_model("llama", num_layers=1), max_ngram=2, min_ngram=3)
