"""Adaptive draft exit, the heuristic draft length and target-confidence gating."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from conftest import VOCAB, make_tiny_model
from helpers import Recorder, ScriptedDrafter
from selfspec_helpers import (  # noqa: F401  (one_thread is a fixture)
    CacheCheckingDrafter,
    autoregressive,
    exact_marginals,
    one_thread,
    prompt_ids,
    sample_counts,
    violations,
)
from specdecode import DraftModelDrafter, GenerationConfig, InvalidArgumentError, SpeculativeDecoder
from specdecode.drafters.control import (
    AdaptiveDraftExit,
    ConfidenceGate,
    DraftControl,
    HeuristicDraftLength,
)
from specdecode.drafters.early_exit import EarlyExitDrafter
from specdecode.drafters.layer_skip import LayerSkipDrafter, SkipSet
from specdecode.drafters.prompt_lookup import PromptLookupDrafter

pytestmark = pytest.mark.usefixtures("one_thread")

# ---------------------------------------------------------------- the controllers alone


def test_threshold_update_follows_hand_computed_sequence():
    """Defaults th=0.6, β1=0.5, β2=0.9, ε=0.01, α=0.9, γ_max=12. Each row: (drafted, accepted),
    then m = 0.5·m + 0.5·acc/drafted, th' = th ± ε or th, th = 0.9·th + 0.1·th'."""
    ctl = AdaptiveDraftExit()
    steps = [
        # drafted, accepted, m,        th' rule              -> th
        (4, 4, 0.5, 0.601),  # m < α: th' = 0.61;  0.54 + 0.061
        (12, 12, 0.75, 0.602),  # m < α: th' = 0.611; 0.5409 + 0.0611
        (5, 5, 0.875, 0.603),  # m < α: th' = 0.612; 0.5418 + 0.0612
        (6, 6, 0.9375, 0.602),  # m >= α, 6 < 12: th' = 0.593; 0.5427 + 0.0593
        (12, 12, 0.96875, 0.602),  # m >= α, drafted == γ_max: th' = th
        (3, 0, 0.484375, 0.603),  # m < α: th' = 0.612
    ]
    for drafted, accepted, m, th in steps:
        ctl.update(drafted, accepted)
        assert ctl.matchness == pytest.approx(m, abs=1e-12)
        assert ctl.threshold == pytest.approx(th, abs=1e-12)


def test_threshold_holds_when_the_block_hit_its_cap():
    ctl = AdaptiveDraftExit(0.5, beta1=0.0, epsilon=0.1)  # m = the last block's ratio
    ctl.update(5, 5, max_drafted=5)  # m = 1 >= α, block full: unchanged
    assert ctl.threshold == pytest.approx(0.5)
    ctl.update(5, 5)  # against γ_max = 12: exited early -> th' = 0.4
    assert ctl.threshold == pytest.approx(0.9 * 0.5 + 0.1 * 0.4)


def test_should_stop_is_strictly_below_threshold():
    ctl = AdaptiveDraftExit(0.6)
    assert ctl.should_stop(0.59) and not ctl.should_stop(0.6) and not ctl.should_stop(0.9)


def test_heuristic_schedule_hand_computed():
    s = HeuristicDraftLength(5)
    lengths = []
    for drafted, accepted in [(5, 5), (7, 3), (6, 0), (5, 4), (4, 0), (3, 0), (2, 0), (1, 0), (1, 1), (3, 3)]:
        s.update(drafted, accepted)
        lengths.append(s.num_tokens)
    assert lengths == [7, 6, 5, 4, 3, 2, 1, 1, 3, 5]
    capped = HeuristicDraftLength(5, max_tokens=8)
    capped.update(5, 5)
    capped.update(7, 7)
    assert capped.num_tokens == 8


def test_confidence_gate():
    gate = ConfidenceGate(0.4)
    assert gate.open
    gate.observe(0.39)
    assert not gate.open
    gate.observe(0.4)
    assert gate.open


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: AdaptiveDraftExit(1.5), "draft exit threshold must be a number in [0, 1], got 1.5"),
        (lambda: AdaptiveDraftExit(beta1=1.0), "beta1 must be a number in [0, 1), got 1.0"),
        (lambda: AdaptiveDraftExit(beta2=-0.1), "beta2 must be a number in [0, 1], got -0.1"),
        (lambda: AdaptiveDraftExit(alpha=float("nan")), "alpha must be a number in [0, 1], got nan"),
        (lambda: AdaptiveDraftExit(epsilon=-0.01), "epsilon must be a finite number >= 0, got -0.01"),
        (lambda: AdaptiveDraftExit(max_draft_tokens=0), "max_draft_tokens must be an integer >= 1, got 0"),
        (lambda: AdaptiveDraftExit().update(0, 0), "num_drafted >= 1 and 0 <= num_accepted <= num_drafted"),
        (lambda: AdaptiveDraftExit().update(3, 4), "got num_drafted=3, num_accepted=4"),
        (lambda: HeuristicDraftLength(0), "initial draft length must be an integer >= 1, got 0"),
        (lambda: ConfidenceGate(2), "confidence gate threshold must be a number in [0, 1], got 2"),
        (lambda: DraftControl(length_schedule="linear"), "unknown draft length schedule 'linear'; allowed: constant"),
        (lambda: DraftControl(confidence_gate=-1.0), "confidence gate threshold must be a number in [0, 1]"),
        (lambda: DraftControl(adaptive_exit=True, exit_threshold=7), "draft exit threshold must be a number"),
    ],
)
def test_invalid_parameters(make, message):
    with pytest.raises(InvalidArgumentError) as e:
        make()
    assert message in str(e.value)


def test_adaptive_exit_needs_a_drafter_with_probabilities():
    model = make_tiny_model("llama", num_layers=2)
    with pytest.raises(InvalidArgumentError, match="PromptLookupDrafter does not"):
        SpeculativeDecoder(model, PromptLookupDrafter(), draft_control=DraftControl(adaptive_exit=True))
    # gating and the schedule work with it
    SpeculativeDecoder(model, PromptLookupDrafter(), draft_control=DraftControl(confidence_gate=0.5))


# ---------------------------------------------------------------- a target whose confidence the test sets


def _next_token(t: torch.Tensor) -> torch.Tensor:
    """After token t the controlled model predicts t + 7 (wrapping over 3..47: one 45-cycle)."""
    return 3 + (t - 3 + 7) % (VOCAB - 3)


_CONFIDENCE = torch.full((VOCAB,), 0.95)
_CONFIDENCE[[5, 9, 17, 18, 26, 30, 33, 41, 44]] = 0.3  # irregular along the cycle


def _confidence(t: torch.Tensor) -> torch.Tensor:
    """The probability the controlled model gives its next token after input token t."""
    return _CONFIDENCE[t]


def _chain(start: int, length: int) -> list[int]:
    chain = [start]
    for _ in range(length):
        chain.append(int(_next_token(torch.tensor(chain[-1]))))
    return chain


def _conf(token: int) -> float:
    return float(_CONFIDENCE[token])


def _control_logits(model):
    """Hook: after input token t the model puts probability _confidence(t) on _next_token(t),
    the rest spread evenly (the real forward still runs and fills the cache)."""

    def hook(module, args, kwargs, output):
        ids = args[0] if args else kwargs["input_ids"]
        n = output.logits.shape[1]
        last = ids[0, -n:]
        conf = _confidence(last)
        probs = ((1 - conf) / (VOCAB - 1))[:, None].repeat(1, VOCAB)
        probs[torch.arange(n), _next_token(last)] = conf
        output.logits = probs.log()[None]
        return output

    return model.register_forward_hook(hook, with_kwargs=True)


class _WrongDrafter(ScriptedDrafter):
    """Always proposes the pad token, which the controlled target never produces."""

    def __init__(self) -> None:
        super().__init__([0] * 64)


def test_gate_switches_off_and_on_with_target_confidence():
    """Every draft is rejected, so each step makes one token x_j = next(x_{j-1}) with probability
    conf(x_{j-1}); step j (making x_{j+1}) may draft only if conf(x_{j-1}) >= 0.5."""
    model = make_tiny_model("llama", num_layers=2)
    handle = _control_logits(model)
    try:
        prompt = torch.tensor([[4, 7, 10]])
        budget = 20
        chain = _chain(10, budget)
        # step j = 1 .. budget-2 can draft (the last step has room for one token only)
        drafts = [j for j in range(1, budget - 1) if _conf(chain[j - 1]) >= 0.5]
        gated = [j for j in range(1, budget - 1) if j not in drafts]
        assert drafts and gated  # the chain has both kinds of token

        drafter = Recorder(_WrongDrafter())
        config = GenerationConfig(max_new_tokens=budget, num_speculative_tokens=3, stop_on_eos=False)
        result = SpeculativeDecoder(model, drafter, draft_control=DraftControl(confidence_gate=0.5)).generate(
            prompt, config
        )
        assert result.token_ids == chain[1:]
        assert [length - prompt.shape[1] for length, _ in drafter.calls] == drafts
        assert result.stats.num_gated_steps == len(gated)
        assert result.stats.num_target_forwards == budget - 1
    finally:
        handle.remove()


def test_gate_looks_at_the_last_token_of_an_accepted_block():
    """A drafter that always agrees with the target (layer skip on the controlled model): each
    open step accepts k = min(3, room) tokens plus the bonus; the gate then reads the bonus
    token's probability (the last row verified), not the first draft token's."""
    model = make_tiny_model("gemma2", num_layers=2)
    handle = _control_logits(model)
    try:
        prompt = torch.tensor([[4, 8, 12]])
        budget = 30
        chain = _chain(12, budget)
        expected, gated = [], 0
        j = 1  # tokens made so far; x_j is pending and was made with probability conf(x_{j-1})
        while budget - j > 1:
            if _conf(chain[j - 1]) >= 0.5:
                k = min(3, budget - j - 1)
                expected.append(3 + j)
                j += k + 1
            else:
                gated += 1
                j += 1
        assert expected and gated

        drafter = Recorder(CacheCheckingDrafter(LayerSkipDrafter(model, SkipSet(mlp=(0,)))))
        config = GenerationConfig(max_new_tokens=budget, num_speculative_tokens=3, stop_on_eos=False)
        result = SpeculativeDecoder(model, drafter, draft_control=DraftControl(confidence_gate=0.5)).generate(
            prompt, config
        )
        assert result.token_ids == chain[1 : budget + 1]
        assert [length for length, _ in drafter.calls] == expected
        assert result.stats.num_gated_steps == gated and result.stats.acceptance_rate == 1.0
    finally:
        handle.remove()


def test_adaptive_exit_stops_after_the_first_unconfident_token():
    """Layer-skip drafting on the controlled model sees the same controlled logits, so every
    draft token is accepted and block lengths are predictable: a block ends after the first
    token drafted from an input t with conf(t) = 0.3 < 0.6 (ε = 0 keeps the threshold fixed),
    or at γ_max = 4."""
    model = make_tiny_model("qwen2", num_layers=2)
    handle = _control_logits(model)
    try:
        prompt = torch.tensor([[4, 8, 11]])
        budget = 30
        chain = _chain(11, budget)
        expected_blocks, caps = [], []
        j = 1  # x_1 comes from the prefill; x_j is pending at the start of a block
        while budget - j > 1:
            cap = min(4, budget - j - 1)
            k = 0
            while k < cap:
                k += 1
                if _conf(chain[j + k - 1]) < 0.6:
                    break
            expected_blocks.append((3 + j, k))
            caps.append(cap)
            j += k + 1  # all accepted + the bonus token
        assert any(k < cap == 4 for (_, k), cap in zip(expected_blocks, caps))  # early exits
        assert any(k == 4 for _, k in expected_blocks)  # full blocks
        assert any(k == 1 for _, k in expected_blocks)  # a block of its unconfident first token only

        drafter = Recorder(CacheCheckingDrafter(LayerSkipDrafter(model, SkipSet(attn=(1,)))))
        control = DraftControl(adaptive_exit=True, exit_threshold=0.6, epsilon=0.0, max_draft_tokens=4)
        config = GenerationConfig(max_new_tokens=budget, stop_on_eos=False)
        result = SpeculativeDecoder(model, drafter, draft_control=control).generate(prompt, config)
        assert result.token_ids == chain[1 : budget + 1]
        assert drafter.calls == expected_blocks
        assert result.stats.acceptance_rate == 1.0
        assert result.stats.final_draft_threshold == pytest.approx(0.6)
    finally:
        handle.remove()


# ---------------------------------------------------------------- exactness with every drafter


def _truncated(model, n):
    small = copy.deepcopy(model)
    small.model.layers = torch.nn.ModuleList(list(small.model.layers)[:n])
    small.config.num_hidden_layers = n
    if getattr(small.config, "layer_types", None):
        small.config.layer_types = small.config.layer_types[:n]
    return small


DRAFTERS = {
    "draft-model": lambda m: DraftModelDrafter(_truncated(m, 2)),
    "layer-skip": lambda m: CacheCheckingDrafter(LayerSkipDrafter(m, SkipSet(attn=(1,), mlp=(2,)))),
    "early-exit": lambda m: CacheCheckingDrafter(EarlyExitDrafter(m, 2)),
    "prompt-lookup": lambda m: PromptLookupDrafter(max_ngram=2),
}


def _token_confidences(model, prompt, tokens):
    """The target's probability of each generated token (what the gate looks at)."""
    seq = torch.cat([prompt, torch.tensor([tokens])], dim=1)
    with torch.inference_mode():
        probs = torch.softmax(model(seq).logits[0, prompt.shape[1] - 1 : -1].float(), dim=-1)
    return probs[torch.arange(len(tokens)), torch.tensor(tokens)]


