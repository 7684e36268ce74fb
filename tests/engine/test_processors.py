"""Penalties, logit_bias, min_p, stop_token_ids and logprobs (``engine.processors``), exact under
speculation: greedy output (float32) equals autoregressive decoding with transformers' own
processors, for the draft model, the cascade and prompt lookup, alone and batched; logprobs
equal the autoregressive ones; bad values are refused with the value and range."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from conftest import VOCAB, make_tiny_model
from helpers import perturbed_copy
from selfspec_helpers import REPETITIVE, one_thread  # noqa: F401 (a fixture)
from specdecode import GenerationConfig, SpeculativeDecoder
from specdecode.drafters import CascadeDrafter, DraftModelDrafter, PromptLookupDrafter
from specdecode.drafters import DraftModelDrafter, PromptLookupDrafter
from specdecode.drafters import CascadeDrafter
from specdecode.engine.batched import BatchedSpeculativeDecoder
from specdecode.engine.processors import LogitsProcessing
from specdecode.errors import InvalidArgumentError

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [REPETITIVE, [7, 3, 30, 7, 3, 30, 8], [44, 12]]
#: One config per processor, and all of them together.
PROCESSORS = {
    "repetition": dict(repetition_penalty=1.6),
    "frequency": dict(frequency_penalty=1.5),
    "presence": dict(presence_penalty=2.0),
    "bias": dict(logit_bias={9: 6.0, 12: -100.0, 20: 3.5}),
    "all": dict(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.5, logit_bias={7: 4.0}),
}


def reference(model, prompt: list[int], config: GenerationConfig) -> tuple[list[int], list[float]]:
    """Autoregressive greedy decoding without a cache, with transformers' processors for the
    repetition penalty and the bias, and OpenAI's frequency / presence penalties written out:
    (tokens, logprob of each token)."""
    procs = LogitsProcessorList()
    if config.logit_bias:
        procs.append(SequenceBiasLogitsProcessor({(t,): b for t, b in config.logit_bias}))
    if config.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(config.repetition_penalty))
    ids, out, logprobs = list(prompt), [], []
    stop = set(config.stop_token_ids) | ({2} if config.stop_on_eos else set())
    with torch.inference_mode():
        while len(out) < config.max_new_tokens:
            logits = model(torch.tensor([ids])).logits[:, -1].float()
            scores = procs(torch.tensor([ids]), logits)
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=VOCAB).float()
            scores = scores - counts * config.frequency_penalty - (counts > 0).float() * config.presence_penalty
            token = int(scores.argmax())
            logprobs.append(float(torch.log_softmax(scores, -1)[0, token]))
            ids.append(token)
            out.append(token)
            if token in stop:
                break
    return out, logprobs


def _single(method: str, draft):
    if method == "draft":
        return DraftModelDrafter(draft)
    if method == "cascade":
        return CascadeDrafter(draft)
    return PromptLookupDrafter()


def _batched(method: str, draft):
    if method == "draft":
        return DraftModelDrafter(draft)
    if method == "cascade":
        return CascadeDrafter(draft)
    return PromptLookupDrafter()


@pytest.mark.parametrize("method", ["draft", "cascade", "prompt-lookup"])
def test_greedy_with_processors_equals_autoregressive(arch, method):
    """Every processor: autoregressive decoding, and speculative decoding alone and batched (three
    rows, one config per row), equal transformers' processors applied token by token."""
    target = make_tiny_model(arch, num_layers=2)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    plain = GenerationConfig(max_new_tokens=18, num_speculative_tokens=4, stop_on_eos=False)
    unprocessed = [reference(target, p, plain)[0] for p in PROMPTS]
    changed = set()
    for name, options in PROCESSORS.items():
        config = dataclasses.replace(plain, **options)
        expected = [reference(target, p, config)[0] for p in PROMPTS]
        changed |= {name for e, u in zip(expected, unprocessed) if e != u}
        ar = SpeculativeDecoder(target, compile=False)
        assert [ar.generate(p, config).token_ids for p in PROMPTS] == expected, (arch, name, "autoregressive")
        dec = SpeculativeDecoder(target, _single(method, draft), compile=False)
        got = [dec.generate(p, config).token_ids for p in PROMPTS]
        assert got == expected, (arch, method, name, "single")
        batch = BatchedSpeculativeDecoder(target, _batched(method, draft), max_batch_size=3, max_length=64,
                                          num_speculative_tokens=4, compile=False)
        got = [r.token_ids for r in batch.generate(PROMPTS, config)]
        assert got == expected, (arch, method, name, "batched")
    assert changed == set(PROCESSORS), f"processors that changed no output: {set(PROCESSORS) - changed}"


