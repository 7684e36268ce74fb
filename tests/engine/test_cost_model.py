"""The draft length of a chain from measured costs (specdecode.engine.cost_model's pieces, priced by
specdecode.engine.speculation_cost's SpeculationCostPolicy with one α at every depth), on hand numbers.

The costs are llama.cpp's for the Qwen2.5-Coder 1.5B Q4_K_M on a 2-core EPYC (issue 30):
32.7, 56.0, 91.7 and 215.0 ms for 1, 2, 4 and 8 tokens. The expected choices are worked out
by hand in each test's comment. (These are the choices the llama.cpp target's measured-cost policy
makes: ``engine.runner_target.measured_cost_policy`` is this policy on such costs.)
"""

from __future__ import annotations

import pytest

from specdecode.engine.cost_model import (
    DRAFT_MODEL_PRIOR,
    MEASURED_WIDTHS,
    PROMPT_LOOKUP_PRIOR,
    SIZES,
    ForwardCosts,
    expected_tokens,
)
from specdecode.engine.protocol import DraftPolicy, RoundController
from specdecode.engine.speculation_cost import SpeculationCostPolicy
from specdecode.errors import InvalidArgumentError


def _implements(obj, protocol) -> bool:
    """Every attribute and method the protocol declares (it is not runtime-checkable)."""
    names = set(protocol.__annotations__) | {n for n in vars(protocol) if not n.startswith("_")}
    return bool(names) and all(hasattr(obj, n) for n in names)


LLAMA_CPP_15B = ForwardCosts({1: 0.0327, 2: 0.0560, 4: 0.0917, 8: 0.2150})


def _policy(costs=LLAMA_CPP_15B, alpha=0.5, draft_node_s=0.0, probe_every=1000, **kw) -> SpeculationCostPolicy:
    """One α at every depth (the prior; nothing learned yet), a fixed draft cost per token."""
    return SpeculationCostPolicy(costs, draft_node_s=draft_node_s, prior=alpha, probe_every=probe_every, **kw)


def _round(controller, cap: int, accepted: int) -> None:
    """A chain round of ``cap`` drafted tokens, ``accepted`` of them accepted, as the engine reports it."""
    controller.record(cap, cap, accepted)
    controller.record_round(cap, cap, 0.1, depth=cap)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.45, 0.9, 0.999])
@pytest.mark.parametrize("k", [0, 1, 2, 5])
def test_expected_tokens_is_the_sum_of_the_acceptance_powers(alpha, k):
    # token i (0-based) of the block is reached with probability α^i; the bonus token counts
    assert expected_tokens(alpha, k) == pytest.approx(sum(alpha**i for i in range(k + 1)))
    assert expected_tokens(1.0, k) == k + 1
    assert _policy(alpha=alpha).expected_tokens(k) == pytest.approx(expected_tokens(alpha, k))  # the chain's


def test_costs_interpolate_between_and_extrapolate_past_the_measured_widths():
    c = LLAMA_CPP_15B
    assert c.at(1) == 0.0327 and c.at(8) == 0.2150
    assert c.at(3) == pytest.approx((0.0560 + 0.0917) / 2)
    assert c.at(6) == pytest.approx(0.0917 + 2 * (0.2150 - 0.0917) / 4)
    assert c.at(10) == pytest.approx(0.2150 + 2 * (0.2150 - 0.0917) / 4)  # the last segment's slope goes on
    assert ForwardCosts({1: 0.01}).at(3) == pytest.approx(0.03)
    assert ForwardCosts({1: 0.02, 4: 0.01}).at(6) == pytest.approx(0.01)  # never falling past the last
    from specdecode.models.llama_cpp_target import COST_WIDTHS  # the models layer's copy (it imports no engine)

    assert MEASURED_WIDTHS == COST_WIDTHS == (1, 2, 3, 4, 6, 8) and SIZES[0] == 0 and list(SIZES) == sorted(SIZES)


@pytest.mark.parametrize("alpha, best", [
    (0.45, 0),  # k=1: 1.45/56.0 = 0.0259 < 1/32.7 = 0.0306: prompt lookup on code at its average α never pays
    (0.70, 0),  # k=1: 1.70/56.0 = 0.0304, k=2: 2.19/73.85 = 0.0297: still just below 0.0306
    (0.80, 2),  # k=1: 0.0321, k=2: 2.44/73.85 = 0.0330, k=3: 2.952/91.7 = 0.0322
    (0.90, 3),  # k=2: 0.0367, k=3: 3.439/91.7 = 0.0375, k=4: 4.095/122.5 = 0.0334
    (1.00, 3),  # k=3: 4/91.7 = 0.0436 > k=4: 5/122.5 = 0.0408
])
def test_the_best_length_on_llama_cpp_costs(alpha, best):
    policy = _policy(alpha=alpha)
    assert policy.controller(8).round_cap() == best
    rates = [policy.rate(k) for k in range(9)]
    assert rates.index(max(rates)) == best  # the same as scanning by hand
    assert rates[2] == pytest.approx(expected_tokens(alpha, 2) / ((0.0560 + 0.0917) / 2))
    assert policy.controller(1).round_cap() == (1 if rates[1] > rates[0] else 0)  # γ caps the length


