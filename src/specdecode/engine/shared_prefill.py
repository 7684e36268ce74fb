"""Shared prefills: the prompts of rows that join together, in a few forwards rather than one each.

On CUDA an eager forward of a 1.5B model costs about 20-27 ms however few tokens it takes: the host
launching its kernels, not the GPU. The batched engine admits up to ``max_batch_size`` requests in one
step, and prefilling each alone (``batch_cache.batch_prefill``) cost 32 eager forwards at B = 32: on an
H200 (``docs/benchmarks/2026-11-27-gpu-h200.md``) a group of 32 code prompts took 1.49 s, of which its
127 decoding rounds took 0.61 s (the rest, by inference, its 32 prefills at about 27 ms each). Here the
k rows admitted together (slots ``lo .. lo + k - 1``) take:

1. each row's whole leading chunks alone (a prompt longer than ``prefill_chunk_tokens``; rare);
2. ONE forward over the rest of every row's prompt but its last token (at most one chunk each), padded
   on the right to a multiple of ``prefill_pad_multiple``; no logits kept;
3. ONE forward of each row's last prompt token (width 1): the (k, V) logits its first token is chosen from.

So 2 eager forwards for the group, whatever k, beside the leading chunks (and one more wherever the
widest chunk would not fit the cache from some row's position: ``prefill_bodies``). Correctness is ``batch_cache``'s: padding lands past a
row's length, where its next forward writes before any query reads (step 3 writes the first padded
position of step 2; decoding the rest), and each row's positions and mask are its own, so its keys and
logits are those of its prompt alone up to the rounding of a different matmul shape (exact tokens in
float32 in the tests). A CPU forward costs about its tokens, so sharing saves nothing there and the
padding costs: on by default on CUDA only (``shared_prefill_default``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from specdecode.engine.batch_cache import BatchKVCache, batch_forward, padded_width, to_device
from specdecode.engine.runner_target import is_runner_target
from specdecode.errors import InvalidArgumentError

logger = logging.getLogger(__name__)


def shared_prefill_default(device: torch.device | str) -> bool:
    """Whether rows admitted together share their prefill forwards by default: on CUDA only (module docstring)."""
    return torch.device(device).type == "cuda"


def check_shared_prefill(value: bool | None, device: torch.device | str) -> bool:
    """``value``, or the device's default for None.

    Raises:
        InvalidArgumentError: If ``value`` is not True, False or None.
    """
    if value is None:
        return shared_prefill_default(device)
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"shared_prefill must be True, False or None (the device default), got {value!r}")
    return value


def engine_shared_prefill(value: bool | None, target, drafter) -> bool:
    """The batched engine's setting (``BatchedSpeculativeDecoder(shared_prefill=...)``): ``value`` or the
    device's default, never with a target run outside torch; a draft model drafter (its ``shared_prefill``
    attribute) is set to it, so its deferred prompt prefills follow the engine.

    Raises:
        InvalidArgumentError: A ``value`` other than True, False or None; True with a llama.cpp target.
    """
    outside = is_runner_target(target)
    if value is True and outside:
        raise InvalidArgumentError(f"shared_prefill=True shares torch forwards, but the {target.name} runs in "
                                   "llama.cpp (one sequence): use shared_prefill=None or False")
    shared = check_shared_prefill(value, "cpu" if outside else target.device) and not outside
    if hasattr(drafter, "shared_prefill"):
        drafter.shared_prefill = shared
    return shared


def prefill_bodies(model: PreTrainedModel, cache: BatchKVCache, bodies: Sequence[Sequence[int]], lo: int,
                   starts: Sequence[int]) -> None:
    """Write row i's tokens ``bodies[i]`` at positions ``starts[i] ..`` of slot ``lo + i``, the rows' last
    (or only) chunks in one shared forward (steps 1-2 of the module docstring). Where the group's widest
    chunk would write past the capacity from some row's position (a row deep into its prompt beside one
    with a long chunk), the rows are cut, in slot order, into runs that fit, one forward each.

    Args:
        model: The model ``cache`` belongs to.
        cache: Its batch cache.
        bodies: Per row, the token ids to write (an empty one writes nothing of its own: its row is fed
            padding at ``starts[i]``, which its next forward overwrites).
        lo: The first row's slot; the rows take slots ``lo .. lo + len(bodies) - 1``.
        starts: Per row, the position its first token goes to (its cached length).

    Raises:
        InvalidArgumentError: As ``BatchKVCache.prepare``: a row whose own tokens do not fit its slot.
    """
    chunk = cache.prefill_chunk_tokens
    tails, at = [], []
    for i, (body, start) in enumerate(zip(bodies, starts)):
        lead = (len(body) - 1) // chunk * chunk if body else 0  # whole chunks before the last one
        if lead:
            ids = torch.tensor([list(body[:lead])], dtype=torch.long, device=model.device)
            for a in range(0, lead, chunk):  # alone, at the row's own positions (no logits needed)
                batch_forward(model, cache, ids[:, a:a + chunk], lo + i, [start + a], 1)
        tails.append(list(body[lead:]))
        at.append(start + lead)
    first = 0
    for i in range(1, len(tails) + 1):  # runs of rows whose widest chunk fits from every row's position
        if i == len(tails) or _width(cache, tails[first:i + 1], at[first:i + 1]) is None:
            _shared_forward(model, cache, tails[first:i], lo + first, at[first:i])
            first = i


def _width(cache: BatchKVCache, tails: Sequence[list[int]], at: Sequence[int]) -> int | None:
    """The padded width of one forward over ``tails`` written at ``at`` (0: nothing to write), or None where
    it would write past the capacity."""
    real = max(len(t) for t in tails)
    width = padded_width(cache, real, max(at))
    return width if real == 0 or max(at) + width <= cache.capacity else None


def _shared_forward(model: PreTrainedModel, cache: BatchKVCache, tails: Sequence[list[int]], lo: int,
                    at: Sequence[int]) -> None:
    """One forward writing row i's ``tails[i]`` at ``at[i] ..`` of slot ``lo + i``, padded on the right (with
    the row's last token) to ``_width``; a lone row that does not fit raises as ``BatchKVCache.prepare``."""
    width = _width(cache, tails, at)
    if width == 0:
        return
    if width is None:
        width = max(len(t) for t in tails)
    pad = [t[-1] if t else 0 for t in tails]
    ids = to_device([t + [p] * (width - len(t)) for t, p in zip(tails, pad)], model.device)
    batch_forward(model, cache, ids, lo, at, 1)


