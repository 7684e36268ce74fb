"""User-facing generation parameters, validated once when they are built."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specdecode.errors import InvalidArgumentError


@dataclass(frozen=True)
class GenerationConfig:
    """What to generate and how to sample it.

    Attributes:
        max_new_tokens: Upper bound on generated tokens (>= 1).
        temperature: 0 means greedy decoding; > 0 means sampling from
            ``softmax(logits / temperature)``.
        top_k: Keep only the ``top_k`` most likely tokens before sampling; 0 disables it.
        top_p: Nucleus sampling mass in (0, 1]; 1 disables it.
        seed: Seed of the ``torch.Generator`` used for sampling; ``None`` draws a random seed.
        num_speculative_tokens: γ, the most tokens the drafter proposes per target forward (>= 1).
            Ignored by autoregressive decoding.
        stop_strings: Generation stops after the first token whose text completes one of these.
        stop_on_eos: Stop when the model emits one of its end-of-sequence tokens.

    Raises:
        InvalidArgumentError: If a value is outside the range given above.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    num_speculative_tokens: int = 5
    stop_strings: tuple[str, ...] = field(default_factory=tuple)
    stop_on_eos: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InvalidArgumentError(
                f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}"
            )
        check_num_speculative_tokens(self.num_speculative_tokens)
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidArgumentError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidArgumentError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidArgumentError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.stop_strings, str):
            object.__setattr__(self, "stop_strings", (self.stop_strings,))
        if any(not s for s in self.stop_strings):
            raise InvalidArgumentError(
                f"stop_strings must be non-empty strings, got {list(self.stop_strings)!r}"
            )

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax (temperature 0)."""
        return self.temperature == 0.0


def check_num_speculative_tokens(value: object) -> int:
    """Return ``value`` if it is a valid γ (``num_speculative_tokens``): an integer >= 1.

    Raises:
        InvalidArgumentError: Not an integer (``bool`` included), or < 1; the message names the value.
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidArgumentError(f"num_speculative_tokens (gamma) must be an integer >= 1, got {value!r}")
    return value
