"""Shared prefills (``engine.shared_prefill``): rows admitted in one step share 2 target forwards, and the draft
model's deferred prompt prefills of rows in consecutive slots share one, with each row's tokens unchanged.

The reference is target-only decoding of each prompt alone (float32, greedy), and for the draft model's
cache, the same engine with sharing off: greedy output does not depend on the draft cache, so its accepted
and drafted counts must agree too. Forwards are counted where the module calls them.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from conftest import make_tiny_model
from helpers import perturbed_copy
from specdecode import GenerationConfig, SpeculativeDecoder
from specdecode.drafters import CascadeDrafter, DraftModelDrafter
from specdecode.drafters.draft_head import DraftHead
from specdecode.engine import shared_prefill
from specdecode.engine.batched import BatchedSpeculativeDecoder
from specdecode.engine.shared_prefill import check_shared_prefill, consecutive_runs
from specdecode.errors import InvalidArgumentError
from test_batched_fast_path import PROMPTS, _alone, _configs

#: Prompts of 1 to 21 tokens: with chunks of 8, the longest ones prefill whole chunks alone first.
LONG = list(range(3, 24))
MIXED = [PROMPTS[0], LONG, PROMPTS[3], PROMPTS[2], PROMPTS[4]]


@pytest.fixture
def counted(monkeypatch) -> list:
    """The (rows, width) of each forward ``shared_prefill`` runs (the shared ones and the leading chunks alone)."""
    calls: list = []
    forward = shared_prefill.batch_forward
    monkeypatch.setattr(shared_prefill, "batch_forward",
                        lambda model, cache, ids, *a, **k: calls.append(tuple(ids.shape)) or forward(model, cache, ids,
                                                                                                   *a, **k))
    return calls


def _engine(target, drafter, shared=True, compile=False, **kwargs) -> BatchedSpeculativeDecoder:
    options = dict(max_batch_size=3, max_length=64, prefill_chunk_tokens=8, prefill_pad_multiple=4) | kwargs
    return BatchedSpeculativeDecoder(target, drafter, num_speculative_tokens=3, shared_prefill=shared, compile=compile,
                                     graphs=False, **options)


def _results(engine: BatchedSpeculativeDecoder, ids: list[int]) -> list:
    """Step ``engine`` until it is idle: each request's (tokens, finish reason), in the order of ``ids``."""
    results = {}
    while engine.has_work:
        for event in engine.step():
            if event.result is not None:
                results[event.request_id] = (event.result.token_ids, event.result.finish_reason)
    return [results[i] for i in ids]


def _counts(engine: BatchedSpeculativeDecoder) -> tuple[int, int]:
    return engine.stats.num_accepted_tokens, engine.stats.num_drafted_tokens


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("method", ["autoregressive", "draft", "cascade"])
def test_shared_prefill_greedy_equals_autoregressive(arch, method, compile, counted):
    """Three rows join at once (two later, as slots free), of 1 to 21 prompt tokens: every row's tokens are the
    target's alone; the first three took 2 shared target forwards plus the long prompt's leading chunks alone."""
    target = make_tiny_model(arch, num_layers=3)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    make = {"autoregressive": lambda: None, "draft": lambda: DraftModelDrafter(draft),
            "cascade": lambda: CascadeDrafter(draft)}[method]
    configs = _configs()
    expected = _alone(target, MIXED, configs)
    dec = _engine(target, make(), compile=compile)
    assert [r.token_ids for r in dec.generate(MIXED, configs)] == expected
    # bodies of 2, 20 and 0 tokens: 16 in two chunks alone, then tails of 2, 4 and 0 padded to 4; then the 3 last
    assert counted[:4] == [(1, 8), (1, 8), (3, 4), (3, 1)], counted
    if make() is not None:  # the draft cache: the same drafts as with sharing off
        alone = _engine(target, make(), shared=False, compile=compile)
        alone.generate(MIXED, configs)
        assert _counts(dec) == _counts(alone)


def test_draft_prefills_of_rows_joining_together_share_a_forward(counted):
    """The draft model's deferred prompt prefills of the three first rows run as one forward (in the first
    round's catch-up); switched off, one each."""
    target = make_tiny_model("llama", num_layers=3)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    prompts, configs = [PROMPTS[0], PROMPTS[2], PROMPTS[4]], _configs()[:3]
    expected = _alone(target, prompts, configs)
    widths, counts = {}, {}
    for share in (True, False):
        drafter = DraftModelDrafter(draft)
        fed: list = []
        handle = draft.register_forward_pre_hook(lambda m, a, k: fed.append(tuple(k["input_ids"].shape)),
                                                 with_kwargs=True)
        try:
            engine = _engine(target, drafter, shared=share)
            assert drafter.shared_prefill is share  # the engine's setting
            assert [r.token_ids for r in engine.generate(prompts, configs)] == expected
        finally:
            handle.remove()
        widths[share], counts[share] = fed[:5], _counts(engine)
    assert counts[True] == counts[False]
    # The draft caches each prompt and its first token but the last token: 3, 7 and 10 tokens. Shared: the 10's
    # first chunk (8) alone, then tails of 3, 7 and 2 in one forward padded to 8. Alone: 4, 8, then 8 + 4.
    assert widths[True][:3] == [(1, 8), (3, 8), (3, 1)], widths
    assert widths[False][:5] == [(1, 4), (1, 8), (1, 8), (1, 4), (3, 1)], widths


