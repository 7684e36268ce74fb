"""How a skip-set search runs: ``SearchSettings``, and the objectives and samplers it allows."""

from __future__ import annotations

import math
from dataclasses import dataclass

from specdecode.bench.datasets import HUMANEVAL
from specdecode.config import DEFAULT_NUM_SPECULATIVE_TOKENS, check_num_speculative_tokens
from specdecode.errors import InvalidArgumentError
from specdecode.search.objective import is_int

OBJECTIVES = ("modelled", "measured")
SAMPLERS = ("tpe", "gp")


@dataclass(frozen=True)
class SearchSettings:
    """How a skip-set search runs.

    Attributes:
        trials: Finished (COMPLETE or PRUNED) trials the study should hold in total, >= 1.
        objective: "modelled" or "measured" (see the ``specdecode.search`` docstring).
        sampler: "tpe" (``TPESampler``) or "gp" (``GPSampler``, needs scipy).
        timeout_s: Stop starting trials after this many seconds of optimisation
            (the one-off calibration is not counted); None: no limit.
        calibration: "humaneval", "spec-bench", "spec-bench:CATEGORY" or a JSONL file.
        num_prompts: Calibration prompts used, >= 1.
        prompt_offset: Calibration prompts skipped first (keep held-out prompts out), >= 0.
        chat: Override the dataset's chat-template default (see ``specdecode.bench.datasets``).
        max_new_tokens: Tokens of each greedy continuation / measured generation, >= 2.
        max_gamma: Largest γ the modelled objective considers, >= 1.
        num_speculative_tokens: γ of measured decoding; None: 5 for the measured
            objective, each set's modelled best γ when re-measuring.
        min_skip_fraction, max_skip_fraction: Bounds on the fraction of the 2L
            sublayers skipped, 0 <= min <= max <= 1.
        remeasure: Best distinct modelled sets decoded for real afterwards, >= 0.
        seed: Sampler seed (None: random). Give parallel workers different seeds.
        timing_repeats: Timed repeats per measurement of the modelled objective, >= 1.
        warmup_tokens: Length of the warm-up generation before measured decoding, >= 1.
        heartbeat_interval_s: Seconds between heartbeats of a running trial, >= 1;
            a trial silent for twice this is marked failed.

    Raises:
        InvalidArgumentError: A value outside the range given above.
    """

    trials: int = 100
    objective: str = "modelled"
    sampler: str = "tpe"
    timeout_s: float | None = None
    calibration: str = HUMANEVAL
    num_prompts: int = 4
    prompt_offset: int = 0
    chat: bool | None = None
    max_new_tokens: int = 64
    max_gamma: int = 12
    num_speculative_tokens: int | None = None
    min_skip_fraction: float = 0.0
    max_skip_fraction: float = 1.0
    remeasure: int = 3
    seed: int | None = None
    timing_repeats: int = 5
    warmup_tokens: int = 8
    heartbeat_interval_s: int = 10

    def __post_init__(self) -> None:
        def need_int(name: str, lo: int) -> None:
            v = getattr(self, name)
            if not is_int(v) or v < lo:
                raise InvalidArgumentError(f"{name} must be an integer >= {lo}, got {v!r}")

        need_int("trials", 1)
        need_int("num_prompts", 1)
        need_int("prompt_offset", 0)
        need_int("max_new_tokens", 2)
        need_int("max_gamma", 1)
        need_int("remeasure", 0)
        need_int("timing_repeats", 1)
        need_int("warmup_tokens", 1)
        need_int("heartbeat_interval_s", 1)
        if self.objective not in OBJECTIVES:
            raise InvalidArgumentError(f"unknown objective {self.objective!r}; allowed: {', '.join(OBJECTIVES)}")
        if self.sampler not in SAMPLERS:
            raise InvalidArgumentError(f"unknown sampler {self.sampler!r}; allowed: {', '.join(SAMPLERS)}")
        if self.timeout_s is not None and not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise InvalidArgumentError(f"timeout must be a number of seconds > 0 (or unset), got {self.timeout_s!r}")
        if self.num_speculative_tokens is not None:
            check_num_speculative_tokens(self.num_speculative_tokens)
        for name in ("min_skip_fraction", "max_skip_fraction"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0.0 <= v <= 1.0):
                raise InvalidArgumentError(f"{name} must be a number in [0, 1], got {v!r}")
        if self.min_skip_fraction > self.max_skip_fraction:
            raise InvalidArgumentError(
                f"min_skip_fraction {self.min_skip_fraction} is above max_skip_fraction {self.max_skip_fraction}; "
                "need 0 <= min <= max <= 1"
            )
        if self.chat not in (None, True, False):
            raise InvalidArgumentError(f"chat must be True, False or None (auto), got {self.chat!r}")
        if not isinstance(self.calibration, str) or not self.calibration.strip():
            raise InvalidArgumentError(
                "calibration must be 'humaneval', 'spec-bench', 'spec-bench:CATEGORY' or a JSONL file, "
                f"got {self.calibration!r}"
            )

    @property
    def measured_gamma(self) -> int:
        """γ of the measured objective: ``num_speculative_tokens``, or the default γ
        (``config.DEFAULT_NUM_SPECULATIVE_TOKENS``, 5)."""
        return self.num_speculative_tokens or DEFAULT_NUM_SPECULATIVE_TOKENS

    def skip_count_bounds(self, num_layers: int) -> tuple[int, int]:
        """(lo, hi): the allowed numbers of skipped sublayers for a model with ``num_layers`` layers.

        Raises:
            InvalidArgumentError: If no non-empty skip set fits the fraction bounds.
        """
        n = 2 * num_layers
        lo = max(math.ceil(self.min_skip_fraction * n - 1e-9), 1)
        hi = math.floor(self.max_skip_fraction * n + 1e-9)
        if lo > hi:
            raise InvalidArgumentError(
                f"no skip set fits the bounds [{self.min_skip_fraction}, {self.max_skip_fraction}]: the model has "
                f"{n} sublayers ({num_layers} layers), so the bounds must admit a whole number of skipped "
                f"sublayers k with 1 <= k <= {n}, i.e. max_skip_fraction >= {1 / n:.4g} and "
                f"the interval [min*{n}, max*{n}] must contain an integer"
            )
        return lo, hi


__all__ = ["OBJECTIVES", "SAMPLERS", "SearchSettings"]
