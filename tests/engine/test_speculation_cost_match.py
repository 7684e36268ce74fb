"""The cost model priced by prompt lookup's match (specdecode.engine.speculation_cost, ``trim``): one α_d per
n-gram size matched, the block trimmed to what its match pays for, probes per n-gram size, and the engine's
call through the protocol with exact greedy output."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import make_tiny_model
from helpers import FixedCapController
from specdecode import GenerationConfig, SpeculativeDecoder
from specdecode.drafters import DraftModelDrafter, PromptLookupDrafter
from specdecode.drafters.prompt_lookup import find_continuation, match_continuation
from specdecode.engine.batched import BatchedSpeculativeDecoder
from specdecode.engine.cost_model import DepthAcceptance, ForwardCosts
from specdecode.engine.protocol import DraftPolicy, RoundController
from specdecode.engine.speculation_cost import RARE_PROBE_FACTOR, SpeculationCostPolicy

# A 2-core Xeon's llama.cpp Q4_K_M 1.5B target (ms, docs/benchmarks/2026-11-27-xeon-amx.md): 4 tokens cost 1.6
# steps and 3 tokens more than 4.
XEON = ForwardCosts({1: 0.0693, 2: 0.1045, 3: 0.1238, 4: 0.1115, 6: 0.1648, 8: 0.1967})


def _primed(probe_every: int = 16, drafter=None, prior: float = 0.56) -> SpeculationCostPolicy:
    policy = SpeculationCostPolicy(XEON, draft_node_s=0.0, prior=prior, probe_every=probe_every, max_size=7)
    policy.prime(drafter if drafter is not None else PromptLookupDrafter())
    return policy


def _round(controller, ngram_size: int, proposed: int, accepted_of) -> int:
    """One round as the engine runs it: cap, propose (``proposed`` tokens), trim, verify, record."""
    cap = controller.round_cap()
    k = controller.trim(min(proposed, cap), ngram_size) if cap else 0
    if k:
        controller.record(cap, k, accepted_of(k))
    controller.record_round(cap, k, 0.1, depth=k or None)
    return k


def test_match_continuation_gives_the_continuation_and_the_ngram_size_that_decided():
    seq = np.array([7, 1, 2, 3, 9, 8, 4, 2, 3, 5, 6, 1, 2, 3], dtype=np.int64)
    tokens, n = match_continuation(seq, 4, 3, 1)
    assert n == 3 and tokens.tolist() == [9, 8, 4, 2]  # "1 2 3" at 1..3
    assert tokens.tolist() == find_continuation(seq, 4, 3, 1).tolist()
    tokens, n = match_continuation(np.array([4, 2, 3, 5, 6, 5, 3], dtype=np.int64), 4, 3, 1)
    assert n == 1 and tokens.tolist() == [5, 6, 5, 3]  # only "3" recurs (at 2): the 4 tokens after it
    tokens, n = match_continuation(np.array([1, 2, 3, 4], dtype=np.int64), 4, 3, 1)
    assert n == 0 and tokens.size == 0


def test_prompt_lookup_reports_the_ngram_size_of_each_rows_match():
    drafter = PromptLookupDrafter(max_ngram=3, min_ngram=1)
    drafter._device = "cpu"
    draft = drafter.propose([[7, 1, 2, 3, 9, 8, 1, 2, 3], [4, 2, 3, 5, 3], [1, 2, 3, 4]], [3, 3, 3])
    assert drafter.reports_ngram_sizes and draft.ngram_sizes == [3, 1, 0] and draft.num_tokens == [3, 2, 0]
    assert not PromptLookupDrafter(branches=2).reports_ngram_sizes  # a tree continues several matches


def test_each_ngram_size_has_its_own_acceptance_and_its_block_is_trimmed_to_what_it_pays_for():
    policy = _primed()
    controller = policy.controller(7)
    assert policy.by_match and controller.round_cap() == 7  # prompt lookup costs nothing to ask for the longest
    for _ in range(12):  # three-token matches are copied whole; one-token matches never
        _round(controller, 3, 7, lambda k: k)
        _round(controller, 1, 7, lambda k: 0)
    # size 1 stopped drafting once it no longer paid (only probes measure it then)
    assert policy.acceptance(3).alpha(1) > 0.9 > 0.3 > policy.acceptance(1).alpha(1)
    assert not policy.acceptance().by_depth()  # the unconditioned estimates are left alone
    assert controller.trim(7, 3) >= 3 and controller.trim(2, 3) == 2
    for _ in range(64):  # a block accepted whole is probed one token deeper every probe_every rounds
        _round(controller, 3, 7, lambda k: k)
    assert len(policy.acceptance(3).by_depth()) == 4 and policy.acceptance(3).alpha(4) > 0.8
    assert controller.trim(7, 1) == 0  # a plain step: 1 token for 1 step beats 1.0x tokens for 1.5 steps
    # At α 0.4 at every depth 3 tokens pay, verified as 4 for 1.6 steps (1.62 tokens for 1.61 steps), 1 does not
    # (1.4 tokens for 1.51 steps); 2 do not either, as 3 tokens cost more than 4 here.
    fresh = _primed(prior=0.4).controller(7)
    assert fresh.round_cap() == 7 and fresh.trim(7, 2) == 3 and fresh.trim(1, 2) == 0 == fresh.trim(2, 2)


def test_a_ngram_size_that_does_not_pay_is_probed_with_one_token_and_backs_off():
    policy = _primed(probe_every=4, prior=0.2)  # at α 0.2 no size pays
    controller = policy.controller(7)
    waits = []
    for _ in range(4):
        steps = 0
        while (k := _round(controller, 1, 7, lambda k: 0)) == 0:
            steps += 1
            _round(controller, 3, 7, lambda k: 0)  # another size's plain steps and probes do not count for size 1
        assert k == 1
        waits.append(steps)
    assert waits == [3, 7, 15, 31] and RARE_PROBE_FACTOR * 4 == 32
    policy.match_depths[1] = DepthAcceptance(1.0, prior_weight=100.0)  # one-token matches turn predictable
    assert _round(controller, 1, 7, lambda k: k) > 0  # drafting pays, and the wait is reset
    policy.match_depths[1] = DepthAcceptance(0.0, prior_weight=100.0)  # until nothing pays again
    steps = 0
    while _round(controller, 1, 7, lambda k: 0) == 0:
        steps += 1
    assert steps == 3


def test_without_reported_matches_the_block_is_kept():
    for drafter in (DraftModelDrafter(make_tiny_model("llama", seed=4)), PromptLookupDrafter(branches=2)):
        policy = _primed(drafter=drafter)
        controller = policy.controller(7)
        assert not policy.by_match and controller.trim(5, 1) == 5
    assert RoundController.trim(object(), 4, 2) == 4  # the protocol's default


class _Trimming(FixedCapController):
    """Keeps one token of each block and logs what ``trim`` was given."""

    def trim(self, num_tokens, ngram_size, source="sequence") -> int:
        self.log.append((num_tokens, ngram_size))
        return 1


class _TrimPolicy(DraftPolicy):
    adaptive_exit = False
    active = True

    def __init__(self) -> None:
        self.log = []

    def controller(self, gamma):
        return _Trimming(self.log)


@pytest.mark.parametrize("rows", [1, 2])
def test_the_engine_verifies_only_what_trim_keeps_and_greedy_output_is_exact(rows):
    target = make_tiny_model("llama", seed=3)
    prompts = [[5, 9, 12, 7, 5, 9, 12, 7, 5, 9], [3, 30, 41, 8, 11, 3, 30, 41]][:rows]
    config = GenerationConfig(max_new_tokens=24, num_speculative_tokens=4, stop_on_eos=False)
    plain = SpeculativeDecoder(target)
    policy = _TrimPolicy()
    if rows == 1:
        results = [SpeculativeDecoder(target, PromptLookupDrafter(), draft_control=policy).generate(prompts[0], config)]
    else:
        results = BatchedSpeculativeDecoder(target, PromptLookupDrafter(), max_batch_size=2, max_length=64,
                                            num_speculative_tokens=4, draft_control=policy).generate(prompts, config)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == plain.generate(prompt, config).token_ids
    trims = [e for e in policy.log if e[0] != "record"]
    assert trims and all(1 <= k <= 4 and 1 <= n <= 3 for k, n in trims)
    assert any(k > 1 for k, _ in trims)  # some blocks were longer than what was verified
    assert [e[1] for e in policy.log if e[0] == "record"] == [1] * len(trims)  # one token verified each time
    assert sum(r.stats.num_drafted_tokens for r in results) == len(trims)
    # The caps recorded: a trimmed block's kept size (1); elsewhere the engine's cap (4, or the tokens left near
    # the end: at most one more round of cap 1 per row).
    trimmed = sum(1 for k, _ in trims if k > 1)
    assert trimmed <= sum(r.stats.rounds_by_draft_cap[1] for r in results) <= trimmed + rows


class _BadTrim(_Trimming):
    def trim(self, num_tokens, ngram_size, source="sequence"):
        return num_tokens + 1


class _BadTrimPolicy(_TrimPolicy):
    def controller(self, gamma):
        return _BadTrim(self.log)


def test_a_trim_outside_the_block_is_refused():
    from specdecode.errors import InvalidArgumentError

    target = make_tiny_model("llama", seed=3)
    config = GenerationConfig(max_new_tokens=24, num_speculative_tokens=4, stop_on_eos=False)
    decoder = SpeculativeDecoder(target, PromptLookupDrafter(), draft_control=_BadTrimPolicy())
    with pytest.raises(InvalidArgumentError, match=r"trim must keep 0\.\.\d+ tokens"):
        decoder.generate([5, 9, 12, 7, 5, 9, 12, 7, 5, 9], config)


def test_trimmed_blocks_on_sampling_rows_are_what_is_verified():
    target = make_tiny_model("llama", seed=3)
    prompts = [[5, 9, 12, 7, 5, 9, 12, 7, 5, 9], [3, 30, 41, 8, 11, 3, 30, 41]]
    config = GenerationConfig(max_new_tokens=24, num_speculative_tokens=4, stop_on_eos=False, temperature=1.0,
                              seed=7)
    policy = _TrimPolicy()
    results = BatchedSpeculativeDecoder(target, PromptLookupDrafter(), max_batch_size=2, max_length=64,
                                        num_speculative_tokens=4, draft_control=policy).generate(prompts, config)
    trims = [e for e in policy.log if e[0] != "record"]
    assert trims and sum(r.stats.num_drafted_tokens for r in results) == len(trims)  # one token each
    assert all(len(r.token_ids) == 24 for r in results)


def test_where_no_size_can_pay_a_measured_draft_cost_is_still_probed_rarely():
    """A prompt-lookup policy whose measured seconds per token made every size unpayable still verifies a rare
    one-token block (``round_cap``'s rare probe goes through ``trim``), so the cost can be measured again."""
    policy = SpeculationCostPolicy(XEON, prior=0.9, probe_every=2, max_size=7)  # s_node measured, not fixed
    policy.prime(PromptLookupDrafter())
    policy.node_seconds.add(0, 30.0)  # a first round 30 s per token: nothing can pay
    controller = policy.controller(7)
    assert not policy.can_pay(controller.sizes)
    kept = [_round(controller, 3, 7, lambda k: k) for _ in range(2 * RARE_PROBE_FACTOR * 2)]
    assert kept.count(1) == 2 and set(kept) == {0, 1}
