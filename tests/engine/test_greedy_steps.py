"""Greedy steps in the runner (``BatchRunner.greedy_steps``, ``forward_greedy``, the write positions advanced on
the device): what the fast path runs by default for a greedy round's draft steps and its verification.

* ``greedy_steps`` gives the tokens, finiteness flag and top probabilities of as many one-token calls (and of
  ``draft_steps``), through a truncated head too, and checks its arguments.
* Run in lockstep against the step-by-step loop (the same drafter with its runner's buckets hidden), the
  drafts, the draft cache, the stats and the output are the same, for the draft model, the cascade, layer
  skip and a truncated head (one host read per round and none inside the steps: ``test_fused_draft_steps``).
* ``forward_greedy`` gives ``__call__``'s logits and their argmax and finiteness, eagerly and from a bucket.
* A bucket's write positions, advanced on the device where every row moved by the same count, always equal
  the ones the host would have copied.

The static path (``graphs=False``, no torch.compile) runs the buckets' functions as compiled code would.
"""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_model
from helpers import perturbed_copy
from selfspec_helpers import one_thread  # noqa: F401 (a fixture)
from specdecode import GenerationConfig
from specdecode.drafters import CascadeDrafter, DraftModelDrafter
from specdecode.drafters import base
from specdecode.drafters.control import DraftControl
from specdecode.drafters.draft_head import DraftHead
from specdecode.engine import batch_runner
from specdecode.engine.batch_cache import BatchKVCache
from specdecode.engine.fast_path import FastPath
from specdecode.engine.batch_runner import BatchRunner
from specdecode.engine.verification import greedy_epilogue
from specdecode.errors import InvalidArgumentError, NonFiniteLogitsError
from test_batched_fast_path import PROMPTS, _configs
from test_fused_draft_steps import HEAD_IDS, _cache_rows, _drafters, _drafts, _engine


class _Calls(list):
    def __init__(self) -> None:
        super().__init__()
        self.with_tops: list[bool] = []
        self.pending: list[bool] = []


@pytest.fixture
def greedy_calls(monkeypatch) -> list:
    """Each ``BatchRunner.greedy_steps`` call: (the runner, rows, steps)."""
    calls = _Calls()
    original = BatchRunner.greedy_steps

    def counted(self, first, starts, num_steps, head_ids, with_tops=False, pending=None):
        calls.append((self, int(first.shape[0]), num_steps))
        calls.with_tops.append(with_tops)
        calls.pending.append(pending is not None)
        return original(self, first, starts, num_steps, head_ids, with_tops, pending)

    monkeypatch.setattr(BatchRunner, "greedy_steps", counted)
    return calls


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name, exit_mode", [("draft", None), ("draft-close", None), ("cascade", None),
                                             ("layer-skip", None), ("draft-truncated", None), ("draft", "masked"),
                                             ("cascade", "previous-round"), ("layer-skip", "masked")])
