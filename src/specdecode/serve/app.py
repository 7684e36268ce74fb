"""The OpenAI-compatible HTTP API (FastAPI) over the engine loop.

Endpoints: ``GET /health`` (and ``HEAD``; no key needed), ``GET /v1/models`` and ``GET /v1/models/{id}``,
``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE streaming via ``sse-starlette``,
ending in ``data: [DONE]``), ``GET /metrics`` (Prometheus text).

Every error is answered with OpenAI's body ``{"error": {"message", "type", "param", "code"}}``,
and ``code`` is never null (``ApiError`` requires one): 400 for bad input (pydantic validation
included; FastAPI's default would be 422), 401 for a missing or wrong key, 404/405 for unknown
routes, 411/413 for a body without a length or too large, 429 with ``Retry-After`` when the
queue is full, 503 while shutting down, 500 only for the server's own failures (logged; a stream, whose
status 200 was sent, ends with the error's body and ``[DONE]``).

``n`` > 1 runs as n rows of the batched engine over the same prompt, each with its own sampler
(seed + i when a seed is given). A message's ``name`` goes to the chat template when the
template uses it, else the request is refused (400): it is never dropped silently.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
from jinja2 import TemplateError
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdecode.config import MIN_SAMPLING_TEMPERATURE, GenerationConfig, check_banned_words
from specdecode.engine import kv_cache
from specdecode.errors import InvalidArgumentError
from specdecode.serve.engine_loop import Delivery, EngineLoop, EngineStoppedError, QueueFullError, RequestHandle
from specdecode.serve.metrics import ServerMetrics
from specdecode.serve.openai_format import (
    FINISH_REASONS,
    ApiError,
    LogprobsMismatchError,
    ResponseShape,
    error_body,
    internal_error,
    logprobs_json,
    speculative,
    usage,
    validation_error,
)
from specdecode.serve.schemas import ChatCompletionRequest, CompletionRequest
from specdecode.serve.text import TextAssembler

logger = logging.getLogger(__name__)

ENDPOINTS = ("/health", "/metrics", "/v1/models", "/v1/models/{id}", "/v1/completions", "/v1/chat/completions")
#: ``code`` of the errors that routing answers (Starlette's HTTPException), by status.
HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}
#: FastAPI's detail of a body it could not decode (not UTF-8, nested too deep), answered as invalid JSON.
BODY_PARSE_ERROR = "There was an error parsing the body"
#: Temperatures below this are served as greedy decoding (vLLM's _SAMPLING_EPS; GenerationConfig refuses them).
GREEDY_TEMPERATURE = MIN_SAMPLING_TEMPERATURE


def endpoint_label(path: str) -> str:
    """The metrics' ``endpoint`` label of a request path: its route in ENDPOINTS ("/v1/models/{id}" for
    any model id, so ids do not become labels), or "other"."""
    if path in ENDPOINTS:
        return path
    if path.startswith("/v1/models/") and len(path) > len("/v1/models/"):
        return "/v1/models/{id}"
    return "other"


@dataclass(frozen=True)
class ServeSettings:
    """What the HTTP layer enforces.

    Attributes:
        model_name: The id ``/v1/models`` lists (requests may name it or omit ``model``).
        method: The speculative method, reported in each response's ``speculative`` field.
        api_key: With a key, every endpoint but ``/health`` needs ``Authorization: Bearer KEY``.
        max_prompt_tokens: Longest prompt accepted (tokens, after the chat template).
        max_tokens_limit: Largest ``max_tokens`` accepted; also the cap of a chat request that
            sends none (which otherwise gets the rest of its row's cache).
        max_body_bytes: Largest request body (bytes).
        shutdown_timeout_s: On SIGTERM, seconds running requests may take to finish before they
            are cancelled.
        retry_after_s: ``Retry-After`` seconds on a 429.
        banned_words: Words no answer may contain (``serve --banned-word``, ``--banned-words-file``), before each
            request's ``bad_words``; ``banned_words_ignore_case`` and ``banned_words_whole_word`` apply to both
            (``GenerationConfig``'s).

    Raises:
        InvalidArgumentError: On a limit below 1 (or a negative timeout); a blank banned word.
    """

    model_name: str
    method: str
    api_key: str | None = None
    max_prompt_tokens: int = 4096
    max_tokens_limit: int = 4096
    max_body_bytes: int = 1 << 20
    shutdown_timeout_s: float = 30.0
    retry_after_s: int = 1
    banned_words: tuple[str, ...] = ()
    banned_words_ignore_case: bool = False
    banned_words_whole_word: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "banned_words", check_banned_words(self.banned_words, allow_empty=True))
        for name in ("max_prompt_tokens", "max_tokens_limit", "max_body_bytes", "retry_after_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidArgumentError(f"{name} must be an integer >= 1, got {v!r}")
        if not self.shutdown_timeout_s >= 0:
            raise InvalidArgumentError(f"shutdown_timeout_s must be >= 0 seconds, got {self.shutdown_timeout_s!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise InvalidArgumentError("api_key must be a non-empty string or None")


class _Guard:
    """Pure ASGI middleware: body-size limits (before any byte is parsed) and per-endpoint counts."""

    def __init__(self, app, settings: ServeSettings, metrics: ServerMetrics) -> None:
        self.app, self.settings, self.metrics = app, settings, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = endpoint_label(scope["path"])
        status: list[int] = []

        async def counted_send(message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        refusal = self._check_body(scope)
        try:
            if refusal is not None:
                self.metrics.errors.labels(endpoint, refusal.type).inc()
                await JSONResponse(refusal.body(), refusal.status)(scope, receive, counted_send)
            else:
                await self.app(scope, receive, counted_send)
        finally:
            self.metrics.requests.labels(endpoint, str(status[0] if status else 499)).inc()

    def _check_body(self, scope) -> ApiError | None:
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return None
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is None:
            return ApiError(411, "a request body needs a Content-Length header (chunked bodies are not accepted)",
                            code="length_required")
        try:
            n = int(length)
        except ValueError:
            return ApiError(400, f"bad Content-Length header {length.decode(errors='replace')!r}",
                            code="invalid_content_length")
        if n > self.settings.max_body_bytes:
            return ApiError(413, f"the request body has {n} bytes; the most this server accepts is "
                                 f"{self.settings.max_body_bytes}", code="request_too_large")
        return None


def create_app(generator, engine: EngineLoop, settings: ServeSettings, metrics: ServerMetrics) -> FastAPI:
    """The FastAPI application; its lifespan starts ``engine`` and stops it on shutdown.

    Args:
        generator: A ``SpeculativeGenerator`` (its tokenizer, ``encode`` and ``encode_messages``
            turn requests into ids exactly as ``specdecode generate`` does).
        engine: The engine loop over the batched decoder (not started yet).
        settings: Limits and the key.
        metrics: Where to count.

    Raises:
        InvalidArgumentError: The decoder's rows hold too few positions for any request (a prompt
            token and a new token beside a draft block).
    """
    tokenizer = generator.tokenizer
    decoder = engine.decoder
    # Positions a request may use: the row's cache (less a draft block) and the model's context.
    model_context = kv_cache.context_length(decoder.target)
    cache_room = decoder.max_length - decoder.max_block - 1
    if cache_room < 2:
        raise InvalidArgumentError(
            f"--max-length {decoder.max_length} leaves no room for a request: a row keeps {decoder.max_block + 1} "
            f"positions for a draft block, and a request needs at least one prompt token and one new token; use "
            f"--max-length >= {decoder.max_block + 3}")

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            await engine.stop(settings.shutdown_timeout_s)

    app = FastAPI(title="specdecode", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        if exc.status >= 400 and endpoint_label(request.url.path) != "other":
            metrics.errors.labels(endpoint_label(request.url.path), exc.type).inc()
        return JSONResponse(exc.body(), exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return await _api_error(request, validation_error(exc.errors(), request.headers.get("content-type")))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 400 and exc.detail == BODY_PARSE_ERROR:  # FastAPI's: not UTF-8, nested too deep
            return await _api_error(request, ApiError(400, "the request body could not be read as JSON: send a "
                                                           "JSON object in UTF-8", code="invalid_json"))
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        metrics.errors.labels(endpoint_label(request.url.path), kind).inc()
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        message = f"{detail}: {request.method} {request.url.path}" if exc.status_code in (404, 405) else detail
        code = HTTP_CODES.get(exc.status_code, f"http_{exc.status_code}")
        return JSONResponse(error_body(message, kind, None, code), exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)  # LogprobsMismatchError included
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unexpected error answering %s %s", request.method, request.url.path)
        err = internal_error(exc)
        metrics.errors.labels(endpoint_label(request.url.path), err.type).inc()
        return JSONResponse(err.body(), err.status)

    async def authorize(request: Request) -> None:
        if settings.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), settings.api_key.encode()):
            raise ApiError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                           "authentication_error", code="invalid_api_key")

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' checks (headers and status only)
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "unavailable", "running": engine.running, "waiting": engine.waiting}, 503)
        return {"status": "ok", "running": engine.running, "waiting": engine.waiting}

    @app.get("/metrics", dependencies=[Depends(authorize)])
    async def prometheus():
        metrics.set_load(engine.running, engine.waiting)
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    def model_card() -> dict:
        return {"id": settings.model_name, "object": "model", "created": 0, "owned_by": "specdecode",
                "max_model_len": decoder.max_length}

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}", dependencies=[Depends(authorize)])
    async def model(model: str):  # OpenAI's "retrieve model" (the openai client's models.retrieve)
        if model != settings.model_name:
            raise ApiError(404, f"the model {model!r} does not exist here; this server serves {settings.model_name!r}",
                           param="model", code="model_not_found")
        return model_card()

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: CompletionRequest, request: Request):
        _check_common(body, settings)
        if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], int):
            ids = list(body.prompt)
            if not ids:
                raise ApiError(400, "the prompt is empty", param="prompt", code="invalid_value")
        else:
            text = body.prompt if isinstance(body.prompt, str) else (body.prompt[0] if body.prompt else "")
            ids = _encode(lambda: generator.encode(text, chat=False, device="cpu"), "prompt")
        return await _serve(request, body, ids, chat=False, param="prompt", max_tokens=body.max_tokens)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_common(body, settings)
        messages = [m.as_template_message() for m in body.messages]
        ids = _encode(lambda: generator.encode_messages(messages, device="cpu"), "messages")
        _check_names(generator, messages, ids)
        return await _serve(request, body, ids, chat=True, param="messages", max_tokens=body.requested_max_tokens)

    async def _serve(request: Request, body, ids: list[int], *, chat: bool, param: str, max_tokens: int | None):
        if len(ids) > settings.max_prompt_tokens:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this server accepts at most "
                                f"{settings.max_prompt_tokens}", param=param, code="context_length_exceeded")
        room = (cache_room if model_context is None else min(cache_room, model_context)) - len(ids)
        if max_tokens is None:
            max_tokens = min(settings.max_tokens_limit, room)
        elif max_tokens > settings.max_tokens_limit:
            raise ApiError(400, f"max_tokens is {max_tokens}; this server allows at most {settings.max_tokens_limit}",
                           param="max_tokens", code="invalid_value")
        if max_tokens < 1 or max_tokens > room:
            raise ApiError(400, f"a request may use {room + len(ids)} positions here (the model's context length "
                                f"{model_context}, the server's --max-length {decoder.max_length} less "
                                f"{decoder.max_block + 1} for a draft block); the prompt has {len(ids)} tokens and "
                                f"max_tokens is {max_tokens}: reduce the prompt or max_tokens (at most {max(room, 0)} "
                                "here)", param=param, code="context_length_exceeded")
        # As vLLM: a temperature below GREEDY_TEMPERATURE is greedy decoding (logits / T would
        # overflow to inf near 1e-38, and sampling at such T is argmax anyway).
        temperature = 0.0 if body.temperature < GREEDY_TEMPERATURE else body.temperature
        _check_token_ids(body, getattr(decoder, "vocab_size", None))
        if body.n > decoder.max_batch_size:
            raise ApiError(400, f"n is {body.n}; this server runs at most {decoder.max_batch_size} choices per "
                                "request (its --max-batch-size: each choice is one row of the batch)", param="n",
                           code="invalid_value")
        try:
            # n choices: one row each, each with its own sampler (seed + i when a seed is given)
            options = body.processor_options()  # [processors] penalties, bias, logprobs; bad_words
            options.update(banned_words=settings.banned_words + options["banned_words"],  # the server's words first
                           banned_words_ignore_case=settings.banned_words_ignore_case,
                           banned_words_whole_word=settings.banned_words_whole_word)
            configs = [GenerationConfig(max_new_tokens=max_tokens, temperature=temperature, top_k=max(body.top_k, 0),
                                        top_p=body.top_p, seed=None if body.seed is None else body.seed + i,
                                        stop_strings=body.stop_strings, **options)
                       for i in range(body.n)]
        except InvalidArgumentError as e:
            raise ApiError(400, str(e), code="invalid_value") from e
        try:
            handles = await engine.submit_group(ids, configs)
        except QueueFullError as e:
            raise ApiError(429, str(e), "rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(settings.retry_after_s)}) from e
        except EngineStoppedError as e:
            raise ApiError(503, str(e), "server_error", code="unavailable") from e
        except InvalidArgumentError as e:
            raise ApiError(400, str(e), param=param, code="invalid_value") from e
        metrics.prompt_tokens.inc(len(ids))
        shape = ResponseShape(chat, settings.model_name)
        # [processors] logprobs: what each token adds to the text, and where (TextAssembler.tokens)
        texts = [TextAssembler(tokenizer, c.stop_strings, offsets=c.logprobs) for c in configs]
        endpoint = request.url.path
        if body.stream:
            return EventSourceResponse(
                _stream(handles, shape, texts, body.include_usage, endpoint),
                ping=15, shutdown_event=anyio.Event(), shutdown_grace_period=settings.shutdown_timeout_s + 5,
            )
        return await _complete(request, handles, shape, texts, endpoint)

    async def _deliveries(handles: list[RequestHandle], request: Request | None = None) -> AsyncIterator[Delivery]:
        """The deliveries of a request's choices (one handle each, sharing one queue), observing latency
        metrics per choice; ends after every choice's final one. With ``request``, a disconnected client
        cancels them all: checked after every delivery (so within one round) and every 0.25 s while none
        comes (a long prefill, a wait for a row). ``Request.is_disconnected`` does not block: it reads a
        pending ``http.disconnect``."""
        queue = handles[0].deliveries
        last: dict[int, float] = {}
        running = len(handles)
        while running:
            if request is None:
                d = await queue.get()
            else:
                try:
                    d = await asyncio.wait_for(queue.get(), 0.25)
                except TimeoutError:
                    d = None
                if (d is None or d.finish_reason is None) and await request.is_disconnected():
                    for handle in handles:
                        handle.cancel()
                    return
                if d is None:
                    continue
            if d.token_ids:
                if d.index not in last:
                    metrics.ttft.observe(d.time_s - handles[d.index].submitted_s)
                else:
                    metrics.itl.observe(d.time_s - last[d.index])
                last[d.index] = d.time_s
            if d.finish_reason is not None:
                metrics.e2e.observe(d.time_s - handles[d.index].submitted_s)
                running -= 1
            yield d

    def _spec(finals: list[Delivery]) -> dict:
        return speculative([d.result.stats for d in finals if d.result is not None], settings.method, decoder.gamma)

    def _failure(d: Delivery) -> ApiError:
        if d.finish_reason == "cancelled":
            return ApiError(503, "the server is shutting down; the request was cancelled", "server_error",
                            code="server_shutdown")
        return ApiError(500, f"generation failed: {d.error or 'unknown error'}", "server_error",
                        code="generation_failed")

    def _push(text: TextAssembler, d: Delivery, logprobs: bool) -> str:
        """``text.push`` of a delivery's tokens; with ``logprobs``, their top tokens' too, once the engine's
        logprobs are checked to be those of its tokens (``LogprobsMismatchError``, an internal error)."""
        alternatives = None
        if logprobs:
            entries = d.logprobs or []
            if [e.token_id for e in entries] != list(d.token_ids):
                raise LogprobsMismatchError(
                    f"the engine delivered {len(entries)} logprobs (tokens {[e.token_id for e in entries][:8]}) "
                    f"with {len(d.token_ids)} tokens ({list(d.token_ids)[:8]})")
            alternatives = [[t for t, _ in e.top] for e in entries]
        return text.push(d.token_ids, final=d.finish_reason is not None, alternatives=alternatives)

    def _usage(handles: list[RequestHandle], texts: list[TextAssembler]) -> dict:
        return usage(len(handles[0].prompt_ids), sum(len(t.token_ids) for t in texts))

    async def _complete(request: Request, handles: list[RequestHandle], shape: ResponseShape,
                        texts: list[TextAssembler], endpoint: str):
        finals: dict[int, Delivery] = {}
        # [processors] per choice, its logprobs so far (None: not asked)
        logprobs = [[] if h.config.logprobs else None for h in handles]
        try:
            async for d in _deliveries(handles, request):
                _push(texts[d.index], d, logprobs[d.index] is not None)
                if logprobs[d.index] is not None:
                    logprobs[d.index] += d.logprobs or []
                if d.finish_reason is None:
                    continue
                if d.finish_reason not in FINISH_REASONS:
                    raise _failure(d)
                finals[d.index] = d
            if len(finals) < len(handles):
                return Response(status_code=499)  # the client went away; nobody reads this
            choices = [(texts[i].text, FINISH_REASONS[finals[i].finish_reason],
                        None if logprobs[i] is None
                        else logprobs_json(shape.chat, logprobs[i], tokenizer, texts[i].tokens))
                       for i in range(len(handles))]
            return shape.full(choices, _usage(handles, texts), _spec([finals[i] for i in range(len(handles))]))
        finally:
            for handle in handles:
                handle.cancel()

    async def _stream(handles: list[RequestHandle], shape: ResponseShape, texts: list[TextAssembler],
                      include_usage: bool, endpoint: str):
        finals: dict[int, Delivery] = {}
        # [processors] per choice, logprobs not yet sent (None: not asked) and how many were sent
        pending = [[] if h.config.logprobs else None for h in handles]
        sent = [0] * len(handles)
        try:
            if shape.chat:
                for i in range(len(handles)):
                    yield _data(shape.chunk(None, index=i, role=True, include_usage=include_usage))
            try:
                async for d in _deliveries(handles):
                    final = d.finish_reason is not None
                    delta = _push(texts[d.index], d, pending[d.index] is not None)
                    if pending[d.index] is not None:
                        pending[d.index] += d.logprobs or []
                    if final and d.finish_reason not in FINISH_REASONS:
                        err = _failure(d)
                        metrics.errors.labels(endpoint, err.type).inc()
                        yield _data(err.body())
                        break
                    if final:
                        finals[d.index] = d
                    if delta or final:
                        reason = FINISH_REASONS[d.finish_reason] if final else None
                        extra = {"speculative": _spec([d])} if final else {}
                        if pending[d.index] is not None:
                            n, tokens = len(pending[d.index]), texts[d.index].tokens
                            extra["logprobs"] = logprobs_json(shape.chat, pending[d.index], tokenizer,
                                                              tokens[sent[d.index]:sent[d.index] + n])
                            sent[d.index] += n
                            pending[d.index] = []
                        yield _data(shape.chunk(delta if delta or not shape.chat else None, reason, index=d.index,
                                                include_usage=include_usage, **extra))
                if include_usage and len(finals) == len(handles):
                    yield _data(shape.usage_chunk(_usage(handles, texts), _spec(list(finals.values()))))
            except Exception as exc:  # noqa: BLE001 -- the status was sent: the stream ends with the error's body
                logger.exception("unexpected error streaming %s", endpoint)
                err = internal_error(exc)
                metrics.errors.labels(endpoint, err.type).inc()
                yield _data(err.body())
            yield "[DONE]"
        finally:
            for handle in handles:
                handle.cancel()

    return _Guard(app, settings, metrics)


def _data(obj: dict) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _encode(encode, param: str) -> list[int]:
    try:
        return encode()[0].tolist()
    except InvalidArgumentError as e:
        raise ApiError(400, str(e), param=param, code="invalid_value") from e
    except TemplateError as e:  # a chat template that refuses the conversation (e.g. roles out of order)
        raise ApiError(400, f"the model's chat template refused these messages: {e}", param=param,
                       code="invalid_messages") from e


def _check_names(generator, messages: list[dict], ids: list[int]) -> None:
    """Refuse a message's ``name`` that the chat template does not use (it would be dropped without a
    word): for each role with a named message, the conversation is rendered again with that role's
    names left out; the same tokens mean the template ignores them (Qwen2.5's and most templates do).

    Raises:
        ApiError: 400 naming the first such message's ``name`` field.
    """
    named_roles = dict.fromkeys(m["role"] for m in messages if "name" in m)
    for role in named_roles:
        without = [{k: v for k, v in m.items() if k != "name"} if m["role"] == role else m for m in messages]
        if _encode(lambda: generator.encode_messages(without, device="cpu"), "messages") == ids:
            i = next(i for i, m in enumerate(messages) if m["role"] == role and "name" in m)
            raise ApiError(400, f"messages[{i}].name is not supported for role {role!r}: this model's chat "
                                "template does not use a message's name, so it would be dropped; leave it out "
                                "(or put the name in the content)", param=f"messages.{i}.name",
                           code="unsupported_parameter")


def _check_token_ids(body, vocab_size: int | None) -> None:
    """Refuse a ``logit_bias`` or ``stop_token_ids`` id outside the target's vocabulary, naming that
    field (the engine refuses them too, but its error cannot say which field of the request it was).

    Raises:
        ApiError: 400 with ``param`` the field.
    """
    if vocab_size is None:
        return
    for param, ids in (("logit_bias", [int(k) for k in body.logit_bias or {}]),
                       ("stop_token_ids", list(body.stop_token_ids or ()))):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ApiError(400, f"{param} names token id {bad[0]}, outside the target model's vocabulary "
                                f"0..{vocab_size - 1}", param=param, code="invalid_value")


def _check_common(body, settings: ServeSettings) -> None:
    if body.model is not None and body.model != settings.model_name:
        raise ApiError(404, f"the model {body.model!r} does not exist here; this server serves "
                            f"{settings.model_name!r}", param="model", code="model_not_found")
    bad = body.unsupported()
    if bad is not None:
        raise ApiError(400, bad[1], param=bad[0], code="unsupported_parameter")
