"""One cost model for every drafter (specdecode.engine.speculation_cost): the size choice on hand-made costs and
acceptances, the estimates by depth, priors, probes, calibration, the engine's calls through the protocol, and
exact greedy output with the "cost-model" draft control."""

from __future__ import annotations

import time

import pytest

from conftest import make_tiny_model
from helpers import FixedCapController, perturbed_copy
from specdecode import GenerationConfig, SpeculativeDecoder
from specdecode.drafters import DraftModelDrafter, PromptLookupDrafter
from specdecode.drafters.control import DraftControl
from specdecode.drafters.token_recycling import TokenRecyclingDrafter
from specdecode.engine.batched import BatchedSpeculativeDecoder
from specdecode.engine.cost_model import (
    DRAFT_MODEL_PRIOR,
    PROMPT_LOOKUP_PRIOR,
    DepthAcceptance,
    ForwardCosts,
    expected_tokens,
)
from specdecode.engine.protocol import DraftPolicy, RoundController
from specdecode.engine.speculation_cost import (
    EXIT_PROBE_TOKENS,
    RARE_PROBE_FACTOR,
    SpeculationCostController,
    SpeculationCostPolicy,
    calibration_widths,
)
from specdecode.errors import InvalidArgumentError

LLAMA_CPP_15B = ForwardCosts({1: 0.0327, 2: 0.0560, 4: 0.0917, 8: 0.2150})  # ms on a 2-core EPYC (issue 30)
FLAT = ForwardCosts({1: 1.0, 65: 1.0})


def _choice(costs, prior, gamma, **kw) -> int:
    return SpeculationCostPolicy(costs, prior=prior, **kw).controller(gamma).round_cap()


def test_flat_verification_picks_the_largest_size():
    assert _choice(FLAT, 0.3, 8) == 8  # every token drafted is free: (1 + Σ 0.3^d) grows with k
    assert _choice(FLAT, 0.3, 8, draft_node_s=0.5) < 8  # a draft that costs half a step per token drafts less


def test_a_steep_verification_picks_a_plain_step_at_low_acceptance():
    # llama.cpp: C(2)/C(1) = 1.71, so a token needs α >= 0.71 to pay; at 0.3 nothing does.
    assert _choice(LLAMA_CPP_15B, 0.3, 7, probe_every=100) == 0
    assert _choice(LLAMA_CPP_15B, 0.95, 7) > 0


@pytest.mark.parametrize("alpha, expected", [(0.49, 0), (0.51, 1)])
def test_the_break_even_by_hand(alpha, expected):
    # C(1) = 1 s, C(2) = 1.5 s: drafting one token gives (1 + α) / 1.5 tokens per second against 1: α = 0.5.
    assert _choice(ForwardCosts({1: 1.0, 2: 1.5}), alpha, 1, probe_every=100) == expected


@pytest.mark.parametrize("alpha, expected", [(0.74, 0), (0.76, 1)])
def test_the_break_even_with_a_draft_cost_by_hand(alpha, expected):
    # plus 0.25 s per drafted token: (1 + α) / 1.75 = 1 at α = 0.75.
    assert _choice(ForwardCosts({1: 1.0, 2: 1.5}), alpha, 1, draft_node_s=0.25, probe_every=100) == expected


@pytest.mark.parametrize("c3, expected", [(1.6, 1), (1.4, 2)])
def test_acceptance_by_depth_prices_each_depth(c3, expected):
    # α_1 = 0.9, α_2 = 0.5: E(1) = 1.9, E(2) = 1 + 0.9 + 0.45 = 2.35. C = 1, 1.2, c3: rates 1, 1.583, 2.35 / c3
    # (1.469 at 1.6: one token; 1.679 at 1.4: two).
    policy = SpeculationCostPolicy(ForwardCosts({1: 1.0, 2: 1.2, 3: c3}), prior=0.5, probe_every=100)
    depths = policy.acceptance()
    depths.accepted[:], depths.trials[:] = [9.0, 5.0], [10.0, 10.0]  # 9 of 10 at depth 1, 5 of 10 at depth 2
    assert policy.expected_tokens(2) == pytest.approx(2.35)
    assert policy.controller(2).round_cap() == expected