def test_greedy_steps_and_the_loop_give_the_same_drafts_cache_stats_and_output(name, exit_mode, greedy_calls):
    """Two engines in lockstep, B = 3 with rows joining and finishing at different lengths: one runs its draft
    steps in the runner (the default), the other's runner hides its buckets from the drafter, so it loops. With
    an adaptive exit that reads nothing between steps, the steps' top probabilities decide each row's block.
    "draft-close": a draft model close to the target, so that blocks are accepted whole and rounds start with
    first forwards of width 2 (the greedy steps start from a feed's last position). Every row's feed there is
    as wide (the draft has no context window), so the drafter's branch for feeds of uneven widths is not run
    here."""
    target = make_tiny_model("llama", num_layers=3)
    close = name == "draft-close"
    make = _drafters(target, perturbed_copy(target, noise=0.05 if close else 0.3, seed=1))["draft" if close else name]
    control = {"draft_control": DraftControl(adaptive_exit=True, exit_mode=exit_mode)} if exit_mode else {}
    steps, loop = _engine(target, make(), 3, False, **control), _engine(target, make(), 3, False, **control)
    loop.drafter.runner.steps_in_buckets = lambda n: False  # this instance only: the drafter loops
    drafts_steps, drafts_loop = _drafts(steps), _drafts(loop)
    for dec in (steps, loop):
        for prompt, config in zip(PROMPTS[:3], _configs()):
            dec.add(prompt, config)
    outputs: dict = {}
    while steps.has_work or loop.has_work:
        for key, dec in (("steps", steps), ("loop", loop)):
            for event in dec.step():
                outputs.setdefault((key, event.request_id), []).extend(event.token_ids)
        assert drafts_steps == drafts_loop
        got, want = _cache_rows(steps.drafter), _cache_rows(loop.drafter)
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    assert {r for r, _, _ in greedy_calls} == {steps.drafter.runner}, "only the first engine ran greedy_steps"
    assert all(with_tops == bool(exit_mode) for with_tops in greedy_calls.with_tops)
    # the draft model and layer skip hand over the verification's input (``Draft.block_ids``); a cascade's block
    # starts with n-gram tokens, a truncated head's columns are mapped after the steps: neither does
    assert set(greedy_calls.pending) == {name in ("draft", "draft-close", "layer-skip")}
    rows = {n for _, n, _ in greedy_calls}
    assert 3 in rows and len(greedy_calls) >= 3 and len(drafts_steps) > 5
    assert {k[1]: v for k, v in outputs.items() if k[0] == "steps"} == \
        {k[1]: v for k, v in outputs.items() if k[0] == "loop"}
    for stat in ("num_drafted_tokens", "num_accepted_tokens", "num_draft_forwards", "num_rounds"):
        assert getattr(steps.stats, stat) == getattr(loop.stats, stat), stat
    assert 0 < steps.stats.num_accepted_tokens < steps.stats.num_drafted_tokens


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", ["draft", "layer-skip"])
def test_the_first_forward_gives_its_epilogue_only_where_the_greedy_steps_start_from_it(name, monkeypatch,
                                                                                      greedy_calls):
    """The drafter's first forward is ``forward_greedy`` where the greedy steps follow it, once per greedy steps
    call; with a per-step exit, fused steps or the loop, its epilogue would go unread, so it is a plain call
    (fused steps: except in rounds whose step count has no fused function, which run the greedy steps), and
    ``draft_batch`` never computes an epilogue of its own. The output is the same."""
    target = make_tiny_model("llama", num_layers=3)
    make = _drafters(target, perturbed_copy(target, noise=0.3, seed=1))[name]
    calls: list = []
    original = BatchRunner.forward_greedy

    def counted(self, ids, starts, logits_to_keep, *args, **kwargs):
        calls.append(self)
        return original(self, ids, starts, logits_to_keep, *args, **kwargs)

    monkeypatch.setattr(BatchRunner, "forward_greedy", counted)
    recomputed: list = []  # epilogues draft_batch computes itself, for want of the first forward's
    monkeypatch.setattr(base, "greedy_epilogue", lambda logits: recomputed.append(1) or greedy_epilogue(logits))
    per_step = {"draft_control": DraftControl(adaptive_exit=True)}  # the default exit mode: "per-step"
    outputs, counts = {}, {}
    for case, fused, kwargs in (("steps", False, {}), ("per-step", False, per_step), ("fused", True, {}),
                                ("loop", False, {})):
        dec = _engine(target, make(), 2, fused, **kwargs)
        if case == "loop":
            dec.drafter.runner.steps_in_buckets = lambda n: False  # this instance only: the drafter loops
        calls.clear()
        greedy_calls.clear()
        recomputed.clear()
        outputs[case] = [r.token_ids for r in dec.generate(PROMPTS[:2], _configs()[:2])]
        drafting = [r for r in calls if r is dec.drafter.runner]
        assert len(drafting) == len(greedy_calls) and not recomputed, (case, len(drafting), len(greedy_calls))
        assert case == "fused" or (len(drafting) > 0) == (case == "steps"), (case, len(drafting))
        assert any(r is not dec.drafter.runner for r in calls)  # the target's greedy verification: unchanged
        counts[case] = len(drafting)
    assert counts["fused"] < counts["steps"], counts  # most fused rounds' first forwards are plain calls
    assert all(out == outputs["steps"] for out in outputs.values())


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("case", ["checked", "truncated", "padded", "unchecked", "per-step", "sampling"])
def test_the_cascades_check_reads_its_first_forwards_epilogue_with_the_same_drafts(case, monkeypatch):
    """The cascade's first forward is ``forward_greedy`` wherever its check reads every position's argmax (or the
    greedy steps start from it): the check's choice, the finiteness flag and the greedy steps' start come from the
    bucket's epilogue, with no argmax or finiteness kernel of the cascade's own. Run in lockstep, B = 3 with rows
    joining and finishing at different lengths, against the same cascade whose first forward is a plain call
    (the argmax and finiteness computed from the logits): the same drafts every round, the same draft cache,
    stats and output. "truncated": a truncated head, whose argmax is a column mapped to its token; "unchecked":
    ``ngram_check=False`` (the epilogue only where the greedy steps follow); "per-step": an exit that reads each
    step (the finiteness read on the host); "sampling": every row samples (the check's choice stays greedy);
    "padded": the draft's head has 16 columns past the vocabulary, one of which often wins the argmax, so the
    epilogue is not the check's choice. Both engines share the device-side packing of the check's indices, so
    each row's drafts are also checked against the row run alone (B = 1): their totals agree."""
    target = make_tiny_model("llama", num_layers=3)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    if case == "padded":
        vocab = draft.get_output_embeddings().weight.shape[0]
        draft.resize_token_embeddings(vocab + 16)
        with torch.no_grad():
            weight = draft.get_output_embeddings().weight
            weight[vocab:] = 0
            weight[vocab + 2] = 1.5 * weight[12]  # past the vocabulary: beats token 12 wherever its logit is > 0
    head = DraftHead.truncated(HEAD_IDS) if case == "truncated" else None
    control = {"draft_control": DraftControl(adaptive_exit=True)} if case == "per-step" else {}
    configs = [GenerationConfig(max_new_tokens=c.max_new_tokens, temperature=0.8, seed=i) if case == "sampling"
               else c for i, c in enumerate(_configs()[:3])]

    def make():
        return CascadeDrafter(draft, head=head, ngram_check=case != "unchecked")

    epilogue, host = _engine(target, make(), 3, False, **control), _engine(target, make(), 3, False, **control)
    plain = host.drafter

    def plain_first_forward(ids, starts, keep, max_tokens, exits, checks=False):
        return plain.runner(ids, starts, keep), None

    plain._first_forward = plain_first_forward  # this instance only: the host computes the argmax and finiteness
    calls: list = []
    original = BatchRunner.forward_greedy
    monkeypatch.setattr(BatchRunner, "forward_greedy",
                        lambda self, *args, **kwargs: calls.append(self) or original(self, *args, **kwargs))
    recomputed: list = []  # epilogues draft_batch computes itself, for want of the first forward's
    monkeypatch.setattr(base, "greedy_epilogue", lambda logits: recomputed.append(1) or greedy_epilogue(logits))
    drafts_epilogue, drafts_host = _drafts(epilogue), _drafts(host)
    for dec in (epilogue, host):
        for prompt, config in zip(PROMPTS[:3], configs):
            dec.add(prompt, config)
    outputs: dict = {}
    recomputed_by = {"epilogue": 0, "host": 0}
    while epilogue.has_work or host.has_work:
        for key, dec in (("epilogue", epilogue), ("host", host)):
            recomputed.clear()
            for event in dec.step():
                outputs.setdefault((key, event.request_id), []).extend(event.token_ids)
            recomputed_by[key] += len(recomputed)
        assert drafts_epilogue == drafts_host
        got, want = _cache_rows(epilogue.drafter), _cache_rows(plain)
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    assert {k[1]: v for k, v in outputs.items() if k[0] == "epilogue"} == \
        {k[1]: v for k, v in outputs.items() if k[0] == "host"}
    for stat in ("num_drafted_tokens", "num_accepted_tokens", "num_draft_forwards", "num_rounds"):
        assert getattr(epilogue.stats, stat) == getattr(host.stats, stat), stat
    assert epilogue.drafter.num_ngram_tokens == plain.num_ngram_tokens > 0
    assert epilogue.drafter.num_ngram_accepted == plain.num_ngram_accepted
    assert 0 < epilogue.stats.num_accepted_tokens < epilogue.stats.num_drafted_tokens
    drafter_calls = sum(r is epilogue.drafter.runner for r in calls)
    assert drafter_calls > 0 and not any(r is plain.runner for r in calls), drafter_calls
    # the greedy steps start from the first forward's epilogue: draft_batch computes none of its own
    greedy_steps_run = case in ("checked", "truncated", "unchecked")
    assert recomputed_by["epilogue"] == 0 and (recomputed_by["host"] > 0) == greedy_steps_run, recomputed_by
    totals = [0, 0, 0]  # each row alone: a row reading another's logits or indices would draft otherwise
    for prompt, config in zip(PROMPTS[:3], configs):
        alone = _engine(target, make(), 1, False, **control)
        alone.generate([prompt], [config])
        for i, value in enumerate((alone.stats.num_drafted_tokens, alone.stats.num_accepted_tokens,
                                   alone.drafter.num_ngram_tokens)):
            totals[i] += value
    assert totals == [epilogue.stats.num_drafted_tokens, epilogue.stats.num_accepted_tokens,
                      epilogue.drafter.num_ngram_tokens], totals


