"""OpenAI's response and error shapes (``/v1/completions``, ``/v1/chat/completions``).

Responses are plain dicts in the layout of OpenAI's API reference; the speculative
statistics ride along in an extension field, ``speculative``, which OpenAI clients keep as
an extra attribute and otherwise ignore.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

from specdecode.engine.stats import SpecDecodingStats

#: The engine's finish reasons -> OpenAI's.
FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "length": "length"}


class ApiError(Exception):
    """An error answered with OpenAI's body ``{"error": {"message", "type", "param", "code"}}``.

    Args:
        status: HTTP status (4xx for the client's mistakes, 5xx for the server's).
        message: What was wrong, naming the value and what is allowed.
        type: OpenAI's error type ("invalid_request_error", "authentication_error",
            "rate_limit_error", "server_error", ...).
        param: The request field at fault, or None.
        code: A machine-readable code ("context_length_exceeded", "invalid_api_key", "invalid_value",
            ...): required, so that no error path answers ``code: null``.
        headers: Extra response headers (``Retry-After`` on 429).
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 *, code: str, headers: dict[str, str] | None = None) -> None:
        if not code:
            raise ValueError("an ApiError needs a code")
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None, code: str) -> dict:
    """OpenAI's error body; every error this server answers carries a ``code``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """Unix seconds, for ``created``."""
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def speculative(stats: Sequence[SpecDecodingStats], method: str, num_speculative_tokens: int) -> dict:
    """The extension field: the speculative statistics of this request's choices, summed.

    ``acceptance_rate`` = accepted ÷ drafted tokens (None when nothing was drafted);
    ``mean_accepted_tokens`` = τ, tokens per target forward COUNTING the bonus token.
    ``stats``: one per choice that finished (empty: only the method is reported).
    """
    out = {"method": method, "num_speculative_tokens": num_speculative_tokens}
    if not stats:
        return out
    total = SpecDecodingStats(
        num_drafted_tokens=sum(s.num_drafted_tokens for s in stats),
        num_accepted_tokens=sum(s.num_accepted_tokens for s in stats),
        num_target_forwards=sum(s.num_target_forwards for s in stats),
    )
    out.update(
        acceptance_rate=total.acceptance_rate,
        mean_accepted_tokens=total.mean_accepted_tokens,
        mean_accepted_tokens_counts_bonus=True,
        num_drafted_tokens=total.num_drafted_tokens,
        num_accepted_tokens=total.num_accepted_tokens,
        num_target_forwards=total.num_target_forwards,
    )
    return out


class ResponseShape:
    """Builds one request's response or stream chunks for either endpoint.

    Args:
        chat: ``/v1/chat/completions`` (else ``/v1/completions``).
        model: The served model name.
    """

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = now()

    def _envelope(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def full(self, choices: Sequence[tuple[str, str]], usage_: dict, spec: dict) -> dict:
        """The non-streamed response; ``choices``: (text, finish reason) per choice, in index order."""
        if self.chat:
            out = [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                    "finish_reason": reason} for i, (text, reason) in enumerate(choices)]
            return self._envelope("chat.completion", out, usage=usage_, system_fingerprint=None, speculative=spec)
        out = [{"index": i, "text": text, "logprobs": None, "finish_reason": reason}
               for i, (text, reason) in enumerate(choices)]
        return self._envelope("text_completion", out, usage=usage_, system_fingerprint=None, speculative=spec)

    def chunk(self, text: str | None, finish_reason: str | None = None, *, index: int = 0, role: bool = False,
              include_usage: bool = False, **extra) -> dict:
        """One streamed chunk of choice ``index`` with a text delta (``role``: the chat stream's first
        chunk of that choice)."""
        if self.chat:
            delta: dict = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            obj = "text_completion"
        if include_usage:
            extra.setdefault("usage", None)  # OpenAI: null on every chunk but the last
        return self._envelope(obj, [choice], system_fingerprint=None, **extra)

    def usage_chunk(self, usage_: dict, spec: dict) -> dict:
        """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(obj, [], system_fingerprint=None, usage=usage_, speculative=spec)
