"""The batched engine: each row's greedy output equals that row decoded alone (float32), rows
join and leave mid-flight, per-row sampling keeps the target's law, bad input is refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import make_tiny_model
from helpers import perturbed_copy
from selfspec_helpers import REPETITIVE, exact_marginals, one_thread, spread_pair, violations  # noqa: F401 (a fixture)
from specdecode import GenerationConfig, SpeculativeDecoder
from specdecode.drafters import (
    CascadeDrafter,
    DraftModelDrafter,
    EarlyExitDrafter,
    LayerSkipDrafter,
    PromptLookupDrafter,
)
from specdecode.drafters.control import DraftControl
from specdecode.drafters.layer_skip import SkipSet
from specdecode.engine.batch_cache import BatchKVCache, batch_forward
from specdecode.engine import sampling, verification
from specdecode.engine.batched import BatchedSpeculativeDecoder
from specdecode.errors import InvalidArgumentError

EOS = 2
# Prompts of different lengths, one repetitive (prompt lookup finds matches), one past the
# sliding window (6) of the Mistral and Gemma test models.
PROMPTS = [[5, 9, 12], REPETITIVE, [7, 3, 30, 41, 8, 11, 19], [44], [13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]
LENGTHS = [20, 9, 25, 14, 17]


def _configs(**kw) -> list[GenerationConfig]:
    return [GenerationConfig(max_new_tokens=m, **kw) for m in LENGTHS]


def _alone(target, prompts, configs, eos=()) -> list[list[int]]:
    dec = SpeculativeDecoder(target, eos_token_ids=eos)
    return [dec.generate(p, c).token_ids for p, c in zip(prompts, configs)]


def _drafters(target, draft):
    return {
        "autoregressive": (lambda: None, None),
        "draft": (lambda: DraftModelDrafter(draft), None),
        "prompt-lookup": (lambda: PromptLookupDrafter(), None),
        "layer-skip": (lambda: LayerSkipDrafter(target, SkipSet(attn=(1,), mlp=(2,))), None),
        "early-exit": (lambda: EarlyExitDrafter(target, 2), None),
        "draft+adaptive": (lambda: DraftModelDrafter(draft), DraftControl(adaptive_exit=True, max_draft_tokens=6)),
        "early-exit+adaptive": (lambda: EarlyExitDrafter(target, 2), DraftControl(adaptive_exit=True)),
    }


@pytest.mark.usefixtures("one_thread")
def test_greedy_rows_equal_each_row_alone(arch):
    """Mixed prompt lengths, more requests than slots (rows join as others finish), every drafter."""
    target = make_tiny_model(arch)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    configs = _configs()
    expected = _alone(target, PROMPTS, configs)
    for name, (make, control) in _drafters(target, draft).items():
        for rule in ("row", "batch") if control is not None else ("row",):
            dec = BatchedSpeculativeDecoder(
                target, make(), max_batch_size=3, max_length=96, num_speculative_tokens=4,
                draft_control=control, exit_rule=rule,
            )
            got = [r.token_ids for r in dec.generate(PROMPTS, configs)]
            assert got == expected, (name, rule)
            assert dec.stats.max_rows == 3 and dec.num_running == 0
            if name != "autoregressive":
                assert 0 < dec.stats.num_accepted_tokens < dec.stats.num_drafted_tokens, (name, rule)


@pytest.mark.usefixtures("one_thread")
def test_rows_finish_at_eos_in_different_rounds():
    target = make_tiny_model("qwen2")
    draft = perturbed_copy(target, noise=0.3, seed=1)
    configs = _configs()
    free = _alone(target, PROMPTS, configs)
    # An EOS id that the rows reach at different positions (or never).
    counts = {}
    for out in free:
        for t in set(out[1:]):
            counts[t] = counts.get(t, 0) + 1
    eos = max(counts, key=lambda t: (0 < counts[t] < len(free), counts[t]))
    expected = _alone(target, PROMPTS, configs, eos=[eos])
    stops = {len(e) for e, f in zip(expected, free) if len(e) < len(f)}
    assert len(stops) >= 2, "the test needs rows stopping at different positions"
    dec = BatchedSpeculativeDecoder(
        target, DraftModelDrafter(draft), max_batch_size=5, max_length=96, eos_token_ids=[eos]
    )
    results = dec.generate(PROMPTS, configs)
    assert [r.token_ids for r in results] == expected
    assert {r.finish_reason for r in results} == {"eos", "length"}


@pytest.mark.usefixtures("one_thread")
def test_rows_join_mid_flight_and_cancel():
    target = make_tiny_model("gemma3")
    draft = perturbed_copy(target, noise=0.3, seed=1)
    configs = _configs()
    expected = _alone(target, PROMPTS, configs)
    dec = BatchedSpeculativeDecoder(target, DraftModelDrafter(draft), max_batch_size=4, max_length=96)
    out: dict[int, list[int]] = {}
    ids = [dec.add(PROMPTS[0], configs[0]), dec.add(PROMPTS[1], configs[1])]
    doomed = dec.add(PROMPTS[3], configs[3])
    finished: dict[int, str] = {}

    def run(steps: int) -> None:
        for _ in range(steps):
            for ev in dec.step():
                out.setdefault(ev.request_id, []).extend(ev.token_ids)
                if ev.finish_reason:
                    finished[ev.request_id] = ev.finish_reason

    run(2)
    assert dec.num_running == 3
    dec.cancel(doomed)  # a running row leaves between rounds; the others go on untouched
    assert dec.num_running == 2
    with pytest.raises(InvalidArgumentError, match=r"request \d+ is not running: it already ended \(cancelled\)"):
        dec.cancel(doomed)
    with pytest.raises(InvalidArgumentError, match="unknown"):
        dec.cancel(12345)
    ids += [dec.add(PROMPTS[2], configs[2]), dec.add(PROMPTS[4], configs[4])]  # join mid-flight
    waiting = dec.add(PROMPTS[0], configs[0])
    dec.cancel(waiting)  # still queued: removed before it ever runs
    run(3)
    while dec.has_work:
        run(1)
    assert dec.num_running == 0 and dec.num_waiting == 0
    assert [out[i] for i in ids] == [expected[0], expected[1], expected[2], expected[4]]
    assert doomed not in finished and waiting not in out
    assert 0 < len(out[doomed]) < len(expected[3])
    assert out[doomed] == expected[3][: len(out[doomed])]


@pytest.mark.usefixtures("one_thread")
def test_stats_per_row_add_up_to_the_batch():
    target = make_tiny_model("llama")
    dec = BatchedSpeculativeDecoder(target, PromptLookupDrafter(), max_batch_size=5, max_length=96)
    results = dec.generate(PROMPTS, _configs())
    s = dec.stats
    assert s.num_new_tokens == sum(len(r.token_ids) for r in results) == sum(LENGTHS)
    assert s.num_drafted_tokens == sum(r.stats.num_drafted_tokens for r in results) > 0
    assert s.num_accepted_tokens == sum(r.stats.num_accepted_tokens for r in results)
    assert s.num_row_rounds == sum(r.stats.num_target_forwards for r in results)
    assert s.num_rounds == max(r.stats.num_target_forwards for r in results)
    assert s.mean_accepted_tokens == pytest.approx((s.num_accepted_tokens + s.num_row_rounds) / s.num_row_rounds)
    assert all(r.stats.decode_time_s > 0 and r.stats.prefill_time_s > 0 for r in results)


@pytest.mark.parametrize("seeded", [True, False])
def test_sampling_rows_with_different_temperatures_keep_the_target_law(seeded):
    """Two rows of one batch, temperatures 0.5 and 1.5: each row's first three tokens follow the
    target's law at its own temperature (draft model with rejections); seeded, or without a seed, the two rows
    drawing together from the engine's generator."""
    vocab, n = 8, 500
    model, draft, prompts = spread_pair(vocab)
    base = GenerationConfig(max_new_tokens=3, stop_on_eos=False)
    temps = (0.5, 1.5)
    dec = BatchedSpeculativeDecoder(model, DraftModelDrafter(draft), max_batch_size=2, max_length=32,
                                    num_speculative_tokens=3)
    dec.generator.manual_seed(11)
    firsts = [torch.zeros((n, 3), dtype=torch.long) for _ in temps]
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i in range(n):
            configs = [dataclasses.replace(base, temperature=t, seed=1000 * r + i if seeded else None)
                       for r, t in enumerate(temps)]
            for r, res in enumerate(dec.generate(prompts, configs)):
                firsts[r][i] = torch.tensor(res.token_ids)
    finally:
        torch.set_num_threads(prev)
    assert 0 < dec.stats.num_accepted_tokens < dec.stats.num_drafted_tokens
    for r, t in enumerate(temps):
        config = dataclasses.replace(base, temperature=t)
        freq = {f"x{j + 1}": torch.bincount(firsts[r][:, j], minlength=vocab).double() / n for j in range(3)}
        freq["x1x2"] = torch.bincount(firsts[r][:, 0] * vocab + firsts[r][:, 1], minlength=vocab**2).double().view(
            vocab, vocab
        ) / n
        assert violations(exact_marginals(model, prompts[r], config, vocab), freq, n) == [], f"row {r}"
        # Negative control: the other row's temperature is rejected by the same test.
        other = dataclasses.replace(base, temperature=temps[1 - r])
        assert violations(exact_marginals(model, prompts[r], other, vocab), freq, n) != [], f"row {r}"


