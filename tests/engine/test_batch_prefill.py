"""Chunked, padded prefills of the batched engine (``batch_cache.batch_prefill``), and a row's own
sampling failure ending only that row."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import make_tiny_model, make_tiny_tokenizer
from helpers import perturbed_copy
from selfspec_helpers import one_thread  # noqa: F401 (a fixture)
from specdecode import GenerationConfig, SpeculativeDecoder
from specdecode.drafters import DraftModelDrafter, PromptLookupDrafter
from specdecode.engine import verification
from specdecode.engine.batch_cache import BatchKVCache
from specdecode.engine.batched import BatchedSpeculativeDecoder
from specdecode.engine.sampling import Sampler
from specdecode.errors import INVALID_DISTRIBUTION, InvalidArgumentError, NonFiniteLogitsError

# Lengths 1 .. 23: single chunks, exact multiples of the chunk, and tails; the longer ones cross
# the sliding window (6) of the Mistral and Gemma test models.
PROMPTS = [[(7 * i + 3 * j) % 44 + 3 for j in range(n)] for i, n in enumerate((1, 5, 8, 13, 16, 23))]


def _alone(target, prompts, config) -> list[list[int]]:
    dec = SpeculativeDecoder(target)
    return [dec.generate(p, config).token_ids for p in prompts]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("chunk,multiple", [(8, 4), (4, 1), (8, 8)])
def test_chunked_padded_prefill_gives_each_row_its_tokens_alone(arch, chunk, multiple):
    """Target and draft model both prefill in chunks: greedy float32 tokens equal target-only decoding."""
    target = make_tiny_model(arch)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    config = GenerationConfig(max_new_tokens=12, stop_on_eos=False)
    expected = _alone(target, PROMPTS, config)
    for make in (lambda: None, lambda: DraftModelDrafter(draft)):
        dec = BatchedSpeculativeDecoder(
            target, make(), max_batch_size=3, max_length=48, num_speculative_tokens=3,
            prefill_chunk_tokens=chunk, prefill_pad_multiple=multiple,
        )
        assert [r.token_ids for r in dec.generate(PROMPTS, config)] == expected


@pytest.mark.usefixtures("one_thread")
def test_prefill_forwards_take_a_fixed_set_of_widths():
    """Every prompt length from 1 to 40 prefills in forwards of width 4 or 8 (chunk 8, multiple 4),
    for the target and the draft model; the default pads to multiples of 16."""
    target = make_tiny_model("llama", num_layers=2)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    widths = {"target": set(), "draft": set()}

    def record(name):
        def hook(module, args, kwargs):
            widths[name].add(kwargs["input_ids"].shape[1])
        return hook

    handles = [target.register_forward_pre_hook(record("target"), with_kwargs=True),
               draft.register_forward_pre_hook(record("draft"), with_kwargs=True)]
    config = GenerationConfig(max_new_tokens=1, stop_on_eos=False)  # the prefill's token only: no round
    # The draft's prefill waits for its first round (DraftModelDrafter._catch_up): 3 tokens, a round of a
    # 1-token draft (a width-1 draft forward, a width-2 verification), maybe a plain step.
    two = GenerationConfig(max_new_tokens=3, stop_on_eos=False)
    try:
        dec = BatchedSpeculativeDecoder(target, DraftModelDrafter(draft), max_batch_size=2, max_length=64,
                                        prefill_chunk_tokens=8, prefill_pad_multiple=4)
        dec.generate([[3 + i % 44 for i in range(n)] for n in range(1, 41)], config)
        assert widths == {"target": {4, 8}, "draft": set()}
        widths["target"].clear()
        dec.generate([[3 + i % 44 for i in range(n)] for n in range(1, 41)], two)
        assert widths["draft"] == {4, 8, 1} and widths["target"] - {1, 2} == {4, 8}
        for w in widths.values():
            w.clear()
        BatchedSpeculativeDecoder(target, max_batch_size=1, max_length=64).generate([[5] * 17, [6] * 40], config)
        assert widths["target"] == {32, 48}
    finally:
        for h in handles:
            h.remove()


@pytest.mark.usefixtures("one_thread")
def test_padding_stops_at_the_slot_capacity():
    """A prompt whose padded chunk would pass ``max_length`` pads only up to it, and decodes right."""
    target = make_tiny_model("qwen2", num_layers=2)
    prompt = [3 + 2 * i for i in range(13)]
    config = GenerationConfig(max_new_tokens=1, stop_on_eos=False)
    dec = BatchedSpeculativeDecoder(target, max_batch_size=1, max_length=15, prefill_chunk_tokens=16,
                                    prefill_pad_multiple=16)
    assert dec.generate([prompt], config)[0].token_ids == _alone(target, [prompt], config)[0]


def test_prefill_settings_are_validated():
    target = make_tiny_model("llama", num_layers=2)
    for kw, match in (
        ({"prefill_chunk_tokens": 0}, "prefill_chunk_tokens must be an integer >= 1, got 0"),
        ({"prefill_pad_multiple": True}, "prefill_pad_multiple must be an integer >= 1, got True"),
        ({"prefill_chunk_tokens": 8, "prefill_pad_multiple": 3}, r"prefill_pad_multiple \(3\) must divide"),
    ):
        with pytest.raises(InvalidArgumentError, match=match):
            BatchedSpeculativeDecoder(target, max_batch_size=1, max_length=16, **kw)
        with pytest.raises(InvalidArgumentError, match=match):
            BatchKVCache(target, 1, 16, **kw)


def _with_first_row_broken(make_drafter, target, prompts, configs, probs, **engine):
    """Run ``prompts`` alone as a reference, then again with the first request's ``sampler.probs`` replaced by
    ``probs`` after the first step (the prefills and a first round): (expected tokens, request ids, each
    request's streamed tokens, each request's last event). ``engine``: more arguments of both engines."""
    reference = BatchedSpeculativeDecoder(target, make_drafter(), max_batch_size=3, max_length=48, **engine)
    expected = [r.token_ids for r in reference.generate(prompts, configs)]
    dec = BatchedSpeculativeDecoder(target, make_drafter(), max_batch_size=3, max_length=48, **engine)
    ids = [dec.add(p, c) for p, c in zip(prompts, configs)]
    out = {i: [] for i in ids}
    ended = {}
    for ev in dec.step():
        out[ev.request_id].extend(ev.token_ids)
    next(row for row in dec._rows if row.request_id == ids[0]).sampler.probs = probs
    while dec.has_work:
        for ev in dec.step():
            out[ev.request_id].extend(ev.token_ids)
            if ev.finish_reason:
                ended[ev.request_id] = ev
    return expected, ids, out, ended


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("trees", [False, True], ids=["linear", "trees"])
def test_a_sampling_failure_ends_only_its_row(trees, monkeypatch):
    """One sampled row's warper raises in a round: that request ends with "error", the others finish. The
    rows share their settings, so the round warps them in one call with the first row's sampler (the broken
    one here): when that raises, each row is warped alone and only the broken one fails. "trees": the rows
    verify prompt lookup's token trees (``tree_sampling.tree_rejection_sample_rows``)."""
    target = make_tiny_model("qwen2", num_layers=2)
    prompts = PROMPTS[1:4]
    base = GenerationConfig(max_new_tokens=10, stop_on_eos=False)
    configs = [dataclasses.replace(base, temperature=0.8, seed=7 + r) for r in range(3)]

    def fail(logits):
        raise RuntimeError("warper failed")

    tree_rows, verify = [], verification.tree_rejection_sample_rows
    monkeypatch.setattr(verification, "tree_rejection_sample_rows",
                        lambda samplers, *a, **k: tree_rows.append(len(samplers)) or verify(samplers, *a, **k))
    if trees:  # "a b" continues three ways: three branches
        prompts = [[a, 7, 11, a, 7, 13, a, 7, 17, a, 7] for a in (3, 4, 5)]
    expected, ids, out, ended = _with_first_row_broken(
        (lambda: PromptLookupDrafter(branches=3)) if trees else PromptLookupDrafter, target, prompts, configs, fail)
    assert bool(tree_rows) == trees  # trees were sampled
    assert ended[ids[0]].finish_reason == "error"
    assert f"request {ids[0]} failed in its sampling: RuntimeError: warper failed" in ended[ids[0]].error
    assert ended[ids[1]].finish_reason == ended[ids[2]].finish_reason == "length"
    assert out[ids[1]] == expected[1] and out[ids[2]] == expected[2]
    assert out[ids[0]] == expected[0][: len(out[ids[0]])] and len(out[ids[0]]) < len(expected[0])


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("case", ["read", "banned-words", "trees"])
def test_a_distribution_that_is_not_one_ends_only_its_row(case, monkeypatch):
    """A sampled row whose warped target distribution comes out NaN in a round (finite logits whose warping
    overflowed; ``sampling.race`` gives -1 on the device) ends with "error" at the round's read, and the other
    rows finish as they would have. "banned-words": the row has banned words, matched only after the read; its
    whole block is sampled before it (``sample_rows``), and its -1 still ends it. "trees": the rows
    verify draft trees, the broken row's walk ends at a node whose p is NaN and draws -1 from it. One sequence
    (``SpeculativeDecoder``, errors not contained): the round raises ``NonFiniteLogitsError``; so does a NaN
    first token after the prefill."""
    target = make_tiny_model("qwen2", num_layers=2)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    prompts = PROMPTS[1:4]
    base = GenerationConfig(max_new_tokens=10, stop_on_eos=False)
    configs = [dataclasses.replace(base, temperature=0.7 if r == 0 else 0.8, seed=7 + r) for r in range(3)]
    engine = {}
    if case == "banned-words":  # a word no output holds: nothing is cut, but the row has a banned-word state
        configs[0] = dataclasses.replace(configs[0], banned_words=("not-a-word",))
        engine = dict(tokenizer=make_tiny_tokenizer())
    tree_rows, verify = [], verification.tree_rejection_sample_rows
    monkeypatch.setattr(verification, "tree_rejection_sample_rows",
                        lambda samplers, *a, **k: tree_rows.append(len(samplers)) or verify(samplers, *a, **k))
    vocab = target.get_output_embeddings().weight.shape[0]
    expected, ids, out, ended = _with_first_row_broken(
        lambda: DraftModelDrafter(draft, tree_depth=2 if case == "trees" else None), target, prompts, configs,
        lambda logits: torch.full((logits.shape[0], vocab), float("nan")), **engine)
    assert bool(tree_rows) == (case == "trees")
    assert ended[ids[0]].finish_reason == "error"
    assert ended[ids[0]].error == f"request {ids[0]} failed in its sampling: {INVALID_DISTRIBUTION}"
    assert ended[ids[1]].finish_reason == ended[ids[2]].finish_reason == "length"
    assert out[ids[1]] == expected[1] and out[ids[2]] == expected[2]
    assert out[ids[0]] == expected[0][: len(out[ids[0]])] and len(out[ids[0]]) < len(expected[0])

    probs, calls = Sampler.probs, []

    def nan_after(first: int):
        def warp(self, logits):
            calls.append(1)
            q = probs(self, logits)
            return q if len(calls) <= first else torch.full_like(q, float("nan"))
        return warp

    for first, when in ((1, "a round"), (0, "the first token")):
        calls.clear()
        one = SpeculativeDecoder(target, DraftModelDrafter(draft), **engine)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Sampler, "probs", nan_after(first))
            with pytest.raises(NonFiniteLogitsError, match="sampling distribution was NaN"):
                one.generate(torch.tensor([prompts[0]]), configs[0])
        assert len(calls) > first, when


