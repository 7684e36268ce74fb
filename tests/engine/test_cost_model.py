"""The draft length from measured costs (specdecode.engine.cost_model), on hand numbers.

The costs are llama.cpp's for the Qwen2.5-Coder 1.5B Q4_K_M on a 2-core EPYC (issue 30):
32.7, 56.0, 91.7 and 215.0 ms for 1, 2, 4 and 8 tokens. The expected choices are worked out
by hand in each test's comment.
"""

from __future__ import annotations

import pytest

from specdecode.engine.cost_model import (
    DRAFT_MODEL_PRIOR,
    PROMPT_LOOKUP_PRIOR,
    AcceptanceEstimate,
    CostModelController,
    CostModelPolicy,
    DraftCostModel,
    ForwardCosts,
    expected_tokens,
)
from specdecode.engine.protocol import DraftPolicy, RoundController
from specdecode.errors import InvalidArgumentError

def _implements(obj, protocol) -> bool:
    """Every attribute and method the protocol declares (it is not runtime-checkable)."""
    names = set(protocol.__annotations__) | {n for n in vars(protocol) if not n.startswith("_")}
    return bool(names) and all(hasattr(obj, n) for n in names)


LLAMA_CPP_15B = ForwardCosts({1: 0.0327, 2: 0.0560, 4: 0.0917, 8: 0.2150})


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.45, 0.9, 0.999])
@pytest.mark.parametrize("k", [0, 1, 2, 5])
def test_expected_tokens_is_the_sum_of_the_acceptance_powers(alpha, k):
    # token i (0-based) of the block is reached with probability α^i; the bonus token counts
    assert expected_tokens(alpha, k) == pytest.approx(sum(alpha**i for i in range(k + 1)))
    assert expected_tokens(1.0, k) == k + 1


def test_costs_interpolate_between_and_extrapolate_past_the_measured_widths():
    c = LLAMA_CPP_15B
    assert c.at(1) == 0.0327 and c.at(8) == 0.2150
    assert c.at(3) == pytest.approx((0.0560 + 0.0917) / 2)
    assert c.at(6) == pytest.approx(0.0917 + 2 * (0.2150 - 0.0917) / 4)
    assert c.at(10) == pytest.approx(0.2150 + 2 * (0.2150 - 0.0917) / 4)  # the last segment's slope goes on
    assert ForwardCosts({1: 0.01}).at(3) == pytest.approx(0.03)
    assert ForwardCosts({1: 0.02, 4: 0.01}).at(6) == pytest.approx(0.01)  # never falling past the last


@pytest.mark.parametrize("alpha, best", [
    (0.45, 0),  # k=1: 1.45/56.0 = 0.0259 < 1/32.7 = 0.0306: prompt lookup on code at its average α never pays
    (0.70, 0),  # k=1: 1.70/56.0 = 0.0304, k=2: 2.19/73.85 = 0.0297: still just below 0.0306
    (0.80, 2),  # k=1: 0.0321, k=2: 2.44/73.85 = 0.0330, k=3: 2.952/91.7 = 0.0322
    (0.90, 3),  # k=2: 0.0367, k=3: 3.439/91.7 = 0.0375, k=4: 4.095/122.5 = 0.0334
    (1.00, 3),  # k=3: 4/91.7 = 0.0436 > k=4: 5/122.5 = 0.0408
])
def test_the_best_length_on_llama_cpp_costs(alpha, best):
    model = DraftCostModel(LLAMA_CPP_15B, draft_step_s=0.0, max_tokens=8)
    assert model.best_length(alpha) == best
    rates = [model.tokens_per_second(alpha, k) for k in range(9)]
    assert rates.index(max(rates)) == best  # the same as scanning by hand
    assert model.best_length(alpha, max_tokens=1) == (1 if rates[1] > rates[0] else 0)


def test_a_draft_that_costs_something_drafts_less():
    # at α = 0.8 a free draft goes to k = 2; a draft step of 10 ms makes k=1: 1.8/66 = 0.0273,
    # k=2: 2.44/93.85 = 0.0260, both below the plain step's 0.0306
    assert DraftCostModel(LLAMA_CPP_15B, draft_step_s=0.010).best_length(0.8) == 0
    # the 0.5B Q4 draft, about 0.09 of the target's step (2.9 ms): at α = 0.9 k = 3 still wins
    assert DraftCostModel(LLAMA_CPP_15B, draft_step_s=0.0029).best_length(0.9) == 3


