"""An adaptive draft exit that reads nothing between draft steps (``engine.draft_exit``): exact greedy
output in every mode, "masked" keeps the per-step exit's blocks, "previous-round" sizes blocks from the
previous round, one host sync per round, per-step by default, the fused steps' top probabilities, bad modes
refused."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_model
from helpers import perturbed_copy
from selfspec_helpers import REPETITIVE, one_thread  # noqa: F401 (a fixture)
from specdecode import GenerationConfig, SpeculativeDecoder
from specdecode.drafters import DraftModelDrafter, EarlyExitDrafter
from specdecode.drafters.cascade import CascadeDrafter
from specdecode.drafters.control import AdaptiveDraftExit, DraftControl
from specdecode.engine.batch_runner import BatchRunner
from specdecode.engine.batched import BatchedSpeculativeDecoder
from specdecode.engine.draft_exit import exit_blocks, exit_points, observe_exits
from specdecode.engine.fast_path import ModelRunner
from specdecode.engine.speculation_cost import SpeculationCostController
from specdecode.errors import InvalidArgumentError
from test_host_syncs import SyncCounter, _prompt

PROMPTS = [[5, 9, 12], REPETITIVE, [7, 3, 30, 41, 8, 11, 19], [44], [13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]
LENGTHS = [20, 9, 25, 14, 17]
MODES = ("per-step", "previous-round", "masked")


def _configs() -> list[GenerationConfig]:
    return [GenerationConfig(max_new_tokens=m, stop_on_eos=False) for m in LENGTHS]


def _drafters(target, draft):
    return {
        "draft": lambda: DraftModelDrafter(draft),
        "cascade": lambda: CascadeDrafter(draft),
        "early-exit": lambda: EarlyExitDrafter(target, 2),
    }


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_every_mode_gives_target_only_greedy_output_with_rows_joining(arch):
    target = make_tiny_model(arch)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    plain = SpeculativeDecoder(target)
    expected = [plain.generate(p, c).token_ids for p, c in zip(PROMPTS, _configs())]
    for name, make in _drafters(target, draft).items():
        for mode in MODES:
            for rule in ("row", "batch"):
                control = DraftControl(adaptive_exit=True, max_draft_tokens=6, exit_mode=mode)
                dec = BatchedSpeculativeDecoder(target, make(), max_batch_size=3, max_length=96,
                                                draft_control=control, exit_rule=rule)
                assert dec.exit_mode == mode
                got = [r.token_ids for r in dec.generate(PROMPTS, _configs())]
                assert got == expected, (name, mode, rule)
                assert 0 < dec.stats.num_accepted_tokens < dec.stats.num_drafted_tokens, (name, mode, rule)


def _one_row(target, drafter, mode, compile=False, threshold=0.6):
    control = DraftControl(adaptive_exit=True, max_draft_tokens=6, exit_mode=mode, exit_threshold=threshold)
    runner = ModelRunner(target, compile=True, graphs=False, name="target") if compile else None
    return SpeculativeDecoder(target, drafter, draft_control=control, runner=runner)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("method", ["draft", "cascade"])
def test_masked_keeps_the_per_step_blocks_and_drafts_the_whole_cap(method):
    """The same blocks, acceptance and thresholds as the per-step exit; more draft forwards (every row
    drafts its cap), and every round of an unsure block verifies fewer tokens than it drafted."""
    target = make_tiny_model("llama", seed=2)
    draft = perturbed_copy(target, noise=0.5, seed=3)
    make = _drafters(target, draft)[method]
    config = GenerationConfig(max_new_tokens=40, stop_on_eos=False)
    prompt = torch.tensor([REPETITIVE])
    step = _one_row(target, make(), "per-step").generate(prompt, config)
    masked = _one_row(target, make(), "masked").generate(prompt, config)
    previous = _one_row(target, make(), "previous-round").generate(prompt, config)
    assert masked.token_ids == step.token_ids == previous.token_ids
    assert previous.stats.num_draft_forwards < masked.stats.num_draft_forwards  # its blocks end sooner
    assert previous.stats.num_drafted_tokens == previous.stats.num_draft_forwards  # keeps all it drafts
    a, b = step.stats, masked.stats
    assert (b.num_target_forwards, b.num_drafted_tokens, b.num_accepted_tokens) == \
        (a.num_target_forwards, a.num_drafted_tokens, a.num_accepted_tokens)
    assert list(b.drafted_by_position) == list(a.drafted_by_position)
    assert b.final_draft_threshold == pytest.approx(a.final_draft_threshold)
    assert a.num_drafted_tokens < 6 * a.num_target_forwards, "the exit should stop some blocks early"
    assert b.num_draft_forwards > a.num_draft_forwards


def test_previous_round_sizes_each_block_from_the_last_rounds_exit_point():
    exit_ = AdaptiveDraftExit(0.5, max_draft_tokens=8)
    exit_.mode = "previous-round"
    assert exit_.next_length == 8
    assert observe_exits([exit_], [8], [3], "row") == [8]  # keeps its block: nothing cut
    assert exit_.next_length == 3
    assert observe_exits([exit_], [3], [4], "row") == [3]  # no unsure token among its 3: two more
    assert exit_.next_length == 5
    observe_exits([exit_], [7], [9], "row")
    assert exit_.next_length == 8  # never past max_draft_tokens


def test_observe_cuts_masked_rows_at_their_exit_point_or_the_batchs_latest():
    exits = []
    for _ in range(3):
        e = AdaptiveDraftExit(0.5, max_draft_tokens=6)
        e.mode = "masked"
        exits.append(e)
    # row 0 unsure at 2, row 1 at 4, row 2 never (its 6 tokens), a row without an exit
    assert observe_exits(exits + [None], [6, 6, 5, 3], [2, 4, 7, 1], "row") == [2, 4, 5, 3]
    assert observe_exits(exits, [6, 6, 3], [2, 4, 7], "batch") == [4, 4, 3]  # the loop's end: row 1's 4
    assert observe_exits(exits[:2], [6, 6], [2, 3], "batch") == [3, 3]


def test_exit_blocks_on_the_device_are_the_blocks_observe_keeps():
    """``exit_blocks`` (before the read, on the device) gives every row the block ``observe_exits`` keeps once the
    points are read: masked rows, other modes, rows without an exit or without tokens, both rules."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(300):
        n = int(torch.randint(1, 6, (1,), generator=generator))
        drafted = torch.randint(0, 7, (n,), generator=generator).tolist()
        points = [int(torch.randint(1, k + 3, (1,), generator=generator)) for k in drafted]
        kinds = torch.randint(0, 3, (n,), generator=generator).tolist()  # no exit, masked, previous-round
        exits = []
        for kind in kinds:
            e = AdaptiveDraftExit(0.5, max_draft_tokens=8) if kind else None
            if e is not None:
                e.mode = "masked" if kind == 1 else "previous-round"
            exits.append(e)
        for rule in ("row", "batch"):
            on_device = exit_blocks(torch.tensor(points), exits, drafted, rule).tolist()
            assert on_device == observe_exits(exits, drafted, points, rule), (drafted, points, kinds, rule)


