"""An adaptive draft exit that reads nothing between draft steps (``ExitPolicy.mode`` not "per-step").

Draft & Verify's exit (Zhang et al. 2023, Sec. 3.3) stops drafting after the first token whose draft top
probability is below a threshold: read as written, the host reads every draft step's probability before
it launches the next step, one host sync per drafted token. On CUDA that read stalls the queue of graphs
(issue 28: nothing is read back between draft steps). Two modes keep a round's steps on the device (a
sampling row draws from safe logits, its finiteness flag read with the round's sync); the draft carries each
step's top probability (``Draft.top_probs``), and the engine reads where each row's first unsure token is
(``exit_points``) with the round's one sync. A sampling row's block is cut on the device before that sync
(``exit_blocks``, what ``observe_exits`` keeps once the points are read) and sampled with the round's other rows
(``verification.rejection_sample_rows``' ``cut``; the row draws the uniforms of every token it drafted, so a seeded
row's draws differ from "per-step"'s, its law does not). On the fast path their steps run as one graph where the
round drafts the engine's longest block (``BatchRunner.draft_steps``):

* **"masked"**: every row drafts its cap (the exit's ``max_draft_tokens``); its block is cut after its
  first unsure token (``observe_exits``), as the per-step exit would have cut it: the tokens past it were
  drafted and verified (the verification's width is its compiled bucket on the fast path) but are not
  kept. The same blocks as "per-step" (but for a cascade under ``exit_rule="batch"`` with several rows,
  whose end is counted over whole blocks here, n-gram tokens included, and over the model parts there),
  at the price of the draft steps past each exit.
* **"previous-round"**: a row drafts ``next_length`` tokens, as many as the previous round's block held up
  to its first unsure token (two more than it drafted where none was unsure), and keeps them all: no step
  is wasted past an exit, but the length lags the text by a round. (Cutting these blocks at their first
  unsure token as well, drafting one token past the previous exit, measured slower: 0.78x "per-step"
  against 0.86x on HumanEval 0-9, τ 4.20 against 4.41.)

The threshold learns from each block as under "per-step": ``AdaptiveDraftExit.update`` is told whether an
unsure token came before the block's last (``observe``).

Measured (2-core Xeon with AMX, bf16 Qwen2.5-Coder 1.5B target and 0.5B draft, 64 tokens;
``docs/benchmarks/2026-11-27-draft-exit-modes.md``): on a CPU a read costs no wait, so "per-step" is the
fastest (HumanEval 0-9: 7.10 tok/s, "previous-round" 6.11, "masked" 4.44) and the default everywhere;
the read-free modes are for CUDA, where they win only if a read stalls the GPU for more than about
0.4 ms ("previous-round") or 1.4 ms ("masked") per draft step: not measured yet
(``docs/benchmarks/gpu_engine.py`` has a row for each).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdecode.engine.batch_cache import to_device
from specdecode.engine.protocol import ExitPolicy


def exit_points(top_probs: torch.Tensor, exits: Sequence[ExitPolicy | None]) -> torch.Tensor:
    """Per row, the 1-based position of its first token whose top probability is below its exit's threshold.

    Args:
        top_probs: (n, K) float32, ``Draft.top_probs``.
        exits: Per row, its exit (its ``threshold``), or None (that row never exits).

    Returns:
        (n,) long on ``top_probs``' device; K + 1 where no position is below the threshold. Compared in
        float64, as the per-step exit compares a Python float with the threshold.
    """
    n, width = top_probs.shape
    thresholds = to_device([[e.threshold if e is not None else -1.0] for e in exits], top_probs.device, torch.float64)
    unsure = top_probs.double() < thresholds  # (n, K)
    first = unsure.long().argmax(dim=1) + 1  # argmax gives the first of equal values
    return torch.where(unsure.any(dim=1), first, torch.full_like(first, width + 1))


def exit_blocks(points: torch.Tensor, exits: Sequence[ExitPolicy | None], num_drafted: Sequence[int],
                exit_rule: str) -> torch.Tensor:
    """On the device, before the round's sync: per row, the tokens of its block that ``observe_exits`` will keep, so
    that its speculative sampling runs with the round's other rows and is read with their one sync.

    Args:
        points: (n,) long, ``exit_points`` (on the device).
        exits, num_drafted, exit_rule: As ``observe_exits``'s.

    Returns:
        (n,) long on ``points``' device: k_b, or less for a "masked" row cut at its exit point (under "batch", the
        latest of the rows' ends), as ``observe_exits`` returns once the points are read.
    """
    n, device = len(exits), points.device
    host = [*num_drafted, *(int(e is not None and k > 0) for e, k in zip(exits, num_drafted)),
            *(int(e is not None and k > 0 and e.mode == "masked") for e, k in zip(exits, num_drafted))]
    k, has_exit, masked = to_device(host, device).split(n)  # one host-to-device copy
    ends = torch.where(has_exit.bool() & (points <= k), points, k)  # a row's end: its exit point, or k_b
    cut = ends if exit_rule == "row" else ends.max().expand(n)
    return torch.where(masked.bool(), torch.minimum(k, cut), k)


def observe_exits(exits: Sequence[ExitPolicy | None], num_drafted: Sequence[int], points: Sequence[int],
                  exit_rule: str) -> list[int]:
    """After the round's sync: tell each row's exit where its block's first unsure token was
    (``AdaptiveDraftExit.observe``) and return, per row, how many of its ``num_drafted`` tokens to keep.

    Args:
        exits: Per row, its exit or None.
        num_drafted: Per row, the tokens its block holds (k_b).
        points: Per row, ``exit_points`` read back (> k_b: none of its tokens was unsure).
        exit_rule: "row": a "masked" row keeps up to its own exit point; "batch": every row keeps up to where
            the per-step loop would have stopped, the latest of the rows' ends (a row's end: its exit point,
            or k_b where it had none).

    Returns:
        Per row, k_b, or less for a "masked" row cut at its exit point.
    """
    seen = [p if e is not None and k and p <= k else None for e, k, p in zip(exits, num_drafted, points)]
    end = max(p if p is not None else k for p, k in zip(seen, num_drafted))
    kept = []
    for e, k, point in zip(exits, num_drafted, seen):
        if e is None or not k:
            kept.append(k)
            continue
        e.observe(point, k)
        cut = (point if point is not None else k) if exit_rule == "row" else end
        kept.append(min(k, cut) if e.mode == "masked" else k)
    return kept
