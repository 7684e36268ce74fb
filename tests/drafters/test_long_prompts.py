"""Long prompts: the draft model's context window, and the cascade's prompt limit; output stays exact."""

from __future__ import annotations

import re

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
from specdecode.drafters import CascadeDrafter, DraftModelDrafter, PromptLookupDrafter
from specdecode.engine.batch_cache import BatchKVCache
from specdecode.engine.sampling import Sampler

pytestmark = pytest.mark.usefixtures("one_thread")

LONG_PROMPT = [40, 41, 42, 43, 44, 45, 46, 47] + REPETITIVE  # 24 tokens


def test_the_draft_sees_only_the_window():
    """Hand-checked: with a window of 5 the draft cache holds 5 prompt tokens, and the block is what
    the draft model drafts greedily from those 5 tokens alone (rotary positions: only distances count)."""
    draft = make_tiny_model("llama", num_layers=2, seed=3)
    prompt = torch.tensor([LONG_PROMPT])
    sampler = Sampler(GenerationConfig(), draft.config.vocab_size, "cpu")
    drafter = DraftModelDrafter(draft, context_window=5)
    drafter.bind(BatchKVCache(draft, 1, 64))

    def held() -> int:  # positions of the draft's cache: sequence positions less the window's offset
        return drafter._num_cached[0] - drafter._offsets[0]

    drafter.join(0, prompt[:, :-1], sampler)
    assert held() == 0 and drafter.num_forwards == 0  # the draft's prefill waits for the first propose
    block = drafter.propose([LONG_PROMPT], [4])
    alone = autoregressive(draft, prompt[:, -6:], GenerationConfig(max_new_tokens=4, stop_on_eos=False))
    assert block.tokens[0, : block.num_tokens[0]].tolist() == alone
    assert held() == 5 + 1 + 3  # the window, the pending token, 3 of 4 drafts fed
    whole = autoregressive(draft, prompt, GenerationConfig(max_new_tokens=4, stop_on_eos=False))
    assert alone != whole, "this check needs a prompt whose beginning changes the draft's tokens"
    drafter.rollback([len(LONG_PROMPT) + 1])  # sequence positions: the prompt and one accepted token
    assert held() == 5 + 1 + 1


@pytest.mark.parametrize("method", ["draft", "cascade"])
@pytest.mark.parametrize("window", [1, 6, 1000])
def test_greedy_equals_autoregressive_with_a_window(arch, method, window):
    """float32, every tiny architecture: a window changes the drafts, never the output; a window
    longer than the prompt changes nothing."""
    target = make_tiny_model(arch, num_layers=2)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    prompt = torch.tensor([LONG_PROMPT])
    config = GenerationConfig(max_new_tokens=30, num_speculative_tokens=4, stop_on_eos=False)

    def run(context_window):
        drafter = (DraftSpy(draft, context_window=context_window) if method == "draft"
                   else CascadeDrafter(draft, context_window=context_window))
        result = SpeculativeDecoder(target, drafter).generate(prompt, config)
        return result, drafter

    windowed, drafter = run(window)
    assert windowed.token_ids == autoregressive(target, prompt, config), (arch, method, window)
    whole, plain = run(None)
    same = (windowed.stats.num_drafted_tokens, windowed.stats.num_accepted_tokens, windowed.stats.num_draft_forwards) \
        == (whole.stats.num_drafted_tokens, whole.stats.num_accepted_tokens, whole.stats.num_draft_forwards)
    if window == 1000:  # longer than the prompt: nothing changes
        assert same and (method == "cascade" or drafter.drafts == plain.drafts)
    elif window == 1 and method == "draft":
        assert drafter.drafts != plain.drafts, "a 1-token window drafted as the whole prompt did"


def test_sampling_with_a_window_preserves_target_distribution():
    vocab, n = 8, 600
    model = make_tiny_model("qwen2", num_layers=1, vocab_size=vocab, seed=2)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(0.25)  # spread-out distributions: rejections happen
    draft = perturbed_copy(model, noise=2.0, seed=3)
    prompt = [5, 3, 6, 5, 3, 4, 6, 5, 7]
    config = GenerationConfig(max_new_tokens=4, num_speculative_tokens=3, stop_on_eos=False, temperature=1.0)
    dec = SpeculativeDecoder(model, CascadeDrafter(draft, max_ngram=2, context_window=2))
    freq = sample_counts(dec, prompt, config, n, vocab)
    exact = exact_marginals(model, prompt, config, vocab)
    assert violations(exact, freq, n) == []
    assert violations(exact_marginals(draft, prompt, config, vocab), freq, n) != []  # the test can fail


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "256"])
def test_bad_windows_are_refused(bad):
    draft = make_tiny_model("llama", num_layers=1)
    with pytest.raises(InvalidArgumentError, match=re.escape(f"context_window={bad!r} is out of range: allowed an "
                                                             "integer >= 1 (tokens), or None for the whole prompt")):
        DraftModelDrafter(draft, context_window=bad)
    with pytest.raises(InvalidArgumentError, match="out of range"):
        CascadeDrafter(draft, context_window=bad)


