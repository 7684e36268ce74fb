"""Overlapped rounds: the next autoregressive forward runs while the host reads and emits this round's.

Issue 28 item 3 lets the host's work for round n (the read, emit, stop strings, streaming) overlap round n + 1's
kernels. Without a drafter that can be done without changing what is decoded: a round of plain decoding feeds
each row the token the last round chose, which is on the device before the host reads it. So once round n's
forward and its token choice are enqueued, the engine enqueues round n + 1's forward on those tokens
(``RoundAhead``), then reads round n back through a pinned buffer and a CUDA event recorded between the two
(``HostReader``), so the read waits for round n alone. While the host emits round n, the device runs round
n + 1; the next round finds its logits ready. vLLM's asynchronous scheduling overlaps its host work the same
way; gpt-fast's decode loop keeps the next token on the device for the same reason.

The forward run ahead serves the next round's rows that are in it: the same request, one token longer,
ending in the token that was fed (``RoundAhead.order``; the fed tokens are read back with the round). Rows
that left (EOS, a stop string, a failure, a cancel) are simply not taken; a row that moved into a freed
slot is taken from its old index, and ``BatchRequests._retire`` moves the position the forward wrote with
it. A row that is not in it (a request joined, a sequence changed) makes the next round drop it and run its
own forward, and ``SpecDecodingStats.num_discarded_forwards`` counts it, as it counts one that no row is left
to use. A dropped forward's cache writes are those of the token it fed at each row's next position, which
the next forward writes again (``batch_cache``'s padding invariant: nothing past a row's length is read
before it is written). ``can_run_ahead`` launches only where no row can need another input: no drafter, no
banned words (whose rollback changes the sequence), no logits processors, some row with more than its last
token to go; and the engine launches only where no waiting request can join at the next step (none waits, or
every slot is taken and no row is at its last token). A request added between steps joins, and the forward
is dropped.

A row's logits after others left come from a forward over the rows as they were (another row count, maybe
another rows bucket): the same values in float32, and in bf16 within the batch-shape dependence that
batching has anyway (a greedy tie may break the other way).

On a CPU the forward runs in the calling thread, so nothing overlaps: ``BatchedSpeculativeDecoder``
turns it on by default on CUDA only (``overlap_rounds``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from specdecode.engine.batch_cache import to_device
from specdecode.engine.runner_target import is_runner_target
from specdecode.engine.verification import SampledRows
from specdecode.errors import InvalidArgumentError


def engine_overlap_rounds(value: bool | None, target) -> bool:
    """The engine's ``overlap_rounds``: ``value``, or for None whether the target runs on CUDA (on a CPU the
    forward runs in the calling thread: nothing would overlap).

    Raises:
        InvalidArgumentError: ``value`` not True, False or None; True with a target run outside torch
            (llama.cpp, ``engine.runner_target``: its forwards are synchronous and its cache is its own).
    """
    if value is not None and not isinstance(value, bool):
        raise InvalidArgumentError(f"overlap_rounds must be True, False or None (the device default), got {value!r}")
    if is_runner_target(target):
        if value:
            raise InvalidArgumentError(f"overlap_rounds=True overlaps torch forwards with the host's work, but the "
                                       f"{target.name} runs in llama.cpp: use None or False")
        return False
    return target.device.type == "cuda" if value is None else value


@dataclasses.dataclass
class RoundAhead:
    """A target forward enqueued before the previous round's read.

    Attributes:
        logits: (n, 1, V) its logits (the runner's, safe to keep).
        ids: (n, 1) long, the tokens it fed, on the device.
        greedy: (n, 1, 2) long, its greedy epilogue (``verification.greedy_epilogue``).
        key: Per row, (request id, position the token was written at, the token), the token read back with
            the previous round's read.
    """

    logits: torch.Tensor
    ids: torch.Tensor
    greedy: torch.Tensor
    key: list[tuple[int, int, int]]

    def order(self, rows) -> list[int] | None:
        """For each of ``rows`` (``batch_rows.BatchRow``), the index of its row in this forward, or None if one
        of them is not there: a row is there when its request, its pending position (its length - 1) and its
        pending token are those fed. Rows that left are simply not asked for; a row that moved slot is found
        at its old index (``BatchRequests._retire`` moves the position this forward wrote with it)."""
        where = {key: j for j, key in enumerate(self.key)}
        out = [where.get((row.request_id, len(row.tokens) - 1, row.tokens[-1])) for row in rows]
        return None if None in out else out


def taken(ahead: RoundAhead | None, rows, width: int, stats) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The round's (ids (n, 1), logits (n, 1, V), greedy (n, 1, 2)) from the forward run ahead, rows in ``rows``'
    order, or None:
    none was run, or the round drafts (``width`` K > 0), or a row is not in it (``RoundAhead.order``: it
    joined, or its sequence changed), in which case it counts in ``stats.num_discarded_forwards``."""
    if ahead is None:
        return None
    order = ahead.order(rows) if width == 0 else None
    if order is None:
        stats.num_discarded_forwards += 1
        return None
    if order == list(range(len(order))):  # the same rows, or the first ones: views
        return ahead.ids[: len(order)], ahead.logits[: len(order)], ahead.greedy[: len(order)]
    index = to_device(order, ahead.logits.device)
    return tuple(x.index_select(0, index) for x in (ahead.ids, ahead.logits, ahead.greedy))


def kept(ahead: RoundAhead | None, rows, stats) -> RoundAhead | None:
    """``ahead`` while rows are left to use it; with none left it is dropped and counted
    (``stats.num_discarded_forwards``)."""
    if ahead is not None and not rows:
        stats.num_discarded_forwards += 1
        return None
    return ahead


def can_run_ahead(rows, sampled: SampledRows, capacity: int, joinable: bool = False) -> bool:
    """Whether the next round's forward can be enqueued before this round's read (the engine also checks that it
    has no drafter, and that no request can join at the next step but where a row leaves).

    Args:
        rows: The round's rows (``batch_rows.BatchRow``): each must be greedy or sampled on the device, with no
            banned words (a rollback changes the sequence) or logits processors, and with a position left in its
            slot; and some row must have more than its last token to go (one at its last token leaves, and
            the others use the forward).
        sampled: The rows sampled on the device (``verification.SampledRows``); where a row's sampling raised,
            that row fails: nothing runs ahead.
        capacity: Positions per slot.
        joinable: Requests wait for a slot: then no row may be at its last token, since a row that leaves lets
            one join, which drops the forward.
    """
    ends = [row.remaining <= 1 for row in rows]
    return all(row.banned is None and row.sampler.processors is None and len(row.tokens) < capacity for row in rows) \
        and (not any(ends) if joinable else not all(ends)) \
        and not sampled.errors


def run_ahead(runner, reader: HostReader, host: torch.Tensor, choice: torch.Tensor, sampled: SampledRows, rows,
              starts: Sequence[int]) -> tuple[RoundAhead, list[int]]:
    """Enqueue the next round's forward on the rows' next tokens, then read this round back.

    The next tokens (``next_tokens``) are read with the round, so the host knows what was fed.

    Args:
        runner: The target's round runner (``batch_runner.BatchRunner``: ``runner.forward_greedy(ids, starts, 1)``).
        reader: The engine's ``HostReader``.
        host: (m,) long on the device, what the round reads back.
        choice: (n, 1) long, the argmax of the round's logits as its verification sees them.
        sampled: The rows sampled on the device and their verdicts (``verification.SampledRows``).
        rows: The round's rows (``batch_rows.BatchRow``).
        starts: (n,) each row's position this round wrote (its length - 1).

    Returns:
        (the forward run ahead, the m values of ``host`` as Python ints).
    """
    ids = next_tokens(choice, sampled)
    reader.stage(torch.cat([host, ids.flatten()]))
    out, greedy = runner.forward_greedy(ids, [s + 1 for s in starts], 1)
    values = reader.read()
    n = len(rows)
    key = [(row.request_id, s + 1, token) for row, s, token in zip(rows, starts, values[-n:])]
    return RoundAhead(out, ids, greedy, key), values[:-n]


def next_tokens(choice: torch.Tensor, sampled: SampledRows | None) -> torch.Tensor:
    """(n, 1) long on the device: each row's next token, the argmax of its last logits or, for a sampling row,
    its verdict's token.

    Args:
        choice: (n, w) long, the argmax of the round's logits as the rows' verification sees them.
        sampled: The rows sampled on the device and their verdicts (accepted, token), or None
            (``verification.SampledRows``).
    """
    out = choice[:, -1]
    if sampled is not None and sampled.rows:
        # -1: a row whose distribution was not one (``sampling.race``); it fails at the read, its run ahead is dropped
        out = out.index_copy(0, to_device(sampled.rows, choice.device), sampled.tokens().clamp_min(0))
    return out.reshape(-1, 1)


class HostReader:
    """Reads a round's values back to the host after work enqueued behind them: on CUDA a non-blocking copy
    into a pinned buffer (kept, grown when a round needs more) and an event recorded after it on the stream
    of the values' device, so ``read`` waits for what was enqueued before ``stage`` alone; elsewhere
    ``tolist()`` at ``read``.

    Args:
        device: The device the values live on (the target's).
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._buffer: torch.Tensor | None = None
        self._event = None
        self._staged: torch.Tensor | None = None
        self._size = 0

    def stage(self, values: torch.Tensor) -> None:
        """Enqueue the copy of ``values``, a (m,) long tensor, to the host."""
        if values.device.type != "cuda":
            self._staged = values
            return
        m = int(values.numel())
        if self._buffer is None or self._buffer.numel() < m:
            self._buffer = torch.empty(max(m, 2 * self._buffer.numel() if self._buffer is not None else 64),
                                       dtype=torch.long, pin_memory=True)
        self._buffer[:m].copy_(values, non_blocking=True)
        if self._event is None:  # made once; it lives on the device of the stream it is first recorded on
            self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(values.device))
        self._staged, self._size = None, m

    def read(self) -> list[int]:
        """The staged values as Python ints (on CUDA it waits for the copy: the round's one host sync)."""
        if self._staged is not None:
            values, self._staged = self._staged, None
            return values.tolist()
        self._event.synchronize()
        return self._buffer[: self._size].tolist()