def test_uniform_acceptance_agrees_with_the_linear_cost_model():
    """With one α at every depth the chain's choice is the argmax of Leviathan et al.'s formula,
    (1 - α^(k+1)) / (1 - α) over k · c + C(k + 1) (the linear cost model this one replaced)."""
    chosen = []
    for alpha in (0.5, 0.7, 0.8, 0.9, 0.95, 0.99):
        rates = [expected_tokens(alpha, k) / (k * 0.004 + LLAMA_CPP_15B.at(k + 1)) for k in range(8)]
        policy = SpeculationCostPolicy(LLAMA_CPP_15B, draft_node_s=0.004, prior=alpha, probe_every=1000)
        chosen.append(policy.controller(7).round_cap())
        assert chosen[-1] == rates.index(max(rates)), alpha
    assert chosen[0] == 0 < chosen[-1]  # the choice changes with α (a plain step, then drafting)


def test_depth_estimates_count_successes_to_the_first_rejection():
    depths = DepthAcceptance(prior=0.5, prior_weight=2.0, decay=0.9)
    depths.update(3, 1)  # depth 1 accepted, depth 2 rejected, depth 3 never reached
    assert depths.alpha(1) == pytest.approx((0.9 * 1.0 + 1) / (0.9 * 2.0 + 1))
    assert depths.alpha(2) == pytest.approx(0.9 * 1.0 / (0.9 * 2.0 + 1))
    assert depths.alpha(3) == 0.5  # the prior
    depths.update(2, 2)  # both accepted: no failure recorded past the block
    assert depths.alpha(2) > 0.9 * 1.0 / (0.9 * 2.0 + 1)
    assert len(depths.by_depth()) == 2
    assert depths.expected_accepted(2) == pytest.approx(depths.alpha(1) * (1 + depths.alpha(2)))
    with pytest.raises(InvalidArgumentError, match="got 3 of 2"):
        depths.update(2, 3)


class _Drafter:
    def __init__(self, with_model: bool) -> None:
        self.supports_exit_policy = with_model


@pytest.mark.parametrize("with_model, prior", [(False, PROMPT_LOOKUP_PRIOR), (True, DRAFT_MODEL_PRIOR)])
def test_the_prior_is_the_drafters_measured_one_and_costs_are_measured_once(with_model, prior):
    asked = []

    def measure(widths):
        asked.append(tuple(widths))
        return {w: 0.01 * (1 + w) for w in widths}

    policy = SpeculationCostPolicy()
    policy.calibrate(measure, 9, _Drafter(with_model))
    assert policy.acceptance().alpha(1) == prior
    assert asked == [calibration_widths(9)] == [(1, 2, 3, 5, 9)]
    policy.calibrate(measure, 6, _Drafter(not with_model))  # narrower: nothing new to time, the prior stays
    assert len(asked) == 1 and policy.acceptance().alpha(1) == prior
    assert policy.seconds(3) == pytest.approx(0.05)  # C(4), halfway between C(3) = 0.04 and C(5) = 0.06
    assert SpeculationCostPolicy(prior=0.3).acceptance().alpha(1) == 0.3  # a prior given wins


def test_a_plain_step_probes_one_token_until_a_round_drafts():
    controller = SpeculationCostPolicy(LLAMA_CPP_15B, prior=0.2, probe_every=4).controller(7)
    chosen = [controller.round_cap() for _ in range(4)]
    assert chosen == [0, 0, 0, 1] and controller.num_probes == 1
    controller.record_round(1, 0, 0.03)  # the drafter had nothing: no evidence, the probe stays due
    assert controller.round_cap() == 1
    controller.record(1, 1, 1)
    controller.record_round(1, 1, 0.05, depth=1)
    assert controller.policy.acceptance().alpha(1) > 0.2
    assert controller.round_cap() == 0  # (0.2·2·0.9 + 1) / (2·0.9 + 1) = 0.49: still below break-even


def test_a_probe_that_finds_nothing_paying_doubles_the_wait_and_a_paying_size_resets_it():
    """Probes of a chain whose best size is 0 back off: 4, 8, 16, 32 and then 32 plain steps apart
    (RARE_PROBE_FACTOR x probe_every at most); a probe after which drafting pays brings the wait back to 4."""
    policy = SpeculationCostPolicy(LLAMA_CPP_15B, prior=0.2, probe_every=4)
    controller = policy.controller(7)

    def plain_steps_to_next_probe():
        steps = 0
        while controller.round_cap() == 0:
            steps += 1
        return steps

    waits = []
    for _ in range(5):
        waits.append(plain_steps_to_next_probe())
        controller.record(1, 1, 0)  # each probe rejected
        controller.record_round(1, 1, 0.05, depth=1)
    assert waits == [3, 7, 15, 31, 31] and RARE_PROBE_FACTOR * 4 == 32
    policy.depths = DepthAcceptance(1.0, prior_weight=100.0)  # the text turns predictable
    controller.record(3, 3, 3)
    controller.record_round(3, 3, 0.05, depth=3)
    assert controller.round_cap() > 0  # drafting pays, and the wait is reset
    policy.depths = DepthAcceptance(0.0, prior_weight=100.0)  # until nothing pays again
    assert plain_steps_to_next_probe() == 3