@pytest.mark.parametrize("limit", [len(LONG_PROMPT) - 1, len(LONG_PROMPT)])
def test_cascade_skips_the_draft_model_for_a_prompt_over_the_limit(arch, limit):
    """Over the limit: no draft forward at all (not even the prefill) and prompt lookup's blocks;
    at the limit: the cascade as without one. float32 output equals autoregressive either way."""
    target = make_tiny_model(arch, num_layers=2)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    calls = []
    hook = draft.register_forward_hook(lambda *a: calls.append(1))
    prompt = torch.tensor([LONG_PROMPT])
    config = GenerationConfig(max_new_tokens=30, num_speculative_tokens=4, stop_on_eos=False)
    try:
        limited = SpeculativeDecoder(target, CascadeDrafter(draft, max_model_prompt_tokens=limit)).generate(prompt, config)
        over = len(calls)
        plain = SpeculativeDecoder(target, CascadeDrafter(draft)).generate(prompt, config)
    finally:
        hook.remove()
    assert limited.token_ids == autoregressive(target, prompt, config)
    if limit < len(LONG_PROMPT):
        assert over == 0 and limited.stats.num_draft_forwards == 0
        lookup = SpeculativeDecoder(target, PromptLookupDrafter()).generate(prompt, config)
        assert (limited.stats.num_drafted_tokens, limited.stats.num_accepted_tokens) == (
            lookup.stats.num_drafted_tokens, lookup.stats.num_accepted_tokens)
        assert limited.stats.num_drafted_tokens > 0
    else:
        assert over > 0
        assert (limited.stats.num_drafted_tokens, limited.stats.num_accepted_tokens,
                limited.stats.num_draft_forwards) == (plain.stats.num_drafted_tokens, plain.stats.num_accepted_tokens,
                                                      plain.stats.num_draft_forwards)


@pytest.mark.parametrize("bad", [0, -1, True, 3.0])
def test_bad_prompt_limits_are_refused(bad):
    draft = make_tiny_model("llama", num_layers=1)
    with pytest.raises(InvalidArgumentError, match=re.escape(
            f"max_model_prompt_tokens={bad!r} is out of range: allowed an integer >= 1 (tokens), or None for no limit")):
        CascadeDrafter(draft, max_model_prompt_tokens=bad)


def test_long_prompt_blocks_are_prompt_lookups_at_gamma_5_even_with_adaptive_exit():
    """Adaptive exit asks for up to 12 tokens a block; over the limit the cascade proposes at most 5,
    exactly prompt lookup's blocks at γ = 5."""
    target = make_tiny_model("llama", num_layers=2)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    prompt = torch.tensor([LONG_PROMPT])
    config = GenerationConfig(max_new_tokens=40, stop_on_eos=False)
    limited = SpeculativeDecoder(target, CascadeDrafter(draft, max_model_prompt_tokens=8),
                                 draft_control=DraftControl(adaptive_exit=True)).generate(prompt, config)
    lookup = SpeculativeDecoder(target, PromptLookupDrafter()).generate(prompt, config)  # γ = 5
    assert limited.token_ids == lookup.token_ids == autoregressive(target, prompt, config)
    assert len(limited.stats.drafted_by_position) == 5  # the longest block had 5 tokens
    assert (limited.stats.num_drafted_tokens, limited.stats.num_accepted_tokens) == (
        lookup.stats.num_drafted_tokens, lookup.stats.num_accepted_tokens)