def test_rows_with_and_without_processors_share_a_batch():
    """Per-row processors: each row equals its own autoregressive output."""
    target = make_tiny_model("llama", num_layers=2)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    base = GenerationConfig(max_new_tokens=16, stop_on_eos=False)
    configs = [dataclasses.replace(base, **PROCESSORS["all"]), base, dataclasses.replace(base, **PROCESSORS["bias"])]
    expected = [reference(target, p, c)[0] for p, c in zip(PROMPTS, configs)]
    dec = BatchedSpeculativeDecoder(target, DraftModelDrafter(draft), max_batch_size=3, max_length=64,
                                    num_speculative_tokens=4, compile=False)
    assert [r.token_ids for r in dec.generate(PROMPTS, configs)] == expected


@pytest.mark.parametrize("method", ["draft", "prompt-lookup"])
def test_logprobs_equal_autoregressive(arch, method):
    target = make_tiny_model(arch, num_layers=2)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    config = GenerationConfig(max_new_tokens=14, num_speculative_tokens=4, stop_on_eos=False, logprobs=True,
                              top_logprobs=3, **PROCESSORS["all"])
    for prompt in PROMPTS:
        tokens, want = reference(target, prompt, config)
        ar = SpeculativeDecoder(target, compile=False).generate(prompt, config)
        spec = SpeculativeDecoder(target, _single(method, draft), compile=False).generate(prompt, config)
        batch = BatchedSpeculativeDecoder(target, _batched(method, draft), max_batch_size=2, max_length=64,
                                          num_speculative_tokens=4, compile=False).generate([prompt], config)[0]
        for result, how in ((ar, "autoregressive"), (spec, "single"), (batch, "batched")):
            assert result.token_ids == tokens, how
            assert [lp.token_id for lp in result.logprobs] == tokens, how
            got = torch.tensor([lp.logprob for lp in result.logprobs])
            torch.testing.assert_close(got, torch.tensor(want), rtol=0, atol=1e-4, msg=how)
            for lp in result.logprobs:  # greedy: the chosen token is the most likely one
                assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id, how
                assert lp.top[0][1] == pytest.approx(lp.logprob, abs=1e-6)
                assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
    assert SpeculativeDecoder(target, compile=False).generate(PROMPTS[0], GenerationConfig(max_new_tokens=3)).logprobs is None


def test_logprobs_of_sampled_tokens_are_the_targets():
    """Sampling: each token's logprob is the target's processed log-probability of it."""
    target = make_tiny_model("qwen2", num_layers=2)
    draft = perturbed_copy(target, noise=0.5, seed=2)
    config = GenerationConfig(max_new_tokens=12, temperature=1.0, seed=3, stop_on_eos=False, logprobs=True,
                              repetition_penalty=1.4, num_speculative_tokens=3)
    prompt = PROMPTS[1]
    result = SpeculativeDecoder(target, DraftModelDrafter(draft), compile=False).generate(prompt, config)
    procs = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.4)])
    ids = list(prompt)
    with torch.inference_mode():
        for lp in result.logprobs:
            scores = procs(torch.tensor([ids]), target(torch.tensor([ids])).logits[:, -1].float())
            assert lp.logprob == pytest.approx(float(torch.log_softmax(scores, -1)[0, lp.token_id]), abs=1e-4)
            ids.append(lp.token_id)
    assert [lp.token_id for lp in result.logprobs] == result.token_ids


def test_stop_token_ids_end_the_generation_single_and_batched():
    target = make_tiny_model("llama", num_layers=2)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    free = GenerationConfig(max_new_tokens=20, stop_on_eos=False)
    out = SpeculativeDecoder(target, compile=False).generate(PROMPTS[0], free).token_ids
    stop = out[5]
    cut = out[: out.index(stop) + 1]
    config = dataclasses.replace(free, stop_token_ids=(stop,))
    single = SpeculativeDecoder(target, DraftModelDrafter(draft), compile=False).generate(PROMPTS[0], config)
    assert (single.token_ids, single.finish_reason) == (cut, "eos")
    dec = BatchedSpeculativeDecoder(target, DraftModelDrafter(draft), max_batch_size=2, max_length=64,
                                    compile=False)
    rows = dec.generate([PROMPTS[0], PROMPTS[0]], [config, free])
    assert (rows[0].token_ids, rows[0].finish_reason) == (cut, "eos")
    assert rows[1].token_ids == out