def test_flat_verification_drafts_the_longest_block():
    """On a GPU-like flat cost every extra token is free: the longest block, but a plain step at α = 0."""
    model = DraftCostModel(ForwardCosts({1: 0.01, 2: 0.01, 4: 0.01, 8: 0.01}), max_tokens=6)
    assert model.best_length(0.3) == 6
    assert model.best_length(0.0) == 0  # a tie goes to the shorter draft


def test_break_even():
    model = DraftCostModel(LLAMA_CPP_15B)
    assert model.break_even(1) == pytest.approx(0.0560 / 0.0327 - 1, abs=1e-5)  # (1 + α)/56 = 1/32.7
    assert DraftCostModel(ForwardCosts({1: 0.01, 2: 0.03})).break_even(1) is None  # 2/30 < 1/10 even at α = 1


def test_the_estimate_counts_accepted_tokens_in_trials_to_the_first_rejection():
    est = AcceptanceEstimate(prior=0.5, prior_weight=2.0, decay=1.0)
    est.update(4, 4)  # 4 of 4 trials
    est.update(4, 1)  # 1 accepted, then a rejection: 1 of 2
    assert est.value == pytest.approx((1 + 4 + 1) / (2 + 4 + 2))
    forgetful = AcceptanceEstimate(prior=0.5, prior_weight=2.0, decay=0.5)
    forgetful.update(3, 0)
    assert forgetful.value == pytest.approx(0.5 / (1 + 1))
    with pytest.raises(InvalidArgumentError, match="accept 0..drafted of them, got 3 of 2"):
        est.update(2, 3)
    with pytest.raises(InvalidArgumentError, match=r"decay must be in \(0, 1\], got 0"):
        AcceptanceEstimate(decay=0)


def test_the_controller_follows_the_acceptance_rate_and_probes_while_plain():
    model = DraftCostModel(LLAMA_CPP_15B)
    control = CostModelController(model, max_tokens=5, estimate=AcceptanceEstimate(prior=0.5), probe_every=4)
    assert _implements(control, RoundController)
    assert control.gated and control.round_cap() == 0  # α = 0.5: plain steps
    for _ in range(20):  # every drafted token accepted (copying from the prompt)
        k = control.round_cap()
        if k:
            control.record(k, k, k)
    assert control.estimate.value > 0.9 and control.round_cap() == 3 and not control.gated
    for _ in range(30):  # every drafted token rejected (prose)
        k = control.round_cap()
        if k:
            control.record(k, k, 0)
    caps = []
    for _ in range(12):
        caps.append(control.round_cap())
        if caps[-1]:
            control.record(caps[-1], 1, 0)  # the probe drafted a token, rejected
    first = caps.index(1)
    assert first < 4 and caps[first:first + 9] == [1, 0, 0, 0, 1, 0, 0, 0, 1]  # plain steps, a probe every 4th
    assert control.num_probes >= 3


def test_a_probe_with_nothing_to_offer_is_repeated_until_a_round_drafts():
    # α = 0.3: plain steps; prompt lookup finds no match in the first probes (the engine records nothing, or 0)
    control = CostModelController(DraftCostModel(LLAMA_CPP_15B), max_tokens=5, estimate=AcceptanceEstimate(prior=0.3),
                                  probe_every=4)
    caps = [control.round_cap() for _ in range(6)]
    assert caps == [0, 0, 0, 1, 1, 1]  # the 4th round probes; no draft came, so it probes again
    control.record(1, 0, 0)  # nothing drafted: no evidence, α unchanged, the probe still due
    assert control.estimate.value == pytest.approx(0.3) and control.round_cap() == 1
    control.record(1, 1, 0)  # a match, rejected: α falls, the probe is spent
    assert control.estimate.value < 0.3
    assert [control.round_cap() for _ in range(4)] == [0, 0, 0, 1]


