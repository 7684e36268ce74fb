"""The draft length per round from measured forward costs and a running acceptance rate.

Where verification is far from flat (llama.cpp on a 2-core CPU: the Qwen2.5-Coder 1.5B Q4_K_M
costs about 33, 56, 92 and 215 ms for forwards over 1, 2, 4 and 8 tokens), a fixed γ loses
to plain decoding unless the draft is accepted most of the time. This module picks, before
each round, the number of tokens k to draft (0: a plain target step) that maximises the
expected tokens per second of that round:

    E[tokens](k) = (1 - α^(k+1)) / (1 - α)        (k + 1 at α = 1)
    seconds(k)   = k · c_draft + C_target(k + 1)
    k*           = argmax_k E[tokens](k) / seconds(k),  k in 0 .. max_tokens

E[tokens] is the expected number of tokens a linear draft of k tokens yields when each
drafted token is accepted independently with probability α, the bonus (or replacement)
token counted (Leviathan et al., 2023, "Fast Inference from Transformers via Speculative
Decoding", eq. 1 and section 3.5, where the same ratio picks γ). ``C_target(w)`` is
measured at warm-up at a few widths (``ForwardCosts``) and interpolated between them;
``c_draft`` is the drafter's cost per token (about 0 for prompt lookup). So no round is
planned to cost more than it is expected to return: k = 0 whenever no draft length beats
a plain step at the current α.

α is estimated while decoding (``AcceptanceEstimate``): in a round that drafted k tokens
and accepted a, the tokens 1 .. a were accepted and, if a < k, token a + 1 was rejected
and ended the block: a successes in a + [a < k] trials, counted with exponential
forgetting so that the estimate follows the text (code that copies from the prompt, then
prose that does not). Only rounds that drafted something count: a round in which the drafter
had nothing to offer (prompt lookup without a match) is a plain step whatever k was allowed,
so α is the acceptance of the drafts that exist, the quantity that decides whether to verify
them. ``CostModelController`` is the per-generation ``RoundController`` (``engine.protocol``)
that a decode loop asks each round; while the model says "plain step" it still allows one
token every ``probe_every`` rounds, and keeps allowing one each round until a round has
actually drafted (a probe that found no match is not spent), so that α can rise again as
soon as there is something to copy.

**The prior** (α before any round) is the drafter's measured acceptance, counted as α is
(accepted tokens in trials to the first rejection, over the rounds that drafted), greedy, from
the project's bench records (``docs/benchmarks/data``):

* prompt lookup: 0.56 on HumanEval (20 prompts, 867 rounds with a match,
  ``2026-11-25-cascade-humaneval20/records.jsonl``), 0.45 on Spec-Bench (65 prompts,
  ``2026-11-25-cascade-specbench65``): ``PROMPT_LOOKUP_PRIOR`` = 0.56, the code figure;
* the 0.5B draft model for the 1.5B target (``draft`` and ``cascade`` with the llama.cpp
  draft, ``2026-11-25-llama-cpp-draft-humaneval20``): 0.88 (a lower bound, as adaptive exit's
  short blocks count as rejected there): ``DRAFT_MODEL_PRIOR``.

With the prior 0.5 of before, prompt lookup sat at the break-even of the measured llama.cpp
costs (0.62-0.71 for k = 1) and its one-token probes were mostly spent on rounds without a
match, so it almost never drafted; the prior is still below break-even for prompt lookup
(its average draft does not pay there), but the first accepted probe lifts α above it, and
that probe now comes at the first match after ``probe_every`` plain steps.

This is the small version that a general engine cost model (the tree-drafting issue) will
replace; it knows linear drafts only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from specdecode.engine.protocol import DraftPolicy, RoundController
from specdecode.errors import InvalidArgumentError

#: The verification widths measured at warm-up (tokens fed to the target in one forward).
MEASURED_WIDTHS = (1, 2, 4, 8)
#: α before any round for prompt lookup and for a draft model (module docstring, "The prior").
PROMPT_LOOKUP_PRIOR = 0.56
DRAFT_MODEL_PRIOR = 0.88


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens a round yields with k drafted tokens each accepted with probability α.

    (1 - α^(k+1)) / (1 - α): the accepted tokens plus the target's bonus or replacement token;
    1 for k = 0 (a plain step), k + 1 at α = 1.

    Raises:
        InvalidArgumentError: α outside [0, 1] or k < 0.
    """
    if not 0.0 <= alpha <= 1.0 or math.isnan(alpha):
        raise InvalidArgumentError(f"the acceptance rate must be in [0, 1], got {alpha!r}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise InvalidArgumentError(f"the draft length must be an integer >= 0, got {k!r}")
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass(frozen=True)
class ForwardCosts:
    """Seconds per forward of a model at the widths measured; other widths interpolated.

    Args:
        seconds: Width (tokens in one forward, >= 1) -> seconds (finite, > 0); must hold width 1.

    Raises:
        InvalidArgumentError: No width 1, a width that is not an integer >= 1, or a cost
            that is not a finite positive number.
    """

    seconds: Mapping[int, float]
    _widths: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        bad = [(w, s) for w, s in self.seconds.items()
               if isinstance(w, bool) or not isinstance(w, int) or w < 1
               or isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0]
        if bad:
            raise InvalidArgumentError(
                f"forward costs must map widths (integers >= 1) to finite seconds > 0, got {bad[0][0]!r}: {bad[0][1]!r}"
            )
        if 1 not in self.seconds:
            raise InvalidArgumentError(
                f"forward costs must include width 1 (a plain step), got widths {sorted(self.seconds)}"
            )
        object.__setattr__(self, "seconds", MappingProxyType({int(w): float(s) for w, s in self.seconds.items()}))
        object.__setattr__(self, "_widths", tuple(sorted(self.seconds)))

    def at(self, width: int) -> float:
        """Seconds of a forward over ``width`` tokens.

        A measured width gives its own cost; one between two measured widths the straight
        line between them; one past the widest measured the last segment's cost per token
        carried on (never falling: at least the widest cost).

        Raises:
            InvalidArgumentError: ``width`` < 1.
        """
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise InvalidArgumentError(f"a forward's width must be an integer >= 1, got {width!r}")
        costs, widths = self.seconds, self._widths
        if width in costs:
            return costs[width]
        above = next((w for w in widths if w > width), None)
        below = max(w for w in widths if w < width)
        if above is not None:
            t = (width - below) / (above - below)
            return costs[below] + t * (costs[above] - costs[below])
        if len(widths) == 1:
            return costs[below] * width  # one measurement: each token as much as the first
        prev = widths[-2]
        slope = max(0.0, (costs[below] - costs[prev]) / (below - prev))
        return costs[below] + slope * (width - below)


@dataclass(frozen=True)
class DraftCostModel:
    """The expected throughput of a round by draft length, and the best length.

    Args:
        target: The target's forward costs (the verification over k + 1 tokens costs
            ``target.at(k + 1)``; a plain step ``target.at(1)``).
        draft_step_s: Seconds the drafter spends per drafted token (0 for prompt lookup; the
            draft model's one-token forward for a draft model), >= 0.
        max_tokens: The longest draft considered, >= 0.

    Raises:
        InvalidArgumentError: A negative or non-finite ``draft_step_s``, or ``max_tokens`` < 0.
    """

    target: ForwardCosts
    draft_step_s: float = 0.0
    max_tokens: int = 8

    def __post_init__(self) -> None:
        if isinstance(self.draft_step_s, bool) or not isinstance(self.draft_step_s, (int, float)) or not (
            math.isfinite(self.draft_step_s) and self.draft_step_s >= 0
        ):
            raise InvalidArgumentError(f"draft_step_s must be finite seconds >= 0, got {self.draft_step_s!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise InvalidArgumentError(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")

    def round_seconds(self, k: int) -> float:
        """Seconds of a round drafting k tokens: k · draft_step_s + the target's forward over k + 1."""
        return k * self.draft_step_s + self.target.at(k + 1)

    def tokens_per_second(self, alpha: float, k: int) -> float:
        """Expected tokens per second of a round drafting k tokens at acceptance rate α."""
        return expected_tokens(alpha, k) / self.round_seconds(k)

    def best_length(self, alpha: float, max_tokens: int | None = None) -> int:
        """The k in 0 .. ``max_tokens`` (default ``self.max_tokens``) with the most expected tokens
        per second at α; a tie goes to the shorter draft (0: a plain step).

        Raises:
            InvalidArgumentError: α outside [0, 1].
        """
        limit = self.max_tokens if max_tokens is None else min(max_tokens, self.max_tokens)
        best, best_rate = 0, self.tokens_per_second(alpha, 0)
        for k in range(1, limit + 1):
            rate = self.tokens_per_second(alpha, k)
            if rate > best_rate * (1 + 1e-12):
                best, best_rate = k, rate
        return best

    def break_even(self, k: int, tolerance: float = 1e-6) -> float | None:
        """The smallest α at which drafting k >= 1 tokens is at least as fast as a plain step
        (bisection on α; None when even α = 1 does not pay)."""
        plain = self.tokens_per_second(0.0, 0)
        if self.tokens_per_second(1.0, k) < plain:
            return None
        lo, hi = 0.0, 1.0
        while hi - lo > tolerance:
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if self.tokens_per_second(mid, k) >= plain else (mid, hi)
        return hi


class AcceptanceEstimate:
    """A running estimate of α, the per-token acceptance rate of a linear draft.

    A round that drafted k tokens and accepted a counts a accepted tokens in a + [a < k]
    trials (the first rejection ends the block). Earlier rounds weigh ``decay`` times less
    per round; the prior counts as ``prior_weight`` trials at ``prior``.

    Args:
        prior: α before any round, in [0, 1].
        prior_weight: Trials the prior is worth (> 0), forgotten like the rounds.
        decay: Weight kept per round, in (0, 1].

    Raises:
        InvalidArgumentError: A value outside its range.
    """

    def __init__(self, prior: float = 0.5, prior_weight: float = 2.0, decay: float = 0.9) -> None:
        if not 0.0 <= prior <= 1.0:
            raise InvalidArgumentError(f"prior must be in [0, 1], got {prior!r}")
        if not prior_weight > 0 or not math.isfinite(prior_weight):
            raise InvalidArgumentError(f"prior_weight must be a finite number > 0, got {prior_weight!r}")
        if not 0.0 < decay <= 1.0:
            raise InvalidArgumentError(f"decay must be in (0, 1], got {decay!r}")
        self.decay = decay
        self.accepted = prior * prior_weight
        self.trials = prior_weight

    @property
    def value(self) -> float:
        """The current α."""
        return self.accepted / self.trials

    def update(self, num_drafted: int, num_accepted: int) -> None:
        """After a round that drafted ``num_drafted`` >= 1 tokens and accepted ``num_accepted`` of them.

        Raises:
            InvalidArgumentError: ``num_drafted`` < 1 or ``num_accepted`` outside 0 .. ``num_drafted``.
        """
        if num_drafted < 1 or not 0 <= num_accepted <= num_drafted:
            raise InvalidArgumentError(
                f"a round must draft >= 1 tokens and accept 0..drafted of them, got {num_accepted} of {num_drafted}"
            )
        self.accepted = self.decay * self.accepted + num_accepted
        self.trials = self.decay * self.trials + num_accepted + (num_accepted < num_drafted)


class CostModelController(RoundController):
    """The per-generation ``RoundController`` (``engine.protocol``) of a ``DraftCostModel``.

    Each round drafts ``model.best_length(α)`` tokens (capped by ``max_tokens``), α from
    ``estimate``; when that is 0 (a plain step: ``gated``), every ``probe_every``-th such
    round allows one token instead (a probe), so that the estimate sees new rounds. A probe
    stays due until a round records a draft: a probe in which the drafter had nothing to offer
    (no ``record``, or ``record`` with ``num_drafted`` 0) is repeated the next round. Where no
    length pays even at α = 1 (``DraftCostModel.break_even`` None for every k up to
    ``max_tokens``: a draft model almost as slow as the target), it never probes: every round is
    a plain step.

    Args:
        model: The costs.
        max_tokens: The longest block (γ, ``GenerationConfig.num_speculative_tokens``), >= 1.
        estimate: The running α (default: a fresh ``AcceptanceEstimate()``).
        probe_every: Plain steps between two probes (>= 1).

    Attributes:
        exit, gate: None (no adaptive exit, no confidence gate).
        num_probes: Probing rounds so far (a repeated probe counts each time).
        can_pay: Whether some length up to ``max_tokens`` pays at some α (else no probes).

    Raises:
        InvalidArgumentError: ``max_tokens`` or ``probe_every`` < 1.
    """

    exit = None
    gate = None

    def __init__(self, model: DraftCostModel, max_tokens: int, estimate: AcceptanceEstimate | None = None,
                 probe_every: int = 16) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise InvalidArgumentError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        if isinstance(probe_every, bool) or not isinstance(probe_every, int) or probe_every < 1:
            raise InvalidArgumentError(f"probe_every must be an integer >= 1, got {probe_every!r}")
        self.model = model
        self.max_tokens = min(max_tokens, model.max_tokens)
        self.estimate = estimate if estimate is not None else AcceptanceEstimate()
        self.probe_every = probe_every
        self.num_probes = 0
        self._plain_steps = 0
        self._probe_due = False  # a probe was allowed and no round has drafted since
        self.can_pay = any(model.break_even(k) is not None for k in range(1, self.max_tokens + 1))

    def _choice(self) -> int:
        k = self.model.best_length(self.estimate.value, self.max_tokens)
        if k == 0 and self.can_pay and (self._probe_due or self._plain_steps + 1 >= self.probe_every):
            return 1
        return k

    @property
    def gated(self) -> bool:
        """True when the next round is a plain target step."""
        return self._choice() == 0

    def round_cap(self) -> int:
        """Tokens to draft in the next round (0: a plain step); call once per round."""
        k = self._choice()
        if k == 0:
            self._plain_steps += 1
        else:
            if self.model.best_length(self.estimate.value, self.max_tokens) == 0:
                self.num_probes += 1
                self._probe_due = True
            self._plain_steps = 0
        return k

    def record(self, cap: int, num_drafted: int, num_accepted: int) -> None:
        """After verifying a block of ``num_drafted`` tokens drafted under ``cap``; a round that
        drafted nothing (``num_drafted`` 0) is no evidence about α and changes nothing.

        Raises:
            InvalidArgumentError: As ``AcceptanceEstimate.update`` (``num_accepted`` outside
                0 .. ``num_drafted``, a negative ``num_drafted``).
        """
        if num_drafted == 0 and num_accepted == 0:
            return
        self.estimate.update(num_drafted, num_accepted)
        self._probe_due = False


@dataclass(frozen=True)
class CostModelPolicy(DraftPolicy):
    """A frozen ``DraftPolicy`` (``engine.protocol``) that draws its draft lengths from ``model``.

    Args:
        model: The measured costs.
        prior, prior_weight, decay: Each generation's ``AcceptanceEstimate``.
        probe_every: As ``CostModelController``.
    """

    model: DraftCostModel
    prior: float = 0.5
    prior_weight: float = 2.0
    decay: float = 0.9
    probe_every: int = 16
    adaptive_exit: bool = False

    def __post_init__(self) -> None:
        AcceptanceEstimate(self.prior, self.prior_weight, self.decay)  # validates them
        if isinstance(self.probe_every, bool) or not isinstance(self.probe_every, int) or self.probe_every < 1:
            raise InvalidArgumentError(f"probe_every must be an integer >= 1, got {self.probe_every!r}")

    @property
    def active(self) -> bool:
        """Always True: the length changes from round to round."""
        return True

    def controller(self, gamma: int) -> CostModelController:
        """Fresh per-generation state, drafting at most γ tokens a round."""
        return CostModelController(self.model, gamma, AcceptanceEstimate(self.prior, self.prior_weight, self.decay),
                                   self.probe_every)