@pytest.mark.usefixtures("one_thread")
def test_bad_input_is_refused_and_other_rows_are_untouched():
    target = make_tiny_model("mistral")
    other = make_tiny_model("mistral", seed=5)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidArgumentError, match="max_batch_size must be an integer >= 1"):
            BatchedSpeculativeDecoder(target, max_batch_size=bad)
    with pytest.raises(InvalidArgumentError, match="exit_rule must be one of"):
        BatchedSpeculativeDecoder(target, PromptLookupDrafter(), exit_rule="sometimes")
    with pytest.raises(InvalidArgumentError, match="own target model"):
        BatchedSpeculativeDecoder(target, LayerSkipDrafter(other, SkipSet(attn=(1,))))
    with pytest.raises(InvalidArgumentError, match="adaptive draft exit needs a drafter that gives probabilities"):
        BatchedSpeculativeDecoder(target, PromptLookupDrafter(), draft_control=DraftControl(adaptive_exit=True))

    configs = _configs()
    expected = _alone(target, PROMPTS[:2], configs[:2])
    dec = BatchedSpeculativeDecoder(target, PromptLookupDrafter(), max_batch_size=2, max_length=48)
    first = dec.add(PROMPTS[0], configs[0])
    out: dict[int, list[int]] = {first: []}
    for ev in dec.step():
        out[ev.request_id].extend(ev.token_ids)
    with pytest.raises(InvalidArgumentError, match=r"needs 56 cache positions, past the batch cache's max_length of 48"):
        dec.add(list(range(3, 33)), GenerationConfig(max_new_tokens=20))
    with pytest.raises(InvalidArgumentError, match=r"token id 48 is outside the target model's vocabulary 0\.\.47"):
        dec.add([5, 48, 7])
    with pytest.raises(InvalidArgumentError, match="prompt is empty"):
        dec.add([])
    with pytest.raises(InvalidArgumentError, match=r"shape \(1, n\)"):
        dec.add(torch.ones((2, 3), dtype=torch.long))
    with pytest.raises(InvalidArgumentError, match="banned_words need a tokenizer; pass tokenizer= to the decoder"):
        dec.add([5, 6], GenerationConfig(max_new_tokens=4, banned_words=("w7",)))
    second = dec.add(PROMPTS[1], configs[1])
    out[second] = []
    while dec.has_work:
        for ev in dec.step():
            out[ev.request_id].extend(ev.token_ids)
    assert out == {first: expected[0], second: expected[1]}


