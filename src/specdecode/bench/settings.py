"""How every benchmarked method generates: ``BenchSettings``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from specdecode.config import DEFAULT_NUM_SPECULATIVE_TOKENS, GenerationConfig, check_seed
from specdecode.errors import InvalidArgumentError


@dataclass(frozen=True)
class BenchSettings:
    """How every method generates.

    Attributes:
        max_new_tokens: Tokens generated per prompt at most (>= 1).
        temperature: 0 = greedy; > 0 samples (top-k and top-p off) for every method.
        num_speculative_tokens: γ for specdecode's speculative methods (transformers'
            methods use their own defaults, recorded in the results).
        repeats: Runs of every (method, prompt); tokens/s is reported as the median
            over repeats, with min and max.
        seed: Base seed, an integer in -2**63 .. 2**64 - 1 (what ``torch.Generator.manual_seed``
            takes); each (prompt, repeat) derives its own, shared by all methods.
        warmup_tokens: Length of the warm-up generation of each method.
        drafter_options: Keywords forwarded to the pipeline's ``decoder``/``make_drafter``
            (e.g. ``{"exit_layer": 8}``).
        prompt_cache: Encode each prompt but its last token once, outside the timing, and
            give every method a copy of that target cache (``PromptPrefix``), as a server
            with prefix caching would; each timed generation then encodes the last prompt
            token and decodes. False: every method encodes the whole prompt inside its
            timing. None (default): on when every method of the run supports it (not
            ``hf-assisted``/``hf-prompt-lookup``, see ``HFMethod``), else off.
        banned_words, banned_words_ignore_case, banned_words_whole_word: As in
            ``GenerationConfig``; specdecode's methods only (transformers' cannot
            match words on the text, so a run with banned words leaves them out).
        gguf_file: The GGUF file method ``llama-cpp`` runs (a ``.gguf`` path or an offline
            model name; ``specdecode.bench.llamacpp``), which must be the target's own file;
            None: the target's, found from its name (an offline model). ``specdecode bench``
            sets it from ``--target``.
        repetition_penalty, frequency_penalty, presence_penalty, min_p, logit_bias: The
            processors, as in ``GenerationConfig`` (``engine.processors``), for every method;
            transformers' methods take ``repetition_penalty`` and ``min_p`` (their own processors)
            and leave a run with the others (no OpenAI penalties in transformers), llama-cpp any.
        compile: The fast path (static KV cache, compiled forwards) on (True) or off (False)
            for every specdecode method whose name sets no ``compile`` option
            (``MethodSpec``); None (default): the pipeline's device default. Compilation
            happens in each method's warm-up, reported as ``warmup_s``.

    Raises:
        InvalidArgumentError: A value outside its range.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    repeats: int = 1
    seed: int = 0
    warmup_tokens: int = 8
    drafter_options: Mapping[str, Any] = field(default_factory=dict)
    prompt_cache: bool | None = None
    banned_words: tuple[str, ...] = ()
    banned_words_ignore_case: bool = False
    banned_words_whole_word: bool = False
    gguf_file: str | None = None
    compile: bool | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        config = GenerationConfig(  # validates max_new_tokens, temperature, gamma, banned words
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            num_speculative_tokens=self.num_speculative_tokens,
            banned_words=self.banned_words,
            **self._processors(),
        )
        object.__setattr__(self, "banned_words", config.banned_words)
        object.__setattr__(self, "logit_bias", config.logit_bias)
        for name in ("repeats", "warmup_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgumentError(f"{name} must be an integer >= 1, got {value!r}")
        if self.prompt_cache not in (None, True, False):
            raise InvalidArgumentError(f"prompt_cache must be True, False or None (auto), got {self.prompt_cache!r}")
        check_seed(self.seed, "seed")
        options = dict(self.drafter_options or {})
        for key, value in options.items():
            if not isinstance(key, str) or not key.isidentifier():
                raise InvalidArgumentError(f"drafter option names must be Python identifiers, got {key!r}")
            try:
                json.dumps(value)
            except TypeError as e:
                raise InvalidArgumentError(f"drafter option {key}={value!r} is not a JSON value") from e
        if "compile" in options:
            raise InvalidArgumentError(
                f"drafter option compile={options['compile']!r}: the fast path is set with BenchSettings.compile "
                "(--compile/--no-compile) or per method as NAME:compile=0|1, not as a drafter option"
            )
        object.__setattr__(self, "drafter_options", MappingProxyType(options))
        if self.compile is not None and not isinstance(self.compile, bool):
            raise InvalidArgumentError(
                f"compile must be True, False or None (the device default), got {self.compile!r}"
            )
        if self.gguf_file is not None and (not isinstance(self.gguf_file, str) or not self.gguf_file.strip()):
            raise InvalidArgumentError(
                f"gguf_file must be a non-empty .gguf path or offline model name, got {self.gguf_file!r}"
            )

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax (temperature 0)."""
        return self.temperature == 0.0

    def generation_config(self, max_new_tokens: int | None = None, seed: int | None = None) -> GenerationConfig:
        """specdecode's ``GenerationConfig`` for one generation."""
        return GenerationConfig(
            max_new_tokens=max_new_tokens or self.max_new_tokens,
            temperature=self.temperature,
            num_speculative_tokens=self.num_speculative_tokens,
            seed=None if self.greedy else seed,
            banned_words=self.banned_words,
            banned_words_ignore_case=self.banned_words_ignore_case,
            banned_words_whole_word=self.banned_words_whole_word,
            **self._processors(),
        )

    def _processors(self) -> dict:
        return dict(repetition_penalty=self.repetition_penalty, frequency_penalty=self.frequency_penalty,
                    presence_penalty=self.presence_penalty, min_p=self.min_p, logit_bias=self.logit_bias)

    def processor_settings(self) -> dict:
        """The processors that are on, JSON-ready (empty when none is: records stay as before)."""
        defaults = dict(repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0, min_p=0.0, logit_bias=())
        out = {k: v for k, v in self._processors().items() if v != defaults[k]}
        if "logit_bias" in out:
            out["logit_bias"] = {str(t): b for t, b in self.logit_bias}
        return out

    def to_dict(self) -> dict:
        """JSON-ready copy."""
        return {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "num_speculative_tokens": self.num_speculative_tokens,
            "repeats": self.repeats,
            "seed": self.seed,
            "warmup_tokens": self.warmup_tokens,
            "drafter_options": dict(self.drafter_options),
            "prompt_cache": self.prompt_cache,
            **self.banned_words_settings(),
            **self.processor_settings(),
            **({"gguf_file": self.gguf_file} if self.gguf_file is not None else {}),
            "compile": self.compile,
        }

    def banned_words_settings(self) -> dict:
        """The banned-word settings, JSON-ready (empty when there are none)."""
        if not self.banned_words:
            return {}
        return {
            "banned_words": list(self.banned_words),
            "banned_words_ignore_case": self.banned_words_ignore_case,
            "banned_words_whole_word": self.banned_words_whole_word,
        }