@pytest.mark.parametrize("method", list(DRAFTERS))
def test_greedy_equals_autoregressive_with_control(arch, method):
    model = make_tiny_model(arch, num_layers=4)
    prompt = prompt_ids(5, 11)
    config = GenerationConfig(max_new_tokens=30, num_speculative_tokens=3, stop_on_eos=False)
    expected = autoregressive(model, prompt, config)
    gate = float(_token_confidences(model, prompt, expected).median())  # gates about half the steps
    controls = {
        "gate": DraftControl(confidence_gate=gate),
        "heuristic+gate": DraftControl(length_schedule="heuristic", confidence_gate=gate),
    }
    if method != "prompt-lookup":
        controls["adaptive"] = DraftControl(adaptive_exit=True, exit_threshold=0.3, max_draft_tokens=6)
        controls["adaptive+heuristic+gate"] = DraftControl(
            adaptive_exit=True, max_draft_tokens=6, length_schedule="heuristic", confidence_gate=gate
        )
    for name, control in controls.items():
        result = SpeculativeDecoder(model, DRAFTERS[method](model), draft_control=control).generate(prompt, config)
        assert result.token_ids == expected, (arch, method, name)
        stats = result.stats
        if control.confidence_gate is not None:
            assert 0 < stats.num_gated_steps < stats.num_target_forwards, name
        if control.adaptive_exit:
            assert stats.final_draft_threshold is not None and stats.final_draft_threshold != control.exit_threshold
        else:
            assert stats.final_draft_threshold is None


