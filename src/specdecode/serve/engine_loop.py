"""One thread owns the models: it runs the batched engine and talks to the HTTP handlers.

The ``BatchedSpeculativeDecoder`` is not thread-safe, so exactly one thread (the engine
loop) calls its ``add``, ``cancel`` and ``step``. HTTP handlers run on the asyncio event
loop; they reach the engine through ``EngineLoop.submit`` (a request, answered by a
``RequestHandle``) and ``RequestHandle.cancel``, both of which only post a command to the
engine thread. Between rounds the engine thread applies the commands (requests join,
cancelled ones leave: continuous batching), runs one ``step`` and posts each request's
new tokens to its handle's ``asyncio.Queue`` with ``loop.call_soon_threadsafe``.

Admission control: at most ``max_batch_size`` requests run and at most ``max_queue`` wait;
``submit`` raises ``QueueFullError`` beyond that (the server answers 429), and
``EngineStoppedError`` once shutdown began (503).

This is the layout of vLLM's ``AsyncLLMEngine`` (an engine core stepping in a loop, a
per-request output queue), reduced to one process and one thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specdecode.config import GenerationConfig
from specdecode.engine.batched import BatchedSpeculativeDecoder
from specdecode.engine.decoder import GenerationResult
from specdecode.errors import InvalidArgumentError, SpecDecodeError
from specdecode.serve.openmp import release_openmp_pool

logger = logging.getLogger(__name__)


class QueueFullError(SpecDecodeError):
    """Too many requests are running and waiting (the server answers 429 with Retry-After)."""


class EngineStoppedError(SpecDecodeError):
    """The engine is shutting down or stopped after a failure (the server answers 503)."""


@dataclass
class Delivery:
    """What the engine sends a request after a step.

    Attributes:
        token_ids: New verified tokens (possibly several: a speculative round delivers blocks).
        time_s: ``time.perf_counter()`` when the step that made them ended (seconds).
        finish_reason: None while running; else the engine's reason ("eos", "stop_string",
            "length", "banned_word", "cancelled", "error").
        result: The request's ``GenerationResult`` (with its statistics) once finished.
        error: Why it ended with "error".
        index: Its handle's ``index`` (the choice it belongs to, in a group of ``n`` choices).
        logprobs: With ``GenerationConfig.logprobs``, one ``TokenLogprob`` per token of ``token_ids``.
    """

    token_ids: list[int]
    time_s: float
    finish_reason: str | None = None
    result: GenerationResult | None = None
    error: str | None = None
    index: int = 0
    logprobs: list | None = None


@dataclass
class RequestHandle:
    """A submitted request, as the HTTP handler sees it.

    Attributes:
        prompt_ids: The prompt (token ids).
        config: Its generation parameters.
        submitted_s: ``time.perf_counter()`` at submission (seconds).
        deliveries: ``asyncio.Queue`` of ``Delivery``; the last one has a ``finish_reason``. The
            handles of one group (``EngineLoop.submit_group``) share it; ``Delivery.index`` tells
            them apart.
        loop: The event loop the handler awaits on (deliveries are posted to it).
        index: Its place in its group (0 for a lone request).
    """

    prompt_ids: list[int]
    config: GenerationConfig
    submitted_s: float
    deliveries: asyncio.Queue
    loop: asyncio.AbstractEventLoop = field(repr=False)
    _engine: EngineLoop = field(repr=False)
    request_id: int | None = None
    finished: bool = False
    index: int = 0

    def cancel(self) -> None:
        """Ask the engine to drop this request at the next round boundary (idempotent)."""
        if not self.finished:
            self._engine._post(("cancel", self))


class EngineLoop:
    """Runs ``decoder.step()`` in a thread while requests come and go.

    Args:
        decoder: The batched engine (its ``max_batch_size`` bounds the running rows).
        max_queue: Requests that may wait for a slot (>= 0) before ``submit`` refuses.
        on_step: Called in the engine thread after every step with (decoder, seconds the
            step took), for metrics; must not raise.
        on_finish: Called in the engine thread when a request ends, with (handle, delivery).

    Raises:
        InvalidArgumentError: If ``max_queue`` is negative or not an int.
    """

    def __init__(
        self,
        decoder: BatchedSpeculativeDecoder,
        *,
        max_queue: int = 64,
        on_step: Callable[[BatchedSpeculativeDecoder, float], None] | None = None,
        on_finish: Callable[[RequestHandle, Delivery], None] | None = None,
    ) -> None:
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise InvalidArgumentError(f"max_queue must be an integer >= 0, got {max_queue!r}")
        self.decoder = decoder
        self.max_queue = max_queue
        self.on_step = on_step
        self.on_finish = on_finish
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._outstanding = 0  # submitted and not yet finished (running + waiting + not yet added)
        self._live: dict[int, RequestHandle] = {}  # engine request id -> handle (engine thread only)
        self._stopping = False
        self._deadline: float | None = None  # monotonic seconds after which requests are cancelled
        self._failed: str | None = None
        self._thread: threading.Thread | None = None

    # -- called from the event loop -------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Most requests running and waiting at once."""
        return self.decoder.max_batch_size + self.max_queue

    @property
    def outstanding(self) -> int:
        """Requests submitted and not finished."""
        return self._outstanding

    @property
    def running(self) -> int:
        """Rows in the batch (as of the last step)."""
        return self.decoder.num_running

    @property
    def waiting(self) -> int:
        """Requests submitted that are not in the batch."""
        return max(0, self._outstanding - self.decoder.num_running)

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs and accepts requests."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def start(self) -> None:
        """Start the engine thread (once).

        Releases the calling thread's OpenMP pool first (``openmp.release_openmp_pool``): the
        engine thread then owns the only one. With two pools on a 2-core machine libgomp made each
        parallel op of the engine thread sleep and wake its worker, and the engine decoded 20-30%
        slower in this thread than in the main thread (``docs/benchmarks/engine_thread_cost.py``).
        The calling thread should run no torch ops while the engine runs (the HTTP handlers do not).
        """
        if self._thread is not None:
            raise RuntimeError("the engine loop was already started")
        release_openmp_pool()
        self._thread = threading.Thread(target=self._run, name="specdecode-engine", daemon=True)
        self._thread.start()

    async def submit(self, prompt_ids: list[int], config: GenerationConfig) -> RequestHandle:
        """Queue a request; returns once the engine accepted it (between two rounds).

        Args:
            prompt_ids: The prompt's token ids (n >= 1).
            config: Its generation parameters.

        Raises:
            QueueFullError: If ``capacity`` requests are already running or waiting.
            EngineStoppedError: If the engine is shutting down or failed.
            InvalidArgumentError: If the engine refuses the request (``BatchedSpeculativeDecoder.add``:
                a prompt that does not fit the cache or the context length, ...).
        """
        return (await self.submit_group(prompt_ids, [config]))[0]

    async def submit_group(self, prompt_ids: list[int], configs: list[GenerationConfig]) -> list[RequestHandle]:
        """Queue one request per config over the same prompt (an API request's ``n`` choices: one row
        of the batched engine each, each with its own sampler), admitted all or none; returns once
        the engine accepted every one. The handles share one deliveries queue (``Delivery.index``
        is the handle's place in ``configs``).

        Raises:
            QueueFullError: If fewer than ``len(configs)`` places are free (``capacity``).
            EngineStoppedError, InvalidArgumentError: As ``submit``; a refused row takes the
                group's others back.
        """
        if not configs:
            raise InvalidArgumentError("submit_group needs at least one config")
        loop = asyncio.get_running_loop()
        deliveries: asyncio.Queue = asyncio.Queue()
        now = time.perf_counter()
        handles = [RequestHandle(list(prompt_ids), c, now, deliveries, loop, self, index=i)
                   for i, c in enumerate(configs)]
        accepted = [loop.create_future() for _ in handles]
        # Checked and posted under the lock that _drain takes: an add is either refused here or
        # read by the engine thread (applied, or refused by _drain), never left unanswered.
        with self._lock:
            if self._stopping or self._failed is not None or self._thread is None:
                raise EngineStoppedError(self._failed or "the server is shutting down; no new requests")
            if self._outstanding + len(handles) > self.capacity:
                wanted = f" and this request needs {len(handles)} (n)" if len(handles) > 1 else ""
                raise QueueFullError(
                    f"{self._outstanding} requests are running or waiting{wanted}; the most this server takes is "
                    f"{self.capacity} ({self.decoder.max_batch_size} running + {self.max_queue} queued); retry later"
                )
            self._outstanding += len(handles)
            for handle, future in zip(handles, accepted):
                self._post(("add", handle, future))
        try:
            outcomes = await asyncio.gather(*accepted, return_exceptions=True)
        except BaseException:
            for handle in handles:
                handle.cancel()  # an add may still happen: take it back (commands run in order)
            raise
        refused = next((o for o in outcomes if isinstance(o, BaseException)), None)
        if refused is not None:
            for handle in handles:
                handle.cancel()
            raise refused
        return handles

    def begin_shutdown(self, timeout_s: float) -> None:
        """Stop taking requests (``submit`` raises ``EngineStoppedError``); running and queued ones
        continue for up to ``timeout_s`` seconds, then are cancelled, each with a final delivery
        ``finish_reason="cancelled"``. Thread-safe (called from a signal handler)."""
        if self._deadline is None:
            self._deadline = time.monotonic() + max(0.0, timeout_s)
        with self._lock:
            self._stopping = True
        self._wake.set()

    async def stop(self, timeout_s: float = 30.0) -> None:
        """``begin_shutdown(timeout_s)``, wait until no request is left, then end the engine thread."""
        self.begin_shutdown(timeout_s)
        while self._outstanding and self._thread is not None and self._thread.is_alive():
            await asyncio.sleep(0.05)
        self._post(("stop",))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 60.0)

    def _post(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    # -- the engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._apply_commands():
                if self._deadline is not None and self._live and time.monotonic() >= self._deadline:
                    logger.warning("shutdown: cancelling %d requests still running", len(self._live))
                    self._end_all("cancelled", "the server is shutting down")
                if not self.decoder.has_work:
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                t0 = time.perf_counter()
                try:
                    events = self.decoder.step()
                except Exception as exc:  # noqa: BLE001 -- the running requests end with an error; the loop goes on
                    logger.exception("a decoding step failed; ending the %d requests in flight", len(self._live))
                    self._end_all("error", f"decoding failed: {type(exc).__name__}: {exc}")
                    continue
                now = time.perf_counter()
                for event in events:
                    handle = self._live.get(event.request_id)
                    if handle is None:
                        continue
                    delivery = Delivery(list(event.token_ids), now, event.finish_reason, event.result, event.error,
                                        logprobs=event.logprobs)
                    if event.finish_reason is not None:
                        self._end(handle, delivery)
                    else:
                        self._deliver(handle, delivery)
                if self.on_step is not None:
                    self.on_step(self.decoder, now - t0)
        except BaseException as exc:  # noqa: BLE001 -- every request gets an answer, the server a 503
            self._failed = f"the engine stopped after an internal error: {type(exc).__name__}: {exc}"
            logger.exception("engine loop failed; ending every request")
        finally:
            with self._lock:
                self._stopping = True  # no add is posted after this (submit checks it under the lock)
            self._drain()

    def _apply_commands(self) -> bool:
        """Apply queued adds and cancels; False on stop."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            kind = command[0]
            if kind == "stop":
                return False
            if kind == "add":
                _, handle, accepted = command
                loop = handle.loop
                try:
                    request_id = self.decoder.add(handle.prompt_ids, handle.config)
                except Exception as exc:  # noqa: BLE001 -- refused: the handler answers 400
                    self._release(handle)
                    loop.call_soon_threadsafe(_settle, accepted, None, exc)
                    continue
                handle.request_id = request_id
                self._live[request_id] = handle
                loop.call_soon_threadsafe(_settle, accepted, request_id, None)
            elif kind == "cancel":
                handle = command[1]
                if handle.request_id is None or handle.request_id not in self._live:
                    continue  # refused at its add, or already over (commands run in order: its add came first)
                try:
                    self.decoder.cancel(handle.request_id)
                except InvalidArgumentError:
                    pass  # it ended in the same step; its final delivery is on its way
                self._end(handle, Delivery([], time.perf_counter(), "cancelled"))

    def _deliver(self, handle: RequestHandle, delivery: Delivery) -> None:
        delivery.index = handle.index
        try:
            handle.loop.call_soon_threadsafe(handle.deliveries.put_nowait, delivery)
        except RuntimeError:  # the event loop closed (the server is gone): nobody is waiting
            logger.debug("delivery for request %s dropped: its event loop is closed", handle.request_id)

    def _end(self, handle: RequestHandle, delivery: Delivery) -> None:
        if handle.request_id is not None:
            self._live.pop(handle.request_id, None)
        if handle.finished:
            return
        handle.finished = True
        self._release(handle)
        if self.on_finish is not None:
            self.on_finish(handle, delivery)
        self._deliver(handle, delivery)

    def _release(self, handle: RequestHandle) -> None:
        with self._lock:
            self._outstanding -= 1

    def _end_all(self, reason: str, error: str | None = None) -> None:
        """End every live request: cancelled in the engine, a final delivery with ``reason``.

        Every handle gets its final delivery even when the engine cannot cancel its row (after
        a failed step the engine's state may be broken): no request is left waiting."""
        for request_id, handle in list(self._live.items()):
            try:
                self.decoder.cancel(request_id)
            except InvalidArgumentError:
                pass  # it had already ended inside the engine
            except Exception:  # noqa: BLE001 -- the engine is broken; the request still gets its answer
                logger.exception("cancelling request %s in the engine failed", request_id)
            self._end(handle, Delivery([], time.perf_counter(), reason, error=error))

    def _drain(self) -> None:
        """After the loop: end every live request and refuse the commands still queued."""
        self._end_all("error" if self._failed else "cancelled", self._failed)
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "add":
                _, handle, accepted = command
                self._release(handle)
                error = EngineStoppedError(self._failed or "the server is shutting down; no new requests")
                try:
                    handle.loop.call_soon_threadsafe(_settle, accepted, None, error)
                except RuntimeError:  # its event loop closed: nobody is waiting
                    pass


def _settle(future: asyncio.Future, value, error: BaseException | None) -> None:
    """Resolve ``future`` on its event loop unless its waiter was cancelled."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
