"""The cost model's small pieces: the target's forward costs, the priors, the widths and sizes it prices.

``engine.speculation_cost`` is the cost model (each round, the draft size with the most expected
tokens per second: ``SpeculationCostPolicy``); this module holds what it and its callers share:

* ``ForwardCosts``: seconds of a target forward by width (tokens in one forward), measured at a
  few widths and interpolated between them. Where verification is far from flat (llama.cpp on a
  2-core AVX512 EPYC: the Qwen2.5-Coder 1.5B Q4_K_M costs about 33, 56, 92 and 215 ms for forwards
  over 1, 2, 4 and 8 tokens), a fixed γ loses to plain decoding unless the draft is accepted most of
  the time; these costs are what the cost model weighs the expected tokens against.
* ``MEASURED_WIDTHS``: the widths a llama.cpp target is timed at (``engine.runner_target.
  measured_cost_policy``); ``SIZES``: the candidate tree sizes (nodes) up to a generation's γ.
* ``DepthAcceptance``: running estimates of α_d, the acceptance at depth d given depth d - 1 was;
  ``best_size``: the size with the most expected tokens per second.
* ``expected_tokens(α, k)``: Leviathan et al. (2023, "Fast Inference from Transformers via
  Speculative Decoding", eq. 1)'s expected tokens of a chain of k drafted tokens each accepted
  with probability α, (1 - α^(k+1)) / (1 - α), the bonus (or replacement) token counted: the
  cost model's chain with one α at every depth (``SpeculationCostPolicy.break_even`` uses it).

**The prior** (α before any round) is the drafter's measured acceptance, counted as α is
(accepted tokens in trials to the first rejection, over the rounds that drafted), greedy, from
the project's bench records (``docs/benchmarks/data``):

* prompt lookup: 0.56 on HumanEval (20 prompts, 867 rounds with a match,
  ``2026-11-25-cascade-humaneval20/records.jsonl``), 0.45 on Spec-Bench (65 prompts,
  ``2026-11-25-cascade-specbench65``): ``PROMPT_LOOKUP_PRIOR`` = 0.56, the code figure;
* the 0.5B draft model for the 1.5B target (``draft`` and ``cascade`` with the llama.cpp
  draft, ``2026-11-25-llama-cpp-draft-humaneval20``): 0.88 (a lower bound, as adaptive exit's
  short blocks count as rejected there): ``DRAFT_MODEL_PRIOR``.

With a prior of 0.5, prompt lookup sat at the break-even of the measured llama.cpp costs
(0.62-0.71 for k = 1) and its one-token probes were mostly spent on rounds without a match, so
it almost never drafted; the prior is still below break-even for prompt lookup (its average
draft does not pay there), but the first accepted probe lifts α above it, and that probe comes
at the first match after ``probe_every`` plain steps (``SpeculationCostController``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from specdecode.errors import InvalidArgumentError

def check_count(name: str, value: object, least: int) -> None:
    """Raise ``InvalidArgumentError`` naming ``name`` unless ``value`` is an integer >= ``least``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise InvalidArgumentError(f"{name} must be an integer >= {least}, got {value!r}")


#: The verification widths a llama.cpp target is measured at (tokens fed to the target in one forward). Not
#: interpolated at 3: llama.cpp's repacked Q4_K kernels run a multiple of 4 tokens together and the rest one at
#: a time, so on a 2-core Xeon 3 tokens cost more than 4 (123.8 against 111.5 ms; docs/benchmarks/2026-11-27-xeon-amx.md).
MEASURED_WIDTHS = (1, 2, 3, 4, 6, 8)
#: Candidate tree sizes (nodes) up to a generation's γ, which is always one.
SIZES = (0, 1, 2, 4, 8, 16, 32, 64)
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


class SizeMeans:
    """Exponentially weighted running means per size (None: not measured).

    Args:
        decay: The weight the old mean keeps at each update, in [0, 1).

    Raises:
        InvalidArgumentError: ``decay`` outside [0, 1).
    """

    def __init__(self, decay: float = 0.8) -> None:
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay < 1.0:
            raise InvalidArgumentError(f"decay must be in [0, 1), got {decay!r}")
        self.decay = float(decay)
        self.means: dict[int, float] = {}

    def add(self, size: int, value: float) -> None:
        """One more measurement of ``value`` at ``size``."""
        old = self.means.get(size)
        self.means[size] = value if old is None else self.decay * old + (1.0 - self.decay) * value

    def get(self, size: int) -> float | None:
        """The mean at ``size``, or None before any."""
        return self.means.get(size)