def test_a_row_that_never_drafts_costs_no_draft_forward_and_a_late_one_catches_up():
    """The draft's prefill is deferred to the row's first propose: a generation whose rounds are all plain
    steps runs no draft forward; a row joining long before its first draft (many plain steps) catches up by
    a chunked prefill and drafts what a drafter that saw the whole sequence from the start drafts."""
    target = make_tiny_model("llama", num_layers=2, seed=5)
    draft = make_tiny_model("llama", num_layers=2, seed=6)
    sampler = Sampler(GenerationConfig(), draft.config.vocab_size, "cpu")
    late, fresh = DraftModelDrafter(draft), DraftModelDrafter(draft)
    late.bind(BatchKVCache(draft, 1, 128))
    fresh.bind(BatchKVCache(draft, 1, 128))
    late.join(0, torch.tensor([LONG_PROMPT[:6]]), sampler)  # then 18 plain steps: the sequence grows
    assert late.num_forwards == 0
    fresh.join(0, torch.tensor([LONG_PROMPT[:-1]]), sampler)
    a, b = late.propose([LONG_PROMPT], [4]), fresh.propose([LONG_PROMPT], [4])
    assert a.tokens[0, : a.num_tokens[0]].tolist() == b.tokens[0, : b.num_tokens[0]].tolist()
    assert late.num_forwards == fresh.num_forwards  # the same drafting forwards (prefills not counted)
    cached = late._num_cached[0]
    late.rollback([len(LONG_PROMPT)])
    seq = LONG_PROMPT + list(range(10, 30))  # 20 tokens later (plain steps): more than CATCH_UP_TOKENS
    c = late.propose([seq], [3])
    again = DraftModelDrafter(draft)
    again.bind(BatchKVCache(draft, 1, 128))
    again.join(0, torch.tensor([seq[:-1]]), sampler)
    d = again.propose([seq], [3])
    assert cached > len(LONG_PROMPT) - 1
    assert c.tokens[0, :3].tolist() == d.tokens[0, :3].tolist()


def test_decoding_without_drafting_runs_no_draft_forward():
    """A generation that never drafts (γ capped at 0 by the engine's remaining budget of 1 token:
    max_new_tokens=1): the draft model is never run, not even its prefill; with 3 tokens it is."""
    target = make_tiny_model("llama", num_layers=2, seed=5)
    draft = make_tiny_model("llama", num_layers=2, seed=6)
    calls = []
    handle = draft.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        for n, runs in ((1, False), (3, True)):
            calls.clear()
            result = SpeculativeDecoder(target, DraftModelDrafter(draft), compile=False).generate(
                torch.tensor([LONG_PROMPT]), GenerationConfig(max_new_tokens=n, stop_on_eos=False))
            assert len(result.token_ids) == n and bool(calls) == runs
    finally:
        handle.remove()


def test_a_draft_model_with_a_shorter_context_refuses_what_it_cannot_hold():
    """The draft model's context length bounds a generation as the target's does (one row and many), except where
    the draft model never sees the prompt (the cascade's long prompts) or sees only its window."""
    from specdecode import GenerationConfig, InvalidArgumentError, SpeculativeDecoder
    from specdecode.drafters import CascadeDrafter, DraftModelDrafter
    from specdecode.engine.batched import BatchedSpeculativeDecoder

    target = make_tiny_model("llama", max_position_embeddings=512)
    draft = make_tiny_model("llama", num_layers=1, seed=1, max_position_embeddings=40)
    prompt = list(range(3, 33))  # 30 tokens
    config = GenerationConfig(max_new_tokens=12, stop_on_eos=False)
    message = r"42 positions, past the draft model's context length of 40.*at most 10"
    with pytest.raises(InvalidArgumentError, match=message):
        SpeculativeDecoder(target, DraftModelDrafter(draft)).generate(prompt, config)
    batched = BatchedSpeculativeDecoder(target, DraftModelDrafter(draft), max_batch_size=2, max_length=128)
    with pytest.raises(InvalidArgumentError, match=message):
        batched.generate([prompt], config)
    fits = GenerationConfig(max_new_tokens=10, stop_on_eos=False)
    assert len(SpeculativeDecoder(target, DraftModelDrafter(draft)).generate(prompt, fits).token_ids) == 10
    # A window of 20 prompt tokens, or a cascade whose long prompts skip the model: no limit reached.
    assert len(SpeculativeDecoder(target, DraftModelDrafter(draft, context_window=20)).generate(prompt, config)
               .token_ids) == 12
    cascade = CascadeDrafter(draft, max_model_prompt_tokens=16)
    assert len(SpeculativeDecoder(target, cascade).generate(prompt, config).token_ids) == 12
    with pytest.raises(InvalidArgumentError, match=message):
        SpeculativeDecoder(target, CascadeDrafter(draft, max_model_prompt_tokens=64)).generate(prompt, config)
