"""What the model-based drafters share: the draft loop over every row (``draft_batch``).

The protocol (``Drafter``, ``Draft``, ``ExitPolicy``) is defined by the engine in
``specdecode.engine.protocol`` and re-exported here.

Adaptive draft exit under ``exit_rule``: "row" ends a row's block at its own first unsure
token while the other rows go on (its later forwards are wasted on it); "batch" goes on until
every row has been unsure, and each row keeps everything it drafted: the verification is as
wide as the longest row either way, so the extra tokens cost the target nothing. Exits that read
nothing between steps (``ExitPolicy.mode`` "previous-round" or "masked") end no block here: every row
drafts its ``max_tokens`` and the draft carries each step's top probability (``Draft.top_probs``).

**Greedy steps in the runner.** On the fast path a round of greedy rows with no per-step exits, processors
or tree runs its steps after the first in the drafter's runner, with no host read and no host-side argmax
or finiteness check between them: ``BatchRunner.greedy_steps`` (one graph a step, each giving its argmax
and finiteness; the default) or, with ``fused_draft_steps``, ``BatchRunner.draft_steps`` (all steps one
compiled function, at the runner's ``fused_steps``). Both give the same tokens, counts, finiteness flag,
top probabilities and steps as the loop (bit for bit on the uncompiled static path; a compiled graph may
round the last bits differently). The greedy steps start from the first forward's greedy epilogue
(``first_greedy``, out of its graph) and, given each row's pending token, return the verification's input whole
(``Draft.block_ids``). Any other round, and an eager or llama.cpp runner, runs the loop.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdecode.drafters.draft_head import BoundDraftHead
from specdecode.engine.processors import DraftProcessing, process_draft_rows
from specdecode.engine.batch_cache import to_device
from specdecode.engine.protocol import Draft, Drafter, ExitPolicy
from specdecode.engine.sampling import (Sampler, check_finite, draw_tokens, finite_rows, greedy_tokens, safe_logits,
                                       warped_probs)
from specdecode.engine.verification import greedy_epilogue
from specdecode.errors import InvalidArgumentError

__all__ = ["Draft", "Drafter", "ExitPolicy", "draft_batch", "draft_views", "first_forward_greedy", "reads_per_step"]


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
    tree_tops=None,
    runner=None,
    fuse: bool = False,
    first_greedy: torch.Tensor | None = None,
    pending: torch.Tensor | None = None,
) -> tuple[Draft, int]:
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
        tree_tops: A ``draft_tree.TopK`` that each step's logits (those the greedy token is taken from)
            are added to, on the device (draft trees); None: nothing kept.
        runner: The ``BatchRunner`` that ``forward`` runs on: a greedy round with no per-step exits,
            processors or ``tree_tops`` runs its steps after the first in the runner (module docstring):
            ``runner.draft_steps`` with ``fuse`` where ``runner.fuses_draft_steps(n, K - 1, with top
            probabilities)``, else ``runner.greedy_steps`` where ``runner.steps_in_buckets(n)`` and no
            logit column lies past the vocabulary (or the head is truncated); a runner without buckets
            (eager), or None (a llama.cpp draft): the loop.
        fuse: Fuse the steps into one compiled function where the runner can (``fused_draft_steps``).
        first_greedy: (n, 2) long, the greedy epilogue of ``first_logits`` from the first forward's graph
            (``BatchRunner.forward_greedy``), which the greedy steps start from in place of an argmax and
            finiteness check of their own; None: computed here where needed.
        pending: (n,) long on the device, each row's pending token (fed by the first forward): with the greedy
            steps and a full head, the draft's ``block_ids`` carry it before the tokens, so that the
            verification feeds them as they are (no host-to-device copy, no ``cat``); None: no ``block_ids``.

    Returns:
        The draft, and S, the steps run (S - 1 drafted tokens were fed back).

    Raises:
        NonFiniteLogitsError: If a forward gives NaN or inf (checked on the host with per-step exits;
            otherwise the flag goes to ``Draft.finite``).
    """
    n, K = len(max_tokens), max(max_tokens)
    if K < 1:
        raise InvalidArgumentError(f"draft_batch needs some row with max_tokens >= 1, got {max_tokens}")
    greedy = all(s.greedy for s in samplers)
    per_step = reads_per_step(exits)
    kept_tops: list[torch.Tensor] | None = [] if exits is not None and not per_step else None
    deferred = not per_step  # finiteness read with the round's sync (sampling rows draw from ``safe_logits``)
    truncated = head is not None and head.ids is not None
    if greedy and deferred and K > 1 and processings is None and tree_tops is None and runner is not None:
        with_tops, vocab, head_ids = kept_tops is not None, samplers[0].vocab_size, head.ids if truncated else None
        if fuse and runner.fuses_draft_steps(n, K - 1, with_tops):
            return _fused(runner, first_logits, next_starts, max_tokens, vocab, who, head_ids, with_tops), K
        if runner.steps_in_buckets(n) and (truncated or first_logits.shape[-1] <= vocab):  # no column past it
            if first_greedy is None:  # the argmax over every column: here the vocabulary's (or the head's)
                first_greedy = greedy_epilogue(first_logits)
            pending = pending if head_ids is None else None
            tokens, finite, tops = runner.greedy_steps(first_greedy, next_starts, K - 1, head_ids, with_tops, pending)
            return Draft(tokens if pending is None else tokens[:, 1:], list(max_tokens), None, finite, who,
                         top_probs=_top_probs(first_logits, tops) if with_tops else None,
                         block_ids=tokens if pending is not None else None), K
    active = [c > 0 for c in max_tokens]
    sampled = [b for b, s in enumerate(samplers) if not s.greedy]  # warped every step, active or not, so the
    sampled_index = to_device(sampled, first_logits.device) if 0 < len(sampled) < n else None  # index is built once
    unsure = [False] * n
    num = [0] * n
    probs: list[list[torch.Tensor]] = [[] for _ in range(n)]
    q_steps: list[torch.Tensor] = []  # every row samples: each step's (n, V) q's
    tokens: list[torch.Tensor] = []
    finite = None
    logits = first_logits
    vocab = samplers[0].vocab_size
    for i in range(K):
        if deferred:
            rows_ok = finite_rows(logits)  # (n,)
            finite = rows_ok.all() if finite is None else finite & rows_ok.all()
            if not greedy:  # a sampling row draws safely; its flag is read with the round's sync
                logits = safe_logits(logits, rows_ok)
        else:
            check_finite(logits, who)
        if processings is not None and not truncated:  # [processors] each row's q on its own context
            logits = process_draft_rows(logits, processings, vocab)
        token = head.ids[greedy_tokens(logits)] if truncated else greedy_tokens(logits[:, :vocab])
        if tree_tops is not None:  # [trees] the step's top-k, kept on the device
            tree_tops.add(logits if truncated else logits[:, :vocab])
        tops = None
        if not greedy:  # [sampling] each active sampling row draws from its q by its generator (draw_tokens)
            token, tops, warped = _sampled_step(logits, token, samplers, sampled, sampled_index, active, probs,
                                                head.ids if truncated else None, exits is not None)
            if sampled_index is None:  # every row samples: the steps' q's are kept whole
                q_steps.append(warped)
        elif exits is not None:
            tops = torch.softmax(logits.float(), -1).amax(-1)
        tokens.append(token)
        if processings is not None:  # [processors]
            for b, view in enumerate(processings):
                if view is not None:
                    view.push(token[b])
        if kept_tops is not None:  # exits that read the round's tops with its one sync
            kept_tops.append(tops)
        top = tops.tolist() if per_step else None  # one host sync per draft step with per-step exits
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
    block = torch.stack(q_steps, dim=1) if q_steps else None  # (n, S, V): each row's q's, then padding
    row_probs = [block[b, : num[b]] if num[b] else None for b in range(n)] if block is not None else \
        [torch.cat(p) if p else None for p in probs]
    top_probs = torch.stack(kept_tops, dim=1).float() if kept_tops is not None else None
    return Draft(torch.stack(tokens, dim=1), num, row_probs if any(p is not None for p in row_probs) else None,
                 finite, who, top_probs=top_probs, probs_block=block), len(tokens)


