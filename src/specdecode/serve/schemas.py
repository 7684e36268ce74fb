"""Request bodies of the OpenAI API, validated with pydantic.

Field names, types and ranges follow OpenAI's API reference for ``/v1/completions`` and
``/v1/chat/completions``. Unknown fields are refused (as OpenAI does: "Unrecognized request
argument supplied"); fields OpenAI has but this server cannot honour are accepted only at
their neutral value (``unsupported`` lists them), so no request is silently answered with
something else than it asked for. ``top_k`` is an extension (as in vLLM; 0 or -1 = off), and
so are ``repetition_penalty``, ``min_p`` and ``stop_token_ids`` (vLLM's names and ranges).
``presence_penalty``, ``frequency_penalty``, ``logit_bias`` and ``logprobs`` / ``top_logprobs``
are OpenAI's (``GenerationConfig`` validates the values and ``engine.processors`` applies them).
``bad_words`` is vLLM's name for words the output must not contain; here they are matched on the
generated text (as case-sensitive substrings unless the server's flags say otherwise), after the server's
own words, and rolled back (``GenerationConfig.banned_words``,
``engine.banned_rows``), so no tokenization of a word gets through, where vLLM masks the last token
of each word's tokenizations with and without a leading space; a stream never shows one. At most
``MAX_BAD_WORDS`` words of at most ``MAX_BAD_WORD_CHARS`` characters: the engine thread builds each
list's automaton while every row waits, and a word's length bounds the work of each token's check.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from specdecode.config import REPETITION_PENALTY_RANGE

#: OpenAI allows at most 4 stop sequences.
MAX_STOP_SEQUENCES = 4
#: The most ``bad_words`` a request may give, and the longest word in characters.
MAX_BAD_WORDS, MAX_BAD_WORD_CHARS = 1000, 100

TokenId = Annotated[int, Field(ge=0, lt=2**31)]


def _whole_float_as_int(value: Any) -> Any:
    """A float with an integral value (``4.0``) as the int it equals; anything else unchanged, for the
    strict int check to refuse (``4.5``, ``"4"``, ``true``, ``inf``)."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


#: An integer field: an int, or a float with an integral value (``"max_tokens": 4.0``, as vLLM and
#: before strict types), converted to the int; strings, booleans and ``4.5`` are refused.
Integer = Annotated[int, BeforeValidator(_whole_float_as_int)]


class _Request(BaseModel):
    """Unknown fields are refused; an explicit ``null`` means the field's default (OpenAI's
    reference marks these fields "or null"). Types are strict, as OpenAI's: a string is not a
    number (``"max_tokens": "4"``), nor a boolean (``"stream": "yes"``), and ``true`` is not
    an integer (``"max_tokens": true`` would be 1); an integer is a number, and a float with an
    integral value is an integer (``"max_tokens": 4.0`` is 4, as vLLM takes it; ``4.5`` is refused)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if not (v is None and k in fields and fields[k].default is not None)}


class StreamOptions(_Request):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage."""

    include_usage: bool = False