def test_adaptive_exit_extremes_in_the_loop():
    """Threshold 1 stops after every first token; threshold 0 never stops (ε = 0: fixed)."""
    model = make_tiny_model("mistral", num_layers=4)
    prompt = prompt_ids(4, 3)
    config = GenerationConfig(max_new_tokens=25, stop_on_eos=False)
    for threshold, block in ((1.0, 1), (0.0, 5)):
        control = DraftControl(adaptive_exit=True, exit_threshold=threshold, epsilon=0.0, max_draft_tokens=5)
        drafter = Recorder(LayerSkipDrafter(model, SkipSet(attn=(1, 2))))
        result = SpeculativeDecoder(model, drafter, draft_control=control).generate(prompt, config)
        assert result.token_ids == autoregressive(model, prompt, config)
        remaining = [25 - (length - 4) for length, _ in drafter.calls]
        assert [k for _, k in drafter.calls] == [min(block, r - 1) for r in remaining]
        assert result.stats.to_dict()["final_draft_threshold"] == threshold


def test_sampling_with_adaptive_exit_and_gate_preserves_target_distribution():
    """Tokens 1-3 keep the target law when adaptive exit cuts blocks short and the gate skips
    drafting after unconfident tokens (both depend only on past tokens and the draft's own draws)."""
    vocab, n = 8, 600
    model = make_tiny_model("llama", num_layers=2, vocab_size=vocab, seed=1)
    prompt = [1, 5, 3, 6]
    config = GenerationConfig(max_new_tokens=4, stop_on_eos=False, temperature=1.0)
    control = DraftControl(adaptive_exit=True, exit_threshold=0.35, max_draft_tokens=3, confidence_gate=0.09)
    drafter = Recorder(LayerSkipDrafter(model, SkipSet(attn=(1,), mlp=(0,))))
    dec = SpeculativeDecoder(model, drafter, draft_control=control)
    freq = sample_counts(dec, prompt, config, n, vocab)
    assert violations(exact_marginals(model, prompt, config, vocab), freq, n) == []
    # both mechanisms acted in these runs: gated steps, blocks cut short, full blocks of 2
    blocks = [(cap, k) for (_, k), cap in zip(drafter.calls, drafter.caps)]
    runs = [dec.generate(prompt, dataclasses.replace(config, seed=s)).stats for s in range(40)]
    assert 0 < sum(r.num_gated_steps for r in runs) < len(runs)
    assert any(k < cap for cap, k in blocks) and any(k == cap == 2 for cap, k in blocks)
