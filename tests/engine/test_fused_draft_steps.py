"""Fused draft steps (``BatchRunner.draft_steps``, ``base.draft_batch``): a greedy round's draft steps
after its first forward as one compiled function give exactly the step-by-step tokens.

* ``graphs=False`` (the static path, no torch.compile): draft model, cascade and layer skip equal
  target-only decoding at B = 1 and B = 3 with rows joining mid-flight and finishing at different
  lengths; the fused path ran, and with ``fused_draft_steps=False`` it did not, with the same drafts,
  stats and draft cache; a truncated head (FR-Spec); one host sync per round, none inside the steps.
* ``graphs=True``: inductor on CPU compiles the fused bucket once (warm-up), one small case.

The reference is target-only decoding of each prompt alone (float32, greedy).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from conftest import make_tiny_model
from helpers import perturbed_copy
from selfspec_helpers import one_thread  # noqa: F401 (a fixture)
from specdecode import GenerationConfig
from specdecode.drafters import CascadeDrafter, DraftModelDrafter, LayerSkipDrafter
from specdecode.drafters.control import DraftControl
from specdecode.drafters.draft_head import DraftHead
from specdecode.drafters.layer_skip import SkipSet
from specdecode.engine.batch_runner import BatchRunner
from specdecode.engine.batched import BatchedSpeculativeDecoder
from specdecode.errors import InvalidArgumentError
from test_batched_fast_path import (  # noqa: F401 (sync_counter: a fixture)
    PROMPTS, _alone, _configs, _continuous, round_syncs, sync_counter)

#: Truncated heads keep these token ids (all but every fifth id of the tiny vocabulary).
HEAD_IDS = [i for i in range(48) if i % 5]


def _drafters(target, draft) -> dict:
    return {
        "draft": lambda: DraftModelDrafter(draft),
        "cascade": lambda: CascadeDrafter(draft),
        "layer-skip": lambda: LayerSkipDrafter(target, SkipSet(attn=(1,), mlp=(2,))),
        "draft-truncated": lambda: DraftModelDrafter(draft, head=DraftHead.truncated(HEAD_IDS)),
    }


@pytest.fixture(autouse=True)
def fused_by_default(monkeypatch):
    """Drafters made in this module fuse their steps (off by default: it did not pay on an H200)."""
    for cls in (DraftModelDrafter, LayerSkipDrafter):
        monkeypatch.setattr(cls, "fused_draft_steps", True)


@pytest.fixture
def fused_calls(monkeypatch) -> list:
    """Each ``BatchRunner.draft_steps`` call's (rows, steps), in order."""
    calls: list = []
    original = BatchRunner.draft_steps

    def counted(self, tokens, starts, num_steps, *args, **kwargs):
        calls.append((int(tokens.shape[0]), num_steps))
        return original(self, tokens, starts, num_steps, *args, **kwargs)

    monkeypatch.setattr(BatchRunner, "draft_steps", counted)
    return calls


def _engine(target, drafter, batch: int, fused: bool = True, **kwargs) -> BatchedSpeculativeDecoder:
    drafter.fused_draft_steps = fused
    return BatchedSpeculativeDecoder(target, drafter, max_batch_size=batch, max_length=96, num_speculative_tokens=4,
                                     compile=True, graphs=False, **kwargs)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", ["draft", "cascade", "layer-skip", "draft-truncated"])
def test_fused_steps_greedy_equals_autoregressive(arch, name, fused_calls):
    """B = 1, then B = 3 with rows joining mid-flight and finishing at different lengths: the target's tokens,
    with γ - 1 = 3 fused steps after each round's first draft forward (fewer near a row's end)."""
    target = make_tiny_model(arch, num_layers=3)
    make = _drafters(target, perturbed_copy(target, noise=0.3, seed=1))[name]
    configs = _configs()
    expected = _alone(target, PROMPTS, configs)
    assert _continuous(_engine(target, make(), 1), PROMPTS, configs) == expected
    assert {rows for rows, _ in fused_calls} == {1} and (1, 3) in fused_calls
    fused_calls.clear()
    assert _continuous(_engine(target, make(), 3), PROMPTS, configs) == expected
    assert {rows for rows, _ in fused_calls} > {3} and (3, 3) in fused_calls, fused_calls  # rows join and finish


def _drafts(dec: BatchedSpeculativeDecoder) -> list:
    """Records every ``propose``'s draft of the engine's drafter: per row, its kept tokens."""
    out: list = []
    propose = dec.drafter.propose

    def recorded(sequences, max_tokens, *args, **kwargs):
        draft = propose(sequences, max_tokens, *args, **kwargs)
        out.append([row[:k] for row, k in zip(draft.tokens.tolist(), draft.num_tokens)])
        return draft

    dec.drafter.propose = recorded
    return out


