"""A target run outside torch in the batched round (specdecode.engine.runner_target): the target's
GGUF file in llama.cpp (``LlamaCppTargetRunner``) decoded by ``SpeculativeDecoder`` at one row.

The first tests run the engine on a stand-in for llama.cpp: a ``LlamaCppTargetRunner`` over a tiny
transformers model on a cropped ``DynamicCache`` (no llama.cpp needed). Its tokens must be the torch
target's own, through the torch engine, for target-only decoding, prompt lookup, stop strings and
banned words (float32, greedy); the engine refuses more than one row, compiling, and prompt caches;
decoders of one target share its memory and a stream that was taken over says so. The last tests run
llama.cpp itself on a float32 GGUF file of a tiny model (tests/tiny_gguf.py): greedy decoding through
the engine gives llama.cpp's own greedy tokens (``Llama.generate``), target-only and with prompt lookup.
"""

from __future__ import annotations

import dataclasses

import pytest

from conftest import make_tiny_model, make_tiny_tokenizer
from runner_target_helpers import PROMPT, TorchBackedModel, llama_cpp_greedy
from specdecode import GenerationConfig, PromptLookupDrafter, SpeculativeDecoder
from specdecode.engine.batched import BatchedSpeculativeDecoder
from specdecode.engine.cost_model import MEASURED_WIDTHS
from specdecode.engine.speculation_cost import SpeculationCostPolicy
from specdecode.engine.runner_target import RunnerTargetCache, is_runner_target, measured_cost_policy
from specdecode.errors import InvalidArgumentError
from specdecode.models.llama_cpp_target import LlamaCppTargetRunner


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_model("llama", num_layers=2, seed=2)


@pytest.fixture
def backed(tiny):
    return LlamaCppTargetRunner(TorchBackedModel(tiny))


def _generate(target, drafter, config, tokenizer=None):
    return SpeculativeDecoder(target, drafter, tokenizer=tokenizer, eos_token_ids=[2]).generate(PROMPT, config)


@pytest.mark.parametrize("lookup", [False, True], ids=["autoregressive", "prompt-lookup"])
def test_greedy_tokens_are_the_torch_targets(tiny, backed, lookup):
    config = GenerationConfig(max_new_tokens=40, num_speculative_tokens=3, stop_on_eos=False)
    expected = _generate(tiny, None, config)
    got = _generate(backed, PromptLookupDrafter(3) if lookup else None, config)
    assert got.token_ids == expected.token_ids and len(got.token_ids) == 40
    assert got.stats.num_target_forwards == backed.num_forwards - 1  # every forward but the prefill is a round's
    if lookup:
        assert got.stats.num_drafted_tokens > 0 and got.stats.num_target_forwards < 40


def test_logits_processors_are_the_torch_targets(tiny, backed):
    config = GenerationConfig(max_new_tokens=30, num_speculative_tokens=3, repetition_penalty=1.5,
                              frequency_penalty=0.5, logprobs=True, stop_on_eos=False)
    expected = _generate(tiny, PromptLookupDrafter(3), config)
    got = _generate(backed, PromptLookupDrafter(3), config)
    assert got.token_ids == expected.token_ids
    assert got.token_ids != _generate(tiny, None, GenerationConfig(max_new_tokens=30, stop_on_eos=False)).token_ids
    assert [lp.token_id for lp in got.logprobs] == got.token_ids
    assert [lp.logprob for lp in got.logprobs] == pytest.approx([lp.logprob for lp in expected.logprobs], abs=1e-5)


def test_sampling_is_the_torch_targets(tiny, backed):
    """The same seed gives the same tokens: the same logits, the same draws (speculative sampling)."""
    config = GenerationConfig(max_new_tokens=30, num_speculative_tokens=3, temperature=0.9, top_p=0.95, seed=7,
                              stop_on_eos=False)
    expected = _generate(tiny, PromptLookupDrafter(3), config).token_ids
    assert _generate(backed, PromptLookupDrafter(3), config).token_ids == expected
    assert _generate(backed, PromptLookupDrafter(3), dataclasses.replace(config, seed=8)).token_ids != expected