def test_exit_points_are_the_first_unsure_position_per_row():
    exits = [AdaptiveDraftExit(0.5), AdaptiveDraftExit(0.9), None]
    tops = torch.tensor([[0.9, 0.4, 0.3], [0.95, 0.91, 0.92], [0.1, 0.1, 0.1]])
    assert exit_points(tops, exits).tolist() == [2, 4, 4]
    exits[0].threshold = 0.95
    assert exit_points(tops, exits).tolist() == [1, 4, 4]


def test_the_threshold_learns_whether_the_block_had_an_early_unsure_token():
    def after(point):
        e = AdaptiveDraftExit(0.5, alpha=0.0, beta2=0.0, epsilon=0.1, max_draft_tokens=6)
        e.observe(point, 6)
        e.update(6, 6, 6)
        return e.threshold

    assert after(None) == pytest.approx(0.5)  # no early exit: the threshold stays
    assert after(6) == pytest.approx(0.5)  # the cap's last token: as the per-step loop, no early exit
    assert after(2) == pytest.approx(0.4)  # exited early, drafts passing: draft longer


def _counted_syncs(dec, models, config):
    """Stream one generation of ``_prompt()``: its tokens, stats and the host syncs of its rounds (after the
    prefill's first token)."""
    counter = SyncCounter(models)
    stream = dec.stream(_prompt(), config)
    rounds = iter(stream)
    first = next(rounds)
    with counter.counting():
        counter.active = True
        tokens = first + [t for block in rounds for t in block]
    return tokens, stream.stats, counter.count


@pytest.mark.parametrize("method", ["draft", "cascade"])
@pytest.mark.parametrize("mode", ["previous-round", "masked"])
def test_one_host_sync_per_round_without_reads_between_draft_steps(method, mode, monkeypatch):
    target = make_tiny_model("llama", num_layers=3)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    make = {"draft": lambda: DraftModelDrafter(draft), "cascade": lambda: CascadeDrafter(draft, ngram_check=False)}
    config = GenerationConfig(max_new_tokens=40, stop_on_eos=False)
    expected = SpeculativeDecoder(target).generate(_prompt(), config).token_ids
    dec = _one_row(target, make[method](), mode, compile=True, threshold=0.05)  # longer blocks
    tokens, stats, syncs = _counted_syncs(dec, [target, draft], config)
    assert tokens == expected
    num_rounds = stats.num_target_forwards
    assert num_rounds > 3 and stats.num_drafted_tokens > num_rounds
    assert syncs <= num_rounds, f"{syncs} host syncs in {num_rounds} rounds"


