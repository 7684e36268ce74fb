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

    def full(self, choices: Sequence[tuple], usage_: dict, spec: dict) -> dict:
        """The non-streamed response; ``choices``: (text, finish reason) or (text, finish reason,
        logprobs) per choice, in index order (``logprobs``: ``logprobs_json``'s, or None)."""
        choices = [(c[0], c[1], c[2] if len(c) > 2 else None) for c in choices]
        if self.chat:
            out = [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                    "finish_reason": reason} for i, (text, reason, lp) in enumerate(choices)]
            return self._envelope("chat.completion", out, usage=usage_, system_fingerprint=None, speculative=spec)
        out = [{"index": i, "text": text, "logprobs": lp, "finish_reason": reason}
               for i, (text, reason, lp) in enumerate(choices)]
        return self._envelope("text_completion", out, usage=usage_, system_fingerprint=None, speculative=spec)

    def chunk(self, text: str | None, finish_reason: str | None = None, *, index: int = 0, role: bool = False,
              include_usage: bool = False, logprobs: dict | None = None, **extra) -> dict:
        """One streamed chunk of choice ``index`` with a text delta (``role``: the chat stream's first
        chunk of that choice; ``logprobs``: those of the tokens this chunk carries, ``logprobs_json``'s)."""
        if self.chat:
            delta: dict = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
            obj = "text_completion"
        if include_usage:
            extra.setdefault("usage", None)  # OpenAI: null on every chunk but the last
        return self._envelope(obj, [choice], system_fingerprint=None, **extra)

    def usage_chunk(self, usage_: dict, spec: dict) -> dict:
        """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(obj, [], system_fingerprint=None, usage=usage_, speculative=spec)


#: The lowest logprob a response carries (a masked token's is -inf, which JSON cannot hold; vLLM's value).
LOGPROB_FLOOR = -9999.0


def logprobs_json(chat: bool, entries: list, tokenizer, text_offsets: Sequence[int] | None = None) -> dict:
    """OpenAI's ``logprobs`` object for ``entries`` (``engine.processors.TokenLogprob``s).

    Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": None}``.
    Completions: ``{"tokens", "token_logprobs", "top_logprobs" (a {token: logprob} dict per token,
    or None when no alternatives were asked), "text_offset"}``. A token's text is its own decode
    (special tokens included).

    ``text_offset[i]``, as vLLM's: where token i starts in the returned text, in characters, which is
    decoded without special tokens (``text.TextAssembler``), so a special token adds no characters.
    ``text_offsets``: those offsets, one per entry (a stream's chunk: its tokens' offsets in the whole
    text, ``TextAssembler.token_offsets``); None: ``entries`` are a whole completion, and the offsets
    are the lengths of its prefixes' text (``tokenizer.decode(ids[:i], skip_special_tokens=True)``).

    Raises:
        ValueError: ``text_offsets`` not one per entry.
    """

    def text_of(token_id: int) -> str:
        return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)

    def finite(value: float) -> float:  # a masked token's -inf is not JSON: vLLM's floor instead
        return max(value, LOGPROB_FLOOR)

    if chat:
        content = []
        for e in entries:
            token = text_of(e.token_id)
            top = [{"token": text_of(t), "logprob": finite(v), "bytes": list(text_of(t).encode("utf-8"))}
                   for t, v in e.top]
            content.append({"token": token, "logprob": finite(e.logprob), "bytes": list(token.encode("utf-8")),
                            "top_logprobs": top})
        return {"content": content, "refusal": None}
    tokens = [text_of(e.token_id) for e in entries]
    if text_offsets is None:
        ids = [e.token_id for e in entries]
        text_offsets = [len(tokenizer.decode(ids[:i], skip_special_tokens=True)) if tokenizer is not None
                        else len("".join(tokens[:i])) for i in range(len(ids))]
    if len(text_offsets) != len(entries):
        raise ValueError(f"text_offsets must hold one offset per entry: {len(text_offsets)} for {len(entries)}")
    asked_top = any(e.top for e in entries)
    return {
        "tokens": tokens,
        "token_logprobs": [finite(e.logprob) for e in entries],
        "top_logprobs": [{text_of(t): finite(v) for t, v in e.top} for e in entries] if asked_top else None,
        "text_offset": list(text_offsets),
    }