def test_stop_strings_and_banned_words_are_the_torch_targets(tiny, backed):
    tok = make_tiny_tokenizer()
    free = _generate(tiny, None, GenerationConfig(max_new_tokens=30, stop_on_eos=False)).token_ids
    # a word the free output says at position >= 2 and not before, as the banned word and as the stop string
    j = next(i for i, t in enumerate(free) if i >= 2 and t >= 10 and t not in free[:i])
    word = tok.decode([free[j]])
    for extra in (dict(banned_words=(word,)), dict(stop_strings=(word,))):
        config = GenerationConfig(max_new_tokens=30, num_speculative_tokens=3, stop_on_eos=False, **extra)
        expected = _generate(tiny, PromptLookupDrafter(3), config, tok)
        got = _generate(backed, PromptLookupDrafter(3), config, tok)
        assert got.token_ids == expected.token_ids and got.finish_reason == expected.finish_reason
        if "stop_strings" in extra:
            assert got.token_ids == free[: j + 1] and got.finish_reason == "stop_string"
        else:
            assert got.token_ids[:j] == free[:j] and free[j] not in got.token_ids[j: j + 1]
            assert word not in got.text.split()


def test_one_row_only_and_no_compiling_or_prompt_cache(backed):
    assert is_runner_target(backed) and not is_runner_target(make_tiny_model("llama", num_layers=1))
    with pytest.raises(InvalidArgumentError, match=r"llama.cpp's target runs one sequence at a time \(one llama.cpp "
                                                   r"context; .*\): use max_batch_size=1, got max_batch_size=2"):
        BatchedSpeculativeDecoder(backed, None, max_batch_size=2, max_length=64)
    with pytest.raises(InvalidArgumentError, match="compile=True compiles torch forwards, but the target model runs "
                                                   "in llama.cpp"):
        BatchedSpeculativeDecoder(backed, None, max_batch_size=1, max_length=64, compile=True)
    with pytest.raises(InvalidArgumentError, match="compile=True compiles torch forwards"):
        SpeculativeDecoder(backed, compile=True)
    with pytest.raises(InvalidArgumentError, match=r"shared_prefill=True shares torch forwards, but the target model "
                                                   r"runs in llama.cpp \(one sequence\)"):
        BatchedSpeculativeDecoder(backed, None, max_batch_size=1, max_length=64, shared_prefill=True)
    assert BatchedSpeculativeDecoder(backed, None, max_batch_size=1, max_length=64, shared_prefill=None).shared_prefill \
        is False
    decoder = SpeculativeDecoder(backed)
    with pytest.raises(InvalidArgumentError, match="a prompt cache holds a torch model's keys and values"):
        decoder.prompt_cache(PROMPT[:4])
    engine = BatchedSpeculativeDecoder(backed, None, max_batch_size=1, max_length=64)
    assert isinstance(engine.cache, RunnerTargetCache) and engine.vocab_size == backed.vocab_size
    assert (engine.cache.num_slots, engine.cache.capacity, engine.cache.fast, engine.cache.owner) == (1, 64, None, backed)
    assert engine.warm_up() >= 0 and backed.num_forwards == 0  # nothing to warm up in llama.cpp
    with pytest.raises(InvalidArgumentError, match=r"the prompt has 15 tokens and max_new_tokens is 500: 515 "
                                                   r"positions, past the model's context length of 512"):
        decoder.generate(PROMPT, GenerationConfig(max_new_tokens=500))


def test_decoders_of_one_target_share_its_memory(backed):
    config = GenerationConfig(max_new_tokens=8, stop_on_eos=False)
    first, second = SpeculativeDecoder(backed), SpeculativeDecoder(backed, PromptLookupDrafter(3))
    expected = first.generate(PROMPT, config).token_ids
    stream = iter(first.stream(PROMPT, config))
    assert next(stream) == expected[:1]
    assert second.generate(PROMPT, config).token_ids == expected  # takes the target's memory over
    with pytest.raises(InvalidArgumentError, match="this generation was taken over by a newer one"):
        list(stream)
    assert first._engine.cache is second._engine.cache  # one RunnerTargetCache for the target


