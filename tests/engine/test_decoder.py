"""Greedy speculative decoding must reproduce target-only greedy decoding exactly (float32)."""

from __future__ import annotations

import pytest
import torch

from conftest import VOCAB, make_tiny_model, make_tiny_tokenizer
from helpers import CorruptingDrafter, ScriptedDrafter, perturbed_copy
from specdecode import DraftModelDrafter, GenerationConfig, InvalidArgumentError, SpeculativeDecoder
from specdecode.engine.kv_cache import new_cache

EOS = 2


def _prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_greedy_equals_autoregressive(arch, gamma):
    target = make_tiny_model(arch, num_layers=3)
    drafts = {
        "close": perturbed_copy(target, noise=0.3, seed=1),  # high, partial acceptance
        "unrelated": make_tiny_model(arch, num_layers=1, seed=7),  # near-zero acceptance
    }
    checked_partial = False
    for seed, length in [(0, 1), (1, 5), (2, 13), (3, 29)]:
        prompt = _prompt(length, seed)
        config = GenerationConfig(max_new_tokens=24, num_speculative_tokens=gamma, stop_on_eos=False)
        expected = SpeculativeDecoder(target).generate(prompt, config).token_ids
        assert len(expected) == 24
        for name, draft in drafts.items():
            result = SpeculativeDecoder(target, DraftModelDrafter(draft)).generate(prompt, config)
            assert result.token_ids == expected, (arch, gamma, seed, name)
            rate = result.stats.acceptance_rate
            checked_partial |= name == "close" and rate is not None and 0 < rate < 1
    assert checked_partial, "the perturbed draft should be accepted sometimes but not always"


def test_self_draft_accepts_everything():
    target = make_tiny_model("llama")
    config = GenerationConfig(max_new_tokens=20, num_speculative_tokens=4, stop_on_eos=False)
    result = SpeculativeDecoder(target, DraftModelDrafter(target)).generate(_prompt(6, 0), config)
    stats = result.stats
    assert stats.acceptance_rate == 1.0
    # 1 token from the prefill, then 5 per forward (4 drafted + bonus), the last forward cut to the budget.
    assert stats.num_target_forwards == 4
    assert stats.mean_accepted_tokens == pytest.approx(19 / 4)
    assert stats.drafted_by_position == [4, 4, 4, 3]
    assert stats.accepted_by_position == [4, 4, 4, 3]


def test_budget_ends_mid_acceptance():
    """max_new_tokens falls inside a fully accepted block: output is cut, not overrun."""
    target = make_tiny_model("qwen2")
    for budget in range(1, 12):
        config = GenerationConfig(max_new_tokens=budget, num_speculative_tokens=5, stop_on_eos=False)
        expected = SpeculativeDecoder(target).generate(_prompt(4, 1), config).token_ids
        got = SpeculativeDecoder(target, DraftModelDrafter(target)).generate(_prompt(4, 1), config)
        assert got.token_ids == expected and len(expected) == budget
        assert got.finish_reason == "length"


def _target_with_eos_at(arch: str, eos_step: int, prompt: torch.Tensor):
    """The tiny target, and the position of its first greedy EOS when the EOS logit is boosted."""
    target = make_tiny_model(arch)
    free = SpeculativeDecoder(target).generate(
        prompt, GenerationConfig(max_new_tokens=eos_step + 1, stop_on_eos=False)
    ).token_ids
    # Make the token greedily produced at `eos_step` the EOS token by swapping LM-head rows.
    head = target.get_output_embeddings().weight
    with torch.no_grad():
        row = free[eos_step]
        head[[row, EOS]] = head[[EOS, row]]
    return target


def test_eos_inside_draft_block():
    prompt = _prompt(5, 3)
    target = _target_with_eos_at("llama", 6, prompt)
    config = GenerationConfig(max_new_tokens=30, num_speculative_tokens=8)
    expected = SpeculativeDecoder(target, eos_token_ids=[EOS]).generate(prompt, config)
    assert expected.finish_reason == "eos" and expected.token_ids[-1] == EOS
    # The self-draft proposes EOS in the middle of an 8-token block and keeps drafting after it.
    got = SpeculativeDecoder(target, DraftModelDrafter(target), eos_token_ids=[EOS]).generate(prompt, config)
    assert got.token_ids == expected.token_ids
    assert got.finish_reason == "eos"
    # Same when EOS is the bonus / replacement token rather than an accepted draft token.
    wrong = [t % 40 + 3 for t in expected.token_ids]  # every drafted token rejected
    got = SpeculativeDecoder(target, ScriptedDrafter(wrong), eos_token_ids=[EOS]).generate(prompt, config)
    assert got.token_ids == expected.token_ids


def test_scripted_rejections_roll_back(arch):
    """A drafter that is right then wrong at chosen positions: the caches must roll back exactly."""
    target = make_tiny_model(arch)
    prompt = _prompt(7, 4)
    config = GenerationConfig(max_new_tokens=30, num_speculative_tokens=4, stop_on_eos=False)
    expected = SpeculativeDecoder(target).generate(prompt, config).token_ids
    got = SpeculativeDecoder(target, CorruptingDrafter(target, period=3)).generate(prompt, config)
    assert got.token_ids == expected
    assert 0 < got.stats.acceptance_rate < 1