def test_a_draft_that_costs_something_drafts_less():
    # at α = 0.8 a free draft goes to k = 2; a draft step of 10 ms makes k=1: 1.8/66 = 0.0273,
    # k=2: 2.44/93.85 = 0.0260, both below the plain step's 0.0306
    assert _policy(alpha=0.8, draft_node_s=0.010).controller(8).round_cap() == 0
    # the 0.5B Q4 draft, about 0.09 of the target's step (2.9 ms): at α = 0.9 k = 3 still wins
    assert _policy(alpha=0.9, draft_node_s=0.0029).controller(8).round_cap() == 3


def test_flat_verification_drafts_the_longest_block():
    """On a GPU-like flat cost every extra token is free: the longest block, but a plain step at α = 0."""
    flat = ForwardCosts({1: 0.01, 2: 0.01, 4: 0.01, 8: 0.01})
    assert _policy(flat, alpha=0.3).controller(6).round_cap() == 6
    assert _policy(flat, alpha=0.3, max_size=4).controller(6).round_cap() == 4  # max_size caps it too
    assert _policy(flat, alpha=0.0).controller(6).round_cap() == 0  # a tie goes to the shorter draft


def test_break_even():
    assert _policy().break_even(1) == pytest.approx(0.0560 / 0.0327 - 1, abs=1e-5)  # (1 + α)/56 = 1/32.7
    assert _policy(ForwardCosts({1: 0.01, 2: 0.03})).break_even(1) is None  # 2/30 < 1/10 even at α = 1
    for alpha in (0.70, 0.72):  # the choice of k = 1 (γ = 1) flips at it
        assert _policy(alpha=alpha).controller(1).round_cap() == (alpha > _policy().break_even(1))


def test_the_controller_follows_the_acceptance_and_probes_while_plain():
    policy = _policy(alpha=0.5, probe_every=4)
    control = policy.controller(5)
    assert _implements(control, RoundController)
    assert control.gated and control.round_cap() == 0  # α = 0.5: plain steps
    for _ in range(60):  # every drafted token accepted (copying from the prompt)
        k = control.round_cap()
        if k:
            _round(control, k, k)
    # α ≈ 1 at every depth drafted: k = 3 (4/91.7 beats 5/122.5), and k = 4 probed every 4th round
    assert min(policy.acceptance().by_depth()[:4]) > 0.9
    assert not control.gated and sorted({control.round_cap() for _ in range(8)}) == [3, 4]
    for _ in range(30):  # every drafted token rejected (prose)
        k = control.round_cap()
        if k:
            _round(control, k, 0)
    caps = []
    for _ in range(30):
        caps.append(control.round_cap())
        if caps[-1]:
            _round(control, 1, 0)  # the probe drafted a token, rejected
    # plain steps and one-token probes, each failed probe doubling the wait (4, 8, 16, 32 plain steps): by now
    # one probe within 16 rounds, and the next one 32 rounds after it
    assert set(caps) == {0, 1} and caps.count(1) == 1 and caps.index(1) < 16
    assert control.num_probes >= 3


def test_a_probe_with_nothing_to_offer_is_repeated_until_a_round_drafts():
    # α = 0.3: plain steps; prompt lookup finds no match in the first probes (the engine records nothing)
    policy = _policy(alpha=0.3, probe_every=4)
    control = policy.controller(5)
    caps = [control.round_cap() for _ in range(6)]
    assert caps == [0, 0, 0, 1, 1, 1]  # the 4th round probes; no draft came, so it probes again
    control.record_round(1, 0, 0.03)  # nothing drafted: no evidence, α unchanged, the probe still due
    assert policy.acceptance().alpha(1) == pytest.approx(0.3) and control.round_cap() == 1
    _round(control, 1, 0)  # a match, rejected: α falls, the probe is spent
    assert policy.acceptance().alpha(1) < 0.3
    assert [control.round_cap() for _ in range(8)] == [0] * 7 + [1]  # a failed probe: twice the wait


def test_no_probes_where_no_length_pays_at_any_acceptance():
    # a draft step of 0.45 target steps (the 0.5B beside the 1.5B in llama.cpp at 1 thread, measured): k tokens
    # cost 0.45k + C(k+1)/C(1) steps for at most k + 1 tokens: 2.16 steps for 2 at k = 1, 3.30 for 3 at k = 2 ...
    slow = _policy(alpha=1.0, draft_node_s=0.45 * 0.0327, probe_every=2)
    assert all(slow.break_even(k) is None for k in range(1, 8))
    control = slow.controller(5)
    assert not slow.can_pay(control.sizes)
    assert [control.round_cap() for _ in range(6)] == [0] * 6 and control.num_probes == 0
    cheap = _policy(alpha=0.0, draft_node_s=0.09 * 0.0327, probe_every=2)  # pays at k = 1 for α >= 0.8
    control = cheap.controller(5)
    assert cheap.can_pay(control.sizes) and [control.round_cap() for _ in range(2)] == [0, 1]