def _cache_rows(drafter) -> list[torch.Tensor]:
    """The draft cache's keys and values of every active slot's cached positions (a layer-skip drafter: its
    bookkeeping lives in the engine, so none)."""
    if not isinstance(drafter, DraftModelDrafter):
        return []
    cache = drafter.cache
    out = []
    for slot, cached in enumerate(drafter._num_cached):
        end = cached - drafter._offsets[slot]
        out += [t[slot, :, :end] for layer in cache.layers for t in (layer.keys, layer.values)]
    return out


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", ["draft", "cascade", "layer-skip", "draft-truncated"])
def test_switch_off_runs_unfused_with_the_same_drafts_stats_and_cache(name, fused_calls):
    """``fused_draft_steps=False`` never fuses (its steps run one graph each, ``greedy_steps``); on and off, run in
    lockstep, give the same drafts round by round, the same draft cache after every step (rollback included) and
    the same stats."""
    target = make_tiny_model("llama", num_layers=3)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    make = _drafters(target, draft)[name]
    configs = _configs()
    on, off = _engine(target, make(), 3, True), _engine(target, make(), 3, False)
    drafts_on, drafts_off = _drafts(on), _drafts(off)
    for dec in (on, off):
        for prompt, config in zip(PROMPTS[:3], configs):
            dec.add(prompt, config)
    outputs: dict = {}
    while on.has_work or off.has_work:
        for event in on.step():
            outputs.setdefault((True, event.request_id), []).extend(event.token_ids)
        before = len(fused_calls)
        for event in off.step():
            outputs.setdefault((False, event.request_id), []).extend(event.token_ids)
        assert len(fused_calls) == before, "the switched-off drafter fused its steps"
        assert drafts_on == drafts_off
        got, want = _cache_rows(on.drafter), _cache_rows(off.drafter)
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    assert fused_calls and len(drafts_on) > 5
    assert getattr(on.drafter, "_num_cached", None) == getattr(off.drafter, "_num_cached", None)
    assert {k[1]: v for k, v in outputs.items() if k[0]} == {k[1]: v for k, v in outputs.items() if not k[0]}
    for stat in ("num_drafted_tokens", "num_accepted_tokens", "num_draft_forwards", "num_rounds"):
        assert getattr(on.stats, stat) == getattr(off.stats, stat), stat
    assert on.drafter.num_forwards == off.drafter.num_forwards
    assert 0 < on.stats.num_accepted_tokens < on.stats.num_drafted_tokens


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", ["draft", "layer-skip"])
@pytest.mark.parametrize("entry, fused", [("draft_steps", True), ("greedy_steps", False)])
def test_one_host_sync_per_greedy_round_and_none_between_steps(name, entry, fused, sync_counter, monkeypatch):
    """A greedy round, its steps fused or not (``greedy_steps``), reads the device back once (the round's
    ``tolist``); nothing inside the steps (their forwards included: the static path has no host reads) syncs."""
    target = make_tiny_model("qwen2", num_layers=3)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    dec = _engine(target, _drafters(target, draft)[name](), 3, fused)
    inside: list[list] = []
    steps = getattr(BatchRunner, entry)

    def watched(self, *args, **kwargs):
        before = len(sync_counter)
        out = steps(self, *args, **kwargs)
        inside.append(sync_counter[before:])
        return out

    monkeypatch.setattr(BatchRunner, entry, watched)
    for prompt, config in zip(PROMPTS[:3], _configs()):
        dec.add(prompt, config)
    per_round = [[(m, f) for m, _, f in calls] for calls in round_syncs(dec, sync_counter)]
    assert len(per_round) == dec.stats.num_rounds > 5
    assert all(c == [("tolist", "_round")] for c in per_round), per_round
    assert len(inside) > 5 and not any(inside), inside


@torch.inference_mode()
def test_draft_steps_equal_one_token_calls_and_flag_non_finite_logits():
    """``draft_steps`` directly: its tokens are the argmaxes of as many one-token calls at the next positions
    (two rows in a bucket of 2, a row whose vocabulary ends before the logits'); NaN logits clear the flag."""
    target = make_tiny_model("llama", num_layers=2)
    dec = _engine(target, DraftModelDrafter(perturbed_copy(target, noise=0.3, seed=1)), 2)
    dec.generate([[5, 9, 12, 4, 8]] * 2, [GenerationConfig(max_new_tokens=3)] * 2)  # allocates the caches
    runner, vocab = dec.drafter.runner, 40
    assert runner.draft_steps(torch.tensor([7, 11]), [4, 6], 3, None, vocab)[2] is None  # no tops asked
    fused, finite, tops = runner.draft_steps(torch.tensor([7, 11]), [4, 6], 3, None, vocab, with_tops=True)
    token, expected, expected_tops = torch.tensor([[7], [11]]), [], []
    for i in range(3):
        logits = runner(token, [4 + i, 6 + i], 1)[:, -1]
        expected_tops.append(torch.softmax(logits.float(), -1).amax(-1))
        token = logits[:, :vocab].argmax(-1, keepdim=True)
        expected.append(token)
    assert torch.equal(fused, torch.cat(expected, dim=1)) and fused.shape == (2, 3)
    assert torch.allclose(tops, torch.stack(expected_tops, dim=1)) and tops.shape == (2, 3)
    assert finite.dim() == 0 and bool(finite)
    head = runner.model.get_output_embeddings().weight
    saved = head[3].clone()
    head[3] = float("nan")
    try:
        assert not bool(runner.draft_steps(torch.tensor([7]), [4], 2, None, vocab)[1])
    finally:
        head[3] = saved


