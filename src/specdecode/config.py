"""User-facing generation parameters, validated once when they are built."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specdecode.errors import InvalidArgumentError

#: γ (``num_speculative_tokens``) when none is given: the one default of the API (``GenerationConfig``),
#: the batched engine, ``generate``, ``bench``, ``serve`` and ``search``'s measured objective.
DEFAULT_NUM_SPECULATIVE_TOKENS = 5


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
        banned_words: Words or phrases the output must never contain, matched on the
            text (any tokenization), with rollback and masking
            (``specdecode.engine.banned_words``). Needs a tokenizer.
        banned_words_ignore_case: Match banned words regardless of case.
        banned_words_whole_word: Match banned words only as whole words (a banned
            "ass" does not block "class").

    Raises:
        InvalidArgumentError: If a value is outside the range given above.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    stop_strings: tuple[str, ...] = field(default_factory=tuple)
    stop_on_eos: bool = True
    banned_words: tuple[str, ...] = field(default_factory=tuple)
    banned_words_ignore_case: bool = False
    banned_words_whole_word: bool = False

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
        if isinstance(self.banned_words, str):
            object.__setattr__(self, "banned_words", (self.banned_words,))
        object.__setattr__(self, "banned_words", check_banned_words(self.banned_words, allow_empty=True))

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax (temperature 0)."""
        return self.temperature == 0.0


def check_num_speculative_tokens(value: object) -> int:
    """Return ``value`` if it is a valid γ (``num_speculative_tokens``): an integer >= 1.

    The one check of γ, used wherever one is given (``GenerationConfig``, the batched engine,
    ``bench``'s ``num_speculative_tokens=N`` option, ``search``'s settings).

    Raises:
        InvalidArgumentError: Not an integer (``bool`` included), or < 1; the message names the value.
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidArgumentError(f"num_speculative_tokens (gamma) must be an integer >= 1, got {value!r}")
    return value


def check_banned_words(words: object, *, allow_empty: bool = False) -> tuple[str, ...]:
    """Return ``words`` as a tuple of distinct banned words, in order.

    Raises:
        InvalidArgumentError: If ``words`` is not a list of strings, a word is empty or
            only whitespace, or (unless ``allow_empty``) there is no word at all.
    """
    if isinstance(words, (str, bytes)) or not hasattr(words, "__iter__"):
        raise InvalidArgumentError(f"banned_words must be a list of strings, got {words!r}")
    words = tuple(dict.fromkeys(words))
    if not words and not allow_empty:
        raise InvalidArgumentError("the banned-word list is empty: give at least one word")
    for w in words:
        if not isinstance(w, str) or not w.strip():
            raise InvalidArgumentError(
                f"a banned word must be a non-empty string with a non-space character, got {w!r}"
            )
    return words