def test_the_prompt_lookup_prior_drafts_after_one_accepted_probe():
    # PROMPT_LOOKUP_PRIOR (0.56, HumanEval) is below the break-even of k = 1 on these costs (56.0 / 32.7 - 1
    # = 0.71): plain steps. One accepted probe: α_1 = (0.9 * 1.12 + 1) / (0.9 * 2 + 1) = 0.717 > 0.71: k = 1
    # (k = 2 with α_2 still 0.56: (1 + 0.717 + 0.402) / 73.85 = 0.0287 < 1.717 / 56 = 0.0307).
    policy = _policy(alpha=PROMPT_LOOKUP_PRIOR, probe_every=16)
    assert policy.break_even(1) == pytest.approx(0.0560 / 0.0327 - 1, abs=1e-4)
    control = policy.controller(5)
    assert policy.acceptance().alpha(1) == pytest.approx(0.56) and control.gated
    _round(control, 1, 1)
    assert policy.acceptance().alpha(1) == pytest.approx(2.008 / 2.8) and control.round_cap() == 1
    # the draft model's prior with its cost (0.09 of a step, issue 30) drafts from the start
    assert _policy(alpha=DRAFT_MODEL_PRIOR, draft_node_s=0.09 * 0.0327).controller(5).round_cap() == 2


def test_the_policy_makes_controllers_capped_by_gamma_that_share_what_it_learned():
    policy = _policy(ForwardCosts({1: 0.01, 8: 0.01}), alpha=0.9, max_size=8)
    assert _implements(policy, DraftPolicy) and policy.active and not policy.adaptive_exit
    first = policy.controller(3)
    assert first.max_tokens == 3 and first.round_cap() == 3
    _round(first, 3, 0)
    assert policy.controller(3).policy.acceptance().alpha(1) < 0.9  # the estimates carry over generations
    assert policy.controller(20).max_tokens == 8


def test_given_costs_within_max_size_are_not_timed_again():
    """The llama.cpp target's costs are measured in llama.cpp at warm-up: the engine's calibration (the
    widest verification, γ + 1) times nothing more while max_size keeps verifications within them."""
    asked = []

    def measure(widths):
        asked.append(tuple(widths))
        return {w: 0.01 * w for w in widths}

    policy = SpeculationCostPolicy(LLAMA_CPP_15B, draft_node_s=0.0, prior=PROMPT_LOOKUP_PRIOR,
                                   max_size=MEASURED_WIDTHS[-1] - 1)
    policy.calibrate(measure, 11, object())  # γ = 10
    assert asked == [] and policy.target_costs is LLAMA_CPP_15B and policy.acceptance().prior == PROMPT_LOOKUP_PRIOR
    unbounded = SpeculationCostPolicy(LLAMA_CPP_15B, prior=PROMPT_LOOKUP_PRIOR)
    unbounded.calibrate(measure, 11, object())
    assert asked == [(1, 2, 3, 5, 9, 11)] and unbounded.target_costs.at(8) == 0.2150  # the given ones kept


@pytest.mark.parametrize("make, message", [
    (lambda: ForwardCosts({2: 0.01}), r"must include width 1 \(a plain step\), got widths \[2\]"),
    (lambda: ForwardCosts({1: 0.0}), "finite seconds > 0, got 1: 0.0"),
    (lambda: ForwardCosts({0: 0.1, 1: 0.1}), "integers >= 1"),
    (lambda: _policy(draft_node_s=-1.0), "draft_node_s must be finite seconds >= 0, got -1.0"),
    (lambda: _policy(max_size=0), "max_size must be an integer >= 1, got 0"),
    (lambda: expected_tokens(1.5, 2), r"acceptance rate must be in \[0, 1\], got 1.5"),
    (lambda: LLAMA_CPP_15B.at(0), "width must be an integer >= 1, got 0"),
    (lambda: _policy().controller(0), "max_tokens must be an integer >= 1, got 0"),
    (lambda: _policy(probe_every=0), "probe_every must be an integer >= 1"),
    (lambda: _policy().break_even(0), "k must be an integer >= 1, got 0"),
    (lambda: SpeculationCostPolicy(LLAMA_CPP_15B.seconds), "target_costs must be a ForwardCosts or None"),
])
def test_bad_values_are_refused_with_their_range(make, message):
    with pytest.raises(InvalidArgumentError, match=message):
        make()