def test_a_chain_probes_one_deeper_than_its_best():
    policy = SpeculationCostPolicy(ForwardCosts({1: 1.0, 2: 1.2, 3: 2.0, 8: 8.0}), prior=0.9, probe_every=5)
    controller = policy.controller(7)
    best = policy.controller(7).round_cap()
    chosen = [controller.round_cap() for _ in range(10)]
    assert 0 < best < 7
    assert chosen == [best] * 4 + [best + 1] + [best] * 4 + [best + 1]


def test_no_drafting_where_nothing_could_pay():
    costs = ForwardCosts({1: 1.0, 2: 2.5})  # a second token costs 1.5 steps: even α = 1 gives 2 / 2.5
    controller = SpeculationCostPolicy(costs, prior=1.0, probe_every=1).controller(1)
    assert [controller.round_cap() for _ in range(5)] == [0] * 5 and controller.num_probes == 0


def test_a_draft_that_pays_only_at_near_full_acceptance_does_not_draft_or_probe():
    # llama.cpp on a 2-core Xeon: the 1.5B target's forwards and the 0.5B draft's 44.1 ms step (seconds).
    costs = ForwardCosts({1: 0.0641, 2: 0.1021, 4: 0.1158, 8: 0.2077})
    policy = SpeculationCostPolicy(costs, draft_node_s=0.0441, prior=0.88, probe_every=2, max_size=7)
    assert 0.95 < policy.break_even(3) < 1.0  # 3 tokens would pay if nearly all were accepted
    controller = policy.controller(7)
    assert not policy.can_pay(controller.sizes)
    assert [controller.round_cap() for _ in range(40)] == [0] * 40 and controller.num_probes == 0
    cheaper = SpeculationCostPolicy(costs, draft_node_s=0.02, prior=0.88, probe_every=2, max_size=7)
    assert cheaper.can_pay(controller.sizes) and cheaper.controller(7).round_cap() > 0


def test_a_measured_draft_cost_too_high_is_probed_again_rarely():
    """A first round's slow draft (first-shape kernels) must not stop drafting for good: with a measured
    s_node where no size pays, one token is tried every RARE_PROBE_FACTOR x probe_every plain steps; with a
    fixed s_node (the llama.cpp draft's) never."""
    from specdecode.engine.speculation_cost import RARE_PROBE_FACTOR

    policy = SpeculationCostPolicy(FLAT, prior=0.9, probe_every=2)
    controller = policy.controller(3)
    assert controller.round_cap() == 3  # flat costs, nothing measured of the draft: the longest block
    controller.record(3, 3, 3)
    controller.record_round(3, 3, 100.0, draft_seconds=90.0, depth=3)  # 30 s per drafted node
    assert not policy.can_pay(controller.sizes)
    chosen = [controller.round_cap() for _ in range(2 * RARE_PROBE_FACTOR * 2)]
    assert chosen.count(1) == 2 and chosen[RARE_PROBE_FACTOR * 2 - 1] == 1 and set(chosen) == {0, 1}
    fixed = SpeculationCostPolicy(FLAT, draft_node_s=30.0, prior=0.9, probe_every=2).controller(3)
    assert [fixed.round_cap() for _ in range(4 * RARE_PROBE_FACTOR)] == [0] * 4 * RARE_PROBE_FACTOR