def test_block_rows_see_the_drafted_tokens_before_them():
    """Unit check of the block: row i counts drafted[:i] (a cumulative scatter), nothing later."""
    config = GenerationConfig(frequency_penalty=1.0, presence_penalty=0.5)
    proc = LogitsProcessing(config, 6, "cpu", [1, 2])
    proc.sync([3, 3])
    scores = proc.block(torch.zeros(4, 6), torch.tensor([4, 3, 4]))
    want = torch.zeros(4, 6)
    want[:, 3] = -2.5
    want[1:, 3] = torch.tensor([-2.5, -3.5, -3.5])
    want[1:, 4] = -1.5
    want[3, 4] = -2.5
    assert torch.equal(scores, want)
    proc.sync([3])  # a rollback recounts
    assert proc.counts.tolist() == [0, 0, 0, 1, 0, 0]


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(repetition_penalty=0.0), "repetition_penalty must be a number in [0.01, 100] (1 = off), got 0.0"),
        (dict(repetition_penalty=float("nan")), "repetition_penalty must be a number in [0.01, 100]"),
        # 1e-300 made the penalized logits inf: sampling failed on NaN probabilities (a traceback, a 500)
        (dict(repetition_penalty=1e-300), "repetition_penalty must be a number in [0.01, 100] (1 = off), got 1e-300"),
        (dict(repetition_penalty=1e300), "repetition_penalty must be a number in [0.01, 100] (1 = off), got 1e+300"),
        (dict(frequency_penalty=2.5), "frequency_penalty must be a number in [-2, 2] (0 = off), got 2.5"),
        (dict(presence_penalty=-3), "presence_penalty must be a number in [-2, 2] (0 = off), got -3"),
        (dict(min_p=1.5), "min_p must be a number in [0, 1] (0 = off), got 1.5"),
        (dict(logit_bias={5: 101}), "logit_bias for token 5 must be a number in [-100, 100], got 101"),
        (dict(logit_bias={-1: 1.0}), "a logit_bias token id must be an integer >= 0, got -1"),
        (dict(logit_bias="x"), "logit_bias must map token ids to biases, got 'x'"),
        (dict(stop_token_ids=[3, -2]), "a stop token id must be an integer >= 0, got -2"),
        (dict(top_logprobs=21, logprobs=True), "top_logprobs must be an integer in 0..20, got 21"),
        (dict(top_logprobs=2), "top_logprobs=2 needs logprobs=True"),
        (dict(logprobs=1), "logprobs must be True or False, got 1"),
    ],
)
def test_bad_values_name_the_value_and_the_range(options, message):
    with pytest.raises(InvalidArgumentError) as err:
        GenerationConfig(**options)
    assert message in str(err.value)


def test_ids_outside_the_vocabulary_are_refused_at_the_start():
    target = make_tiny_model("llama", num_layers=1)
    dec = SpeculativeDecoder(target, compile=False)
    with pytest.raises(InvalidArgumentError, match=r"logit_bias names token id 48, outside .* 0\.\.47"):
        dec.generate([5, 6], GenerationConfig(logit_bias={48: 1.0}))
    batch = BatchedSpeculativeDecoder(target, None, max_batch_size=1, max_length=32, compile=False)
    with pytest.raises(InvalidArgumentError, match=r"stop_token_ids names token id 99"):
        batch.add([5, 6], GenerationConfig(max_new_tokens=4, stop_token_ids=[99]))
    assert not batch.has_work


class _RawDrafter(DraftModelDrafter):
    """A draft model that ignores the processors (its sampler's ``drafting`` gives None)."""

    def propose(self, sequences, max_tokens, exits=None, exit_rule="row"):
        samplers = [s for s in self._samplers[: len(sequences)] if s is not None]
        for sampler in samplers:
            sampler.drafting = lambda seq: None  # an instance attribute: this generation's samplers only
        try:
            return super().propose(sequences, max_tokens, exits, exit_rule)
        finally:
            for sampler in samplers:
                del sampler.drafting


def test_the_draft_models_q_gets_the_processors_on_its_own_context():
    """A draft equal to the target, with processors: every proposal is accepted only if the draft
    applies the same processors on its own context (drafted tokens included); single and batched."""
    target = make_tiny_model("llama", num_layers=2)
    config = GenerationConfig(max_new_tokens=20, num_speculative_tokens=4, stop_on_eos=False, **PROCESSORS["all"])
    for prompt in PROMPTS:
        result = SpeculativeDecoder(target, DraftModelDrafter(target), compile=False).generate(prompt, config)
        assert result.stats.num_accepted_tokens == result.stats.num_drafted_tokens > 0
        batch = BatchedSpeculativeDecoder(target, DraftModelDrafter(target), max_batch_size=1, max_length=64,
                                          num_speculative_tokens=4, compile=False)
        assert batch.generate([prompt], config)[0].token_ids == result.token_ids
        assert batch.stats.num_accepted_tokens == batch.stats.num_drafted_tokens > 0
        cascade = BatchedSpeculativeDecoder(target, CascadeDrafter(target, ngram_check=False), max_batch_size=1,
                                            max_length=64, num_speculative_tokens=4, compile=False)
        assert cascade.generate([prompt], config)[0].token_ids == result.token_ids
    # Negative control: a draft that ignores the processors gets rejections.
    stats = SpeculativeDecoder(target, _RawDrafter(target), compile=False).generate(PROMPTS[0], config).stats
    assert stats.num_accepted_tokens < stats.num_drafted_tokens


