"""What the batched engine gained so that ``SpeculativeDecoder`` runs it with one row: the prompt
cache (copied into a row's slot, only the rest of the prompt prefilled), a one-sequence drafter
behind a one-sequence runner at B = 1 (the llama.cpp draft's form) that refuses more
rows, and γ per generation."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import make_tiny_model
from helpers import perturbed_copy
from runner_target_helpers import TorchBackedModel
from specdecode import CascadeDrafter, DraftModelDrafter, GenerationConfig, PromptLookupDrafter, SpeculativeDecoder
from specdecode.models.llama_cpp_target import LlamaCppTargetRunner
from specdecode.engine.batched import BatchedSpeculativeDecoder
from specdecode.errors import InvalidArgumentError

PROMPTS = [[5, 9, 12, 30, 41, 8, 11, 19, 7, 3], [13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]]


def _fed_widths(model) -> tuple[list[int], object]:
    """Records the token count of every forward of ``model``."""
    widths: list[int] = []

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        widths.append(int(ids.shape[1]))

    return widths, model.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("method", ["autoregressive", "draft"])
def test_batched_prompt_cache_prefills_only_the_rest(arch, method):
    """Rows joining with a prompt cache give the tokens they give without (float32, greedy), the
    target prefills only the uncached tokens, and the cache is left as it was."""
    target = make_tiny_model(arch, num_layers=3)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    config = GenerationConfig(max_new_tokens=12, num_speculative_tokens=3, stop_on_eos=False)

    def engine():
        drafter = DraftModelDrafter(draft) if method == "draft" else None
        return BatchedSpeculativeDecoder(target, drafter, max_batch_size=2, max_length=64, num_speculative_tokens=3,
                                         prefill_pad_multiple=1)

    expected = [r.token_ids for r in engine().generate(PROMPTS, config)]
    dec = SpeculativeDecoder(target)
    caches = [dec.prompt_cache(p[:m]) for p, m in zip(PROMPTS, (4, 7))]
    before = [copy.deepcopy(c) for c in caches]
    batched = engine()
    widths, handle = _fed_widths(target)
    try:
        ids = [batched.add(p, config, prompt_cache=c) for p, c in zip(PROMPTS, caches)]
        results = {}
        while batched.has_work:
            for event in batched.step():
                if event.result is not None:
                    results[event.request_id] = event.result.token_ids
    finally:
        handle.remove()
    assert [results[i] for i in ids] == expected
    window = getattr(target.config, "sliding_window", None)
    if window is None:  # a trimmed sliding layer cannot be copied: then the whole prompt is prefilled
        assert widths[:2] == [len(PROMPTS[0]) - 4, len(PROMPTS[1]) - 7]
    for got, want in zip(caches, before):
        for a, b in zip(got.layers, want.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_batched_prompt_cache_must_leave_a_token():
    target = make_tiny_model("llama", num_layers=2)
    cache = SpeculativeDecoder(target).prompt_cache(PROMPTS[0])
    engine = BatchedSpeculativeDecoder(target, max_batch_size=1, max_length=64)
    with pytest.raises(InvalidArgumentError, match="prompt_cache holds 10 tokens; it must hold 1..9 of the 10"):
        engine.add(PROMPTS[0], GenerationConfig(max_new_tokens=4), prompt_cache=cache)
    assert not engine.has_work


def _sequence_runner(model) -> tuple[LlamaCppTargetRunner, list[int]]:
    """The llama.cpp runner over a stand-in that runs ``model`` in torch; returns it and the positions
    of every rollback it made (``remove_from``)."""
    backed = TorchBackedModel(model, role="draft model")
    rollbacks: list[int] = []
    remove_from = backed.remove_from
    backed.remove_from = lambda position: rollbacks.append(position) or remove_from(position)
    return LlamaCppTargetRunner(backed, name="stand-in draft"), rollbacks


def test_a_one_sequence_draft_refuses_more_rows():
    target = make_tiny_model("llama", num_layers=2)
    drafter = DraftModelDrafter(runner=_sequence_runner(perturbed_copy(target, 0.3))[0],
                                one_sequence_reason="llama.cpp's draft runs one sequence")
    with pytest.raises(InvalidArgumentError, match="max_batch_size is 4, but llama.cpp's draft runs one sequence"):
        BatchedSpeculativeDecoder(target, drafter, max_batch_size=4, max_length=64)


@pytest.mark.parametrize("cls", [DraftModelDrafter, CascadeDrafter])
def test_a_one_sequence_draft_in_the_round(cls):
    """A draft model behind a one-sequence runner (the llama.cpp draft's form) gives target-only output,
    drafts the same blocks as the same model in torch, and its runner is rolled back by position."""
    target = make_tiny_model("llama", num_layers=3)
    draft = perturbed_copy(target, 0.5)
    config = GenerationConfig(max_new_tokens=20, num_speculative_tokens=4, stop_on_eos=False)
    prompt = PROMPTS[1] + PROMPTS[1][:6]
    expected = SpeculativeDecoder(target).generate(prompt, config).token_ids
    runner, rollbacks = _sequence_runner(draft)
    results = [SpeculativeDecoder(target, d).generate(prompt, config) for d in (cls(runner=runner), cls(draft))]
    assert [r.token_ids for r in results] == [expected, expected]
    assert results[0].stats.num_drafted_tokens == results[1].stats.num_drafted_tokens > 0
    assert 0 < results[0].stats.num_accepted_tokens == results[1].stats.num_accepted_tokens < results[0].stats.num_drafted_tokens
    assert any(position > 0 for position in rollbacks)  # rejected drafts rolled back by position


def test_gamma_per_generation():
    """``GenerationConfig.num_speculative_tokens`` holds per generation in ``SpeculativeDecoder``."""
    target = make_tiny_model("llama", num_layers=2)
    dec = SpeculativeDecoder(target, DraftModelDrafter(target))  # the target drafts itself: all accepted
    for gamma in (2, 5, 3):
        config = GenerationConfig(max_new_tokens=13, num_speculative_tokens=gamma, stop_on_eos=False)
        stats = dec.generate(PROMPTS[0], config).stats
        assert stats.drafted_by_position and len(stats.drafted_by_position) == gamma


def test_a_newer_generation_takes_over():
    """One sequence at a time: a stream left unfinished is cancelled by the next, and says so."""
    target = make_tiny_model("llama", num_layers=2)
    dec = SpeculativeDecoder(target)
    config = GenerationConfig(max_new_tokens=10, stop_on_eos=False)
    first = iter(dec.stream(PROMPTS[0], config))
    next(first)
    expected = SpeculativeDecoder(target).generate(PROMPTS[1], config).token_ids
    assert dec.generate(PROMPTS[1], config).token_ids == expected
    with pytest.raises(InvalidArgumentError, match="taken over by a newer one"):
        next(first)


def test_decoders_on_one_runner_keep_sharing_the_cache_after_it_grows():
    """Decoders sharing a ``ModelRunner`` share one cache (and compiled buckets), also after a
    generation outgrew it: the next decoder takes the runner's latest engine, not its own stale one
    (which gave each decoder a cache of its own: memory times the decoders, and on CUDA each
    recompiling every bucket)."""
    from specdecode.engine.fast_path import ModelRunner

    target = make_tiny_model("llama", num_layers=2)
    runner = ModelRunner(target, compile=False, name="target")
    a = SpeculativeDecoder(target, PromptLookupDrafter(), runner=runner)  # same γ: same compiled widths
    b = SpeculativeDecoder(target, PromptLookupDrafter(max_ngram=2), runner=runner)
    short, long = GenerationConfig(max_new_tokens=4), GenerationConfig(max_new_tokens=300, stop_on_eos=False)
    a.generate(PROMPTS[0], short)
    b.generate(PROMPTS[0], short)
    assert b._engine.cache is a._engine.cache
    a.generate(PROMPTS[0], long)  # outgrows the shared cache: a larger one replaces it
    b.generate(PROMPTS[0], short)
    assert b._engine.cache is a._engine.cache
    assert b._engine.cache.capacity >= len(PROMPTS[0]) + 300