def _sampled_step(logits: torch.Tensor, token: torch.Tensor, samplers: list[Sampler], sampled: list[int],
                  sampled_index: torch.Tensor | None, active: list[bool], probs: list[list[torch.Tensor]],
                  head_ids: torch.Tensor | None,
                  with_tops: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """One draft step's tokens in a round with sampling rows: the sampling rows' q warped together
    (``warped_probs``), then each active one's token drawn from its q by its generator (``draw_tokens``: rows
    sharing one in one call, a seeded row alone), written over the greedy rows' argmax ``token`` in one copy;
    where not every row samples, each drawn row's (1, V) q is appended to ``probs[b]`` (else the caller keeps
    the returned q's whole). With ``with_tops``, each row's top probability: its q's where it drew, else the
    softmax of its logits. A seeded row's draws, their order and their values are those of drawing row by row.

    Args:
        logits: (n, V') the step's logits (finite, or made safe); token: (n,) long, their argmax (greedy rows').
        samplers, sampled, sampled_index: Per row its sampler; the sampling rows; their index on the device, or
            None when every row samples.
        active: Per row, whether it drafts this step.
        probs: Per row, the q of its drawn tokens so far (appended to).
        head_ids: A truncated head's (K,) token ids, or None.
        with_tops: Whether to return the top probabilities.

    Returns:
        (n,) long, the step's tokens; (n,) float32 top probabilities or None; the sampling rows' (len(sampled), V)
        float32 q's.
    """
    warped = warped_probs([samplers[b] for b in sampled],  # (len(sampled), V)
                          logits if sampled_index is None else logits.index_select(0, sampled_index), head_ids)
    drawing = [j for j, b in enumerate(sampled) if active[b]]
    if sampled_index is not None:  # not every row samples: each row's q's are kept as views
        views = warped.split(1)
        for j in drawing:
            probs[sampled[j]].append(views[j])
    # unchecked: a q that is not a distribution (NaN) draws a token where it is NaN, which verification rejects
    drawn = draw_tokens([samplers[sampled[j]] for j in drawing], warped, drawing, check=False) if drawing else None
    everyone = len(drawing) == len(sampled) == token.shape[0]
    index = to_device([*(sampled[j] for j in drawing), *drawing], token.device) if drawing and not everyone else None
    if drawing:
        token = drawn if everyone else token.index_copy(0, index[: len(drawing)], drawn)
    if not with_tops:
        return token, None, warped
    tops = warped.amax(-1)
    if not everyone:  # rows that drew nothing: the softmax of their logits
        drawn_tops = tops.index_select(0, index[len(drawing) :]) if drawing else None
        tops = torch.softmax(logits.float(), -1).amax(-1)
        if drawn_tops is not None:
            tops = tops.index_copy(0, index[: len(drawing)], drawn_tops)
    return token, tops, warped


def first_forward_greedy(runner, n: int, width: int, samplers: list[Sampler], max_tokens: list[int],
                         exits: list[ExitPolicy | None] | None, fuse: bool) -> bool:
    """Whether a round's first forward, n rows of ``width`` tokens on ``runner`` (a ``BatchRunner``), should be
    ``runner.forward_greedy``: it runs in a bucket, and ``draft_batch`` may start the greedy steps from its
    epilogue (every row greedy, more than one token to draft, no per-step exit, the steps in the runner's
    buckets and not fused). Where the loop or the fused steps follow, the epilogue would go unread (an argmax
    over every column per position)."""
    K = max(max_tokens, default=0)
    if K < 2 or reads_per_step(exits) or not all(s.greedy for s in samplers[:n]) \
            or not runner.in_bucket(n, width) or not runner.steps_in_buckets(n):
        return False
    with_tops = exits is not None  # per-step exits are excluded above
    return not (fuse and runner.fuses_draft_steps(n, K - 1, with_tops))


def reads_per_step(exits: list[ExitPolicy | None] | None) -> bool:
    """Whether some row's exit reads each draft step's confidence on the host (``ExitPolicy.mode``)."""
    return exits is not None and any(e is not None and e.mode == "per-step" for e in exits)


def _fused(runner, first_logits: torch.Tensor, next_starts: list[int], max_tokens: list[int], vocab: int, who: str,
           head_ids: torch.Tensor | None, with_tops: bool) -> Draft:
    """``draft_batch``'s greedy round with no per-step exits, processors or tree, its K - 1 steps after the
    first token fused into one call (``BatchRunner.draft_steps``): every row drafts K = max(max_tokens) tokens
    and keeps its own ``max_tokens[b]``, as the loop does; the finiteness flag stays on the device, and so do
    the steps' top probabilities (``with_tops``: exits that read them with the round's sync)."""
    n, K = len(max_tokens), max(max_tokens)
    token = head_ids[greedy_tokens(first_logits)] if head_ids is not None else greedy_tokens(first_logits[:, :vocab])
    rest, finite, tops = runner.draft_steps(token, next_starts, K - 1, head_ids, vocab, with_tops)
    tokens = torch.cat([token.view(n, 1), rest], dim=1)
    finite = finite_rows(first_logits).all() & finite
    return Draft(tokens, list(max_tokens), None, finite, who, top_probs=_top_probs(first_logits, tops) if with_tops
                 else None)


def _top_probs(first_logits: torch.Tensor, tops: torch.Tensor) -> torch.Tensor:
    """(n, K) float32: each row's top probability of its first token, from ``first_logits`` (n, V'), then the
    steps' ``tops`` (n, K - 1); as the loop, the softmax over every column of each step's logits."""
    return torch.cat([torch.softmax(first_logits.float(), -1).amax(-1).view(-1, 1), tops], dim=1)


def draft_views(samplers: list[Sampler], sequences: list[list[int]], head: BoundDraftHead) -> list | None:
    """Per row, ``Sampler.drafting`` on its draft context (``sequences[b]``), or None when no row
    has processors that change logits or the head is truncated (its K columns are not the vocabulary)."""
    if head.ids is not None:
        return None
    views = [s.drafting(seq) if s is not None else None for s, seq in zip(samplers, sequences)]
    return views if any(v is not None for v in views) else None