@pytest.mark.parametrize("method", ["autoregressive", "draft", "prompt-lookup"])
def test_processors_add_no_host_sync_to_a_round(method):
    """On the fast path's host logic (static cache, eager forwards), a greedy round with every
    processor still reads the device once (``test_host_syncs``'s counter and bound)."""
    from test_host_syncs import SyncCounter

    from specdecode.engine.fast_path import ModelRunner

    target = make_tiny_model("llama", num_layers=2)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    target_runner = ModelRunner(target, compile=True, graphs=False, name="target")
    drafter = {
        "autoregressive": lambda: None,
        "draft": lambda: DraftModelDrafter(draft),
        "prompt-lookup": lambda: PromptLookupDrafter(),
    }[method]()
    config = GenerationConfig(max_new_tokens=30, num_speculative_tokens=4, stop_on_eos=False, **PROCESSORS["all"])
    expected = reference(target, REPETITIVE, config)[0]
    counter = SyncCounter([target, draft])
    stream = SpeculativeDecoder(target, drafter, runner=target_runner).stream(REPETITIVE, config)
    rounds = iter(stream)
    first = next(rounds)  # the prefill may sync: not a round
    with counter.counting():
        counter.active = True
        tokens = first + [t for block in rounds for t in block]
    assert tokens == expected
    assert stream.stats.num_target_forwards > 3
    assert counter.count <= stream.stats.num_target_forwards


def test_batched_fast_path_with_processors_and_logprobs():
    """The batched engine's fast path (static forwards, eager here) with per-row processors and
    logprobs: each row equals the reference."""
    target = make_tiny_model("gemma2", num_layers=2)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    base = GenerationConfig(max_new_tokens=16, stop_on_eos=False, logprobs=True)
    configs = [dataclasses.replace(base, **PROCESSORS[name]) for name in ("all", "bias", "repetition")]
    dec = BatchedSpeculativeDecoder(target, DraftModelDrafter(draft), max_batch_size=2, max_length=64,
                                    num_speculative_tokens=4, compile=True, graphs=False)
    for result, prompt, config in zip(dec.generate(PROMPTS, configs), PROMPTS, configs):
        tokens, logprobs = reference(target, prompt, config)
        assert result.token_ids == tokens
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in result.logprobs]), torch.tensor(logprobs),
                                   rtol=0, atol=1e-4)


def test_logprobs_follow_banned_word_rollbacks_and_events():
    """With banned words (rollbacks) the logprobs stay one per kept token; a batched request's
    events carry the logprobs of their own tokens."""
    from conftest import make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    target = make_tiny_model("llama", num_layers=2)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    free = GenerationConfig(max_new_tokens=16, stop_on_eos=False, logprobs=True, **PROCESSORS["repetition"])
    words = tok.decode(reference(target, PROMPTS[0], free)[0][3:5]).split()
    config = dataclasses.replace(free, banned_words=tuple(words))
    single = SpeculativeDecoder(target, DraftModelDrafter(draft), tokenizer=tok, compile=False).generate(
        PROMPTS[0], config)
    assert single.stats.num_banned_word_rollbacks > 0
    assert [lp.token_id for lp in single.logprobs] == single.token_ids
    dec = BatchedSpeculativeDecoder(target, DraftModelDrafter(draft), max_batch_size=2, max_length=64,
                                    num_speculative_tokens=4, tokenizer=tok, compile=False)
    request = dec.add(PROMPTS[0], config)
    other = dec.add(PROMPTS[1], free)
    seen: dict[int, list] = {request: [], other: []}
    results = {}
    while dec.has_work:
        for event in dec.step():
            assert [lp.token_id for lp in event.logprobs or []] == event.token_ids
            seen[event.request_id] += event.logprobs or []
            if event.result is not None:
                results[event.request_id] = event.result
    assert results[request].token_ids == single.token_ids
    for rid in (request, other):
        assert [lp.token_id for lp in seen[rid]] == results[rid].token_ids
        assert [lp.logprob for lp in seen[rid]] == [lp.logprob for lp in results[rid].logprobs]