class RateMean:
    """Tokens per second of a kind of round, measured: exponentially weighted running means of its tokens
    and of its seconds, and their ratio (so a long round weighs by its length).

    Args:
        decay: The weight the old means keep at each round, in [0, 1).

    Raises:
        InvalidArgumentError: ``decay`` outside [0, 1).
    """

    def __init__(self, decay: float = 0.8) -> None:
        self._tokens, self._seconds = SizeMeans(decay), SizeMeans(decay)

    def add(self, tokens: float, seconds: float) -> None:
        """One more round of ``tokens`` in ``seconds`` (> 0; others are ignored)."""
        if seconds > 0 and math.isfinite(seconds):
            self._tokens.add(0, float(tokens))
            self._seconds.add(0, float(seconds))

    @property
    def rate(self) -> float | None:
        """Tokens per second, or None before any round."""
        seconds = self._seconds.get(0)
        return None if seconds is None else self._tokens.get(0) / seconds


class DepthAcceptance:
    """Running estimates of α_d, the probability that depth d is accepted given depth d - 1 was.

    Args:
        prior: α_d before any trial at depth d, in [0, 1].
        prior_weight: Trials the prior is worth (> 0), forgotten like the trials.
        decay: Weight an earlier trial keeps at each new trial of its depth, in (0, 1].

    Raises:
        InvalidArgumentError: A value outside its range.
    """

    def __init__(self, prior: float, prior_weight: float = 2.0, decay: float = 0.9) -> None:
        if isinstance(prior, bool) or not isinstance(prior, (int, float)) or not 0.0 <= prior <= 1.0:
            raise InvalidArgumentError(f"prior must be in [0, 1], got {prior!r}")
        if isinstance(prior_weight, bool) or not isinstance(prior_weight, (int, float)) or not (
                math.isfinite(prior_weight) and prior_weight > 0):
            raise InvalidArgumentError(f"prior_weight must be a finite number > 0, got {prior_weight!r}")
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < decay <= 1.0:
            raise InvalidArgumentError(f"decay must be in (0, 1], got {decay!r}")
        self.prior, self.prior_weight, self.decay = float(prior), float(prior_weight), float(decay)
        self.accepted: list[float] = []  # per depth (index d - 1): decayed successes, the prior's included
        self.trials: list[float] = []
        # Σ_{d<=k} Π_{j<=d} α_j for k = 0, 1, ..: the controller prices every size each round (twice), so the
        # sums are built once per update, not once per size; cleared by every trial.
        self._sums: list[float] = [0.0]
        self._reach = 1.0

    def alpha(self, depth: int) -> float:
        """α at ``depth`` >= 1 (the prior at a depth never tried)."""
        check_count("depth", depth, 1)
        if depth > len(self.trials):
            return self.prior
        return self.accepted[depth - 1] / self.trials[depth - 1]

    def _trial(self, depth: int, success: bool) -> None:
        while len(self.trials) < depth:
            self.accepted.append(self.prior * self.prior_weight)
            self.trials.append(self.prior_weight)
        i = depth - 1
        self.accepted[i] = self.decay * self.accepted[i] + success
        self.trials[i] = self.decay * self.trials[i] + 1.0
        self._sums, self._reach = [0.0], 1.0

    def update(self, num_drafted: int, num_accepted: int) -> None:
        """After a chain of ``num_drafted`` >= 1 tokens of which the first ``num_accepted`` were accepted:
        successes at depths 1 .. num_accepted, a failure at num_accepted + 1 when it was drafted.

        Raises:
            InvalidArgumentError: ``num_drafted`` < 1 or ``num_accepted`` outside 0 .. ``num_drafted``.
        """
        if isinstance(num_drafted, bool) or not isinstance(num_drafted, int) or num_drafted < 1 \
                or not 0 <= num_accepted <= num_drafted:
            raise InvalidArgumentError(f"a chain must draft >= 1 tokens and accept 0..drafted of them, "
                                       f"got {num_accepted!r} of {num_drafted!r}")
        for d in range(1, num_accepted + 1):
            self._trial(d, True)
        if num_accepted < num_drafted:
            self._trial(num_accepted + 1, False)

    def expected_accepted(self, k: int) -> float:
        """Σ_{d=1..k} Π_{j=1..d} α_j: the expected accepted tokens of a chain of k >= 0 tokens."""
        check_count("k", k, 0)
        sums = self._sums
        while len(sums) <= k:
            self._reach *= self.alpha(len(sums))
            sums.append(sums[-1] + self._reach)
        return sums[k]

    def by_depth(self) -> list[float]:
        """α_1, α_2, .. at the depths tried so far."""
        return [a / t for a, t in zip(self.accepted, self.trials)]


def best_size(sizes: Sequence[int], rate) -> int:
    """The size in ``sizes`` with the highest ``rate(size)`` (expected tokens per second; None: not
    known, skipped); a tie goes to the smaller size. 0 when no size has a rate."""
    best, best_rate = 0, None
    for size in sorted(sizes):
        r = rate(size)
        if r is not None and (best_rate is None or r > best_rate * (1 + 1e-12)):
            best, best_rate = size, r
    return best