def test_kv_cache_after_rollback_equals_fresh_forward(arch):
    """After rejections, the round's cache (slot 0 of the one-row engine) holds, at every confirmed
    position, what a fresh forward over the confirmed tokens gives; positions past them are never read."""
    target = make_tiny_model(arch)
    prompt = _prompt(5, 5)
    config = GenerationConfig(max_new_tokens=40, num_speculative_tokens=4, stop_on_eos=False)
    drafter = CorruptingDrafter(perturbed_copy(target, 0.3), period=2)
    dec = SpeculativeDecoder(target, drafter)
    stream = dec.stream(prompt, config)
    rounds = iter(stream)
    next(rounds)  # the prefill's token
    rejections = 0
    for _ in range(8):
        new = next(rounds)
        rejections += len(new) < 5
        confirmed = stream._row.tokens[:-1]  # all tokens whose keys/values must be cached
        seq = torch.tensor([confirmed])
        fresh = new_cache(target)
        with torch.inference_mode():
            target(seq, past_key_values=fresh, use_cache=True)
        fresh.crop(0)  # trim sliding layers the same way
        length = len(confirmed)
        for got, want in zip(dec._engine.cache.layers, fresh.layers):
            kept = want.keys.shape[-2]  # a trimmed sliding layer keeps the last ones
            torch.testing.assert_close(got.keys[:1, :, length - kept : length], want.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got.values[:1, :, length - kept : length], want.values, rtol=1e-5, atol=1e-5)
        # The drafter's cache, too, holds exactly the confirmed tokens' entries, not a rejected one.
        held = drafter._num_cached[0]
        assert held <= length
        fresh_draft = new_cache(drafter.model)
        with torch.inference_mode():
            drafter.model(seq[:, :held], past_key_values=fresh_draft, use_cache=True)
        fresh_draft.crop(0)
        for got, want in zip(drafter.cache.layers, fresh_draft.layers):
            kept = want.keys.shape[-2]
            torch.testing.assert_close(got.keys[:1, :, held - kept : held], want.keys, rtol=1e-5, atol=1e-5)
    assert rejections > 0


def test_stop_strings():
    target = make_tiny_model("llama")
    tok = make_tiny_tokenizer()
    prompt = _prompt(4, 6)
    free = SpeculativeDecoder(target, tokenizer=tok).generate(
        prompt, GenerationConfig(max_new_tokens=20, stop_on_eos=False)
    )
    stop_at = 7
    stop = tok.decode(free.token_ids[stop_at - 1 : stop_at + 1])  # straddles two tokens
    assert stop not in tok.decode(free.token_ids[:stop_at])
    config = GenerationConfig(max_new_tokens=20, stop_strings=(stop,), num_speculative_tokens=5, stop_on_eos=False)
    for drafter in (None, DraftModelDrafter(target)):
        got = SpeculativeDecoder(target, drafter, tokenizer=tok).generate(prompt, config)
        assert got.finish_reason == "stop_string"
        assert got.token_ids == free.token_ids[: stop_at + 1]
        assert got.text.endswith(stop)


def test_stream_yields_each_verified_block():
    target = make_tiny_model("qwen2")
    config = GenerationConfig(max_new_tokens=16, num_speculative_tokens=3, stop_on_eos=False)
    stream = SpeculativeDecoder(target, DraftModelDrafter(target)).stream(_prompt(3, 0), config)
    chunks = list(stream)
    assert chunks[0] == stream.token_ids[:1]  # the prefill's token comes out alone, first
    assert all(len(c) == 4 for c in chunks[1:-1])  # 3 accepted + bonus per forward
    assert sum(chunks, []) == stream.token_ids and len(stream.token_ids) == 16
    with pytest.raises(RuntimeError, match="only once"):
        iter(stream)


def test_empty_prompt_and_bad_shape_raise():
    dec = SpeculativeDecoder(make_tiny_model("llama"))
    with pytest.raises(InvalidArgumentError, match="prompt is empty"):
        dec.generate([])
    with pytest.raises(InvalidArgumentError, match=r"shape \(1, n\)"):
        dec.generate(torch.ones(2, 3, dtype=torch.long))


def test_prompt_cache_gives_the_same_output(arch):
    """A prefix encoded once and copied into each generation changes nothing (float32), past the sliding window."""
    import copy

    from specdecode.drafters.layer_skip import LayerSkipDrafter, SkipSet

    target = make_tiny_model(arch, num_layers=3)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    config = GenerationConfig(max_new_tokens=16, num_speculative_tokens=3, stop_on_eos=False)
    prompt = _prompt(13, 5)  # longer than the tiny models' sliding window (6)
    for drafter in (None, DraftModelDrafter(draft), LayerSkipDrafter(target, SkipSet(attn=(1,), mlp=(1, 2)))):
        dec = SpeculativeDecoder(target, drafter)
        expected = dec.generate(prompt, config)
        for m in (1, 6, 12):
            cache = dec.prompt_cache(prompt[:, :m])
            assert cache.get_seq_length() == m
            result = dec.generate(prompt, config, prompt_cache=copy.deepcopy(cache))
            assert result.token_ids == expected.token_ids, (arch, type(drafter).__name__, m)
            assert result.stats.num_target_forwards == expected.stats.num_target_forwards
            assert cache.get_seq_length() == m, "the copied-from cache must be left alone"


def test_prompt_cache_must_leave_a_token_to_encode():
    dec = SpeculativeDecoder(make_tiny_model("llama"))
    prompt = _prompt(5, 0)
    with pytest.raises(InvalidArgumentError, match=r"holds 5 tokens; it must hold 1..4 of the 5"):
        dec.generate(prompt, prompt_cache=dec.prompt_cache(prompt))
    with pytest.raises(InvalidArgumentError, match=r"prefix_ids must have shape \(1, m\) with m >= 1"):
        dec.prompt_cache([])