def test_batch_cache_masks_and_moves():
    """Stale positions past a row's length are never read, and a moved row decodes as before."""
    model = make_tiny_model("llama", num_layers=2)
    cache = BatchKVCache(model, num_slots=2, capacity=16)
    mask = cache.attention_mask(torch.tensor([[2, 3], [0, 1]]), 4, torch.float32)
    allowed = mask == 0
    assert allowed[0, 0].tolist() == [[True, True, True, False], [True, True, True, True]]
    assert allowed[1, 0].tolist() == [[True, False, False, False], [True, True, False, False]]
    with torch.inference_mode():
        a, b = torch.tensor([[5, 6, 7, 8]]), torch.tensor([[9, 10, 11]])
        batch_forward(model, cache, b, 1, [0], 1)
        ref = batch_forward(model, cache, torch.tensor([[12]]), 1, [3], 1)
        batch_forward(model, cache, a, 0, [0], 1)
        # Junk written past slot 1's length must not matter.
        batch_forward(model, cache, torch.tensor([[40, 41, 42]]), 1, [3], 1)
        cache.move(1, 0, 3)
        moved = batch_forward(model, cache, torch.tensor([[12]]), 0, [3], 1)
    assert torch.equal(ref, moved)
    with pytest.raises(InvalidArgumentError, match="past the batch cache's capacity of 16"):
        cache.prepare(0, [15], 2, torch.float32, "cpu")
    with pytest.raises(InvalidArgumentError, match="outside the cache's 0..1"):
        cache.prepare(1, [0, 0], 1, torch.float32, "cpu")