def prefill_rows(model: PreTrainedModel, cache: BatchKVCache, prompts: Sequence[Sequence[int]], lo: int,
                 starts: Sequence[int]) -> torch.Tensor:
    """Prefill k rows admitted together (the module docstring's three steps) and return their last logits.

    Args:
        model: The model ``cache`` belongs to.
        cache: Its batch cache.
        prompts: Per row, its prompt's token ids (at least one each).
        lo: The first row's slot (rows in ``lo .. lo + k - 1``).
        starts: Per row, positions already holding its prompt (a prompt cache, ``BatchKVCache.load_prefix``;
            0 .. len - 1).

    Returns:
        (k, V) logits at each row's last prompt token.

    Raises:
        InvalidArgumentError: As ``prefill_bodies``, or an empty prompt or a start outside 0 .. len - 1.
    """
    for prompt, start in zip(prompts, starts):
        if not 0 <= start < len(prompt):
            raise InvalidArgumentError(f"a prompt of {len(prompt)} tokens must start in 0..{len(prompt) - 1}, "
                                       f"got start {start}")
    prefill_bodies(model, cache, [p[s:-1] for p, s in zip(prompts, starts)], lo, starts)
    last = to_device([[p[-1]] for p in prompts], model.device)
    return batch_forward(model, cache, last, lo, [len(p) - 1 for p in prompts], 1)[:, 0]


def admit_shared(model: PreTrainedModel, cache: BatchKVCache, rows: Sequence, lo: int) -> dict[int, tuple]:
    """The batched engine's shared prefill of the requests it admits in one step (``prefill_rows``).

    Args:
        model: The target model.
        cache: Its batch cache.
        rows: The requests about to take slots ``lo ..`` in order (each with ``request_id``, ``tokens``,
            the prompt, and ``prompt_cache``, loaded here into its slot and left to the engine to drop).
        lo: The first one's slot.

    Returns:
        By request id, ``(slot, (1, V) logits, seconds)``: its slot, its last prompt token's logits and its
        share of the time (the forwards waited for on CUDA: one sync per admission). Empty if the shared
        forwards raised (logged; their time is not counted): the engine then prefills each row alone, where the
        failing one fails by itself with its own message. A row prefilled again (an earlier row failed, so
        its slot moved) counts only its own prefill.
    """
    t0 = time.perf_counter()
    try:
        starts = [load_prompt_cache(cache, lo + i, row) for i, row in enumerate(rows)]
        logits = prefill_rows(model, cache, [row.tokens for row in rows], lo, starts)
        if logits.is_cuda:
            torch.cuda.synchronize(logits.device)  # the time below is the forwards', not the first row's check
    except Exception as exc:  # noqa: BLE001 -- each row is prefilled alone next, and fails alone if it must
        logger.warning("the shared prefill of %d requests failed (%s: %s); each is prefilled alone", len(rows),
                       type(exc).__name__, exc)
        return {}
    share = (time.perf_counter() - t0) / len(rows)
    return {row.request_id: (lo + i, logits[i:i + 1], share) for i, row in enumerate(rows)}


def load_prompt_cache(cache: BatchKVCache, slot: int, row) -> int:
    """Copy a joining request's prompt cache (``row.prompt_cache``, a ``DynamicCache`` or None) into ``slot``
    (``BatchKVCache.load_prefix``): the positions now held, 0 for none or one not usable (logged at debug)."""
    if row.prompt_cache is None:
        return 0
    start = cache.load_prefix(slot, row.prompt_cache)
    if not start:
        logger.debug("request %d: prompt cache not usable (a trimmed sliding layer): re-encoded", row.request_id)
    return start


def consecutive_runs(slots: Sequence[int]) -> list[list[int]]:
    """``slots`` (ascending) cut into runs of consecutive integers: ``[1, 2, 4]`` gives ``[[1, 2], [4]]``."""
    runs: list[list[int]] = []
    for slot in slots:
        if runs and runs[-1][-1] == slot - 1:
            runs[-1].append(slot)
        else:
            runs.append([slot])
    return runs
