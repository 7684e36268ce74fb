"""OpenAI's response and error shapes (``/v1/completions``, ``/v1/chat/completions``).

Responses are plain dicts in the layout of OpenAI's API reference; the speculative
statistics ride along in an extension field, ``speculative``, which OpenAI clients keep as
an extra attribute and otherwise ignore.
"""

from __future__ import annotations

import functools
import json
import re
import time
import uuid
from collections.abc import Sequence

from tokenizers import decoders

from specdecode.engine.stats import SpecDecodingStats
from specdecode.errors import SpecDecodeError
from specdecode.serve.text import REPLACEMENT, TextAssembler, TokenText

#: The engine's finish reasons -> OpenAI's ("banned_word": ``bad_words`` left no token to continue with, what
#: OpenAI calls content omitted by a filter).
FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "length": "length", "banned_word": "content_filter"}


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


def internal_error(exc: Exception) -> ApiError:
    """The 500 ``internal_error`` of a failure of the server itself (never of a request's content: bad input
    is answered 4xx before it reaches the engine), naming what failed; the caller logs the traceback."""
    if isinstance(exc, LogprobsMismatchError):
        message = f"internal server error: the logprobs do not match the generated tokens: {exc}"
    else:
        message = f"internal server error ({type(exc).__name__})"
    return ApiError(500, message, "server_error", code="internal_error")


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
#: A SentencePiece byte-fallback token: the byte it stands for.
BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class LogprobsMismatchError(SpecDecodeError):
    """The engine's logprobs do not describe the tokens they came with (an internal error: the server
    answers 500 ``internal_error``; no request field can cause it)."""


def logprobs_json(chat: bool, entries: Sequence, tokenizer, tokens: Sequence[TokenText] | None = None) -> dict:
    """OpenAI's ``logprobs`` object for ``entries`` (``engine.processors.TokenLogprob``s).

    Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": None}``.
    Completions: ``{"tokens", "token_logprobs", "top_logprobs" (a {token: logprob} dict per token,
    or None when no alternatives were asked), "text_offset"}``.

    A token's text (``tokens``, ``token``, the top tokens' too) is what it adds to the returned text,
    decoded in context as the text is (vLLM's incremental detokenization; ``text.TokenText``): joined,
    the tokens' texts are the text (before a stop string cut it); a special token adds "" (the text is
    decoded without them), and of a UTF-8 character split over tokens, the token completing it carries
    the whole character and those before it "". Chat's ``bytes`` are the token's own
    (``token_bytes``), so the bytes of a split character's pieces join to its UTF-8.
    ``text_offset[i]``, as vLLM's: where token i starts in the returned text, in characters.

    Args:
        chat: Chat's layout (else completions').
        entries: The tokens' logprobs.
        tokenizer: The target's tokenizer (None: a token's text is its id, for tests).
        tokens: What each entry's token adds to the text and where (``TextAssembler.tokens``: a
            stream chunk's, in the whole text); None: ``entries`` are a whole completion, decoded here.

    Raises:
        LogprobsMismatchError: ``tokens`` not those of ``entries`` (another number, or another token), or
            without the text of one of their top tokens.
    """
    if tokens is None:
        tokens = _whole_completion(entries, tokenizer)
    if len(tokens) != len(entries) or any(t.token_id != e.token_id for t, e in zip(tokens, entries)):
        raise LogprobsMismatchError(
            f"{len(entries)} logprobs (tokens {[e.token_id for e in entries][:8]}) for {len(tokens)} tokens "
            f"({[t.token_id for t in tokens][:8]})")

    missing = next(((t.token_id, i) for t, e in zip(tokens, entries) for i, _ in e.top if i not in t.alternatives),
                   None)
    if missing is not None:
        raise LogprobsMismatchError(f"the text of top token {missing[1]} at token {missing[0]} was not decoded "
                                    "(TextAssembler.push takes the top tokens as alternatives)")

    def finite(value: float) -> float:  # a masked token's -inf is not JSON: vLLM's floor instead
        return max(value, LOGPROB_FLOOR)

    if chat:
        content = []
        for t, e in zip(tokens, entries):
            top = [{"token": t.alternatives[i], "logprob": finite(v), "bytes": list(token_bytes(tokenizer, i))}
                   for i, v in e.top]
            content.append({"token": t.text, "logprob": finite(e.logprob),
                            "bytes": list(token_bytes(tokenizer, e.token_id)), "top_logprobs": top})
        return {"content": content, "refusal": None}
    asked_top = any(e.top for e in entries)
    return {
        "tokens": [t.text for t in tokens],
        "token_logprobs": [finite(e.logprob) for e in entries],
        "top_logprobs": [{t.alternatives[i]: finite(v) for i, v in e.top} for t, e in zip(tokens, entries)]
        if asked_top else None,
        "text_offset": [t.offset for t in tokens],
    }


def _whole_completion(entries: Sequence, tokenizer) -> list[TokenText]:
    """The ``TokenText``s of a whole completion's tokens (with their top tokens' texts)."""
    ids = [e.token_id for e in entries]
    if tokenizer is None:
        offsets = [0]
        for i in ids:
            offsets.append(offsets[-1] + len(str(i)))
        return [TokenText(i, offsets[k], str(i), {t: str(t) for t, _ in e.top}) for k, (i, e) in
                enumerate(zip(ids, entries))]
    assembler = TextAssembler(tokenizer, offsets=True)
    assembler.push(ids, final=True, alternatives=[[t for t, _ in e.top] for e in entries])
    return assembler.tokens