@pytest.mark.usefixtures("one_thread")
def test_the_cascade_from_its_epilogue_still_names_the_draft_model_for_non_finite_logits():
    """A NaN in the draft model's head reaches the round's one read through the epilogue's finiteness flag (the
    same flag for sampling rows), and raises naming the draft model. The NaN is in token 7's column, so every
    argmax is 7 (NaN ranks highest) and the prompt [11, 7, 7, ...], after which the target says 11, has its
    n-gram candidates (7s) all kept: the check's forward is the round's only draft forward, and its flag the only
    one."""
    target = make_tiny_model("llama", num_layers=2)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    with torch.no_grad():
        draft.get_output_embeddings().weight[7, 0] = float("nan")
    dec = _engine(target, CascadeDrafter(draft), 1, False)
    with pytest.raises(NonFiniteLogitsError, match="the draft model produced non-finite logits"):
        dec.generate([[11] + [7] * 11], [GenerationConfig(max_new_tokens=8)])
    assert dec.drafter.num_forwards == 1 and dec.drafter.num_ngram_tokens > 0


def _first(tokens: list[int], finite: bool = True) -> torch.Tensor:
    """(n, 2) greedy epilogue of the logits that give each row's first draft token: the token (or column), finite."""
    return torch.tensor([[t, int(finite)] for t in tokens])


