"""Drafters for the batched engine (``engine.batched``): every active row drafts in one forward.

* ``BatchDraftModelDrafter``: a smaller model with its own ``BatchKVCache`` (same slots and
  capacity as the target's). Like ``DraftModelDrafter``, each row's cache lacks the tokens not
  yet fed (1, or 2 after a fully accepted block); the first forward of a round feeds them,
  rows with one token padded on the right to two (the padding lands past the row's length).
* ``BatchLayerSkipDrafter`` / ``BatchEarlyExitDrafter``: the target itself with a skip set
  (Draft & Verify; LayerSkip's early exit), writing into the target's batch cache at each
  row's next positions; the verification forward then overwrites them, so nothing is restored.
* ``BatchPromptLookupDrafter``: per-row n-gram lookup (``prompt_lookup.find_continuation``).

Adaptive draft exit under ``exit_rule``: "row" ends a row's block at its own first unsure
token while the other rows go on (its later forwards are wasted on it); "batch" goes on until
every row has been unsure, and each row keeps everything it drafted: the verification is as
wide as the longest row either way, so the extra tokens cost the target nothing.

A draft model may draft with a truncated head (FR-Spec, ``draft_head``: its forwards give K
logits, mapped back to vocabulary ids) and within a context window (``BatchDraftModelDrafter``'s
``head`` and ``context_window``).

Decode-time forwards go through a ``BatchRunner`` (``engine.batch_runner``): on the engine's
fast path (``BatchKVCache.fast``) a draft model compiles its widths 1 and 2, a layer-skip or
early-exit draft its width 1, each at every rows bucket, in graphs of its own (the layer-skip
draft's are traced in draft mode, one set per drafter, hence per skip set).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from transformers import PreTrainedModel

from specdecode.drafters.control import check_optional_count
from specdecode.drafters.draft_head import BoundDraftHead, DraftHead
from specdecode.drafters.early_exit import exit_skip_set
from specdecode.drafters.layer_skip import SkipSet, decoder_layers, draft_mode
from specdecode.drafters.prompt_lookup import PromptLookupDrafter, find_continuation
from specdecode.engine.batch_cache import (
    BatchKVCache,
    batch_prefill,
    to_device,
    warm_up_forwards,
    warm_up_widths,
)
from specdecode.engine.batch_runner import BatchRunner
from specdecode.engine.processors import DraftProcessing, process_draft_rows
from specdecode.engine.protocol import BatchDraft, BatchDrafter, ExitPolicy
from specdecode.engine.sampling import Sampler, check_finite
from specdecode.errors import InvalidArgumentError

__all__ = [
    "BatchDraftModelDrafter",
    "BatchEarlyExitDrafter",
    "BatchLayerSkipDrafter",
    "BatchPromptLookupDrafter",
    "draft_batch",
]


def draft_batch(
    forward: Callable[[torch.Tensor, list[int]], torch.Tensor],
    first_logits: torch.Tensor,
    next_starts: list[int],
    max_tokens: list[int],
    samplers: list[Sampler],
    exits: list[ExitPolicy | None] | None,
    exit_rule: str,
    who: str,
    head: BoundDraftHead | None = None,
    processings: list[DraftProcessing | None] | None = None,
) -> tuple[BatchDraft, int]:
    """The batched draft loop shared by the model drafters.

    Args:
        forward: ``forward(ids (n, 1), starts) -> (n, V)`` logits of one more token per row.
        first_logits: (n, V) logits of each row's first draft token (the caller's first forward).
        next_starts: Per row, the position the first drafted token is fed at.
        max_tokens: Per row, the most tokens to keep (>= 0); the loop runs max(max_tokens) steps
            at most.
        samplers: Per row, its ``Sampler`` (greedy rows take the argmax).
        exits: Per row, an ``ExitPolicy`` or None; None altogether: no adaptive exit.
        exit_rule: "row" or "batch" (module docstring).
        who: The drafting model, for errors.
        head: A truncated draft head (FR-Spec) whose K logits the forwards give (``head.ids[j]`` is
            column j's token); None or the full head: (n, V') logits.
        processings: Per row, the target's processors on the row's draft context
            (``Sampler.drafting``), or None (full heads only); None altogether: raw logits.

    Returns:
        The draft, and S, the steps run (S - 1 drafted tokens were fed back).

    Raises:
        NonFiniteLogitsError: If a forward gives NaN or inf (checked on the host when sampling
            or with exits; otherwise the flag goes to ``BatchDraft.finite``).
    """
    n, K = len(max_tokens), max(max_tokens)
    if K < 1:
        raise InvalidArgumentError(f"draft_batch needs some row with max_tokens >= 1, got {max_tokens}")
    greedy = all(s.greedy for s in samplers)
    deferred = greedy and exits is None
    active = [c > 0 for c in max_tokens]
    unsure = [False] * n
    num = [0] * n
    probs: list[list[torch.Tensor]] = [[] for _ in range(n)]
    tokens: list[torch.Tensor] = []
    finite = None
    logits = first_logits
    vocab = samplers[0].vocab_size
    truncated = head is not None and head.ids is not None
    for i in range(K):
        if deferred:
            ok = torch.isfinite(logits).all()
            finite = ok if finite is None else finite & ok
        else:
            check_finite(logits, who)
        if processings is not None and not truncated:  # [processors] each row's q on its own context
            logits = process_draft_rows(logits, processings, vocab)
        token = head.ids[logits.argmax(-1)] if truncated else logits[:, :vocab].argmax(-1)
        tops = None
        if not greedy:
            token, tops = token.clone(), []
            for b, sampler in enumerate(samplers):
                if sampler.greedy or not active[b]:
                    if exits is not None:
                        tops.append(torch.softmax(logits[b].float(), -1).amax())
                    continue
                q = head.probs(sampler, logits[b : b + 1]) if truncated else sampler.probs(logits[b : b + 1])
                token[b] = sampler.sample(q)[0]
                probs[b].append(q)
                if exits is not None:
                    tops.append(q.amax())
            tops = torch.stack(tops) if exits is not None else None
        elif exits is not None:
            tops = torch.softmax(logits.float(), -1).amax(-1)
        tokens.append(token)
        if processings is not None:  # [processors]
            for b, view in enumerate(processings):
                if view is not None:
                    view.push(token[b])
        top = tops.tolist() if exits is not None else None  # one host sync per draft step with exits
        for b in range(n):
            if not active[b]:
                continue
            num[b] = i + 1
            if i + 1 >= max_tokens[b]:
                active[b] = False
            elif top is not None and exits[b] is not None and exits[b].should_stop(top[b]):
                unsure[b] = True
                if exit_rule == "row":
                    active[b] = False
        if not any(active) or (exit_rule == "batch" and all(u or not a for u, a in zip(unsure, active))):
            break
        if i + 1 < K:
            logits = forward(token.view(n, 1), [s + i for s in next_starts])
    steps = len(tokens)
    row_probs = [torch.cat(p) if p else None for p in probs]
    draft = BatchDraft(
        torch.stack(tokens, dim=1),
        num,
        row_probs if any(p is not None for p in row_probs) else None,
        finite,
        who,
    )
    return draft, steps


def draft_views(samplers: list[Sampler], sequences: list[list[int]], head: BoundDraftHead) -> list | None:
    """Per row, ``Sampler.drafting`` on its draft context (``sequences[b]``), or None when no row
    has processors that change logits or the head is truncated (its K columns are not the vocabulary)."""
    if head.ids is not None:
        return None
    views = [s.drafting(seq) if s is not None else None for s, seq in zip(samplers, sequences)]
    return views if any(v is not None for v in views) else None


class BatchDraftModelDrafter(BatchDrafter):
    """A smaller model drafts for every row at once, from its own ``BatchKVCache``.

    **Draft context window** (``context_window=W``, as ``DraftModelDrafter``'s): a joining row's
    draft prefill is its prompt's last W tokens only, written at the slot's positions 0 .. W - 1;
    every token after them is kept. The row's draft positions count from the window's start (its
    ``offset``, the prompt tokens left out): rotary attention depends on the distance between
    positions only, so the draft sees the window as a prompt of W tokens. Lengths are kept in
    sequence positions; a row's draft-cache positions are ``offset`` fewer. The output is
    unchanged (the target verifies every token); acceptance may drop.

    **Truncated head** (``head=DraftHead.truncated(ids)``, FR-Spec, ``drafters.draft_head``): every
    forward of the draft model (prefills and warm-up included, so that the fast path's graphs are
    traced with it) computes the K rows of its LM head only; the draft proposes among those K
    tokens, its q is zero outside them (exact under sampling, as for ``DraftModelDrafter``).

    Args:
        model: The draft model (vocabulary mapped like the target's; eager or SDPA attention).
        context_window: W >= 1, or None: the whole prompt.
        head: Which LM-head rows drafting computes (``DraftHead.full()`` when None).

    Raises:
        InvalidArgumentError: ``context_window`` not None or an integer >= 1; a truncated head's id
            past the model's head rows, or (at ``join``) past the target's vocabulary.
        UnsupportedModelError: At ``bind``, if the model's attention cannot take batch masks; a
            truncated head the model's forward does not apply.
    """

    supports_exit_policy = True
    who = "draft model"

    def __init__(self, model: PreTrainedModel, context_window: int | None = None,
                 head: DraftHead | None = None) -> None:
        self.context_window = check_optional_count("context_window", context_window, "the whole prompt")
        self.model = model
        self.head = (head or DraftHead.full()).bind(model)
        self.cache: BatchKVCache | None = None
        self.runner: BatchRunner | None = None
        self._num_cached: list[int] = []  # per slot, in sequence positions
        self._offsets: list[int] = []  # per slot, the prompt positions the context window left out
        self._samplers: list[Sampler | None] = []

    def bind(self, target_cache: BatchKVCache) -> None:
        self.cache = BatchKVCache(
            self.model,
            target_cache.num_slots,
            target_cache.capacity,
            prefill_chunk_tokens=target_cache.prefill_chunk_tokens,
            prefill_pad_multiple=target_cache.prefill_pad_multiple,
            fast=target_cache.fast,
        )
        self.runner = BatchRunner(self.model, self.cache, (1, 2), self.who)
        self._num_cached = [0] * target_cache.num_slots
        self._offsets = [0] * target_cache.num_slots
        self._samplers = [None] * target_cache.num_slots
        self.num_forwards = 0

    @property
    def compile_time_s(self) -> float:
        """Seconds its runner spent compiling buckets."""
        return self.runner.compile_time_s if self.runner is not None else 0.0

    def warm_up(self, max_rows: int, max_block: int) -> None:
        with self.head.applied():
            warm_up_forwards(self.model, self.cache, *warm_up_widths(self.cache, max_rows, max_block))
            if self.cache.fast is not None:
                self.runner.warm_up()

    @torch.inference_mode()
    def join(self, slot: int, prompt_ids: torch.Tensor, sampler: Sampler) -> None:
        self.head.check_vocab(sampler.vocab_size)
        n, window = prompt_ids.shape[1], self.context_window
        self._offsets[slot] = max(0, n - window) if window is not None else 0
        with self.head.applied():
            batch_prefill(self.model, self.cache, prompt_ids[:, self._offsets[slot]:], slot)
        self._num_cached[slot] = n
        self._samplers[slot] = sampler
        self.num_forwards += 1

    @torch.inference_mode()
    def propose(self, sequences, max_tokens, exits=None, exit_rule="row") -> BatchDraft:
        """Draft for every row; the first forward feeds each row's tokens not yet in the draft cache.

        The rows' feeds are aligned on the right: a row with fewer new tokens than the widest
        re-feeds some it already holds (same keys, rewritten in place), so every row's write ends
        at its sequence length and none pads past it. Only a sequence shorter than the width pads
        on the right (within the longest sequence's positions).
        """
        with self.head.applied():
            return self._propose(sequences, max_tokens, exits, exit_rule)

    def _propose(self, sequences, max_tokens, exits, exit_rule) -> BatchDraft:
        n = len(sequences)
        lengths = [len(s) for s in sequences]
        offsets = self._offsets[:n]
        width = max(length - cached for length, cached in zip(lengths, self._num_cached[:n]))
        starts = [max(length - width, offset) for length, offset in zip(lengths, offsets)]
        feeds = [s[start:] for s, start in zip(sequences, starts)]
        ids = to_device([f + f[-1:] * (width - len(f)) for f in feeds], self.cache.device)
        logits = self.runner(ids, [s - o for s, o in zip(starts, offsets)], width)
        self.head.check_logits(logits)
        if all(len(f) == width for f in feeds):
            first = logits[:, -1]
        else:
            last = to_device([len(f) - 1 for f in feeds], logits.device)
            first = logits[torch.arange(n, device=logits.device), last]

        def forward(token: torch.Tensor, at: list[int]) -> torch.Tensor:
            return self.runner(token, at, 1)[:, -1]

        at = [length - o for length, o in zip(lengths, offsets)]
        views = draft_views(self._samplers[:n], sequences, self.head)  # [processors]
        draft, steps = draft_batch(forward, first, at, max_tokens, self._samplers[:n], exits, exit_rule, self.who,
                                   self.head, views)
        self.num_forwards += steps
        for b in range(n):
            self._num_cached[b] = lengths[b] + min(draft.num_tokens[b], steps - 1)
        return draft

    def rollback(self, num_valid: list[int]) -> None:
        for b, valid in enumerate(num_valid):
            self._num_cached[b] = min(self._num_cached[b], valid)

    def move(self, src: int, dst: int, num_valid: int) -> None:
        self.cache.move(src, dst, min(self._num_cached[src], num_valid) - self._offsets[src])
        self._num_cached[dst] = min(self._num_cached[src], num_valid)
        self._offsets[dst] = self._offsets[src]
        self._samplers[dst] = self._samplers[src]
        self._samplers[src] = None


class BatchLayerSkipDrafter(BatchDrafter):
    """The target itself, some sublayers skipped, drafts for every row (Draft & Verify, batched).

    It writes into the target's batch cache at each row's next positions; the target's
    verification overwrites them, and skipped sublayers need no placeholders (each row's
    positions are given to every layer).

    Args:
        model: The target model.
        skip_set: Sublayers skipped while drafting.

    Raises:
        InvalidArgumentError: If a skip-set index is out of range, or at ``bind`` if the cache
            belongs to another model.
    """

    supports_exit_policy = True
    who = "layer-skip draft"

    def __init__(self, model: PreTrainedModel, skip_set: SkipSet) -> None:
        skip_set.check(len(decoder_layers(model)))
        self.model = model
        self.skip_set = skip_set
        self.cache: BatchKVCache | None = None
        self.runner: BatchRunner | None = None
        self._samplers: list[Sampler | None] = []

    def bind(self, target_cache: BatchKVCache) -> None:
        if target_cache.owner is not self.model:
            raise InvalidArgumentError(
                f"the {self.who}er must wrap the batched decoder's own target model: its cache belongs to another model"
            )
        self.cache = target_cache
        key = ("layer-skip runner", self.skip_set)  # another drafter of the skip set reuses its graphs
        self.runner = target_cache.shared.get(key) or BatchRunner(self.model, target_cache, (1,), self.who)
        target_cache.shared[key] = self.runner
        self._samplers = [None] * target_cache.num_slots
        self.num_forwards = 0

    @property
    def compile_time_s(self) -> float:
        """Seconds its runner spent compiling buckets (graphs of the model in draft mode)."""
        return self.runner.compile_time_s if self.runner is not None else 0.0

    def warm_up(self, max_rows: int, max_block: int) -> None:
        """On the fast path, every bucket of the draft-mode graphs once (the eager widths are the target's)."""
        if self.cache.fast is not None:
            with draft_mode(self.model, self.skip_set):
                self.runner.warm_up()

    def join(self, slot: int, prompt_ids: torch.Tensor, sampler: Sampler) -> None:
        self._samplers[slot] = sampler

    @torch.inference_mode()
    def propose(self, sequences, max_tokens, exits=None, exit_rule="row") -> BatchDraft:
        n = len(sequences)
        pending = to_device([s[-1:] for s in sequences], self.cache.device)
        starts = [len(s) - 1 for s in sequences]  # the target cache holds len - 1 positions of each row

        def forward(token: torch.Tensor, at: list[int]) -> torch.Tensor:
            return self.runner(token, at, 1)[:, -1]

        with draft_mode(self.model, self.skip_set):
            first = forward(pending, starts)
            draft, steps = draft_batch(
                forward, first, [s + 1 for s in starts], max_tokens, self._samplers[:n], exits, exit_rule, self.who
            )
        self.num_forwards += steps
        return draft

    def rollback(self, num_valid: list[int]) -> None:
        """Nothing to do: the engine keeps the target rows' lengths."""

    def move(self, src: int, dst: int, num_valid: int) -> None:
        self._samplers[dst] = self._samplers[src]
        self._samplers[src] = None


class BatchEarlyExitDrafter(BatchLayerSkipDrafter):
    """The target's first ``exit_layer`` layers, final norm and LM head draft for every row (LayerSkip).

    Raises:
        InvalidArgumentError: If ``exit_layer`` is outside 1..L-1.
    """

    who = "early-exit draft"

    def __init__(self, model: PreTrainedModel, exit_layer: int) -> None:
        super().__init__(model, exit_skip_set(exit_layer, len(decoder_layers(model))))
        self.exit_layer = exit_layer


class BatchPromptLookupDrafter(BatchDrafter):
    """Per-row prompt lookup: each row copies what followed its last n-gram's latest earlier match.

    Args:
        max_ngram, min_ngram: As ``PromptLookupDrafter``.

    Raises:
        InvalidArgumentError: Unless 1 <= min_ngram <= max_ngram.
    """

    who = "prompt lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        checked = PromptLookupDrafter(max_ngram, min_ngram)
        self.max_ngram, self.min_ngram = checked.max_ngram, checked.min_ngram
        self._device = None

    def bind(self, target_cache: BatchKVCache) -> None:
        self._device = target_cache.device
        self.num_forwards = 0

    def join(self, slot: int, prompt_ids: torch.Tensor, sampler: Sampler) -> None:
        """Nothing to keep: the sequence is passed to every ``propose``."""

    def propose(self, sequences, max_tokens, exits=None, exit_rule="row") -> BatchDraft:
        found = [
            # numpy on the host, as the single decoder's prompt lookup: no torch op, no host sync
            find_continuation(np.asarray(s, dtype=np.int64), cap, self.max_ngram, self.min_ngram).tolist()
            if cap > 0
            else []
            for s, cap in zip(sequences, max_tokens)
        ]
        width = max(1, max(len(f) for f in found))
        ids = to_device([f + [0] * (width - len(f)) for f in found], self._device)
        return BatchDraft(ids, [len(f) for f in found], None, None, self.who)

    def rollback(self, num_valid: list[int]) -> None:
        """Nothing to do: no state."""

    def move(self, src: int, dst: int, num_valid: int) -> None:
        """Nothing to do: no state."""