def test_no_probes_where_no_length_pays_at_any_acceptance():
    # a draft step of 0.45 target steps (the 0.5B beside the 1.5B in llama.cpp at 1 thread, measured): k tokens
    # cost 0.45k + C(k+1)/C(1) steps for at most k + 1 tokens: 2.16 steps for 2 at k = 1, 3.30 for 3 at k = 2 ...
    slow = DraftCostModel(LLAMA_CPP_15B, draft_step_s=0.45 * 0.0327)
    assert all(slow.break_even(k) is None for k in range(1, 8))
    control = CostModelController(slow, max_tokens=5, estimate=AcceptanceEstimate(prior=1.0), probe_every=2)
    assert not control.can_pay and [control.round_cap() for _ in range(6)] == [0] * 6 and control.num_probes == 0
    cheap = CostModelController(DraftCostModel(LLAMA_CPP_15B, draft_step_s=0.09 * 0.0327), max_tokens=5,
                                estimate=AcceptanceEstimate(prior=0.0), probe_every=2)  # pays at k = 1 for α >= 0.8
    assert cheap.can_pay and [cheap.round_cap() for _ in range(2)] == [0, 1]


def test_the_prompt_lookup_prior_drafts_after_one_accepted_probe():
    # PROMPT_LOOKUP_PRIOR (0.56, HumanEval) is below the break-even of k = 1 on these costs (56.0 / 32.7 - 1
    # = 0.71): plain steps. One accepted probe: α = (0.9 * 1.12 + 1) / (0.9 * 2 + 1) = 0.717 > 0.71: k = 1.
    model = DraftCostModel(LLAMA_CPP_15B)
    assert model.break_even(1) == pytest.approx(0.0560 / 0.0327 - 1, abs=1e-4)
    control = CostModelPolicy(model, prior=PROMPT_LOOKUP_PRIOR).controller(5)
    assert control.estimate.value == pytest.approx(0.56) and control.gated
    control.record(1, 1, 1)
    assert control.estimate.value == pytest.approx(2.008 / 2.8) and control.round_cap() == 1
    # the draft model's prior with its cost (0.09 of a step, issue 30) drafts from the start
    drafting = CostModelPolicy(DraftCostModel(LLAMA_CPP_15B, draft_step_s=0.09 * 0.0327), prior=DRAFT_MODEL_PRIOR)
    assert drafting.controller(5).round_cap() == 2


def test_the_policy_makes_fresh_controllers_capped_by_gamma():
    policy = CostModelPolicy(DraftCostModel(ForwardCosts({1: 0.01, 8: 0.01}), max_tokens=8), prior=0.9)
    assert _implements(policy, DraftPolicy) and policy.active and not policy.adaptive_exit
    first = policy.controller(3)
    assert first.max_tokens == 3 and first.round_cap() == 3
    first.record(3, 3, 0)
    assert policy.controller(3).estimate.value == pytest.approx(0.9)  # per generation


@pytest.mark.parametrize("make, message", [
    (lambda: ForwardCosts({2: 0.01}), r"must include width 1 \(a plain step\), got widths \[2\]"),
    (lambda: ForwardCosts({1: 0.0}), "finite seconds > 0, got 1: 0.0"),
    (lambda: ForwardCosts({0: 0.1, 1: 0.1}), "integers >= 1"),
    (lambda: DraftCostModel(LLAMA_CPP_15B, draft_step_s=-1.0), "draft_step_s must be finite seconds >= 0, got -1.0"),
    (lambda: DraftCostModel(LLAMA_CPP_15B, max_tokens=-1), "max_tokens must be an integer >= 0, got -1"),
    (lambda: expected_tokens(1.5, 2), r"acceptance rate must be in \[0, 1\], got 1.5"),
    (lambda: LLAMA_CPP_15B.at(0), "width must be an integer >= 1, got 0"),
    (lambda: CostModelController(DraftCostModel(LLAMA_CPP_15B), 0), "max_tokens must be an integer >= 1, got 0"),
    (lambda: CostModelPolicy(DraftCostModel(LLAMA_CPP_15B), probe_every=0), "probe_every must be an integer >= 1"),
])
def test_bad_values_are_refused_with_their_range(make, message):
    with pytest.raises(InvalidArgumentError, match=message):
        make()