@pytest.mark.parametrize("method", ["autoregressive", "draft"])
def test_shared_prefill_with_prompt_caches(method):
    """Rows joining together with prompt caches (``BatchKVCache.load_prefix``) give the tokens they give without,
    and the caches are left as they were."""
    target = make_tiny_model("qwen2", num_layers=3)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    config = GenerationConfig(max_new_tokens=12, num_speculative_tokens=3, stop_on_eos=False)
    prompts = [PROMPTS[4], LONG, PROMPTS[2], LONG]

    def engine(shared):
        drafter = DraftModelDrafter(draft) if method == "draft" else None
        return _engine(target, drafter, shared=shared, max_batch_size=4)

    expected = [r.token_ids for r in engine(False).generate(prompts, config)]
    # The second LONG keeps 3 of its 21 tokens: 17 of its body to write, a leading chunk of 16 from position 3.
    caches = [SpeculativeDecoder(target).prompt_cache(p[:m]) for p, m in zip(prompts, (4, 15, 6, 3))]
    before = [copy.deepcopy(c) for c in caches]
    batched = engine(True)
    fed: list = []
    handle = target.register_forward_pre_hook(lambda m, a, k: fed.append(tuple(k["input_ids"].shape)), with_kwargs=True)
    try:
        got = _results(batched, [batched.add(p, config, prompt_cache=c) for p, c in zip(prompts, caches)])
    finally:
        handle.remove()
    assert [tokens for tokens, _ in got] == expected
    # bodies of 5, 5, 0 and 17 tokens after their caches: 16 alone (2 chunks), then 5, 5, 0, 1 padded to 8
    assert fed[:4] == [(1, 8), (1, 8), (4, 8), (4, 1)], fed
    for got, want in zip(caches, before):
        for a, b in zip(got.layers, want.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_a_failing_shared_prefill_falls_back_to_one_row_at_a_time(monkeypatch, caplog):
    """If the shared forwards raise, a warning says so and each row is prefilled alone: the same tokens."""
    target = make_tiny_model("llama", num_layers=2)
    configs = _configs()[:3]
    expected = _alone(target, PROMPTS[:3], configs)

    def broken(*args, **kwargs):
        raise RuntimeError("deliberately broken shared prefill")

    monkeypatch.setattr(shared_prefill, "prefill_rows", broken)
    with caplog.at_level(logging.WARNING, logger="specdecode.engine.shared_prefill"):
        out = _engine(target, None).generate(PROMPTS[:3], configs)
    assert [r.token_ids for r in out] == expected
    assert "the shared prefill of 3 requests failed (RuntimeError: deliberately broken shared prefill)" in caplog.text


def test_a_row_whose_logits_are_not_finite_fails_alone_and_the_next_rows_are_prefilled_again():
    """The second of three rows gets NaN logits in the shared forward: it ends with "error", the rows after
    it (no longer in their planned slots) are prefilled alone, and every other row gives its tokens."""
    target = make_tiny_model("llama", num_layers=2)
    configs = _configs()[:3]
    prompts = [PROMPTS[0], [45, 46, 47], PROMPTS[2]]
    expected = _alone(target, [prompts[0], prompts[2]], [configs[0], configs[2]])

    def poison(module, args, kwargs, output):
        ids = kwargs["input_ids"]
        if ids.shape[0] == 3 and ids.shape[1] == 1:  # the shared last-token forward: row 1 is NaN
            output.logits[1] = float("nan")
        return output

    handle = target.register_forward_hook(poison, with_kwargs=True)
    try:
        out = _engine(target, None).generate(prompts, configs)
    finally:
        handle.remove()
    assert out[1].finish_reason == "error" and out[1].token_ids == []
    assert [out[0].token_ids, out[2].token_ids] == expected


def test_options_are_checked_and_default_to_cuda_only():
    target = make_tiny_model("llama", num_layers=2)
    assert BatchedSpeculativeDecoder(target, max_batch_size=2).shared_prefill is False  # CPU: off
    assert check_shared_prefill(None, "cuda") is True and check_shared_prefill(None, "cpu") is False
    with pytest.raises(InvalidArgumentError, match=r"shared_prefill must be True, False or None .* got 'yes'"):
        BatchedSpeculativeDecoder(target, shared_prefill="yes")
    assert consecutive_runs([0, 1, 3, 4, 5, 7]) == [[0, 1], [3, 4, 5], [7]] and consecutive_runs([]) == []


@pytest.mark.parametrize("cls", [DraftModelDrafter, CascadeDrafter])
@pytest.mark.parametrize("truncated", [False, True])
def test_the_draft_cache_is_the_one_filled_alone_sliding_window_and_truncated_head(cls, truncated):
    """On a sliding-window model (gemma2), with a full or truncated draft head (FR-Spec): sharing on and off give
    the same tokens and the same accepted and drafted counts."""
    target = make_tiny_model("gemma2", num_layers=3)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    out = {}
    for share in (False, True):
        drafter = cls(draft, head=DraftHead.truncated(list(range(40)))) if truncated else cls(draft)
        dec = _engine(target, drafter, shared=share)
        out[share] = ([r.token_ids for r in dec.generate(MIXED, _configs())], _counts(dec))
    assert out[True] == out[False]


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_rows_joining_beside_a_running_one_share_from_its_slot_on(arch, compile, counted):
    """One request runs; three join together into slots 1..3 (the shared forwards start at slot 1): the same
    tokens and counts as with sharing off."""
    target = make_tiny_model(arch, num_layers=3)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    config = GenerationConfig(max_new_tokens=15, stop_on_eos=False)
    out = {}
    for share in (False, True):
        dec = _engine(target, DraftModelDrafter(draft), shared=share, compile=compile, max_batch_size=4)
        ids = [dec.add(PROMPTS[2], config)]
        dec.step()
        dec.step()
        ids += [dec.add(p, config) for p in (LONG, PROMPTS[3], PROMPTS[4])]
        out[share] = (_results(dec, ids), _counts(dec))
    assert out[True] == out[False]
    assert (3, 1) in counted  # the three last prompt tokens in one forward


@pytest.mark.parametrize("method", ["autoregressive", "draft"])
def test_rows_that_fit_alone_but_not_under_one_width_are_cut_into_runs(method, counted, caplog):
    """A row deep into its prompt (its last chunk from position 32 of a 41-position cache) beside one with a
    16-token chunk: no shared forward of width 16 fits from position 32, so they take one each; no warning,
    the same tokens."""
    target = make_tiny_model("llama", num_layers=3)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    config = GenerationConfig(max_new_tokens=3, num_speculative_tokens=3, stop_on_eos=False)
    prompts = [[(7 * i) % 47 for i in range(34)], [(5 * i + 1) % 47 for i in range(17)]]
    out = {}
    for share in (False, True):
        drafter = DraftModelDrafter(draft) if method == "draft" else None
        dec = _engine(target, drafter, shared=share, max_length=41, prefill_chunk_tokens=16)
        with caplog.at_level(logging.WARNING, logger="specdecode.engine.shared_prefill"):
            out[share] = _results(dec, [dec.add(p, config) for p in prompts])
    assert out[True] == out[False] and all(reason == "length" for _, reason in out[True])
    assert "failed" not in caplog.text
    # bodies of 33 (32 alone, then 1 padded to 4 from position 32) and 16: two runs, then the 2 last tokens
    assert counted[:5] == [(1, 16), (1, 16), (1, 4), (1, 16), (2, 1)], counted


def _slot_keys(cache, slot: int, n: int) -> list[torch.Tensor]:
    return [layer.keys[slot, :, :n].clone() for layer in cache.layers]


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_the_caches_hold_what_prefilling_alone_writes(arch):
    """After admission, each row's target cache holds at its prompt positions what the per-row prefill writes
    (prompt caches, a leading chunk after one, a 1-token prompt); after the first round, each row's draft
    cache holds the same keys at the positions its deferred prefill wrote."""
    target = make_tiny_model(arch, num_layers=3)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    config = GenerationConfig(max_new_tokens=12, num_speculative_tokens=3, stop_on_eos=False)
    prompts = [PROMPTS[4], LONG, PROMPTS[3], LONG]
    keys = {}
    for share in (False, True):
        caches = [SpeculativeDecoder(target).prompt_cache(p[:m]) if m else None
                  for p, m in zip(prompts, (4, 15, 0, 3))]
        dec = _engine(target, DraftModelDrafter(draft), shared=share, max_batch_size=4)
        for p, c in zip(prompts, caches):
            dec.add(p, config, prompt_cache=c)
        dec.step(decode=False)
        keys[share] = [_slot_keys(dec.cache, s, len(p)) for s, p in enumerate(prompts)]
        dec.step()  # the first round: the draft's deferred prefills (each prompt and first token but the last)
        keys[share, "draft"] = [_slot_keys(dec.drafter.cache, s, len(p)) for s, p in enumerate(prompts)]
    for name in (True, (True, "draft")):
        other = False if name is True else (False, "draft")
        for got, want in zip(keys[name], keys[other]):
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
