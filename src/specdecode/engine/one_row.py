"""A one-sequence ``Drafter`` run by the batched engine at B = 1 (``OneRowDrafter``).

``SpeculativeDecoder`` decodes one sequence with the batched round
(``engine.batched.BatchedSpeculativeDecoder(max_batch_size=1)``). A drafter that keeps its own
state for one sequence (a draft model with its own cache, prompt lookup, the cascade, the
llama.cpp draft, a user's ``Drafter``) runs there through this adapter: the engine's calls
(``bind``, ``join``, ``propose``, ``rollback``, ``move``) become the drafter's (``begin``,
``propose``, ``rollback``). Drafters that write into the target's cache (layer skip, early
exit) give their batch-native form instead (``Drafter.batch_drafter``).

It holds one row only: ``bind`` refuses a cache of more than one slot. The llama.cpp draft
(``models.llama_cpp``) runs one sequence in one llama.cpp context, so the batched engine runs
it with ``max_batch_size=1`` only.
"""

from __future__ import annotations

import numpy as np
import torch

from specdecode.engine.batch_cache import to_device
from specdecode.engine.protocol import BatchDraft, BatchDrafter, Drafter, ExitPolicy
from specdecode.engine.sampling import Sampler
from specdecode.errors import InvalidArgumentError


class OneRowDrafter(BatchDrafter):
    """A ``BatchDrafter`` over one slot that drives a one-sequence ``Drafter``.

    The sequence (prompt + confirmed tokens) is kept on the device and, for a drafter with
    ``uses_host_sequence``, as an int64 numpy array, both written incrementally from the
    engine's host lists (no device read).

    Args:
        drafter: The one-sequence drafter.
        reason: Why it cannot batch, for the error of ``bind`` with more than one slot (e.g.
            "llama.cpp's draft runs one sequence").

    Raises:
        InvalidArgumentError: At ``bind``, a target cache of more than one slot (the message
            names ``max_batch_size`` and ``reason``).
    """

    def __init__(self, drafter: Drafter, reason: str | None = None) -> None:
        self.drafter = drafter
        self.reason = reason or f"{type(drafter).__name__} drafts one sequence"
        self.supports_exit_policy = bool(getattr(drafter, "supports_exit_policy", False))
        self.who = getattr(drafter, "who", "draft model")
        self._target_cache = None
        self._buf: torch.Tensor | None = None  # (1, capacity) long on the model's device
        self._host: np.ndarray | None = None  # (capacity,) int64, for a drafter that matches on the host
        self._written = 0  # leading tokens of the sequence held in _buf (and _host)

    @property
    def num_forwards(self) -> int:
        """The drafter's forwards (the engine counts the difference over each round: decode phase only)."""
        return int(getattr(self.drafter, "num_forwards", 0))

    @property
    def compile_time_s(self) -> float:
        """The drafter's compile time (``Drafter.compile_time_s``)."""
        return float(getattr(self.drafter, "compile_time_s", 0.0))

    def bind(self, target_cache) -> None:
        if target_cache.num_slots > 1:
            raise InvalidArgumentError(
                f"max_batch_size is {target_cache.num_slots}, but {self.reason}: use max_batch_size=1 "
                "(or another draft backend)"
            )
        self._target_cache = target_cache
        capacity = target_cache.capacity + 1
        self._buf = torch.zeros((1, capacity), dtype=torch.long, device=target_cache.device)
        self._host = np.zeros(capacity, dtype=np.int64) if getattr(self.drafter, "uses_host_sequence", False) else None
        self._written = 0

    def warm_up(self, max_rows: int, max_block: int) -> None:
        """Nothing: a one-sequence drafter compiles on first use."""

    def join(self, slot: int, prompt_ids: torch.Tensor, sampler: Sampler) -> None:
        n = prompt_ids.shape[1]
        self._buf[:, :n] = prompt_ids
        if self._host is not None:
            self._host[:n] = prompt_ids[0].cpu().numpy()  # once per generation, before any round
        self._written = n
        self.drafter.begin(prompt_ids, sampler, self._target_cache)

    def propose(
        self,
        sequences: list[list[int]],
        max_tokens: list[int],
        exits: list[ExitPolicy | None] | None = None,
        exit_rule: str = "row",
    ) -> BatchDraft:
        seq, cap = sequences[0], max_tokens[0]
        length = len(seq)
        if length > self._written:
            new = seq[self._written :]
            # pinned and non-blocking on CUDA (batch_cache.to_device): no host sync here
            self._buf[0, self._written : length] = to_device(new, self._buf.device)
            if self._host is not None:
                self._host[self._written : length] = new
            self._written = length
        if cap <= 0:
            return BatchDraft(self._buf.new_zeros((1, 1)), [0], None, None, self.who)
        kwargs = {}
        exit_policy = exits[0] if exits is not None else None
        if exit_policy is not None:
            kwargs["exit_policy"] = exit_policy
        if self._host is not None:
            kwargs["host_sequence"] = self._host[:length]
        draft = self.drafter.propose(self._buf[:, :length], cap, **kwargs)
        k = len(draft)
        if k == 0:
            return BatchDraft(self._buf.new_zeros((1, 1)), [0], None, draft.finite, draft.who)
        tokens = draft.tokens
        if tokens.device != self._buf.device:  # a host draft (prompt lookup): no device read
            tokens = tokens.to(self._buf.device, non_blocking=True)
        probs = [draft.probs] if draft.probs is not None else None
        return BatchDraft(tokens.view(1, k), [k], probs, draft.finite, draft.who)

    def rollback(self, num_valid: list[int]) -> None:
        valid = num_valid[0]
        self._written = min(self._written, valid + 1)  # the pending token (valid + 1 - 1) may be rewritten
        self.drafter.rollback(valid)

    def move(self, src: int, dst: int, num_valid: int) -> None:
        """Never called: one slot."""