def _allocated(batch: int = 2) -> tuple:
    target = make_tiny_model("llama", num_layers=2)
    dec = _engine(target, DraftModelDrafter(perturbed_copy(target, noise=0.3, seed=1)), batch, False)
    dec.generate([[5, 9, 12, 4, 8]] * batch, [GenerationConfig(max_new_tokens=3)] * batch)  # allocates the caches
    return dec, dec.drafter.runner


@torch.inference_mode()
def test_greedy_steps_equal_one_token_calls_and_draft_steps_and_flag_non_finite_logits():
    dec, runner = _allocated()
    vocab = runner.model.get_output_embeddings().weight.shape[0]
    tokens, finite, tops = runner.greedy_steps(_first([7, 11]), [4, 6], 3, None, with_tops=True)
    token, expected_tops = torch.tensor([[7], [11]]), []
    expected = [token]
    for i in range(3):
        logits = runner(token, [4 + i, 6 + i], 1)[:, -1]
        expected_tops.append(torch.softmax(logits.float(), -1).amax(-1))
        token = logits.argmax(-1, keepdim=True)
        expected.append(token)
    assert torch.equal(tokens, torch.cat(expected, dim=1)) and tokens.shape == (2, 4)  # the first token, then 3
    assert torch.equal(tops, torch.stack(expected_tops, dim=1))  # the same logits: bit for bit
    assert finite.dim() == 0 and bool(finite)
    assert runner.greedy_steps(_first([7, 11]), [4, 6], 3, None)[2] is None  # no tops asked
    fused = runner.draft_steps(torch.tensor([7, 11]), [4, 6], 3, None, vocab)
    assert torch.equal(fused[0], tokens[:, 1:]) and bool(fused[1])
    assert not bool(runner.greedy_steps(_first([7, 11], finite=False), [4, 6], 3, None)[1])  # the first's flag counts
    # Only the last step non-finite: the token it is fed has a NaN embedding (the first steps are finite).
    chosen = runner.greedy_steps(_first([7]), [4], 3, None)[0]
    embeddings = runner.model.get_input_embeddings().weight
    last_input = int(chosen[0, 2])
    assert last_input not in (7, int(chosen[0, 1]))  # else an earlier step would read it too
    saved = embeddings[last_input].clone()
    embeddings[last_input] = float("nan")
    try:
        assert bool(runner.greedy_steps(_first([7]), [4], 2, None)[1])  # the first two steps alone: finite
        assert not bool(runner.greedy_steps(_first([7]), [4], 3, None)[1])
    finally:
        embeddings[last_input] = saved