class _Sampling(_Request):
    """Fields shared by both endpoints."""

    model: str | None = None
    max_tokens: Integer | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: Integer = Field(default=0, ge=-1)
    seed: Integer | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    n: Integer = Field(default=1, ge=1, le=128)  # OpenAI's range; the server also bounds it by --max-batch-size
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for abuse monitoring; recorded nowhere
    # Processors (engine.processors): OpenAI's penalties and bias, vLLM's extensions.
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None  # OpenAI's range
    repetition_penalty: float = Field(default=1.0, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    stop_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None  # vLLM's name; matched on the text, with rollback (module docstring)

    @field_validator("bad_words")
    @classmethod
    def _check_bad_words(cls, v):
        if v is not None and len(v) > MAX_BAD_WORDS:
            raise ValueError(f"at most {MAX_BAD_WORDS} bad_words are allowed, got {len(v)}")
        for word in v or ():
            if len(word) > MAX_BAD_WORD_CHARS:
                raise ValueError(f"a bad word may have at most {MAX_BAD_WORD_CHARS} characters, got {len(word)}: "
                                 f"{word[:20]!r}...")
            if not word.strip():
                raise ValueError(f"bad_words must be non-empty strings with a non-space character, got {word!r}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v):
        seen: dict[int, str] = {}
        for key in v or {}:
            digits = key.strip()
            # ASCII digits only: str.isdigit() also takes "²" or "٥", which int() refuses or reads otherwise
            if not (digits.isascii() and digits.isdigit()):
                raise ValueError(f"logit_bias keys must be token ids (decimal integers >= 0), got {key!r}")
            token = int(digits)
            if token in seen:
                raise ValueError(f"logit_bias names token {token} twice ({seen[token]!r} and {key!r})")
            seen[token] = key
        return v

    def processor_options(self) -> dict[str, Any]:
        """The ``GenerationConfig`` fields of the processors, banned words and logprobs this request asks for."""
        return dict(
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_p=self.min_p,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            stop_token_ids=tuple(self.stop_token_ids or ()),
            banned_words=tuple(self.bad_words or ()),
            logprobs=self.logprobs_wanted,
            top_logprobs=self.top_logprobs_wanted,
        )

    @property
    def logprobs_wanted(self) -> bool:
        return False

    @property
    def top_logprobs_wanted(self) -> int:
        return 0

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return v

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for the first field set to a value this server cannot honour."""
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed with stream=true"
        return None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: a prompt as text, a one-element list of text, or token ids."""

    prompt: str | list[str] | list[TokenId]
    max_tokens: Integer | None = Field(default=16, ge=1)  # OpenAI's default for completions
    echo: bool = False
    logprobs: Integer | None = Field(default=None, ge=0, le=5)  # OpenAI: the top 0..5 alternatives
    best_of: Integer | None = None
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) != 1:
            return "prompt", f"got {len(self.prompt)} prompts; this server takes one prompt per request"
        if self.echo:
            return "echo", "echo is not supported; allowed: false"
        if self.best_of not in (None, 1):
            return "best_of", f"best_of={self.best_of} is not supported; allowed: 1"
        if self.best_of is not None and self.best_of < self.n:  # OpenAI: best_of must be at least n
            return "best_of", (f"best_of={self.best_of} is less than n={self.n}: best_of counts the candidates the n "
                               "choices are picked from, so it must be at least n; leave best_of out")
        if self.suffix:
            return "suffix", "suffix is not supported; allowed: null"
        return super().unsupported()

    @property
    def logprobs_wanted(self) -> bool:
        return self.logprobs is not None

    @property
    def top_logprobs_wanted(self) -> int:
        return self.logprobs or 0


class TextPart(_Request):
    """One text part of a message's ``content`` (other part types, e.g. images, are refused)."""

    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    """One message of a conversation."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_message(self) -> dict[str, Any]:
        """The message as a chat template takes it (text parts joined; "developer" as "system";
        ``name``, when given, passed on: the server refuses it where the template does not use it)."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Integer | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Integer | None = Field(default=None, ge=0, le=20)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    response_format: dict | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", f"top_logprobs={self.top_logprobs} needs logprobs=true"
        if self.tools:
            return "tools", "tools (function calling) are not supported"
        if self.tool_choice not in (None, "none"):
            return "tool_choice", "tool_choice is not supported; allowed: null or 'none'"
        if self.response_format is not None and self.response_format.get("type") != "text":
            return "response_format", f"only response_format {{'type': 'text'}} is supported, got {self.response_format!r}"
        if self.max_tokens is not None and self.max_completion_tokens is not None and (
            self.max_tokens != self.max_completion_tokens
        ):
            return "max_completion_tokens", "max_tokens and max_completion_tokens disagree; send one of them"
        return super().unsupported()

    @property
    def logprobs_wanted(self) -> bool:
        return self.logprobs

    @property
    def top_logprobs_wanted(self) -> int:
        return self.top_logprobs or 0

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
