"""The tree size per round (specdecode.engine.speculation_cost, as "token-recycling"'s default): every size that
could win is tried, the best rate of measured accepted tokens over the calibrated forward costs wins, neighbours
are probed, and the engine feeds it every round."""

from __future__ import annotations

import pytest

from conftest import make_tiny_model
from specdecode import GenerationConfig, SpeculativeDecoder
from specdecode.drafters.token_recycling import TokenRecyclingDrafter
from specdecode.engine.cost_model import ForwardCosts
from specdecode.engine.speculation_cost import SpeculationCostController, SpeculationCostPolicy
from specdecode.errors import InvalidArgumentError


def _drive(controller: SpeculationCostController, accepted, rounds: int) -> list[int]:
    """Run ``rounds`` tree rounds (a tree of n nodes, n // 2 deep) accepting ``accepted(n)`` tokens."""
    chosen = []
    for _ in range(rounds):
        size = controller.round_cap()
        chosen.append(size)
        if size:
            controller.record(size, size, accepted(size))
        controller.record_round(size, size, 1.0, depth=max(1, size // 2) if size else None)
    return chosen


def _tree_policy(costs: ForwardCosts, probe_every: int, size_decay: float = 0.8) -> SpeculationCostPolicy:
    policy = SpeculationCostPolicy(costs, draft_node_s=0.0, prior=0.5, probe_every=probe_every, size_decay=size_decay)
    policy.trees = True  # as after a drafter's first tree
    return policy


def test_each_size_that_could_win_is_tried_then_the_best_rate_wins_with_probes():
    # A GPU-like device: verification nearly flat (C(n + 1) = 1 + 0.02 n), 3 tokens accepted at most: 4 nodes
    # is best (4 / 1.08 tokens per second against 4 / 1.16 for 8).
    controller = _tree_policy(ForwardCosts({1: 1.0, 65: 2.28}), probe_every=4, size_decay=0.5).controller(8)
    assert controller.sizes == [0, 1, 2, 4, 8]
    chosen = _drive(controller, lambda n: min(n, 3), 41)
    # every size once, smallest first, while it could still win: 1 (2 tokens in 1.02 s) and 2 (3 in 1.04) are
    # measured; 4 and 8 could beat 2's 3 / 1.04 if all their nodes were accepted
    assert chosen[:4] == [1, 2, 4, 8]
    later = chosen[4:]
    probes = [s for i, s in enumerate(later, start=5) if i % 4 == 0]
    assert [s for i, s in enumerate(later, start=5) if i % 4] == [4] * (len(later) - len(probes))
    assert probes and probes == ([8, 2] * len(probes))[: len(probes)]  # the neighbours above and below, in turn


def test_where_nothing_beats_a_plain_step_only_probes_draft():
    """A 2-core CPU in float32: a forward over n + 1 tokens costs about (n + 2) / 2 steps, and a third of
    the rounds accept one token: no size pays (1.33 / 1.5 tokens per second for n = 1, against 1)."""
    controller = _tree_policy(ForwardCosts({1: 1.0, 2: 1.5}), probe_every=8).controller(8)
    calls = iter(range(10_000))
    chosen = _drive(controller, lambda n: int(next(calls) % 3 == 0), 64)
    later = chosen[-40:]  # once the first lucky acceptances have decayed
    assert later.count(0) >= 40 - 40 // 8 and set(later) == {0, 1}  # plain steps but for the probes
    assert controller.gated == (controller._next()[0] == 0)


def test_a_round_that_drafted_nothing_is_no_evidence():
    """Token Recycling with nothing to offer drafts no tree: the size's mean is left as it was."""
    policy = _tree_policy(ForwardCosts({1: 1.0, 65: 2.28}), probe_every=4)
    controller = policy.controller(8)
    size = controller.round_cap()
    controller.record_round(size, 0, 1.0)
    assert size > 0 and policy.tree_accepted.get(size) is None and controller.round_cap() == size


def test_bad_settings_are_refused():
    with pytest.raises(InvalidArgumentError, match="decay must be in \\[0, 1\\), got 1.0"):
        SpeculationCostPolicy(size_decay=1.0)
    with pytest.raises(InvalidArgumentError, match="probe_every must be an integer >= 1, got 0"):
        SpeculationCostPolicy(probe_every=0)
    with pytest.raises(InvalidArgumentError, match="max_tokens must be an integer >= 1, got 0"):
        SpeculationCostPolicy().controller(0)


def test_the_engine_calibrates_and_feeds_every_tree_round_and_output_stays_exact():
    target = make_tiny_model("llama", seed=12)
    prompt = [5, 9, 12, 7, 5, 9, 12, 7, 5, 9]
    config = GenerationConfig(max_new_tokens=40, num_speculative_tokens=8, stop_on_eos=False)
    expected = SpeculativeDecoder(target).generate(prompt, config).token_ids
    policy = SpeculationCostPolicy(probe_every=8)  # "token-recycling"'s default (pipeline.size_policy)
    dec = SpeculativeDecoder(target, TokenRecyclingDrafter(max_nodes=8), draft_control=policy)
    assert dec.generate(prompt, config).token_ids == expected
    assert policy.target_costs is not None and {1, 9} <= set(policy.target_costs.seconds)  # calibrated to γ + 1
    assert policy.trees and policy.tree_accepted.means  # trees were priced by their measured acceptance
    assert policy.node_seconds.get(0) is not None  # the drafter's seconds per node were measured
    calibrated = policy.target_costs
    assert dec.generate(prompt, config).token_ids == expected  # a second generation shares what was learned
    assert policy.target_costs is calibrated  # timed once in the policy's life
