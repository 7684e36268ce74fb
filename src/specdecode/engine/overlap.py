"""Overlapped rounds: the next autoregressive forward runs while the host reads and emits this round's.

Issue 28 item 3 lets the host's work for round n (the read, emit, stop strings, streaming) overlap round
n + 1's kernels. Without a drafter that can be done exactly: a round of plain decoding feeds each row the
token the last round chose, which is on the device before the host reads it. So once round n's forward
and its token choice are enqueued, the engine enqueues round n + 1's forward on those tokens
(``RoundAhead``), then reads round n back through a pinned buffer and a CUDA event recorded between the
two (``HostReader``), so the read waits for round n alone. While the host emits round n, the device
runs round n + 1; the next round finds its logits ready. vLLM's asynchronous scheduling overlaps its
host work the same way; gpt-fast's decode loop keeps the next token on the device for the same reason.

The forward run ahead is exactly the next round's when the rows are what it assumed: the same requests
in the same slots, each one token longer, ending in the token that was fed (checked by ``matches``).
Otherwise (a row finished at EOS or a stop string, failed, was cancelled, or a request joined) the
next round drops it and runs its own forward, and ``SpecDecodingStats.num_discarded_forwards`` counts
it. Its cache writes are those of the token it fed at the row's next position, which the next forward
writes again (``batch_cache``'s padding invariant: nothing past a row's length is read before it is
written). ``can_run_ahead`` launches only where no row can need another input: no drafter, no banned
words (whose rollback changes the sequence), no logits processors, no row at its last token, no
request waiting to join.

On a CPU the forward runs in the calling thread, so nothing overlaps: ``BatchedSpeculativeDecoder``
turns it on by default on CUDA only (``overlap_rounds``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from specdecode.engine.batch_cache import to_device
from specdecode.engine.runner_target import is_runner_target
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
        key: Per row, (request id, position the token was written at).
        fed: The fed tokens as Python ints, once the previous round's read has them.
    """

    logits: torch.Tensor
    ids: torch.Tensor
    key: list[tuple[int, int]]
    fed: list[int] | None = None

    def matches(self, rows) -> bool:
        """Whether this forward is the round's own for ``rows`` (``batch_rows.BatchRow``): the same requests
        in the same slots, each ending in the token fed, at the position it was written."""
        if self.fed is None or len(rows) != len(self.key):
            return False
        return all((row.request_id, len(row.tokens) - 1) == key and row.tokens[-1] == token
                   for row, key, token in zip(rows, self.key, self.fed))


def can_run_ahead(rows, sampled: dict, capacity: int) -> bool:
    """Whether the next round's forward can be enqueued before this round's read (the engine checks that it has
    no drafter and no waiting request): every row greedy or sampled on the device (``sampled``: row index ->
    its (2,) verdict, or an error message), none with banned words or logits processors, none at its last
    token, and room for one more position in each slot (``capacity`` positions)."""
    return all(row.banned is None and row.sampler.processors is None and row.remaining > 1
               and len(row.tokens) < capacity for row in rows) \
        and all(isinstance(v, torch.Tensor) for v in sampled.values())


def taken(ahead: RoundAhead | None, rows, width: int, stats) -> RoundAhead | None:
    """``ahead`` if it is this round's forward (no draft: ``width`` K = 0; ``RoundAhead.matches`` the rows), else
    None; an ``ahead`` not taken counts in ``stats.num_discarded_forwards``."""
    if ahead is not None and not (width == 0 and ahead.matches(rows)):
        stats.num_discarded_forwards += 1
        return None
    return ahead


def run_ahead(runner, reader: HostReader, host: torch.Tensor, logits: torch.Tensor, sampled: dict, rows,
              starts: Sequence[int]) -> tuple[RoundAhead, list[int]]:
    """Stage the round's read (``host``, (m,) long on the device), enqueue the next round's forward on the rows'
    next tokens (``next_tokens``) at ``starts`` + 1, then read: (the forward run ahead, the values read).

    Args:
        runner: The target's round runner (``batch_runner.BatchRunner``: ``runner(ids, starts, 1)``).
        reader: The engine's ``HostReader``.
        logits: (n, 1, V) the round's logits, as its verification sees them.
        sampled: Row index -> (2,) verdict of the rows sampled on the device.
        rows: The round's rows (``batch_rows.BatchRow``).
        starts: (n,) each row's position this round wrote (its length - 1).
    """
    reader.stage(host)
    ids = next_tokens(logits, sampled)
    ahead = RoundAhead(runner(ids, [s + 1 for s in starts], 1), ids,
                       [(row.request_id, s + 1) for row, s in zip(rows, starts)])
    return ahead, reader.read()


def next_tokens(logits: torch.Tensor, sampled: dict) -> torch.Tensor:
    """(n, 1) long on the device: each row's next token, the argmax of its last logits or, for a sampling row,
    its verdict's token (``verification.sample_rows``: row index -> (2,) (accepted, token)).

    Args:
        logits: (n, w, V) the round's logits, as the rows' verification sees them.
        sampled: Row index -> (2,) long verdict, for the rows sampled on the device.
    """
    out = logits[:, -1].argmax(-1)
    if sampled:
        index = to_device(list(sampled), logits.device)
        out = out.index_copy(0, index, torch.stack(list(sampled.values()))[:, 1])
    return out.view(-1, 1)


class HostReader:
    """Reads a round's values back to the host after work enqueued behind them: on CUDA a non-blocking copy
    into a pinned buffer (kept, grown when a round needs more) and an event recorded after it, so ``read``
    waits for what was enqueued before ``stage`` alone; elsewhere ``tolist()`` at ``read``.

    Args:
        device: The device the values live on.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._buffer: torch.Tensor | None = None
        self._event = None
        self._staged: torch.Tensor | None = None
        self._size = 0

    def stage(self, values: torch.Tensor) -> None:
        """Enqueue the copy of ``values``, a (m,) long tensor on ``device``, to the host."""
        if not self._cuda:
            self._staged = values
            return
        m = int(values.numel())
        if self._buffer is None or self._buffer.numel() < m:
            self._buffer = torch.empty(max(m, 2 * self._buffer.numel() if self._buffer is not None else 64),
                                       dtype=torch.long, pin_memory=True)
            self._event = torch.cuda.Event()
        self._buffer[:m].copy_(values, non_blocking=True)
        self._event.record(torch.cuda.current_stream(self.device))
        self._size = m

    def read(self) -> list[int]:
        """The staged values as Python ints (waits for the copy on CUDA: the round's one host sync)."""
        if not self._cuda:
            values, self._staged = self._staged, None
            return values.tolist()
        self._event.synchronize()
        return self._buffer[: self._size].tolist()


def fed_tokens(argmax: Sequence[int], width: int, sampled: dict) -> list[int]:
    """The tokens ``next_tokens`` fed, as the round's read gives them: row b's argmax at its last position
    (``argmax``: n * ``width`` values) or its sampled token (``sampled``: row index -> (accepted, token) or an
    error message, whose row fails)."""
    n = len(argmax) // width
    out = []
    for b in range(n):
        v = sampled.get(b)
        out.append(v[1] if isinstance(v, tuple) else -1 if isinstance(v, str) else argmax[(b + 1) * width - 1])
    return out