def test_measuring_the_costs_takes_a_stream_over(backed):
    stream = iter(SpeculativeDecoder(backed).stream(PROMPT, GenerationConfig(max_new_tokens=8, stop_on_eos=False)))
    next(stream)
    measured_cost_policy(backed, context_tokens=20)
    with pytest.raises(InvalidArgumentError, match="this generation was taken over by a newer one"):
        list(stream)


def test_the_cost_policy_comes_from_measured_costs(backed):
    policy = measured_cost_policy(backed, max_tokens=5, context_tokens=20)
    assert isinstance(policy, SpeculationCostPolicy) and list(backed.forward_costs) == list(MEASURED_WIDTHS)
    assert policy.max_size == 5 and policy.draft_node_s == 0.0 and policy.controller(8).max_tokens == 5
    costs = dict(backed.forward_costs)
    assert measured_cost_policy(backed).target_costs.seconds == costs  # measured once
    config = GenerationConfig(max_new_tokens=24, num_speculative_tokens=5, stop_on_eos=False)
    expected = _generate(backed, None, config).token_ids
    got = SpeculativeDecoder(backed, PromptLookupDrafter(3), draft_control=policy).generate(PROMPT, config)
    assert got.token_ids == expected


# ---------------------------------------------------------------------------------------------
# llama.cpp on a tiny float32 GGUF file


@pytest.fixture
def llama_target(tiny_gguf):
    from specdecode.models.llama_cpp import LlamaCppModel

    model = LlamaCppModel(tiny_gguf, n_threads=1, role="target model", kv_cache_type="f32")
    yield LlamaCppTargetRunner(model)
    model.close()


@pytest.mark.parametrize("lookup", [False, True], ids=["autoregressive", "prompt-lookup"])
def test_greedy_decoding_is_llama_cpps_own(llama_target, tiny_gguf, lookup):
    n = 40
    reference = llama_cpp_greedy(tiny_gguf, PROMPT, n)
    config = GenerationConfig(max_new_tokens=n, num_speculative_tokens=3, stop_on_eos=False)
    result = SpeculativeDecoder(llama_target, PromptLookupDrafter(3) if lookup else None).generate(PROMPT, config)
    assert result.token_ids == reference
    assert llama_target.context_length == 512  # the GGUF file's (the tiny model's max_position_embeddings)
    if lookup:  # drafts were verified, some accepted, some rejected and rolled back
        stats = result.stats
        assert 0 < stats.num_accepted_tokens < stats.num_drafted_tokens and stats.num_target_forwards < n


def test_the_round_runs_torch_on_one_thread_around_a_llama_cpp_target_and_restores_it(tiny):
    """Torch's OpenMP pool and llama.cpp's contend for the cores between forwards
    (``runner_target.torch_threads``): the engine's torch work runs at 1 thread and the caller's
    setting is back afterwards, also when the round raises."""
    import torch

    seen = []

    class Recording(TorchBackedModel):
        def decode(self, ids, first_position, logits_to_keep):
            seen.append(torch.get_num_threads())
            if len(seen) == 6 and self.fail:
                raise RuntimeError("llama_decode failed")
            return super().decode(ids, first_position, logits_to_keep)

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = Recording(tiny)
        model.fail = False
        config = GenerationConfig(max_new_tokens=8, stop_on_eos=False)
        got = _generate(LlamaCppTargetRunner(model), None, config)
        assert len(got.token_ids) == 8 and seen and set(seen) == {1}
        assert torch.get_num_threads() == 2
        seen.clear()
        model.fail = True
        with pytest.raises(RuntimeError, match="llama_decode failed"):
            _generate(LlamaCppTargetRunner(model), None, config)
        assert torch.get_num_threads() == 2
        torch_target = _generate(tiny, None, config)  # a torch target keeps the caller's threads
        assert torch_target.token_ids == got.token_ids and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