@pytest.mark.usefixtures("one_thread")
def test_a_draft_equal_to_the_target_is_always_accepted(arch):
    """The draft cache stays in step with each row (also after fully accepted blocks, when two
    tokens are fed, and for rows padded to the longest block): a perfect draft is never rejected."""
    target = make_tiny_model(arch)
    configs = _configs()
    for control in (None, DraftControl(adaptive_exit=True, max_draft_tokens=6)):
        dec = BatchedSpeculativeDecoder(target, DraftModelDrafter(target), max_batch_size=3, max_length=96,
                                        num_speculative_tokens=4, draft_control=control)
        got = [r.token_ids for r in dec.generate(PROMPTS, configs)]
        assert got == _alone(target, PROMPTS, configs)
        assert dec.stats.num_drafted_tokens > 0
        assert dec.stats.num_accepted_tokens == dec.stats.num_drafted_tokens


@pytest.mark.usefixtures("one_thread")
def test_a_row_done_at_its_first_token_never_enters_a_round():
    """A request joining while others run, whose first token is EOS (or max_new_tokens=1), gets that
    one token and leaves; the running row is unaffected."""
    target = make_tiny_model("llama")
    draft = perturbed_copy(target, noise=0.3, seed=1)
    first = _alone(target, [PROMPTS[2]], [GenerationConfig(max_new_tokens=1)])[0][0]
    expected = _alone(target, [PROMPTS[0]], [GenerationConfig(max_new_tokens=20)], eos=[first])[0]
    assert first not in expected, "the test needs an EOS id the running row never produces"
    dec = BatchedSpeculativeDecoder(target, DraftModelDrafter(draft), max_batch_size=4, max_length=96,
                                    eos_token_ids=[first])
    running = dec.add(PROMPTS[0], GenerationConfig(max_new_tokens=20))
    out: dict[int, list[int]] = {running: []}
    finished = {}

    def drain(events):
        for ev in events:
            out.setdefault(ev.request_id, []).extend(ev.token_ids)
            if ev.finish_reason:
                finished[ev.request_id] = ev.result

    drain(dec.step())
    at_eos = dec.add(PROMPTS[2], GenerationConfig(max_new_tokens=30))
    one = dec.add(PROMPTS[4], GenerationConfig(max_new_tokens=1))
    drain(dec.step())
    assert out[at_eos] == [first] and finished[at_eos].finish_reason == "eos"
    assert len(out[one]) == 1 and finished[one].finish_reason == "length"
    assert finished[at_eos].stats.num_target_forwards == finished[one].stats.num_target_forwards == 0
    assert dec.num_running == 1
    while dec.has_work:
        drain(dec.step())
    assert out[running] == expected