@torch.inference_mode()
def test_greedy_steps_place_the_pending_tokens_before_the_block(monkeypatch):
    """With ``pending``, the block comes back as the verification's input: each row's pending token, its first
    token, then the steps'; the pending slot's (unwritten) flag is not read, the first token's is."""
    dec, runner = _allocated()
    with monkeypatch.context() as patch:  # a zeroed buffer: a pending slot's flag read as part of the result is 0
        patch.setattr(torch, "empty", torch.zeros)
        assert bool(runner.greedy_steps(_first([7, 11]), [4, 6], 3, None, pending=torch.tensor([40, 41]))[1])
    plain, finite, _ = runner.greedy_steps(_first([7, 11]), [4, 6], 3, None)
    block, block_finite, _ = runner.greedy_steps(_first([7, 11]), [4, 6], 3, None, pending=torch.tensor([40, 41]))
    assert block.shape == (2, 5) and block[:, 0].tolist() == [40, 41] and torch.equal(block[:, 1:], plain)
    assert bool(finite) and bool(block_finite)
    for _ in range(3):  # whatever the buffer held before: the pending slot's flag is never part of the result
        assert not bool(runner.greedy_steps(_first([7, 11], finite=False), [4, 6], 2, None,
                                            pending=torch.tensor([40, 41]))[1])
    head_ids = torch.arange(runner.model.get_output_embeddings().weight.shape[0])
    with pytest.raises(InvalidArgumentError, match=r"places the pending token only without head ids"):
        runner.greedy_steps(_first([7, 11]), [4, 6], 3, head_ids, pending=torch.tensor([40, 41]))
    with pytest.raises(InvalidArgumentError, match=r"greedy_steps' pending must be \(rows,\) = \(2,\), got \(2, 1\)"):
        runner.greedy_steps(_first([7, 11]), [4, 6], 3, None, pending=torch.tensor([[40], [41]]))


