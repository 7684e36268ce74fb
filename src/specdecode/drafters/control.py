"""How many tokens to draft each round: adaptive draft exit, length schedules, confidence gating.

* **Adaptive draft exit** (Draft & Verify, Zhang et al. 2023, arXiv 2309.08168,
  Sec. 3.3 "Adaptive Draft-Exiting Mechanism"): drafting stops after the first
  token whose draft top probability is below a threshold ``th``; ``th`` follows
  the acceptance rate. After each verification, with ``m`` a running matchness::

      m   <- β1·m + (1 - β1)·(accepted / drafted)
      th' =  th + ε   if m < α            (drafts fail: stop sooner)
             th       elif drafted == max (no early exit happened)
             th - ε   otherwise           (drafts pass: draft longer)
      th  <- β2·th + (1 - β2)·th'

* **Heuristic draft length** (transformers' ``num_assistant_tokens_schedule=
  "heuristic"``): +2 after a fully accepted block, -1 otherwise, never below 1.

* **Cost model** (``length_schedule="cost-model"``): each round the size (tokens of a chain, nodes
  of a tree, 0 for a plain step) with the most expected tokens per second, from the target's
  forward costs measured before the first round and acceptance by depth measured while decoding
  (``engine.speculation_cost``, after SpecDec++ and DISCO). Its estimates live in the
  ``DraftControl`` (one ``SpeculationCostPolicy`` each) and carry over between generations.
  With adaptive draft exit as well, the two split the work: the exit sets each draft's length
  (up to ``max_draft_tokens``) from the draft's confidence, and the cost model decides whether a
  round drafts at all, by the measured tokens per second of drafting rounds against plain steps
  (``engine.speculation_cost``; nothing timed beforehand: after the first drafting round, plain
  rounds give the plain arm its rate); the exit alone always drafts at least one token.

* **Target-confidence gating** (the blog post "Using The Target Model's Confidence
  Threshold To Decide Whether To Enable Speculative Decoding"): when the target's
  probability of the token it just produced is below a threshold, the text is
  hard to predict and a draft would likely be rejected, so the next step is a
  plain target step (no drafting); drafting resumes once the target's confidence
  is back at or above the threshold.

``DraftControl`` holds the parameters (frozen, reusable); the decoder makes a fresh
``DraftController`` with the mutable state for each generation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specdecode.engine.cost_model import check_count
from specdecode.engine.protocol import DRAFT_EXIT_MODES, DraftPolicy, Drafter, MeasureForwards, RoundController
from specdecode.engine.speculation_cost import SpeculationCostPolicy
from specdecode.errors import InvalidArgumentError

LENGTH_SCHEDULES = ("constant", "heuristic", "cost-model")


def _check_unit(name: str, value: float, *, open_right: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or value > 1 or (open_right and value == 1):
        allowed = "[0, 1)" if open_right else "[0, 1]"
        raise InvalidArgumentError(f"{name} must be a number in {allowed}, got {value!r}")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_optional_count(name: str, value: object, none_means: str) -> int | None:
    """Return ``value`` if it is None or an integer >= 1 (a number of tokens; drafters' options).

    Raises:
        InvalidArgumentError: Anything else, naming ``name``, the value and the allowed range
            (``none_means``: what None stands for).
    """
    if value is not None and not _is_count(value):
        raise InvalidArgumentError(
            f"{name}={value!r} is out of range: allowed an integer >= 1 (tokens), or None for {none_means}"
        )
    return value


def _check_block(num_drafted: int, num_accepted: int) -> None:
    if num_drafted < 1 or not 0 <= num_accepted <= num_drafted:
        raise InvalidArgumentError(
            f"a verified block needs num_drafted >= 1 and 0 <= num_accepted <= num_drafted, "
            f"got num_drafted={num_drafted!r}, num_accepted={num_accepted!r}"
        )


class AdaptiveDraftExit:
    """Draft & Verify's adaptive draft-exit threshold (see the module docstring).

    Args:
        threshold: Initial threshold on the draft's top probability, in [0, 1].
        beta1: Smoothing of the matchness m, in [0, 1).
        beta2: Smoothing of the threshold, in [0, 1].
        epsilon: Threshold step, >= 0 (finite).
        alpha: Target matchness, in [0, 1].
        max_draft_tokens: γ_max, the most tokens drafted per block (>= 1).

    Attributes:
        threshold: The current threshold.
        matchness: m, the smoothed accepted/drafted ratio (starts at 0, as in the paper's code).
        mode: How the draft's confidence is read (``engine.protocol.ExitPolicy.mode``): "per-step" unless the
            engine sets another (``DraftControl.exit_mode``).
        next_length: With mode "previous-round", the next block's length (``observe``; starts at
            ``max_draft_tokens``).

    Raises:
        InvalidArgumentError: If a parameter is outside its range.
    """

    def __init__(
        self,
        threshold: float = 0.6,
        *,
        beta1: float = 0.5,
        beta2: float = 0.9,
        epsilon: float = 0.01,
        alpha: float = 0.9,
        max_draft_tokens: int = 12,
    ) -> None:
        _check_unit("draft exit threshold", threshold)
        _check_unit("beta1", beta1, open_right=True)
        _check_unit("beta2", beta2)
        _check_unit("alpha", alpha)
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not math.isfinite(epsilon) or epsilon < 0:
            raise InvalidArgumentError(f"epsilon must be a finite number >= 0, got {epsilon!r}")
        check_count("max_draft_tokens", max_draft_tokens, 1)
        self.threshold = float(threshold)
        self.beta1, self.beta2, self.epsilon, self.alpha = beta1, beta2, epsilon, alpha
        self.max_draft_tokens = max_draft_tokens
        self.matchness = 0.0
        self.mode = "per-step"
        self.next_length = max_draft_tokens
        self._exited: bool | None = None  # set by ``observe`` for the next ``update``

    def should_stop(self, top_prob: float) -> bool:
        """True when a drafted token's top probability is below the threshold (that token still counts)."""
        return top_prob < self.threshold

    def observe(self, exit_point: int | None, num_drafted: int) -> None:
        """A block drafted without reads between steps (``engine.draft_exit``): its first unsure token's
        1-based position, or None (none of its ``num_drafted`` tokens was unsure). The next ``update`` counts
        the block as exited early iff one before its last token was (as the per-step loop, which drafts the
        cap's last token whatever its confidence); "previous-round" sizes the next block from it."""
        self._exited = exit_point is not None and exit_point < num_drafted
        self.next_length = exit_point if exit_point is not None else min(self.max_draft_tokens, num_drafted + 2)

    def update(self, num_drafted: int, num_accepted: int, max_drafted: int | None = None) -> None:
        """Account one verified block.

        Args:
            num_drafted: Tokens in the block (>= 1).
            num_accepted: How many the target accepted (0..num_drafted).
            max_drafted: The block's cap; ``num_drafted == max_drafted`` means the
                threshold never stopped drafting (after an ``observe``, its exit point says). Defaults to
                ``max_draft_tokens`` (the decoder passes a smaller cap near the length budget).

        Raises:
            InvalidArgumentError: If the counts are inconsistent.
        """
        _check_block(num_drafted, num_accepted)
        cap = self.max_draft_tokens if max_drafted is None else max_drafted
        exited, self._exited = (num_drafted < cap if self._exited is None else self._exited), None
        self.matchness = self.beta1 * self.matchness + (1 - self.beta1) * (num_accepted / num_drafted)
        if self.matchness < self.alpha:
            proposal = self.threshold + self.epsilon
        elif not exited:
            proposal = self.threshold
        else:
            proposal = self.threshold - self.epsilon
        self.threshold = self.beta2 * self.threshold + (1 - self.beta2) * proposal


class HeuristicDraftLength:
    """transformers' "heuristic" schedule: +2 tokens after a fully accepted block, else -1 (min 1).

    Args:
        initial: Draft length of the first block (>= 1).
        max_tokens: Optional upper bound (>= 1); None leaves it unbounded, as in transformers.

    Attributes:
        num_tokens: The draft length for the next block.

    Raises:
        InvalidArgumentError: If ``initial`` or ``max_tokens`` is below 1.
    """

    def __init__(self, initial: int, max_tokens: int | None = None) -> None:
        check_count("initial draft length", initial, 1)
        if max_tokens is not None:
            check_count("max draft length", max_tokens, 1)
        self.max_tokens = max_tokens
        self.num_tokens = initial if max_tokens is None else min(initial, max_tokens)

    def update(self, num_drafted: int, num_accepted: int) -> None:
        """Account one verified block (``num_drafted`` >= 1, ``num_accepted`` <= num_drafted)."""
        _check_block(num_drafted, num_accepted)
        if num_accepted == num_drafted:
            self.num_tokens += 2
            if self.max_tokens is not None:
                self.num_tokens = min(self.num_tokens, self.max_tokens)
        else:
            self.num_tokens = max(1, self.num_tokens - 1)


class ConfidenceGate:
    """Drafting is on while the target's probability of its last token is >= ``threshold``.

    Args:
        threshold: In [0, 1]; 0 never gates.

    Attributes:
        open: Whether the next step may draft (True until a low-confidence token is seen).

    Raises:
        InvalidArgumentError: If ``threshold`` is outside [0, 1].
    """

    def __init__(self, threshold: float) -> None:
        _check_unit("confidence gate threshold", threshold)
        self.threshold = float(threshold)
        self.open = True

    def observe(self, target_prob: float) -> None:
        """Record the target's probability (its own, warped distribution) of the token it just produced."""
        self.open = target_prob >= self.threshold


@dataclass(frozen=True)
class DraftControl(DraftPolicy):
    """Per-round draft-length policy of a speculative decoder.

    Attributes:
        adaptive_exit: Turn on Draft & Verify's adaptive draft exit; the block cap is
            then ``max_draft_tokens`` instead of ``GenerationConfig.num_speculative_tokens`` (γ).
        exit_threshold, beta1, beta2, epsilon, alpha, max_draft_tokens: Its parameters
            (see ``AdaptiveDraftExit``); defaults 0.6, 0.5, 0.9, 0.01, 0.9, 12.
        length_schedule: "constant" (γ tokens each round), "heuristic"
            (``HeuristicDraftLength`` starting at γ, capped at ``max_draft_tokens``
            when adaptive exit is on), or "cost-model" (each round's size from measured costs
            and acceptance, up to γ: ``engine.speculation_cost``; not with a confidence gate; its
            estimates in ``cost_policy``, shared by the generations that use this control). With
            adaptive exit too, the cost model chooses between drafting (up to ``max_draft_tokens``,
            the exit stopping earlier) and a plain step by their measured tokens per second.
        confidence_gate: Threshold of ``ConfidenceGate``, or None for no gating.
        exit_mode: How the adaptive exit reads the draft's confidence (``engine.protocol.DRAFT_EXIT_MODES``,
            ``engine.draft_exit``): "per-step" (after every draft step, on the host), "previous-round" (the
            block's length from the previous round's confidences; nothing read between draft steps),
            "masked" (the whole cap drafted, cut after the first unsure token once read with the round's
            sync). Default "per-step": the fastest measured (``engine.draft_exit``).

    Raises:
        InvalidArgumentError: If a value is outside its range.
    """

    adaptive_exit: bool = False
    exit_threshold: float = 0.6
    beta1: float = 0.5
    beta2: float = 0.9
    epsilon: float = 0.01
    alpha: float = 0.9
    max_draft_tokens: int = 12
    length_schedule: str = "constant"
    confidence_gate: float | None = None
    exit_mode: str = "per-step"

    def __post_init__(self) -> None:
        self.new_exit()  # validates the exit parameters
        if self.exit_mode not in DRAFT_EXIT_MODES:
            raise InvalidArgumentError(
                f"unknown draft exit mode {self.exit_mode!r}; allowed: {', '.join(DRAFT_EXIT_MODES)}"
            )
        if self.length_schedule not in LENGTH_SCHEDULES:
            raise InvalidArgumentError(
                f"unknown draft length schedule {self.length_schedule!r}; allowed: {', '.join(LENGTH_SCHEDULES)}"
            )
        if self.confidence_gate is not None:
            ConfidenceGate(self.confidence_gate)
        policy = None
        if self.length_schedule == "cost-model":
            if self.confidence_gate is not None:
                raise InvalidArgumentError(
                    "length_schedule='cost-model' decides itself when a round is a plain step; it does not combine "
                    f"with confidence_gate={self.confidence_gate!r}: turn that off"
                )
            policy = SpeculationCostPolicy()
        object.__setattr__(self, "_cost_policy", policy)

    @property
    def cost_policy(self) -> SpeculationCostPolicy | None:
        """The cost model's policy and estimates ("cost-model"), or None."""
        return self._cost_policy

    @property
    def active(self) -> bool:
        """Whether this differs from drafting γ tokens every round."""
        return self.adaptive_exit or self.length_schedule != "constant" or self.confidence_gate is not None

    def controller(self, gamma: int) -> RoundController:
        """Fresh per-generation state for a decoder drafting ``gamma`` tokens per round by default."""
        if self._cost_policy is not None:
            if not self.adaptive_exit:
                return self._cost_policy.controller(gamma)
            return self._cost_policy.controller(self.max_draft_tokens, exit=self.new_exit())
        return DraftController(self, gamma)

    def calibrate(self, measure: MeasureForwards, max_width: int, drafter: Drafter) -> None:
        """The cost model's calibration (``SpeculationCostPolicy.calibrate``); with the adaptive exit only its
        prior (``prime``: both arms are measured by their rounds); nothing for the other schedules."""
        if self._cost_policy is None:
            return
        if self.adaptive_exit:
            self._cost_policy.prime(drafter)
        else:
            self._cost_policy.calibrate(measure, max_width, drafter)

    def new_exit(self) -> AdaptiveDraftExit:
        """A fresh ``AdaptiveDraftExit`` with these parameters."""
        return AdaptiveDraftExit(
            self.exit_threshold,
            beta1=self.beta1,
            beta2=self.beta2,
            epsilon=self.epsilon,
            alpha=self.alpha,
            max_draft_tokens=self.max_draft_tokens,
        )


class DraftController(RoundController):
    """The per-generation state of a ``DraftControl``: what the decode loop asks each round.

    Args:
        control: The policy.
        gamma: ``GenerationConfig.num_speculative_tokens``.

    Attributes:
        exit: The ``AdaptiveDraftExit`` (passed to ``Drafter.propose``), or None.
        schedule: The ``HeuristicDraftLength``, or None.
        gate: The ``ConfidenceGate``, or None.
    """

    def __init__(self, control: DraftControl, gamma: int) -> None:
        self.exit = control.new_exit() if control.adaptive_exit else None
        self.max_tokens = control.max_draft_tokens if control.adaptive_exit else gamma
        self.schedule = (
            HeuristicDraftLength(gamma, self.max_tokens if control.adaptive_exit else None)
            if control.length_schedule == "heuristic"
            else None
        )
        self.gate = ConfidenceGate(control.confidence_gate) if control.confidence_gate is not None else None

    @property
    def gated(self) -> bool:
        """True when the confidence gate turns the next step into a plain target step."""
        return self.gate is not None and not self.gate.open

    def round_cap(self) -> int:
        """Most tokens to draft in the next round (0 when gated)."""
        if self.gated:
            return 0
        if self.schedule is not None:
            return self.schedule.num_tokens
        return self.max_tokens

    def record(self, cap: int, num_drafted: int, num_accepted: int) -> None:
        """After verifying a block of ``num_drafted`` >= 1 tokens drafted under ``cap``."""
        if self.exit is not None:
            self.exit.update(num_drafted, num_accepted, cap)
        if self.schedule is not None:
            self.schedule.update(num_drafted, num_accepted)