@pytest.mark.usefixtures("one_thread")
def test_greedy_and_sampling_rows_share_a_batch_and_gating_works_per_row():
    target = make_tiny_model("qwen2")
    draft = perturbed_copy(target, noise=0.3, seed=1)
    configs = _configs()
    configs[1] = dataclasses.replace(configs[1], temperature=0.8, seed=3)
    configs[3] = dataclasses.replace(configs[3], temperature=1.2, top_k=10, seed=4)
    greedy = [0, 2, 4]
    expected = _alone(target, PROMPTS, configs)
    for control in (None, DraftControl(confidence_gate=0.1), DraftControl(length_schedule="heuristic")):
        dec = BatchedSpeculativeDecoder(target, DraftModelDrafter(draft), max_batch_size=5, max_length=96,
                                        draft_control=control)
        results = dec.generate(PROMPTS, configs)
        assert [results[i].token_ids for i in greedy] == [expected[i] for i in greedy]
        assert [len(results[i].token_ids) for i in (1, 3)] == [LENGTHS[1], LENGTHS[3]]
        if control is not None and control.confidence_gate is not None:
            assert sum(r.stats.num_gated_steps for r in results) > 0
            assert 0 < sum(r.stats.num_drafted_tokens for r in results)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_non_finite_target_logits_end_only_that_row(temperature):
    """The poisoned row ends with its error, greedy or sampling (its draw on the device, made before the
    round's read tells its logits were not finite, is safe and never kept); the others are untouched."""
    target = make_tiny_model("gemma2")
    configs = _configs()
    configs[1] = dataclasses.replace(configs[1], temperature=temperature, seed=5)
    expected = _alone(target, PROMPTS[:3], configs[:3])
    poisoned = {"slot": None}

    def poison(module, args, output):  # NaN logits for one slot of the batched rounds
        if poisoned["slot"] is not None and output.shape[0] > poisoned["slot"]:
            output[poisoned["slot"]] = float("nan")
        return output

    dec = BatchedSpeculativeDecoder(target, PromptLookupDrafter(), max_batch_size=3, max_length=96)
    ids = [dec.add(p, c) for p, c in zip(PROMPTS[:3], configs[:3])]
    out = {i: [] for i in ids}
    ended = {}
    handle = target.get_output_embeddings().register_forward_hook(poison)
    try:
        for ev in dec.step():  # the three prefills (batch size 1 each) and a first round
            out[ev.request_id].extend(ev.token_ids)
        poisoned["slot"] = 1
        for ev in dec.step():
            out[ev.request_id].extend(ev.token_ids)
            if ev.finish_reason:
                ended[ev.request_id] = ev
        poisoned["slot"] = None
    finally:
        handle.remove()
    assert list(ended) == [ids[1]] and ended[ids[1]].finish_reason == "error"
    assert f"non-finite logits (NaN or inf) in a torch.float32 forward for request {ids[1]}" in ended[ids[1]].error
    with pytest.raises(InvalidArgumentError, match=r"already ended \(error\)"):
        dec.cancel(ids[1])
    while dec.has_work:
        for ev in dec.step():
            out[ev.request_id].extend(ev.token_ids)
    assert out[ids[0]] == expected[0] and out[ids[2]] == expected[2]
    assert 1 <= len(out[ids[1]]) < len(expected[1]) and out[ids[1]] == expected[1][: len(out[ids[1]])]


def test_more_bad_input():
    target = make_tiny_model("llama", num_layers=2)
    dec = BatchedSpeculativeDecoder(target, max_batch_size=2, max_length=64)
    for bad in ([1.5, 2.0], "w5 w6", [True, 3]):
        with pytest.raises(InvalidArgumentError, match="token ids"):
            dec.add(bad)
    with pytest.raises(InvalidArgumentError, match="integer token ids, got a torch.float32 tensor"):
        dec.add(torch.tensor([[3.0, 4.0]]))
    for bad in (True, "0", 1.0):
        with pytest.raises(InvalidArgumentError, match="request_id must be an int"):
            dec.cancel(bad)
    with pytest.raises(InvalidArgumentError, match="token id 99"):
        dec.generate([[5, 6], [5, 99]], GenerationConfig(max_new_tokens=3))
    assert not dec.has_work  # the first prompt of the refused call was not left queued


@pytest.mark.usefixtures("one_thread")
def test_max_verify_tokens_shrinks_blocks_as_the_batch_grows():
    target = make_tiny_model("mistral")
    draft = perturbed_copy(target, noise=0.3, seed=1)
    configs = _configs()
    expected = _alone(target, PROMPTS, configs)
    drafted = {}
    for limit in (None, 9, 4):
        dec = BatchedSpeculativeDecoder(target, DraftModelDrafter(draft), max_batch_size=3, max_length=96,
                                        num_speculative_tokens=4, max_verify_tokens=limit)
        results = dec.generate(PROMPTS, configs)
        assert [r.token_ids for r in results] == expected
        blocks = [len(p) for r in results for p in [r.stats.drafted_by_position]]
        drafted[limit] = (dec.stats.num_drafted_tokens, max(blocks))
    assert drafted[None][1] == 4  # γ
    assert drafted[9][1] >= 3  # 9 // 3 - 1 = 2 with three rows, 3 with two, γ when one is left
    assert drafted[4][1] == 3  # 4 // n - 1: no drafting with 2 or 3 rows, 3 tokens when one row is left
    assert drafted[None][0] > drafted[9][0] > drafted[4][0] > 0
    for bad in (0, -3, 2.5, True):
        with pytest.raises(InvalidArgumentError, match="max_verify_tokens must be an integer >= 1 or None"):
            BatchedSpeculativeDecoder(target, max_verify_tokens=bad)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("method", ["draft", "draft+masked-exit", "draft+nucleus", "cascade", "prompt-lookup",
                                    "draft+trees", "draft+shaped-trees", "prompt-lookup+trees"])