@torch.inference_mode()
def test_greedy_steps_map_a_truncated_heads_columns_to_token_ids():
    """With head ids, each step's argmax is a column: the token fed to the next step and returned is its id."""
    dec, runner = _allocated(1)
    columns = runner.model.get_output_embeddings().weight.shape[0]
    head_ids = torch.arange(columns).flip(0)  # column j is token columns - 1 - j
    tokens, finite, _ = runner.greedy_steps(_first([columns - 1 - 7]), [4], 3, head_ids)  # the column of token 7
    token = torch.tensor([[7]])
    expected = [token]
    for i in range(3):
        token = head_ids[runner(token, [4 + i], 1)[:, -1].argmax(-1, keepdim=True)]
        expected.append(token)
    assert torch.equal(tokens, torch.cat(expected, dim=1)) and bool(finite)
    unmapped = runner.greedy_steps(_first([7]), [4], 3, None)[0]
    assert not torch.equal(tokens[:, 1:], unmapped[:, 1:])  # the mapping changed what was fed


@torch.inference_mode()
def test_greedy_steps_in_a_larger_rows_bucket_with_head_ids_and_tops_equal_one_token_calls():
    """Three rows in the rows bucket of four (the free row padded), a truncated head's ids and the top
    probabilities: the same tokens and tops as one-token calls, returned as (n, 1 + S)."""
    dec, runner = _allocated(4)
    assert 3 not in runner.rows and 4 in runner.rows  # the rows bucket is larger than the call
    columns = runner.model.get_output_embeddings().weight.shape[0]
    head_ids = torch.arange(columns).flip(0)
    starts = [4, 6, 5]
    first = _first([columns - 1 - t for t in (7, 11, 3)])
    tokens, finite, tops = runner.greedy_steps(first, starts, 3, head_ids, with_tops=True)
    token, expected_tops = torch.tensor([[7], [11], [3]]), []
    expected = [token]
    for i in range(3):
        logits = runner(token, [s + i for s in starts], 1)[:, -1]
        expected_tops.append(torch.softmax(logits.float(), -1).amax(-1))
        token = head_ids[logits.argmax(-1, keepdim=True)]
        expected.append(token)
    assert tokens.shape == (3, 4) and torch.equal(tokens, torch.cat(expected, dim=1))
    assert torch.equal(tops, torch.stack(expected_tops, dim=1)) and bool(finite)


def test_greedy_steps_check_their_arguments():
    dec, runner = _allocated(2)
    tokens = _first([5])
    with pytest.raises(InvalidArgumentError, match=r"greedy_steps' num_steps must be an integer >= 1, got 0"):
        runner.greedy_steps(tokens, [3], 0, None)
    with pytest.raises(InvalidArgumentError, match=r"greedy steps need .* a rows bucket for 3 rows \(rows buckets \[1, 2\]"):
        runner.greedy_steps(_first([5, 6, 7]), [3, 3, 3], 2, None)
    with pytest.raises(InvalidArgumentError, match=r"greedy_steps' first must be \(rows, 2\), got \(1,\)"):
        runner.greedy_steps(torch.tensor([5]), [3], 2, None)
    with pytest.raises(InvalidArgumentError, match=r"past the batch cache's capacity of 96"):
        runner.greedy_steps(tokens, [94], 3, None)
    with pytest.raises(InvalidArgumentError, match=r"greedy_steps needs one start \(an int >= 0\) per row of its 1 "
                                                   r"tokens, got \[3, 4\]"):
        runner.greedy_steps(tokens, [3, 4], 2, None)
    with pytest.raises(InvalidArgumentError, match=r"got \[-1\]"):
        runner.greedy_steps(tokens, [-1], 2, None)
    eager = BatchRunner(dec.drafter.model, BatchKVCache(dec.drafter.model, 1, 32), (1,), "draft model")
    assert not eager.steps_in_buckets(1)  # no fast path: the drafters run the loop


