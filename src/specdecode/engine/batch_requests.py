"""The request side of the batched engine: ``BatchRequests``, the queue, slots and results of
``engine.batched.BatchedSpeculativeDecoder``.

Continuous batching (as vLLM's scheduler does it, at the granularity of one round): ``add``
queues a request at any time; the engine's ``step`` admits queued requests while slots are
free; finished or cancelled rows leave after the round (``_retire``), and the last active row
moves into each freed slot (one copy of its cache and the drafter's), so the active rows
always occupy slots 0 .. n - 1 and every forward works on views. ``generate`` runs prompts to
the end through ``step``.

The round itself (draft, verify, accept, emit) is in ``engine.batched``; this base class holds
the bookkeeping around it and needs from the engine: ``target``, ``cache``, ``drafter``,
``tokenizer``, ``vocab_size``, ``max_block``, ``max_length`` and ``step``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Sequence

import torch
from transformers import DynamicCache

from specdecode.config import GenerationConfig
from specdecode.engine import kv_cache
from specdecode.engine.banned_rows import compiled_lists
from specdecode.engine.batch_rows import BatchEvent, BatchRow, check_prompt_cache, request_prompt
from specdecode.engine.overlap import RoundAhead, kept
from specdecode.engine.results import GenerationResult
from specdecode.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

#: Finished and cancelled request ids remembered, for clear errors on a repeated cancel.
_FINISHED_MEMORY = 4096


class BatchRequests:
    """Queue, cancel and collect the requests of a batched engine (module docstring).

    Attributes (set by ``_init_requests``): the active rows in slot order, the waiting queue,
    the last ``_FINISHED_MEMORY`` finished request ids with their finish reason, the next id.
    """

    def _init_requests(self) -> None:
        self._rows: list[BatchRow] = []  # active, in slot order
        self._waiting: deque[BatchRow] = deque()
        self._finished: OrderedDict[int, str] = OrderedDict()
        self._next_id = 0
        self._ahead: RoundAhead | None = None  # [overlap] a forward enqueued before the last round's read
        self.banned_lists = compiled_lists()  # [banned words] compiled lists, shared by rows that ask alike

    @property
    def num_running(self) -> int:
        """Rows in the batch now."""
        return len(self._rows)

    @property
    def num_waiting(self) -> int:
        """Requests queued for a free slot."""
        return len(self._waiting)

    @property
    def has_work(self) -> bool:
        """Whether ``step`` has anything to do."""
        return bool(self._rows or self._waiting)

    def add(
        self,
        input_ids: torch.Tensor | Sequence[int],
        config: GenerationConfig | None = None,
        *,
        prompt_cache: DynamicCache | None = None,
    ) -> int:
        """Queue a request; it joins the batch at the next ``step`` with a free slot.

        Args:
            input_ids: (1, n) or (n,) long prompt ids, or a list of ints, n >= 1.
            config: Its generation parameters (per row: max_new_tokens, temperature, top_k,
                top_p, seed, stop_strings, stop_on_eos, banned_words and their options).
            prompt_cache: Optional target cache (transformers ``DynamicCache``, made by
                ``SpeculativeDecoder.prompt_cache``) holding the first m prompt tokens,
                1 <= m <= n - 1: when the row joins, its keys and values are copied into the
                row's slot (``BatchKVCache.load_prefix``) and only tokens m .. n - 1 are
                prefilled. It is read, never modified. A draft model prefills the whole prompt
                itself. A cache that cannot be copied (a sliding-window layer trimmed to its
                window) is ignored: the whole prompt is prefilled.

        Returns:
            The request id, for ``cancel`` and ``BatchEvent.request_id``.

        Raises:
            InvalidArgumentError: If the prompt is empty, not one row, holds an id outside the
                target's vocabulary, does not fit ``max_length`` or the model's context
                length (or the draft model's) with its ``max_new_tokens``, asks for banned words without a
                tokenizer, or ``prompt_cache`` holds no tokens or not fewer than n. The batch
                is left unchanged.
        """
        config = config or GenerationConfig()
        prompt = request_prompt(input_ids, self.vocab_size)
        kv_cache.check_context_length(self.target, len(prompt), config.max_new_tokens)
        if self.drafter is not None:
            self.drafter.check_context(len(prompt), config.max_new_tokens)
        need = len(prompt) + config.max_new_tokens + self.max_block + 1
        if need > self.max_length:
            raise InvalidArgumentError(
                f"the prompt has {len(prompt)} tokens and max_new_tokens is {config.max_new_tokens}: with the "
                f"longest draft block ({self.max_block}) + 1 it needs {need} cache positions, past the batch "
                f"cache's max_length of {self.max_length}; allowed: prompt + max_new_tokens <= "
                f"{self.max_length - self.max_block - 1}"
            )
        check_prompt_cache(prompt_cache, len(prompt))
        row = BatchRow(self._next_id, prompt, config, self)
        row.prompt_cache = prompt_cache
        self._next_id += 1
        self._waiting.append(row)
        return row.request_id

    def cancel(self, request_id: int) -> None:
        """Remove a request now (between rounds): queued, or running (its slot is freed).

        Args:
            request_id: As returned by ``add``.

        Raises:
            InvalidArgumentError: If the request already finished, was cancelled, or never existed;
                other rows are untouched.
        """
        if isinstance(request_id, bool) or not isinstance(request_id, int):
            raise InvalidArgumentError(f"request_id must be an int returned by add, got {request_id!r}")
        for row in self._waiting:
            if row.request_id == request_id:
                self._waiting.remove(row)
                self._forget(row, "cancelled")
                return
        for row in self._rows:
            if row.request_id == request_id:
                row.finish_reason = "cancelled"
                self._retire()
                return
        if request_id in self._finished:
            raise InvalidArgumentError(
                f"request {request_id} is not running: it already ended ({self._finished[request_id]})"
            )
        raise InvalidArgumentError(f"request {request_id} is unknown (ids come from add)")

    def generate(
        self, prompts: Sequence[torch.Tensor | Sequence[int]], configs: GenerationConfig | Sequence | None = None
    ) -> list[GenerationResult]:
        """Decode ``prompts`` together to the end; results in the prompts' order.

        Requests already in the engine run along; their events are not returned.

        Args:
            prompts: Each as ``add`` takes it.
            configs: One ``GenerationConfig`` for all, or one per prompt (None: the defaults).

        Returns:
            One ``GenerationResult`` per prompt (``finish_reason`` "error" for a request whose
            prefill failed or whose target logits were not finite).

        Raises:
            InvalidArgumentError: As ``add``, or a ``configs`` list of another length than
                ``prompts``. On any error this call's requests are cancelled (none stays queued).
        """
        if configs is None or isinstance(configs, GenerationConfig):
            configs = [configs] * len(prompts)
        if len(configs) != len(prompts):
            raise InvalidArgumentError(f"got {len(prompts)} prompts but {len(configs)} configs")
        ids: list[int] = []
        results: dict[int, GenerationResult] = {}
        try:
            for p, c in zip(prompts, configs):
                ids.append(self.add(p, c))
            while self.has_work:
                for event in self.step():
                    if event.result is not None:
                        results[event.request_id] = event.result
        except BaseException:
            live = {row.request_id for row in (*self._rows, *self._waiting)}
            for request_id in ids:
                if request_id in live:
                    self.cancel(request_id)
            raise
        return [results[i] for i in ids]

    def request(self, request_id: int) -> BatchRow:
        """The state of a queued or running request (``BatchRow``: its tokens, output, stats).

        Raises:
            InvalidArgumentError: If the request is neither queued nor running.
        """
        for row in (*self._rows, *self._waiting):
            if row.request_id == request_id:
                return row
        raise InvalidArgumentError(f"request {request_id!r} is neither queued nor running")

    def is_running(self, request_id: int) -> bool:
        """Whether the request is queued or running."""
        return any(row.request_id == request_id for row in (*self._rows, *self._waiting))

    def cancel_all(self) -> None:
        """Cancel every queued and running request (``cancel``)."""
        for row in [*self._waiting, *self._rows]:
            self.cancel(row.request_id)

    def _event(self, events: dict, row: BatchRow, new: list[int]) -> None:
        event = events.setdefault(row.request_id, BatchEvent(row.request_id, []))
        event.token_ids.extend(new)
        logprobs = row.logprobs_of(new)  # [processors]
        if logprobs is not None:
            event.logprobs = (event.logprobs or []) + logprobs
        if row.finish_reason is not None:
            event.finish_reason = row.finish_reason
            event.result = row.result(self.tokenizer)

    def _retire(self) -> None:
        """Finished rows leave; the last row moves into each freed slot, so slots stay 0 .. n - 1 (with the
        position a forward run ahead wrote, ``engine.overlap``, which is dropped once no row is left)."""
        rows = self._rows
        for i in range(len(rows) - 1, -1, -1):
            if rows[i].finish_reason is None:
                continue
            self._forget(rows[i], rows[i].finish_reason)
            last = len(rows) - 1
            if i != last:
                valid = len(rows[last].tokens) - 1
                self.cache.move(last, i, valid + 1)  # and the pending position, which a forward run ahead writes
                if self.drafter is not None:
                    self.drafter.move(last, i, valid)
                rows[i] = rows[last]
            rows.pop()
        self._ahead = kept(self._ahead, rows, self.stats)

    def _fail(self, events: dict, row: BatchRow, message: str) -> None:
        """End ``row`` with ``finish_reason="error"`` (it leaves at the next ``_retire``); logged."""
        logger.warning("%s", message)
        row.finish_reason = "error"
        if row not in self._rows:
            self._forget(row, "error")
        self._event(events, row, [])
        events[row.request_id].error = message

    def _forget(self, row: BatchRow, reason: str) -> None:
        row.finish_reason = reason
        self._finished[row.request_id] = reason
        while len(self._finished) > _FINISHED_MEMORY:
            self._finished.popitem(last=False)
