"""The draft size per round from measured rounds (specdecode.engine.tree_cost): every size is tried, the
best measured rate wins, neighbours are probed, and the engine feeds it every round's seconds."""

from __future__ import annotations

import pytest

from conftest import make_tiny_model
from specdecode import GenerationConfig, SpeculativeDecoder
from specdecode.drafters.token_recycling import TokenRecyclingDrafter
from specdecode.engine.tree_cost import MeasuredSizeController, MeasuredSizePolicy, SizeEstimates
from specdecode.errors import InvalidArgumentError


def _drive(controller: MeasuredSizeController, seconds, accepted, rounds: int) -> list[int]:
    """Run ``rounds`` rounds against made-up costs: size -> seconds, size -> tokens accepted."""
    chosen = []
    for _ in range(rounds):
        size = controller.round_cap()
        chosen.append(size)
        if size:
            controller.record(size, size, accepted(size))
        controller.record_round(size, size, seconds(size))
    return chosen


def test_each_size_is_tried_then_the_best_rate_wins_with_probes():
    estimates = SizeEstimates(decay=0.5)
    controller = MeasuredSizeController(estimates, max_tokens=8, probe_every=4)
    assert controller.sizes == [0, 1, 2, 4, 8]
    # A GPU-like device: verification nearly flat, 3 tokens accepted at most: 4 nodes is best (4 / 1.08
    # tokens per second against 4 / 1.16 for 8).
    chosen = _drive(controller, lambda n: 1.0 + 0.02 * n, lambda n: min(n, 3), 41)
    assert chosen[:5] == [0, 1, 2, 4, 8]  # every size once, the plain step first
    later = chosen[5:]
    probes = [s for i, s in enumerate(later, start=6) if i % 4 == 0]
    assert [s for i, s in enumerate(later, start=6) if i % 4] == [4] * (len(later) - len(probes))
    assert probes and probes == ([8, 2] * len(probes))[: len(probes)]  # the neighbours above and below, in turn


def test_where_nothing_beats_a_plain_step_only_probes_draft():
    """A 2-core CPU in float32: a forward over n + 1 tokens costs about (n + 1) / 2 steps, and a third of
    the rounds accept one token: no size pays (1.33 / 1.5 tokens per second for n = 1, against 1)."""
    controller = MeasuredSizePolicy(probe_every=8).controller(8)
    calls = iter(range(10_000))
    chosen = _drive(controller, lambda n: 1.0 + 0.5 * n, lambda n: int(next(calls) % 3 == 0), 64)
    later = chosen[-40:]  # once the first lucky acceptances have decayed
    assert later.count(0) >= 40 - 40 // 8 and set(later) == {0, 1}  # plain steps but for the probes
    assert controller.gated == (controller._next()[0] == 0)


def test_bad_settings_are_refused():
    with pytest.raises(InvalidArgumentError, match="decay must be in \\[0, 1\\), got 1.0"):
        MeasuredSizePolicy(decay=1.0)
    with pytest.raises(InvalidArgumentError, match="probe_every must be an integer >= 1, got 0"):
        MeasuredSizePolicy(probe_every=0)
    with pytest.raises(InvalidArgumentError, match="max_tokens must be an integer >= 1, got 0"):
        MeasuredSizePolicy().controller(0)


def test_the_engine_times_every_round_and_output_stays_exact():
    target = make_tiny_model("llama", seed=12)
    prompt = [5, 9, 12, 7, 5, 9, 12, 7, 5, 9]
    config = GenerationConfig(max_new_tokens=40, num_speculative_tokens=8, stop_on_eos=False)
    expected = SpeculativeDecoder(target).generate(prompt, config).token_ids
    policy = MeasuredSizePolicy()
    dec = SpeculativeDecoder(target, TokenRecyclingDrafter(max_nodes=8), draft_control=policy)
    assert dec.generate(prompt, config).token_ids == expected
    assert set(policy.estimates.seconds) >= {0, 1, 2, 4, 8}  # every size was timed by the engine
    assert dec.generate(prompt, config).token_ids == expected  # a second generation shares what was learned
