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
        temperature: 0 means greedy decoding; >= 1e-5 (``MIN_SAMPLING_TEMPERATURE``) means
            sampling from ``softmax(logits / temperature)`` (smaller ones would overflow it).
        top_k: Keep only the ``top_k`` most likely tokens before sampling; 0 disables it.
        top_p: Nucleus sampling mass in (0, 1]; 1 disables it.
        seed: Seed of the ``torch.Generator`` used for sampling, an integer in -2**63 .. 2**64 - 1
            (what ``torch.Generator.manual_seed`` takes); ``None`` draws a random seed.
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
        repetition_penalty: transformers' / CTRL's multiplicative penalty (Keskar et al. 2019) on
            every token already in the prompt or the output: a positive logit is divided by it, a
            negative one multiplied; in [0.01, 100], 1 = off (further out the logits overflow to
            inf, e.g. 30 / 1e-300, and sampling fails on NaN probabilities).
        frequency_penalty: OpenAI's: subtracted from a token's logit once per time the token
            occurs in the output so far; in [-2, 2], 0 = off.
        presence_penalty: OpenAI's: subtracted from a token's logit once it occurs in the output;
            in [-2, 2], 0 = off.
        min_p: Keep only tokens whose probability is at least ``min_p`` times the most likely
            one's (after temperature; transformers' ``MinPLogitsWarper``); in [0, 1], 0 = off.
            No effect on greedy decoding.
        logit_bias: token id -> bias added to its logit (OpenAI's ``logit_bias``), each in
            [-100, 100]; a dict or (id, bias) pairs, kept as sorted pairs. Ids are checked
            against the target's vocabulary when the generation starts.
        stop_token_ids: Extra token ids that end the generation like EOS (finish reason "eos"),
            also with ``stop_on_eos=False``.
        logprobs: Report, for every generated token, its log-probability under the target's
            distribution after the processors above (``engine.processors``).
        top_logprobs: With ``logprobs``, also the ``top_logprobs`` most likely tokens at each
            position with theirs; in 0..20.

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
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    logprobs: bool = False
    top_logprobs: int = 0

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
        if 0 < self.temperature < MIN_SAMPLING_TEMPERATURE:
            raise InvalidArgumentError(
                f"temperature must be 0 (greedy) or at least {MIN_SAMPLING_TEMPERATURE:g}, got {self.temperature!r}: "
                "below that the logits / temperature overflow (use 0 for greedy decoding)"
            )
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidArgumentError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidArgumentError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None:
            check_seed(self.seed, "seed")
        if isinstance(self.stop_strings, str):
            object.__setattr__(self, "stop_strings", (self.stop_strings,))
        if any(not s for s in self.stop_strings):
            raise InvalidArgumentError(
                f"stop_strings must be non-empty strings, got {list(self.stop_strings)!r}"
            )
        if isinstance(self.banned_words, str):
            object.__setattr__(self, "banned_words", (self.banned_words,))
        object.__setattr__(self, "banned_words", check_banned_words(self.banned_words, allow_empty=True))
        self._check_processors()

    def _check_processors(self) -> None:
        """Validate (and normalize) the processor fields; see the class docstring for the ranges."""
        low, high = REPETITION_PENALTY_RANGE
        if not _is_number(self.repetition_penalty) or not low <= self.repetition_penalty <= high:
            raise InvalidArgumentError(
                f"repetition_penalty must be a number in [{low}, {high:g}] (1 = off), got {self.repetition_penalty!r}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise InvalidArgumentError(f"{name} must be a number in [-2, 2] (0 = off), got {value!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidArgumentError(f"min_p must be a number in [0, 1] (0 = off), got {self.min_p!r}")
        object.__setattr__(self, "logit_bias", check_logit_bias(self.logit_bias))
        ids = self.stop_token_ids
        if isinstance(ids, int) and not isinstance(ids, bool):
            ids = (ids,)
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise InvalidArgumentError(f"stop_token_ids must be a list of token ids (integers >= 0), got {ids!r}")
        ids = tuple(ids)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise InvalidArgumentError(f"a stop token id must be an integer >= 0, got {t!r}")
        object.__setattr__(self, "stop_token_ids", tuple(dict.fromkeys(ids)))
        if not isinstance(self.logprobs, bool):
            raise InvalidArgumentError(f"logprobs must be True or False, got {self.logprobs!r}")
        top = self.top_logprobs
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise InvalidArgumentError(f"top_logprobs must be an integer in 0..{MAX_TOP_LOGPROBS}, got {top!r}")
        if top and not self.logprobs:
            raise InvalidArgumentError(f"top_logprobs={top} needs logprobs=True")

    @property
    def processes_logits(self) -> bool:
        """True when a processor depends on the context or changes logits (penalties, logit_bias):
        ``engine.processors.LogitsProcessing`` then runs on every verification block."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or bool(self.logit_bias)
        )

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax (temperature 0)."""
        return self.temperature == 0.0


#: The smallest temperature > 0: logits / T stay finite (1e-40 made them inf, and sampling failed
#: on NaN probabilities); the server serves a smaller one as greedy decoding (as vLLM).
MIN_SAMPLING_TEMPERATURE = 1e-5
#: ``repetition_penalty``'s allowed [low, high]: far enough from 0 and inf that the penalized logits stay finite.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
#: The seeds ``torch.Generator.manual_seed`` takes: a signed or an unsigned 64-bit integer.
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1


def check_seed(seed: object, name: str = "seed") -> int:
    """Return ``seed`` if it is an int (not a bool) in MIN_SEED .. MAX_SEED.

    Raises:
        InvalidArgumentError: Naming ``name``, the value and the range.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not MIN_SEED <= seed <= MAX_SEED:
        raise InvalidArgumentError(
            f"{name} must be an integer in {MIN_SEED}..{MAX_SEED} (-2**63 .. 2**64 - 1), got {seed!r}"
        )
    return seed
#: The most ``top_logprobs`` a request may ask for (OpenAI's limit).
MAX_TOP_LOGPROBS = 20
#: ``logit_bias`` values lie in [-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT] (OpenAI's range).
LOGIT_BIAS_LIMIT = 100.0


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_logit_bias(bias: object) -> tuple[tuple[int, float], ...]:
    """Return ``bias`` (a dict or (token id, bias) pairs) as sorted ``(id, float)`` pairs.

    Raises:
        InvalidArgumentError: Not a mapping or pairs, an id that is not an integer >= 0, a bias
            outside [-100, 100], or an id given twice; the message names the value.
    """
    if isinstance(bias, dict):
        items = list(bias.items())
    elif isinstance(bias, (str, bytes)) or not hasattr(bias, "__iter__"):
        raise InvalidArgumentError(f"logit_bias must map token ids to biases, got {bias!r}")
    else:
        items = list(bias)
    out: dict[int, float] = {}
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise InvalidArgumentError(f"logit_bias must map token ids to biases, got the entry {item!r}")
        token, value = item
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise InvalidArgumentError(f"a logit_bias token id must be an integer >= 0, got {token!r}")
        if not _is_number(value) or not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
            raise InvalidArgumentError(
                f"logit_bias for token {token} must be a number in [-100, 100], got {value!r}"
            )
        if token in out:
            raise InvalidArgumentError(f"logit_bias gives token {token} twice")
        out[token] = float(value)
    return tuple(sorted(out.items()))


def parse_logit_bias(items: list[str]) -> dict[int, float]:
    """``ID=BIAS`` strings (the ``--logit-bias`` flag of ``generate`` and ``bench``) as a dict.

    Raises:
        InvalidArgumentError: An item that is not an integer id, "=", and a number; the message
            names it (the values' ranges are checked by ``check_logit_bias``).
    """
    out = {}
    for item in items:
        token, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError(item)
            out[int(token)] = float(value)
        except ValueError:
            raise InvalidArgumentError(f"--logit-bias takes ID=BIAS (an integer id, a number), got {item!r}") from None
    return out


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


def check_unicode(text: str, what: str) -> None:
    """Raise unless ``text`` is valid Unicode, encodable as UTF-8 (tokenizers refuse a lone
    surrogate: JSON's unpaired ``\\ud800`` escape, or an undecodable command-line byte that
    Python keeps as ``\\udcXX``).

    Raises:
        InvalidArgumentError: Naming ``what``, the character and its position.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgumentError(
            f"{what} is not valid Unicode: character {e.start} is a lone surrogate {text[e.start]!r} "
            "(an unpaired \\ud800-\\udfff escape, or bytes that are not UTF-8); send UTF-8 text"
        ) from None