def test_draft_steps_checks_its_arguments():
    target = make_tiny_model("llama", num_layers=2)
    dec = _engine(target, LayerSkipDrafter(target, SkipSet(attn=(1,))), 2)
    dec.generate([[5, 9, 12]], [GenerationConfig(max_new_tokens=3)])  # allocates the cache
    runner, tokens = dec.drafter.runner, torch.tensor([5])
    with pytest.raises(InvalidArgumentError, match=r"num_steps must be an integer >= 1, got 0"):
        runner.draft_steps(tokens, [3], 0, None, 48)
    with pytest.raises(InvalidArgumentError, match=r"vocab must be an integer >= 1, got True"):
        runner.draft_steps(tokens, [3], 2, None, True)
    with pytest.raises(InvalidArgumentError, match=r"rows bucket for 3 rows \(rows buckets \[1, 2\]"):
        runner.draft_steps(torch.tensor([5, 6, 7]), [3, 3, 3], 2, None, 48)
    with pytest.raises(InvalidArgumentError, match=r"past the batch cache's capacity of 96"):
        runner.draft_steps(tokens, [94], 3, None, 48)
    with pytest.raises(InvalidArgumentError, match=r"one start \(an int >= 0\) per row of its 1 tokens, got \[3, 4\]"):
        runner.draft_steps(tokens, [3, 4], 2, None, 48)
    with pytest.raises(InvalidArgumentError, match=r"got \[-1\]"):
        runner.draft_steps(tokens, [-1], 2, None, 48)
    eager = BatchedSpeculativeDecoder(target, LayerSkipDrafter(target, SkipSet(attn=(1,))), max_batch_size=1,
                                      max_length=32, compile=False)
    assert not eager.drafter.runner.fuses_draft_steps(1)  # no fast path: the drafters run the loop


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("one_thread", "fresh_dynamo")
def test_compiled_fused_steps_equal_autoregressive(fused_calls):
    """Inductor on CPU: warm-up compiles the target's 2 buckets, the draft's 2 and the fused 3 steps (one
    graph); rows joining mid-flight through a truncated head give the target's tokens, compiling nothing more
    (shorter rounds, near a row's end, run step by step)."""
    target = make_tiny_model("qwen2", num_layers=2)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    configs, prompts = _configs()[:3], PROMPTS[:3]
    expected = _alone(target, prompts, configs)
    dec = BatchedSpeculativeDecoder(target, DraftModelDrafter(draft, head=DraftHead.truncated(HEAD_IDS)),
                                    max_batch_size=3, max_length=96, num_speculative_tokens=4, compile=True,
                                    row_buckets=(3,))
    graphs = counters["stats"]["unique_graphs"]
    dec.warm_up()
    assert counters["stats"]["unique_graphs"] - graphs == 5
    assert set(dec.drafter.runner._steps_buckets) == {(3, 3, 48, len(HEAD_IDS), False)}
    compiled = dec.compile_time_s
    assert compiled > 0
    assert _continuous(dec, prompts, configs) == expected
    assert {steps for _, steps in fused_calls} == {3}  # a row near its end drafts less: step by step
    assert counters["stats"]["unique_graphs"] - graphs == 5  # nothing compiled mid-request
    assert dec.compile_time_s == compiled


@pytest.mark.usefixtures("one_thread")
def test_an_engine_sharing_a_wider_engines_cache_fuses_its_own_rounds(fused_calls):
    """One row at a time, a γ = 4 engine takes over the cache of an adaptive one whose blocks reach 6: each
    fuses its own full rounds (5 and 3 steps), and both give the target's tokens."""
    target = make_tiny_model("llama", num_layers=3)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    configs, prompts = _configs()[:2], PROMPTS[:2]
    expected = _alone(target, prompts, configs)
    control = DraftControl(adaptive_exit=True, max_draft_tokens=6, exit_mode="masked")
    wide = BatchedSpeculativeDecoder(target, DraftModelDrafter(draft), max_batch_size=1, max_length=96,
                                     draft_control=control, compile=True, graphs=False)
    assert _continuous(wide, prompts, configs) == expected
    narrow = BatchedSpeculativeDecoder(target, DraftModelDrafter(draft), max_batch_size=1, max_length=96,
                                       num_speculative_tokens=4, compile=True, graphs=False, shared_with=wide)
    assert narrow.cache is wide.cache and narrow.drafter.runner is wide.drafter.runner
    assert narrow.drafter.runner.fused_steps == ((3, False), (5, True))
    fused_calls.clear()
    assert _continuous(narrow, prompts, configs) == expected
    assert {steps for _, steps in fused_calls} == {3}