def test_sizes_stay_within_a_cap_the_engine_lowered():
    """Where the engine gives a row less than the controller chose (its share of max_verify_tokens), the
    controller chooses within that cap for probe_every rounds instead of choosing an unmeasured size again
    and again; afterwards it may try the larger sizes once more."""
    policy = SpeculationCostPolicy(ForwardCosts({1: 1.0, 65: 1.1}), prior=0.5, probe_every=4)
    policy.trees = True
    controller = policy.controller(16)
    for _ in range(10):  # trees: each size tried once, smallest first, until one above 4
        big = controller.round_cap()
        if big > 4:
            break
        if big:
            controller.record(big, big, min(big, 2))
            controller.record_round(big, big, 1.0, depth=max(1, big // 2))
    assert big > 4 and big not in policy.tree_accepted.means
    controller.record(4, 4, 2)  # the engine cut it to 4
    controller.record_round(4, 4, 1.0, depth=2)
    assert max(controller.sizes) == 4
    following = []
    for _ in range(5):  # probe_every + 1 rounds under the ceiling
        size = controller.round_cap()
        following.append(size)
        if size:
            controller.record(size, size, min(size, 2))
            controller.record_round(size, size, 1.0, depth=max(1, size // 2))
    assert max(following) <= 4
    assert max(controller.sizes) == 16  # the ceiling expired


def _tree_round(controller, size, accepted, depth=None):
    controller.record(size, size, accepted)
    controller.record_round(size, size, 1.0, depth=depth if depth is not None else max(1, size // 2))


def test_trees_try_each_size_then_price_measured_acceptance_with_the_forward_costs():
    # GPU-like: verification nearly flat. Trees accept min(n, 3) tokens: 4 nodes has the best rate
    # (4 / 1.08 against 4 / 1.16 for 8).
    policy = SpeculationCostPolicy(ForwardCosts({1: 1.0, 65: 2.28}), prior=0.5, probe_every=4)
    controller = policy.controller(8)
    first = controller.round_cap()  # chain mode first: its choice, then a tree is seen
    _tree_round(controller, first, min(first, 3))
    assert policy.trees and controller.sizes == [0, 1, 2, 4, 8]
    chosen = []
    for _ in range(40):
        size = controller.round_cap()
        chosen.append(size)
        if size:
            _tree_round(controller, size, min(size, 3))
    # 8 was tried; 1 never: even accepting its node (2 tokens in 1.02 s) it cannot beat 4 (4 tokens in 1.08 s).
    assert set(policy.tree_accepted.means) >= {4, 8} and 1 not in policy.tree_accepted.means
    later = chosen[10:]
    assert later.count(4) >= len(later) - len(later) // 4 - 1  # the best, but for the probes
    assert set(later) - {4} <= {2, 8}  # probes are the neighbours


def test_a_tree_size_that_cannot_win_is_not_tried():
    # CPU-like: C(w) = w steps. A tree of 8 nodes could at best give 9 tokens in 9 steps (1 per step),
    # never more than a measured 2-node tree accepting 2 (3 tokens in 3 steps): skipped.
    policy = SpeculationCostPolicy(ForwardCosts({1: 1.0, 2: 2.0}), prior=0.5, probe_every=1000)
    policy.trees = True
    for size in (1, 2, 4):
        policy.tree_accepted.add(size, float(min(size, 2)) + 0.5)
    controller = policy.controller(8)
    assert controller.round_cap() != 8


class _Recording(FixedCapController):
    """A controller that keeps the protocol's default ``record_round``; the engine must call it."""

    def record_round(self, cap, num_drafted, seconds, *, draft_seconds=0.0, depth=None) -> None:
        self.log.append(("round", num_drafted, depth))
        super().record_round(cap, num_drafted, seconds, draft_seconds=draft_seconds, depth=depth)


class _Policy(DraftPolicy):
    adaptive_exit = False
    active = True

    def __init__(self) -> None:
        self.log, self.calibrations = [], []

    def controller(self, gamma):
        return _Recording(self.log)

    def calibrate(self, measure, max_width, drafter):
        self.calibrations.append((max_width, dict(measure([1, max_width]))))


def test_the_engine_calls_the_protocol_every_round_and_calibrates_once():
    target = make_tiny_model("llama", seed=3)
    prompt = [5, 9, 12, 7, 5, 9, 12, 7, 5, 9]
    config = GenerationConfig(max_new_tokens=12, num_speculative_tokens=4, stop_on_eos=False)
    policy = _Policy()
    dec = SpeculativeDecoder(target, TokenRecyclingDrafter(max_nodes=4), draft_control=policy)
    result = dec.generate(prompt, config)
    rounds = [e for e in policy.log if e[0] == "round"]
    assert len(rounds) == result.stats.num_target_forwards >= 1
    assert all((e[2] is None) if e[1] == 0 else (1 <= e[2] <= e[1]) for e in rounds)  # depth <= nodes
    assert any(e[1] > 0 and e[2] < e[1] for e in rounds)  # a tree was reported with its depth
    assert [e[1] for e in policy.log if e[0] == "record"] == [e[1] for e in rounds if e[1]]  # record, then the round
    assert len(policy.calibrations) == 1 and set(policy.calibrations[0][1]) == {1, 5}
    assert all(s > 0 for s in policy.calibrations[0][1].values())
    # The protocol's default is a no-op: a controller that does not override it runs.
    assert RoundController.record_round(object(), 1, 1, 0.1) is None
    assert DraftPolicy.calibrate(object(), lambda w: {}, 2, None) is None


class _DraftSeconds(_Recording):
    def record_round(self, cap, num_drafted, seconds, *, draft_seconds=0.0, depth=None) -> None:
        if num_drafted:
            self.log.append(("draft_s", draft_seconds))
        self.log.append(("round_s", seconds))


class _DraftSecondsPolicy(_Policy):
    def controller(self, gamma):
        return _DraftSeconds(self.log)


def test_the_deferred_draft_prefill_is_not_charged_to_the_rounds_draft_seconds(monkeypatch):
    """The draft model's prompt prefill, deferred to its first ``propose``, is prefill: a cost model that
    charged it to the first round's drafted tokens would price a draft token at a prompt's prefill."""
    import specdecode.drafters.draft_model as draft_model

    prefill = draft_model.batch_prefill

    def slow_prefill(*args, **kwargs):
        time.sleep(0.5)
        return prefill(*args, **kwargs)

    monkeypatch.setattr(draft_model, "batch_prefill", slow_prefill)
    target = make_tiny_model("llama", seed=3)
    drafter = DraftModelDrafter(perturbed_copy(target, noise=0.3, seed=2))
    policy = _DraftSecondsPolicy()
    config = GenerationConfig(max_new_tokens=8, num_speculative_tokens=4, stop_on_eos=False)
    SpeculativeDecoder(target, drafter, draft_control=policy).generate([5, 9, 12, 7, 5, 9], config)
    seconds = [e[1] for e in policy.log if e[0] == "draft_s"]
    assert seconds and drafter.prefill_time_s >= 0.5  # the prompt was prefilled inside the first propose
    assert max(seconds) < 0.5  # and left out of every round's draft seconds
    assert max(e[1] for e in policy.log if e[0] == "round_s") < 0.5  # and of its round seconds


@pytest.fixture(scope="module")
def pair():
    target = make_tiny_model("llama", seed=21)
    return target, perturbed_copy(target, noise=0.3, seed=2)


@pytest.mark.parametrize("method", ["prompt-lookup", "draft", "token-recycling"])
def test_greedy_output_equals_target_only_with_the_cost_model(pair, method):
    target, draft = pair
    prompts = [[5, 9, 12, 7, 5, 9, 12, 7, 5, 9], [3, 30, 41, 8, 11, 3, 30, 41]]
    config = GenerationConfig(max_new_tokens=30, num_speculative_tokens=6, stop_on_eos=False)
    plain = SpeculativeDecoder(target)
    make = {"prompt-lookup": PromptLookupDrafter, "draft": lambda: DraftModelDrafter(draft),
            "token-recycling": lambda: TokenRecyclingDrafter(max_nodes=6)}[method]
    control = DraftControl(length_schedule="cost-model")
    dec = SpeculativeDecoder(target, make(), draft_control=control)
    drafted = 0
    for prompt in prompts:
        result = dec.generate(prompt, config)
        assert result.token_ids == plain.generate(prompt, config).token_ids
        drafted += result.stats.num_drafted_tokens
    assert drafted > 0  # the cost model drafted (a tiny model's verification is nearly flat)
    policy = control.cost_policy
    assert policy.target_costs is not None and 1 in policy.target_costs.seconds
    if method == "draft":
        assert not policy.trees and policy.acceptance().by_depth()  # chains measured by depth
    elif method == "prompt-lookup":  # chains measured by depth, per n-gram size matched
        assert not policy.trees and policy.by_match and not policy.acceptance().by_depth()
        assert policy.match_depths and all(1 <= n <= 3 for n in policy.match_depths)
        assert any(d.by_depth() for d in policy.match_depths.values())
    # Batched, two rows at once: each row's output is its own target-only output.
    batched = BatchedSpeculativeDecoder(target, make(), max_batch_size=2, max_length=96, num_speculative_tokens=6,
                                        draft_control=DraftControl(length_schedule="cost-model"))
    for prompt, result in zip(prompts, batched.generate(prompts, config)):
        assert result.token_ids == plain.generate(prompt, config).token_ids


def test_the_control_is_refused_with_a_gate_and_takes_adaptive_exit_within_its_cap():
    with pytest.raises(InvalidArgumentError, match="cost-model.*confidence_gate=0.5"):
        DraftControl(length_schedule="cost-model", confidence_gate=0.5)
    alone = DraftControl(length_schedule="cost-model").controller(3)
    assert isinstance(alone, SpeculationCostController) and alone.exit is None and alone.max_tokens == 3
    both = DraftControl(length_schedule="cost-model", adaptive_exit=True, max_draft_tokens=7).controller(3)
    assert isinstance(both, SpeculationCostController) and both.max_tokens == 7  # the exit's cap, as without
    assert both.exit is not None and both.exit.threshold == 0.6
    both.record(4, 4, 0)  # a rejected block: the exit's threshold rises, as Draft & Verify's
    assert both.exit.threshold > 0.6
    assert DraftControl().cost_policy is None


class _Exit:
    def __init__(self) -> None:
        self.updates = []

    def update(self, num_drafted, num_accepted, cap) -> None:
        self.updates.append((num_drafted, num_accepted, cap))


def test_with_adaptive_exit_drafting_and_plain_steps_are_chosen_by_their_measured_rates():
    policy = SpeculationCostPolicy(ForwardCosts({1: 1.0}), prior=0.5, probe_every=4)
    exit = _Exit()
    controller = policy.controller(6, exit=exit)
    assert policy.plain_rate() == 1.0  # 1 / C_target(1) before any plain round
    assert controller.round_cap() == 6  # no drafting round measured yet: draft, up to the cap
    controller.record(6, 3, 3)
    controller.record_round(6, 3, 2.0)  # 4 tokens in 2 s: 2 tok/s against 1
    assert exit.updates == [(3, 3, 6)] and controller.exit_rounds.rate == 2.0
    assert controller.round_cap() == 6
    rounds = 0
    while controller.round_cap() == 6:  # rounds of 1 token in 2 s pull the drafting rate below 1 tok/s
        controller.record(6, 2, 0)
        controller.record_round(6, 2, 2.0)
        rounds += 1
    assert 1 <= rounds <= 10 and controller.exit_rounds.rate < 1.0
    controller.record_round(0, 0, 0.5)  # the round that ended the loop: a plain step, at 2 tok/s
    assert policy.plain_rate() == 2.0
    waits, plain_steps = [], 1  # the drafting arm is probed after 3, then 7, then 15 plain steps
    for _ in range(3):
        while (cap := controller.round_cap()) == 0:
            controller.record_round(0, 0, 0.5)
            plain_steps += 1
        assert cap == EXIT_PROBE_TOKENS == 3  # a probe is short
        controller.record(3, 1, 0)  # each probe loses
        controller.record_round(6, 1, 2.0)
        waits.append(plain_steps)
        plain_steps = 0
    assert waits == [3, 7, 15] and controller.num_probes == 3
    # The next generation starts from the earlier drafting rounds (slower: a plain step) until its own
    # first drafting round, and then goes by its own: one fast probe turns it back to drafting.
    later = policy.controller(6, exit=_Exit())
    assert later.round_cap() == 0 and later.exit_rounds.rate is None and policy.plain_rate() == 2.0
    while later.round_cap() == 0:
        later.record_round(0, 0, 0.5)
    later.record(3, 3, 3)
    later.record_round(3, 3, 2.1)  # every token accepted, but 4 tokens in 2.1 s: slower than plain steps
    assert later.round_cap() == 0
    while later.round_cap() == 0:
        later.record_round(0, 0, 0.5)
    later.record(3, 2, 1)
    later.record_round(3, 2, 0.9)  # a rejection, but 2 tokens in 0.9 s beat plain steps: draft at the full cap
    assert later.round_cap() == 6 and later.exit_rounds.rate is None
    later.record(6, 6, 6)
    later.record_round(6, 6, 2.0)  # 7 tokens in 2 s: drafting goes on
    assert later.exit_rounds.rate == 3.5 and later.round_cap() == 6
    assert policy.exit_rounds.rate < 2.0  # though the policy's history is slower


def test_with_adaptive_exit_a_generation_prices_the_plain_arm_by_its_own_plain_steps():
    """A step's cost grows with the context: a generation on a long prompt compares its drafting rounds with its
    own plain steps once it has one, not with the faster plain steps of the shorter prompts before it."""
    policy = SpeculationCostPolicy(ForwardCosts({1: 1.0}), prior=0.5, probe_every=4)
    policy.plain_rounds.add(1, 0.25)  # earlier generations' plain steps: 4 tok/s
    later = policy.controller(6, exit=_Exit())
    assert later.plain_rate() == 4.0 and later.round_cap() == 6  # no drafting round measured yet: draft
    later.record(6, 3, 1)
    later.record_round(6, 3, 1.0)  # 2 tok/s: below the earlier plain steps' 4
    assert later.round_cap() == 0
    later.record_round(0, 0, 1.0)  # this generation's plain step, on its long context: 1 tok/s
    assert later.plain_rate() == 1.0 and policy.plain_rate() > 1.0
    assert later.round_cap() == 6  # drafting at 2 tok/s beats this generation's plain steps


def test_with_adaptive_exit_nothing_is_timed_before_the_first_round_and_a_plain_round_prices_the_plain_arm():
    """The exit under the cost model times no synthetic forward: the first round drafts, the next ones are
    real plain steps (the first a warm-up) whose rate starts the plain arm, and from then on the arms'
    measured rates decide."""
    control = DraftControl(length_schedule="cost-model", adaptive_exit=True, max_draft_tokens=6)
    policy, calls = control.cost_policy, []

    class ModelDrafter:
        supports_exit_policy = True

    control.calibrate(lambda widths: calls.append(widths) or {w: 1.0 for w in widths}, 7, ModelDrafter())
    assert calls == [] and policy.target_costs is None and policy.acceptance().prior == DRAFT_MODEL_PRIOR
    assert policy.plain_rate() is None
    controller = control.controller(3)
    assert controller.round_cap() == 6  # nothing measured: draft, up to the exit's cap
    controller.record(6, 4, 4)
    controller.record_round(6, 4, 1.0)  # 5 tokens in 1 s
    assert controller.gated and controller.round_cap() == 0  # the plain arm's first rate: plain rounds
    controller.record_round(0, 0, 5.0)  # the first is a warm-up (first-call kernels), not counted
    assert policy.plain_rate() is None and controller.round_cap() == 0
    controller.record_round(0, 0, 0.5)
    assert policy.plain_rate() == 2.0 and controller.round_cap() == 6  # 5 tok/s against 2: drafting goes on
    assert control.controller(3).round_cap() == 6  # a later generation starts from both measured arms


@pytest.mark.parametrize("rows", [1, 3])
def test_with_adaptive_exit_the_engine_measures_the_plain_arm_by_a_plain_round(pair, rows):
    """In the engine (B = 1 and B = 3): no calibration forward (no warm-up seconds on the eager path), plain
    rounds after the first drafting round price the plain arm, and the output is target-only's."""
    target, draft = pair
    config = GenerationConfig(max_new_tokens=16, stop_on_eos=False)
    prompts = [[5, 9, 12, 7, 5, 9, 12, 7], [3, 4, 8], [11, 6, 11, 6, 11]][:rows]
    plain = SpeculativeDecoder(target)
    control = DraftControl(length_schedule="cost-model", adaptive_exit=True, max_draft_tokens=6)
    dec = BatchedSpeculativeDecoder(target, DraftModelDrafter(draft), max_batch_size=rows, max_length=64,
                                    draft_control=control)
    dec._measure_forwards = lambda *a, **k: pytest.fail("the exit under the cost model timed a forward")
    results = dec.generate(prompts, config)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == plain.generate(prompt, config).token_ids
        assert result.stats.warmup_s == 0.0 and result.stats.rounds_by_draft_size[0] >= 2
    assert control.cost_policy.plain_rounds.rate is not None and control.cost_policy.exit_rounds.rate is not None


def test_with_adaptive_exit_the_batched_engine_gives_each_row_its_target_only_output(pair):
    """B > 1 with rows of different lengths: the exit under the cost model, one controller per row."""
    target, draft = pair
    config = GenerationConfig(max_new_tokens=24, stop_on_eos=False)
    prompts = [[5, 9, 12, 7, 5, 9, 12, 7], [3, 4, 8], [11, 6, 11, 6, 11]]
    plain = SpeculativeDecoder(target)
    control = DraftControl(length_schedule="cost-model", adaptive_exit=True, max_draft_tokens=6)
    control.cost_policy.target_costs = ForwardCosts({1: 1.0})  # rounds of milliseconds: drafting wins
    batched = BatchedSpeculativeDecoder(target, DraftModelDrafter(draft), max_batch_size=3, max_length=96,
                                        draft_control=control)
    results = batched.generate(prompts, config)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == plain.generate(prompt, config).token_ids
    assert batched.stats.num_draft_forwards > 0 and control.cost_policy.exit_rounds.rate is not None


def test_with_adaptive_exit_a_plain_round_beside_drafting_rows_is_not_a_plain_steps_time():
    """With several rows, a row's plain step shares its round with rows that drafted: that round's seconds
    (draft_seconds > 0) are not a plain step's. A probe the engine cannot give (cap 0) is no probe."""
    policy = SpeculationCostPolicy(ForwardCosts({1: 1.0}), prior=0.5, probe_every=4)
    controller = policy.controller(6, exit=_Exit())
    controller.round_cap()
    controller.record(6, 2, 0)
    controller.record_round(6, 2, 4.0)  # 1 token in 4 s: drafting is slower than the 1 tok/s plain prior
    assert controller.round_cap() == 0
    controller.record_round(0, 0, 3.0, draft_seconds=2.0)  # another row drafted in this round
    assert policy.plain_rounds.rate is None and policy.plain_rate() == 1.0
    controller.record_round(0, 0, 0.5)  # a round where nobody drafted
    assert policy.plain_rate() == 2.0
    controller._ceiling = 0  # the engine allows this row no draft for now: no probe is counted
    assert [controller.round_cap() for _ in range(4)] == [0] * 4 and controller.num_probes == 0  # one was due


def test_with_adaptive_exit_the_cost_model_caps_the_rounds_and_the_exit_stops_within_them(pair):
    target, draft = pair
    prompt = [5, 9, 12, 7, 5, 9, 12, 7, 5, 9]
    config = GenerationConfig(max_new_tokens=40, num_speculative_tokens=3, stop_on_eos=False)
    expected = SpeculativeDecoder(target).generate(prompt, config).token_ids
    control = DraftControl(length_schedule="cost-model", adaptive_exit=True, exit_threshold=0.999,
                           max_draft_tokens=6)
    # A plain step priced at 1 s: the tiny models' drafting rounds (milliseconds) are faster, so every
    # round drafts, up to its cap.
    control.cost_policy.target_costs = ForwardCosts({1: 1.0})
    result = SpeculativeDecoder(target, DraftModelDrafter(draft), draft_control=control).generate(prompt, config)
    assert result.token_ids == expected
    caps, sizes = result.stats.rounds_by_draft_cap, result.stats.rounds_by_draft_size
    assert len(caps) == 7 and caps[6] > 0  # caps up to max_draft_tokens (not γ = 3)
    # the exit at 0.999 stopped drafts short of their caps
    assert sum(n * c for n, c in enumerate(sizes)) < sum(n * c for n, c in enumerate(caps))
    assert control.cost_policy.acceptance().by_depth()  # the drafted chains taught the cost model


@pytest.mark.parametrize("make, message", [
    (lambda: SpeculationCostPolicy(prior=1.5), "prior must be in"),
    (lambda: SpeculationCostPolicy(probe_every=0), "probe_every must be an integer >= 1, got 0"),
    (lambda: SpeculationCostPolicy(draft_node_s=-1.0), "draft_node_s must be finite seconds >= 0"),
    (lambda: SpeculationCostPolicy().controller(0), "max_tokens must be an integer >= 1, got 0"),
    (lambda: calibration_widths(0), "max_width must be an integer >= 1, got 0"),
])
def test_bad_values_are_refused_with_their_range(make, message):
    with pytest.raises(InvalidArgumentError, match=message):
        make()


def test_on_the_fast_path_each_bucket_is_timed_and_widths_between_take_its_cost(pair):
    """The fast path's target buckets are widths 1 and γ + 1: a verification of 2..γ + 1 tokens runs the
    widest, so the cost model sees one cost for all of them (and drafts γ or nothing)."""
    target, _ = pair
    prompt = [5, 9, 12, 7, 5, 9, 12, 7, 5, 9]
    config = GenerationConfig(max_new_tokens=20, num_speculative_tokens=4, stop_on_eos=False)
    expected = SpeculativeDecoder(target).generate(prompt, config).token_ids
    control = DraftControl(length_schedule="cost-model")
    engine = BatchedSpeculativeDecoder(target, PromptLookupDrafter(), max_batch_size=1, max_length=64,
                                       num_speculative_tokens=4, draft_control=control, compile=True, graphs=False)
    assert engine.runner.widths == (1, 5)
    assert engine.generate([prompt], config)[0].token_ids == expected
    costs = control.cost_policy.target_costs.seconds
    assert sorted(costs) == [1, 2, 3, 5] and costs[2] == costs[3] == costs[5]  # calibration_widths(5)