def test_per_step_reads_every_draft_step():
    """The check above can fail: the per-step exit reads each step's confidence."""
    target = make_tiny_model("llama", num_layers=3)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    config = GenerationConfig(max_new_tokens=40, stop_on_eos=False)
    dec = _one_row(target, DraftModelDrafter(draft), "per-step", compile=True, threshold=0.05)
    _, stats, syncs = _counted_syncs(dec, [target, draft], config)
    assert syncs > 2 * stats.num_target_forwards


def test_per_step_is_the_default_and_only_an_exit_has_a_mode():
    target = make_tiny_model("llama", num_layers=2)
    dec = BatchedSpeculativeDecoder(target, DraftModelDrafter(perturbed_copy(target, 0.3)),
                                    draft_control=DraftControl(adaptive_exit=True))
    assert dec.exit_mode == "per-step"
    assert BatchedSpeculativeDecoder(target, DraftModelDrafter(perturbed_copy(target, 0.3)),
                                     draft_control=DraftControl(confidence_gate=0.5)).exit_mode is None


def test_an_unknown_mode_is_refused_with_the_allowed_ones():
    with pytest.raises(InvalidArgumentError, match=r"unknown draft exit mode 'lagged'; allowed: per-step, "
                                                   r"previous-round, masked"):
        DraftControl(adaptive_exit=True, exit_mode="lagged")


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("mode", ["previous-round", "masked"])
def test_read_free_modes_run_their_steps_fused_with_the_loops_blocks(mode, monkeypatch):
    """On the fast path a read-free exit's draft steps run as one ``BatchRunner.draft_steps`` call, whose
    top probabilities give the same blocks, thresholds and output as the unfused steps (``greedy_steps``, B = 2)."""
    target = make_tiny_model("llama", num_layers=3, seed=4)
    draft = perturbed_copy(target, noise=0.4, seed=5)
    calls = []
    original = BatchRunner.draft_steps

    def counted(self, *args, **kwargs):
        calls.append(args[2])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(BatchRunner, "draft_steps", counted)
    results = {}
    for fused in (True, False):
        drafter = DraftModelDrafter(draft)
        drafter.fused_draft_steps = fused
        control = DraftControl(adaptive_exit=True, max_draft_tokens=6, exit_mode=mode, exit_threshold=0.1)
        dec = BatchedSpeculativeDecoder(target, drafter, max_batch_size=2, max_length=96, draft_control=control,
                                        compile=True, graphs=False)
        out = dec.generate(PROMPTS[:3], _configs()[:3])
        results[fused] = ([r.token_ids for r in out], [r.stats.num_drafted_tokens for r in out],
                          [r.stats.num_accepted_tokens for r in out], [r.stats.final_draft_threshold for r in out])
        if fused:
            assert calls and all(c >= 1 for c in calls), calls
            calls.clear()
    assert not calls  # the switch off never fuses
    assert results[True] == results[False]
    plain = SpeculativeDecoder(target)
    assert results[True][0] == [plain.generate(p, c).token_ids for p, c in zip(PROMPTS[:3], _configs()[:3])]


@pytest.mark.usefixtures("one_thread")
def test_previous_round_shortens_the_draft_not_the_cap_the_cost_model_learns_from(monkeypatch):
    """With the cost model, the controller's ``record_round`` gets its own ``round_cap`` back (a shorter cap
    would read as a row near its end and hold its sizes down), while the rounds draft less."""
    target = make_tiny_model("llama", num_layers=3, seed=2)
    draft = perturbed_copy(target, noise=0.5, seed=3)
    events = []
    round_cap, record_round = SpeculationCostController.round_cap, SpeculationCostController.record_round

    def cap(self):
        events.append(("cap", round_cap(self)))
        return events[-1][1]

    def record(self, cap, *args, **kwargs):
        events.append(("record", cap))
        return record_round(self, cap, *args, **kwargs)

    monkeypatch.setattr(SpeculationCostController, "round_cap", cap)
    monkeypatch.setattr(SpeculationCostController, "record_round", record)
    control = DraftControl(adaptive_exit=True, max_draft_tokens=6, exit_mode="previous-round",
                           length_schedule="cost-model", exit_threshold=0.3)
    dec = BatchedSpeculativeDecoder(target, DraftModelDrafter(draft), max_batch_size=1, max_length=128,
                                    draft_control=control)
    result = dec.generate([REPETITIVE], [GenerationConfig(max_new_tokens=60, stop_on_eos=False)])[0]
    pairs = [(a[1], b[1]) for a, b in zip(events, events[1:]) if a[0] == "cap" and b[0] == "record"]
    assert len(pairs) > 10
    assert all(recorded == min(given, 6) for given, recorded in pairs[:-7])  # the budget binds at the end
    drafted_caps = result.stats.rounds_by_draft_cap
    assert any(drafted_caps[c] for c in range(1, 6)), drafted_caps  # previous-round drafted less than 6