@pytest.mark.usefixtures("one_thread")
def test_warm_up_covers_every_forward_width_and_changes_no_output():
    """After ``warm_up``, requests of many lengths (chunked prefills, 1-3 rows, drafts) run only
    forward widths the warm-up already ran, for the target and the draft model, and decode
    exactly as without it."""
    target = make_tiny_model("gemma2", num_layers=2)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    seen = {"target": [], "draft": []}

    def record(name):
        def hook(module, args, kwargs):
            ids = kwargs["input_ids"]
            seen[name].append((ids.shape[0] * ids.shape[1], kwargs["logits_to_keep"] * ids.shape[0]))
        return hook

    prompts = [[3 + (5 * i + j) % 44 for j in range(n)] for i, n in enumerate((1, 7, 16, 19, 33, 40, 4))]
    config = GenerationConfig(max_new_tokens=9, stop_on_eos=False)
    expected = _alone(target, prompts, config)
    dec = BatchedSpeculativeDecoder(target, DraftModelDrafter(draft), max_batch_size=3, max_length=64,
                                    num_speculative_tokens=3, prefill_chunk_tokens=16, prefill_pad_multiple=4)
    handles = [target.register_forward_pre_hook(record("target"), with_kwargs=True),
               draft.register_forward_pre_hook(record("draft"), with_kwargs=True)]
    try:
        assert dec.warm_up() >= 0
        warm = {name: set(calls) for name, calls in seen.items()}
        for calls in seen.values():
            calls.clear()
        assert [r.token_ids for r in dec.generate(prompts, config)] == expected
    finally:
        for h in handles:
            h.remove()
    for name in ("target", "draft"):
        tokens = {t for t, _ in warm[name]}
        logits = {k for _, k in warm[name]}
        used = set(seen[name])
        assert {t for t, _ in used} <= tokens, name
        assert {k for _, k in used} <= logits, name
        assert len({t for t, _ in used}) > 5, name  # the requests really took many widths
    dec.add([5, 6], config)
    with pytest.raises(InvalidArgumentError, match="warm_up runs before any request"):
        dec.warm_up()


def test_warm_up_looks_up_every_embedding_row():
    """The warm-up reads every row of the target's and the draft model's input embedding."""
    target = make_tiny_model("qwen2", num_layers=1)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    looked_up = {"target": set(), "draft": set()}

    def record(name):
        def hook(module, args):
            looked_up[name].update(args[0].flatten().tolist())
        return hook

    handles = [target.get_input_embeddings().register_forward_pre_hook(record("target")),
               draft.get_input_embeddings().register_forward_pre_hook(record("draft"))]
    try:
        BatchedSpeculativeDecoder(target, DraftModelDrafter(draft), max_batch_size=1, max_length=32).warm_up()
    finally:
        for h in handles:
            h.remove()
    rows = set(range(target.get_input_embeddings().num_embeddings))
    assert looked_up == {"target": rows, "draft": rows}