def _own_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def token_bytes(tokenizer, token_id: int) -> bytes:
    """A token's own bytes (chat logprobs' ``bytes``): the UTF-8 of its own decode (special tokens included),
    or, where that decode is an incomplete UTF-8 character (U+FFFD), the bytes the token stands for when the
    tokenizer says: a SentencePiece byte-fallback token's (``<0xC3>``), or a byte-level BPE token's (GPT-2's
    byte-to-character map, the tokenizer's decoder ``ByteLevel``). A tokenizer that says neither keeps the
    U+FFFD's UTF-8 (what its decode gives)."""
    own = _own_text(tokenizer, token_id)
    if REPLACEMENT in own and tokenizer is not None:
        raw = _raw_bytes(tokenizer, token_id)
        if raw is not None:
            return raw
    return own.encode("utf-8")


def _raw_bytes(tokenizer, token_id: int) -> bytes | None:
    """The bytes a byte-fallback or byte-level token stands for, or None (another kind of token)."""
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    piece = convert(token_id) if callable(convert) else None
    if not isinstance(piece, str):
        return None
    match = BYTE_FALLBACK.fullmatch(piece)
    if match:
        return bytes([int(match.group(1), 16)])
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    table = _byte_level_table()
    if isinstance(decoder, decoders.ByteLevel) and all(c in table for c in piece):
        return bytes(table[c] for c in piece)
    return None


@functools.cache
def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: character -> the byte it stands for (``bytes_to_unicode``, inverted)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def validation_error(errors: Sequence[dict], content_type: str | None = None) -> ApiError:
    """The 400 of a body that pydantic (or FastAPI's JSON decoding) refused: ``errors``, a
    ``RequestValidationError``'s ``errors()``; ``content_type``: the request's header, named when a body
    that is not JSON was sent under another type."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    locs = [[str(p) for p in e["loc"] if p != "body"] for e in errors]
    tag = _union_position(locs, first.get("type", ""))
    if tag is not None:  # a value that matches none of a union's types ("prompt", "stop", a message's "content")
        prefix = loc[:tag]
        tried = [e for e, where in zip(errors, locs) if where[:tag] == prefix and len(where) > tag]
        # an error past the type check (a value out of range, a wrong literal) says the most
        specific = [e for e in tried if not e["type"].endswith("_type")]
        if not specific:
            members = dict.fromkeys(where[tag] for where in locs if where[:tag] == prefix and len(where) > tag)
            value = first.get("input")
            return ApiError(400, f"invalid value for {'.'.join(prefix)!r}: {_shown(value)} (it must be "
                                 f"{' or '.join(_member_name(m) for m in members)})", param=".".join(prefix),
                            code="invalid_value")
        first = specific[0]
        loc = [str(p) for p in first["loc"] if p != "body"]
        loc = loc[:tag] + loc[tag + 1:]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        return ApiError(400, "the request body is not valid JSON", code="invalid_json")
    if param is None and kind == "missing":  # FastAPI's reading of an empty body
        return ApiError(400, "the request body is empty: send a JSON object (Content-Type: application/json)",
                        code="invalid_json")
    if param is None and isinstance(first.get("input"), (bytes, bytearray)):  # not read as JSON at all
        return ApiError(400, f"the request body must be JSON, sent with Content-Type: application/json; got "
                             f"Content-Type {content_type or '(none)'!r}", code="invalid_json")
    if kind == "extra_forbidden":
        return ApiError(400, f"Unrecognized request argument supplied: {param}", param=param,
                        code="unrecognized_argument")
    if kind == "missing":
        return ApiError(400, f"{param!r} is a required property", param=param, code="missing_required_parameter")
    return ApiError(400, f"invalid value for {param or 'the body'!r}: {_shown(first.get('input'))} "
                         f"({first.get('msg', kind)})", param=param, code="invalid_value")


#: The request fields whose type is a union (serve/schemas.py), "*" for a list index: pydantic names the
#: union's member tried right after them in an error's location ("prompt", "list[constrained-int]", "1").
UNION_FIELDS = (("prompt",), ("stop",), ("messages", "*", "content"), ("tool_choice",))


def _union_position(locs: list[list[str]], kind: str = "") -> int | None:
    """Where the first error's location names a union's member: the position right after a union field
    of the request schemas, or None (an ``extra_forbidden`` key is a field the client sent, never a member)."""
    loc = locs[0] if locs else []
    for field in UNION_FIELDS:
        n = len(field)
        if len(loc) > n and _matches(loc[:n], field):
            return None if kind == "extra_forbidden" and len(loc) == n + 1 else n
    return None


def _matches(loc: list[str], field: tuple[str, ...]) -> bool:
    return all(f == p or (f == "*" and p.isdigit()) for p, f in zip(loc, field))


def _member_name(member: str) -> str:
    """A union member as the JSON a client sends."""
    names = {"str": "a string", "list[str]": "a list of strings", "list[constrained-int]": "a list of token ids "
             "(integers >= 0)", "list[TextPart]": "a list of text parts ({\"type\": \"text\", \"text\": ...})"}
    return names.get(member, member.replace("dict[str,any]", "an object").replace("dict[any,any]", "an object"))


def _shown(value) -> str:
    return json.dumps(value)[:80] if isinstance(value, (int, float, str, bool, type(None))) else type(value).__name__