def test_a_seeded_sampling_row_draws_the_same_tokens_in_a_batch_as_alone(method, monkeypatch):
    """Each seeded sampling row draws from its own generator, in a batch as alone: a greedy row first (so the
    sampling rows are not the batch's first rows), sampling rows with different settings, requests without a seed
    between them (drawn together from the engine's generator), more requests than slots. The draft steps' draws
    and the verification's rejection sampling are batched over the rows (``drafters.base``,
    ``verification.rejection_sample_rows``); a row taking another's draw or q fails this. "draft+nucleus": the
    top-p row's nucleus (its draft q's and its target p's, 25-34 of these 48 tokens) is looked for among its 28,
    then 32, most likely tokens (``Sampler.nucleus_probs``; a spy checks that both counts looked at rows), in a
    batch as alone. "+trees": token trees (a draft model's, prompt lookup's branches), sampled by
    ``tree_sampling.tree_rejection_sample_rows`` in the same calls as the linear rows' ``rejection_sample_rows``;
    "+shaped-trees": a draft model's trees shaped from each row's own earlier rounds (``tree_shape=
    "previous-round"``), which must move with the row and start afresh for each request."""
    found, tree_rows, verify = [], [], verification.tree_rejection_sample_rows
    monkeypatch.setattr(verification, "tree_rejection_sample_rows",
                        lambda samplers, *a, **k: tree_rows.append(len(samplers)) or verify(samplers, *a, **k))
    if method == "draft+nucleus":
        monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", (28, 32))
        topk = torch.Tensor.topk

        def spied(self, k, *args, **kwargs):  # how many rows each count looked at
            found.append((k, self.shape[0]))
            return topk(self, k, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "topk", spied)
    target = make_tiny_model("llama")
    draft = perturbed_copy(target, noise=0.3, seed=1)
    make = {"draft": lambda: DraftModelDrafter(draft), "draft+masked-exit": lambda: DraftModelDrafter(draft),
            "draft+nucleus": lambda: DraftModelDrafter(draft),
            "cascade": lambda: CascadeDrafter(draft),
            "prompt-lookup": lambda: PromptLookupDrafter(),
            "draft+trees": lambda: DraftModelDrafter(draft, tree_depth=2),
            "draft+shaped-trees": lambda: DraftModelDrafter(draft, tree_depth=2, tree_shape="previous-round"),
            "prompt-lookup+trees": lambda: PromptLookupDrafter(branches=3)}[method]
    control = DraftControl(adaptive_exit=True, exit_mode="masked") if method.endswith("masked-exit") else None
    settings = [dict(), dict(temperature=0.9, top_p=0.9), dict(temperature=1.0), dict(temperature=0.7, top_k=10),
                dict(temperature=1.0)]
    configs = [GenerationConfig(max_new_tokens=m, stop_on_eos=False, seed=40 + i, **kw)
               for i, (m, kw) in enumerate(zip(LENGTHS, settings))]
    unseeded = [GenerationConfig(max_new_tokens=12, stop_on_eos=False, temperature=t) for t in (1.0, 0.8)]
    batched = BatchedSpeculativeDecoder(target, make(), max_batch_size=4, draft_control=control)
    requests = [*zip(PROMPTS, configs)]
    requests[1:1], requests[4:4] = [(PROMPTS[2], unseeded[0])], [(PROMPTS[0], unseeded[1])]
    out = batched.generate([p for p, _ in requests], [c for _, c in requests])
    together = [r.token_ids for r, (_, c) in zip(out, requests) if c.seed is not None]
    assert batched.stats.num_drafted_tokens > 0 and batched.stats.num_accepted_tokens > 0
    assert all(len(r.token_ids) == 12 for r, (_, c) in zip(out, requests) if c.seed is None)
    alone = [BatchedSpeculativeDecoder(target, make(), max_batch_size=1, draft_control=control).generate([p], [c])[0]
             .token_ids for p, c in zip(PROMPTS, configs)]
    assert together == alone
    assert bool(tree_rows) == method.endswith("trees")  # trees were sampled; a draft model's, rows together
    assert max(tree_rows, default=0) > 1 or method not in ("draft+trees", "draft+shaped-trees")
    if method == "draft+nucleus":
        rows = {k: sum(r for kk, r in found if kk == k) for k in (28, 32)}
        assert rows[28] > rows[32] > 0, rows
