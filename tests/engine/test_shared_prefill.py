"""Shared prefills (``engine.shared_prefill``): rows admitted in one step share 2 target forwards, and the draft
model's deferred prompt prefills of rows in consecutive slots share one, with each row's tokens unchanged.

The reference is target-only decoding of each prompt alone (float32, greedy). Forwards are counted where
the module calls them.
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
    """The widths of the forwards ``shared_prefill`` runs (its shared ones, and the leading chunks alone)."""
    calls: list = []
    forward, alone = shared_prefill.batch_forward, shared_prefill.batch_prefill
    monkeypatch.setattr(shared_prefill, "batch_forward",
                        lambda model, cache, ids, *a, **k: calls.append(tuple(ids.shape)) or forward(model, cache, ids,
                                                                                                   *a, **k))
    monkeypatch.setattr(shared_prefill, "batch_prefill",
                        lambda model, cache, ids, *a, **k: calls.append(("alone", ids.shape[1])) or alone(
                            model, cache, ids, *a, **k))
    return calls


def _engine(target, drafter, shared=True, compile=False, **kwargs) -> BatchedSpeculativeDecoder:
    return BatchedSpeculativeDecoder(target, drafter, max_batch_size=3, max_length=64, num_speculative_tokens=3,
                                     prefill_chunk_tokens=8, prefill_pad_multiple=4, shared_prefill=shared,
                                     compile=compile, graphs=False, **kwargs)


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("method", ["autoregressive", "draft", "cascade"])
def test_shared_prefill_greedy_equals_autoregressive(arch, method, compile, counted):
    """Three rows join at once (two later, as slots free), of 1 to 21 prompt tokens: every row's tokens are the
    target's alone; the first three took 2 shared target forwards plus the long prompt's leading chunks alone."""
    target = make_tiny_model(arch, num_layers=3)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    drafter = {"autoregressive": None, "draft": DraftModelDrafter, "cascade": CascadeDrafter}[method]
    if drafter is not None:
        drafter = drafter(draft)
        drafter.shared_prefill = True
    configs = _configs()
    expected = _alone(target, MIXED, configs)
    dec = _engine(target, drafter, compile=compile)
    assert [r.token_ids for r in dec.generate(MIXED, configs)] == expected
    # bodies of 2, 20 and 0 tokens: 16 alone, then tails of 2, 4 and 0 padded to 4; then the 3 last tokens
    assert counted[:3] == [("alone", 16), (3, 4), (3, 1)], counted


def test_draft_prefills_of_rows_joining_together_share_a_forward(counted):
    """The draft model's deferred prompt prefills of the three first rows run as one forward (in the first
    round's catch-up); switched off, one each."""
    target = make_tiny_model("llama", num_layers=3)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    prompts, configs = [PROMPTS[0], PROMPTS[2], PROMPTS[4]], _configs()[:3]
    expected = _alone(target, prompts, configs)
    widths = {}
    for share in (True, False):
        drafter = DraftModelDrafter(draft)
        drafter.shared_prefill = share
        fed: list = []
        handle = draft.register_forward_pre_hook(lambda m, a, k: fed.append(tuple(k["input_ids"].shape)),
                                                 with_kwargs=True)
        try:
            assert [r.token_ids for r in _engine(target, drafter).generate(prompts, configs)] == expected
        finally:
            handle.remove()
        widths[share] = fed[:5]
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
    prompts = [PROMPTS[4], LONG, PROMPTS[2]]

    def engine(shared):
        drafter = DraftModelDrafter(draft) if method == "draft" else None
        return _engine(target, drafter, shared=shared)

    expected = [r.token_ids for r in engine(False).generate(prompts, config)]
    caches = [SpeculativeDecoder(target).prompt_cache(p[:m]) for p, m in zip(prompts, (4, 15, 6))]
    before = [copy.deepcopy(c) for c in caches]
    batched = engine(True)
    ids = [batched.add(p, config, prompt_cache=c) for p, c in zip(prompts, caches)]
    results = {}
    while batched.has_work:
        for event in batched.step():
            if event.result is not None:
                results[event.request_id] = event.result.token_ids
    assert [results[i] for i in ids] == expected
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