@torch.inference_mode()
@pytest.mark.parametrize("fast", [False, True])
def test_forward_greedy_gives_the_logits_of_a_call_and_their_argmax_and_finiteness(fast):
    model = make_tiny_model("qwen2", num_layers=2)
    cache = BatchKVCache(model, 2, 32, fast=FastPath((1, 2), 4, graphs=False) if fast else None)
    runner = BatchRunner(model, cache, (1, 4), "target model")
    ids = torch.tensor([[5, 9, 12], [4, 8, 3]])
    runner(ids, [0, 0], 3)  # allocates the cache (eagerly)
    step = torch.tensor([[7, 2], [6, 1]])
    expected = runner(step, [3, 3], 2)
    eager_before = runner.num_eager_forwards
    logits, greedy = runner.forward_greedy(step, [3, 3], 2)
    assert runner.num_eager_forwards == eager_before + (not fast)  # a bucket of width 4 on the fast path
    assert torch.equal(logits, expected) and greedy.shape == (2, 2, 2) and greedy.dtype == torch.long
    assert torch.equal(greedy, greedy_epilogue(expected))
    assert greedy[..., 1].all() and torch.equal(greedy[..., 0], expected.argmax(-1))
    assert runner.forward_greedy(step, [3, 3], 2, with_logits=False)[0] is None
    head = model.get_output_embeddings().weight
    saved = head[3].clone()
    head[3] = float("nan")
    try:
        assert not runner.forward_greedy(step, [3, 3], 2)[1][..., 1].any()
    finally:
        head[3] = saved


@torch.inference_mode()
def test_write_positions_advanced_on_the_device_equal_the_hosts(monkeypatch):
    """Calls whose rows all moved by one count advance the bucket's positions in place; others (another count
    per row, another row count, after a warm-up) copy them: either way the buffer holds each row's start + t,
    and the free rows 0 .. W - 1."""
    model = make_tiny_model("llama", num_layers=2)
    cache = BatchKVCache(model, 4, 64, fast=FastPath((1, 2, 4), 3, graphs=False))
    runner = BatchRunner(model, cache, (1, 3), "target model")
    runner(torch.tensor([[5, 9, 12, 4]] * 4), [0] * 4, 1)  # allocates the cache
    copies, copied = [], []
    original = batch_runner._copy_from_host
    monkeypatch.setattr(batch_runner, "_copy_from_host", lambda dst, values: (copied.append(values),
                                                                               original(dst, values)))

    def expected(starts, rows, width):
        return [[s + t for t in range(width)] for s in starts] + [list(range(width))] * (rows - len(starts))

    calls = [[4, 9], [5, 10], [8, 13], [9, 15], [10, 16], [10, 16], [3], [4], [6, 7, 8], [9, 10, 11]]
    for starts in calls:
        bucket = runner._bucket(next(r for r in runner.rows if r >= len(starts)), 3)
        before = len(copied)
        runner(torch.tensor([[1, 2, 3]] * len(starts)), starts, 1)
        copies.append(len(copied) - before)
        assert bucket.index.view(bucket.rows, 3).tolist() == expected(starts, bucket.rows, 3), starts
    # copied from the host: each bucket's first call, [9, 15] (rows moved by 1 and 2), [3] and [6, 7, 8] (another
    # rows bucket's first calls); the others (one move for all rows, or none) advanced on the device
    assert copies == [1, 0, 0, 1, 0, 0, 1, 0, 1, 0]
    runner.warm_up()
    bucket = runner._bucket(2, 3)
    assert bucket.starts is None and bucket.index.view(2, 3).tolist() == expected([], 2, 3)
    runner(torch.tensor([[1, 2, 3]] * 2), [11, 17], 1)
    assert bucket.index.view(2, 3).tolist() == expected([11, 17], 2, 3)
