"""The batched engine's fast path: decode-time forwards compiled at a few (rows, width) buckets.

gpt-fast's design (``generate.py``: a static cache, static shapes, CUDA graphs), for a batch
whose rows each continue at their own position (``batch_cache.BatchKVCache``):

* **Buckets.** A forward over n rows of w tokens runs the graph of the smallest rows bucket
  R >= n (powers of two up to the engine's ``max_batch_size``, and that size itself;
  ``bucket_functions.row_buckets``) and the smallest width bucket W >= w of its runner (the target: 1 and the
  longest verification, ``max_block + 1``; a draft model: 1 and 2; a layer-skip draft: 1).
  Its input is padded: tokens on the right with copies of each row's last token, which land
  past the row's length where the next forward overwrites them (the cache's ``margin`` holds
  them near the end of a slot); rows n .. R - 1 are free slots (the active rows fill slots
  0 .. n - 1), written at positions 0 .. W - 1, which a joining row's prefill overwrites.
* **Static shapes inside the graph.** Every forward sees all ``num_positions`` positions of its
  R slots; its write positions come from a persistent (R, 1, W, 1) buffer of the bucket and
  the 4D attention mask (causal, and sliding-window where the model has it) is computed from
  them inside the graph. No Python int that changes from round to round reaches a graph, so a
  bucket compiles once.
* **One compiled function per bucket**, each on its own code object: torch keeps compiled
  variants and their recompile budget per code object, so no bucket can exhaust another's
  (torch 2.11's ``torch.compile`` has no ``isolate_recompiles``). ``dynamic=False,
  fullgraph=True``, no guards on the model's modules (``compat``); on CUDA torch.compile's CUDA graphs
  (``mode="reduce-overhead"``'s): each call starts with
  ``torch.compiler.cudagraph_mark_step_begin()`` and its outputs (logits, greedy epilogue) are
  cloned, or used up (``greedy_steps``), before the next graph reuses their memory. The first
  calls of a bucket (compilation, graph capture) are timed apart, in ``compile_time_s``, and
  logged at INFO.
* **Dynamic shapes** (``FastPath.dynamic_shapes``, off by default): rows and widths above 1 are
  symbolic (``torch._dynamo.mark_dynamic`` on the buckets' buffers, ``dynamic=None``; size 1 stays
  apart, as dynamo specializes sizes 0 and 1), so a runner compiles at most four functions (rows 1 or
  more, width 1 or more; tree forwards up to four more; fused draft steps still one per rows bucket),
  as vLLM compiles its decode graph once for every batch size and captures a CUDA graph per size.
  Ranges: rows 2 .. the cache's slots (the graph guards on them), widths 2 .. ``FastPath.max_width``;
  a range of one size stays static. Measured on a 2-core Xeon (torch 2.13,
  Qwen2.5-Coder 0.5B bf16; ``docs/benchmarks/2026-11-27-dynamic-shapes.md``): rows buckets 2, 4, 8 at
  widths 1 and 6 compiled in 141 s against 262 s, forwards no slower. Not yet run on a GPU.
* **Inputs** are copied into the bucket's persistent buffers: token ids device to device; write
  positions advanced in place on the device where every row moved by the same count since the bucket's
  last call (each draft step; every call at B = 1), else from host ints through pinned memory without
  blocking (``_write_positions``). Nothing reads back.
* **Greedy epilogue.** Each bucket's function also returns every position's argmax and finiteness
  (``verification.greedy_epilogue``), computed in its graph: the verification reads them
  (``forward_greedy``), a greedy round's draft steps feed them back (``greedy_steps``) and start from the
  drafter's first forward's, so none launches an argmax or a finiteness check of its own (on CUDA,
  ``isfinite`` alone is four kernels).

**Fused draft steps** (``BatchRunner.draft_steps``): a greedy draft round's one-token steps after
its first forward, S of them, run as ONE compiled function (one CUDA graph on CUDA), as gpt-fast
compiles its whole decode step: step i feeds step i - 1's argmax at each row's position + i, the
write positions advanced on the device (``index.add_(1)`` on the bucket's buffer), finiteness
accumulated on the device, so no host work runs between the steps. Rounds fuse at their engine's
longest block less one (``fused_steps``); a bucket of its own per rows bucket and count, compiled at
its first use (``warm_up_draft_steps``: before a server's first request) and timed in
``compile_time_s`` like the others. Free rows n .. R - 1 are written at positions 0 .. S - 1, which a
joining row's prefill overwrites.

**Captured graphs** (``FastPath.graphs="captured"``, CUDA only; elsewhere as True): each bucket is
compiled without torch.compile's CUDA graphs (no ``mode``), and its second call records that compiled
function as one ``torch.cuda.CUDAGraph`` (after one run on a side stream, as ``torch.cuda.graph`` asks;
a steps bucket's write positions put back first), which every later call replays: no dynamo guards, no
graph-tree bookkeeping per call, the way vLLM and SGLang replay their decode graphs. A replay skips
dynamo's guards, so it needs what the trace read to stay put, as it does: the cache's tensors (allocated
once), the weights, a truncated head's rows, a skip set's runner and the window's tree flag, all fixed
per bucket. Each graph keeps a memory pool of its own (its outputs and scratch). On an H200 a
compiled call cost about 0.3-0.8 ms of host time beside its graph (``docs/benchmarks/2026-11-27-gpu-h200.md``);
this option is what ``docs/benchmarks/gpu_engine.py``'s ``-captured`` rows measure against it. Not yet
run on a GPU: off by default.

A forward wider than the runner's widest bucket, the first forward on a cache not yet
allocated, and every prefill run eagerly on the same cache (``batch_cache.batch_forward``).
``graphs=False`` keeps the static full-capacity path, buckets and padding included, without
``torch.compile``: the fast path's logic without its compile time, for tests and debugging.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel

from specdecode.engine.batch_cache import BatchKVCache, batch_forward
from specdecode.engine.bucket_functions import forward_function, steps_function
from specdecode.engine.fast_path import check_compilable
from specdecode.engine.tree import TokenTree, tree_inputs
from specdecode.engine.verification import greedy_epilogue
from specdecode.errors import InvalidArgumentError

logger = logging.getLogger(__name__)


class BatchRunner:
    """Runs one model's decode-time forwards over a ``BatchKVCache``: eager, or on the fast path.

    Args:
        model: The model (for a self-speculative draft, the target in ``draft_mode``: give it
            a runner of its own, so its graphs are those of the skipped model).
        cache: Its batch cache; its ``fast`` settings (``fast_path.FastPath``) decide the
            path: None runs every forward eagerly (``batch_forward``), as the engine did before.
        widths: Width buckets (tokens per row), each an integer in 1 .. ``cache.fast.max_width``.
        name: For log messages ("target model", "draft model", "layer-skip draft").

    Attributes:
        compile_time_s: Seconds in first calls of buckets (compilation; CUDA graph capture).
        num_eager_forwards: Forwards run eagerly (all of them without the fast path).

    Raises:
        InvalidArgumentError: A width outside 1 .. ``cache.fast.max_width``; compiled forwards (``FastPath.graphs``)
            of a model the fast path cannot compile (``fast_path.check_compilable``).
    """

    def __init__(self, model: PreTrainedModel, cache: BatchKVCache, widths: Sequence[int], name: str) -> None:
        self.model, self.cache, self.name = model, cache, name
        self.fast = cache.fast
        if self.fast is not None and self.fast.graphs:  # before any forward: the draft's as well as the target's
            check_compilable(model, name)
        self.widths: tuple[int, ...] = ()
        self.add_widths(widths)
        self.rows = self.fast.rows if self.fast is not None else ()
        self.compile_time_s = 0.0
        self.num_eager_forwards = 0
        self._cuda = cache.device.type == "cuda"
        self._warm_calls = 2 if self._cuda else 1  # CUDA graph trees record at the second call
        self._buckets: dict[tuple[int, int, bool], _Bucket] = {}
        #: [fused draft steps] by (rows, steps, vocab, head size or None)
        self._steps_buckets: dict[tuple[int, int, int, int | None, bool], _Bucket] = {}
        #: Compiled forwards by (rows or "N", width or "N", tree): "N" a symbolic size (``FastPath.dynamic_shapes``)
        self._forwards: dict[tuple, Callable] = {}

    takes_trees = True  # tree forwards (``engine.tree``): on the fast path, buckets of their own

    def add_widths(self, widths: Sequence[int]) -> None:
        """Add width buckets (a drafter sharing this runner may feed wider forwards than the one that made it);
        each compiles at ``warm_up`` or at its first call.

        Raises:
            InvalidArgumentError: A width that is not an integer in 1 .. ``cache.fast.max_width``.
        """
        limit = self.fast.max_width if self.fast is not None else None
        for w in widths:
            if isinstance(w, bool) or not isinstance(w, int) or w < 1 or (limit is not None and w > limit):
                raise InvalidArgumentError(f"{self.name}: width buckets must be integers in 1..{limit}, "
                                           f"got {list(widths)}")
        self.widths = tuple(sorted({*self.widths, *widths}))

    @property
    def buckets(self) -> list[tuple[int, int]]:
        """Every (rows, width) bucket this runner runs on the fast path (none without it)."""
        return [(r, w) for r in self.rows for w in self.widths]

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, starts: Sequence[int], logits_to_keep: int,
                 trees: Sequence | None = None) -> torch.Tensor:
        """One forward over slots 0 .. n - 1, row i at positions ``starts[i] ..``.

        Args:
            ids: (n, w) long token ids on the model's device.
            starts: (n,) each row's cached length, as Python ints.
            logits_to_keep: The last positions (of the w) to return logits for.
            trees: A tree forward (``engine.tree``; per row a ``TokenTree``): on the fast path it
                runs a bucket of its own (the same shapes, plus each node's depth and ancestor
                mask in persistent buffers; compiled at its first use), so the linear graphs
                stay as they are.

        Returns:
            (n, logits_to_keep, V) logits, safe to keep across later forwards.

        Raises:
            InvalidArgumentError: As ``BatchKVCache.prepare`` (a row past the capacity).
        """
        logits, _, owned = self._forward(ids, starts, logits_to_keep, trees)
        return logits.clone() if owned else logits

    @torch.inference_mode()
    def forward_greedy(self, ids: torch.Tensor, starts: Sequence[int], logits_to_keep: int, trees: Sequence | None = None,
                       with_logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``__call__``'s forward, with each kept position's greedy token and finiteness.

        On the fast path both come out of the bucket's graph (``bucket_functions.forward_function``), so the caller
        launches no argmax or finiteness kernels of its own; eagerly they are computed after the forward.

        Args:
            ids, starts, logits_to_keep, trees: As ``__call__``.
            with_logits: Also return the logits (a copy on CUDA); False: None in their place.

        Returns:
            ``(logits, greedy)``: logits as ``__call__``'s, or None; greedy (n, logits_to_keep, 2) long,
            safe to keep: ``[..., 0]`` the argmax over all V columns, ``[..., 1]`` 1 where every logit of
            the position is finite, else 0.

        Raises:
            InvalidArgumentError: As ``__call__``.
        """
        logits, greedy, owned = self._forward(ids, starts, logits_to_keep, trees)
        if greedy is None:  # eager: the same epilogue, after the forward
            greedy = greedy_epilogue(logits)
        elif owned:  # the graph's outputs are overwritten by its next run
            greedy = greedy.clone()
        return (logits.clone() if owned else logits) if with_logits else None, greedy

    def _forward(self, ids: torch.Tensor, starts: Sequence[int], logits_to_keep: int,
                 trees: Sequence | None) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """``(logits, greedy or None, owned)``: the forward's kept logits and, from a bucket, its greedy
        epilogue (``forward_greedy``), both the graph's outputs (or views of them) where ``owned`` (CUDA: the
        next run overwrites them); eagerly (no bucket) greedy is None."""
        n, w = ids.shape
        rows, width = self._shape(n, w)
        if rows is None:
            self.num_eager_forwards += 1
            return batch_forward(self.model, self.cache, ids, 0, starts, logits_to_keep, trees), None, False
        end = max(starts) + w
        if end > self.cache.capacity:
            raise InvalidArgumentError(
                f"a forward would write position {end - 1}, past the batch cache's capacity of {self.cache.capacity}"
            )
        bucket = self._bucket(rows, width, trees is not None)
        exact = n == rows and w == width  # the bucket's shape (each draft step at B = 1): no slicing, no padding
        if exact:
            bucket.ids.copy_(ids)
        else:
            bucket.ids[:n, :w].copy_(ids)
            if width > w:
                bucket.ids[:n, w:].copy_(ids[:, -1:].expand(n, width - w))
        self._write_positions(bucket, starts)
        if trees is not None:  # [trees] each node's depth and ancestors; free rows: a chain
            chains = [TokenTree.chain(width - 1)] * (rows - n)
            depths, ancestors = tree_inputs([*trees, *chains], [0] * rows, width, "cpu")  # start 0: the depth
            bucket.depth.copy_(depths.to(bucket.depth.device, non_blocking=self._cuda))
            bucket.ancestors.copy_(ancestors.to(bucket.ancestors.device, non_blocking=self._cuda))
        logits, greedy = self._run(bucket)
        if exact and logits_to_keep == w:
            return logits, greedy, self._cuda
        kept = slice(w - logits_to_keep, w)
        return logits[:n, kept], greedy[:n, kept], self._cuda

    def _shape(self, n: int, w: int) -> tuple[int, int] | tuple[None, None]:
        """The (rows, width) bucket a forward of ``n`` rows of ``w`` tokens runs in, or (None, None): eagerly (no
        such bucket, or the cache not allocated yet)."""
        rows = next((r for r in self.rows if r >= n), None)
        width = next((b for b in self.widths if b >= w), None)
        if rows is None or width is None or not self.cache.layers[0].is_initialized:
            return None, None
        return rows, width

    def in_bucket(self, n: int, w: int) -> bool:
        """Whether a forward of ``n`` rows of ``w`` tokens runs in a bucket (whose graph gives ``forward_greedy``'s
        epilogue at no cost), not eagerly."""
        return self._shape(n, w)[0] is not None

    def warm_up(self) -> None:
        """Run every bucket once (twice on CUDA: capture), so that a server compiles before its
        first request. Slots 0 .. R - 1 hold garbage afterwards, which prefills overwrite.
        Needs an allocated cache (an eager forward first: ``batch_cache.warm_up_forwards``)."""
        if not self.cache.layers[0].is_initialized:
            raise InvalidArgumentError(f"{self.name}: warm up the eager widths first (the cache is not allocated)")
        for rows, width in self.buckets:
            bucket = self._bucket(rows, width)
            with torch.inference_mode():
                bucket.ids.zero_()
                _copy_from_host(bucket.positions, [list(range(width))] * rows)
                bucket.starts = None
                for _ in range(self._warm_calls):
                    self._run(bucket)

    def _write_positions(self, bucket: _Bucket, starts: Sequence[int]) -> None:
        """Set ``bucket``'s write positions: row i at ``starts[i] ..``, free rows n .. R - 1 at 0 .. W - 1.

        Where the bucket's last call had the same n rows and every row moved by the same d since (each
        draft step, and every call at B = 1), the positions advance on the device (``index[:n] += d``;
        ``index += d`` where n is the bucket's R):
        one kernel and no host-to-device copy. Otherwise they are copied from the host (``_copy_from_host``).
        Only this method (and ``warm_up``, which forgets them) writes a linear bucket's positions, so
        ``bucket.starts`` is what the buffer holds."""
        last, n, width = bucket.starts, len(starts), bucket.width
        if last is not None and len(last) == n:
            delta = starts[0] - last[0]
            if all(s - l == delta for s, l in zip(starts, last)):
                if delta:  # every row of the bucket: one in-place add on the buffer itself
                    (bucket.index if n == bucket.rows else bucket.positions[:n]).add_(delta)
                bucket.starts = list(starts)
                return
        index = [[s + t for t in range(width)] for s in starts] + [list(range(width))] * (bucket.rows - n)
        _copy_from_host(bucket.positions, index)
        bucket.starts = list(starts)

    @property
    def fused_steps(self) -> tuple[tuple[int, bool], ...]:
        """What rounds fuse (``fuses_draft_steps``): (steps, with top probabilities) pairs, each engine's
        longest block less one (``FastPath.draft_steps``); none without the fast path. Other counts (a row
        near its end, a cost model's shorter block) run step by step, so no graph compiles in the middle
        of a request."""
        return tuple(sorted(self.fast.draft_steps)) if self.fast is not None else ()

    def steps_in_buckets(self, n: int) -> bool:
        """Whether ``n`` rows' one-token forwards run in a bucket (``greedy_steps``, ``draft_steps``): the fast
        path on, its cache allocated, a rows bucket for n rows and a width-1 bucket."""
        return self.fast is not None and 1 in self.widths and self.cache.layers[0].is_initialized \
            and any(r >= n for r in self.rows)

    def fuses_draft_steps(self, n: int, num_steps: int | None = None, with_tops: bool = False) -> bool:
        """Whether ``draft_steps`` can run ``n`` rows (``steps_in_buckets``); with ``num_steps``, also whether a
        round of that many steps (``with_tops``: and top probabilities) fuses (one of ``fused_steps``)."""
        return self.steps_in_buckets(n) and (num_steps is None or (num_steps, with_tops) in self.fast.draft_steps)

    def _check_steps(self, what: str, steps: str, n: int, starts: Sequence[int], **counts: int) -> None:
        """``draft_steps``' and ``greedy_steps``' arguments (``what``, for messages; ``steps``, what needs the
        buckets): one start (an int >= 0) per row, each of ``counts`` an integer >= 1, a bucket for the rows
        (``steps_in_buckets``), the last step within the cache's capacity. Raises ``InvalidArgumentError``."""
        if len(starts) != n or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in starts):
            raise InvalidArgumentError(f"{self.name}: {what} needs one start (an int >= 0) per row of its "
                                       f"{n} tokens, got {list(starts)!r}")
        for name, value in counts.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{self.name}: {what}' {name} must be an integer >= 1, got {value!r}")
        if not self.steps_in_buckets(n):
            raise InvalidArgumentError(
                f"{self.name}: {steps} need the fast path, an allocated cache, width 1 and a rows bucket "
                f"for {n} rows (rows buckets {list(self.rows)}, widths {list(self.widths)})")
        end = max(starts) + counts["num_steps"]
        if end > self.cache.capacity:
            raise InvalidArgumentError(
                f"a forward would write position {end - 1}, past the batch cache's capacity of {self.cache.capacity}"
            )

    @torch.inference_mode()
    def greedy_steps(self, first: torch.Tensor, starts: Sequence[int], num_steps: int, head_ids: torch.Tensor | None,
                     with_tops: bool = False, pending: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A greedy draft block: the round's first token, from its first forward's greedy epilogue, then
        ``draft_steps``' greedy steps, one call of the width-1 bucket each (one graph each on CUDA): step i
        feeds step i - 1's argmax, taken from the bucket's greedy epilogue (``forward_greedy``). Per step the
        host copies the token in (device to device), advances the write positions on the device
        (``_write_positions``) and copies the epilogue out: no argmax, finiteness check or logits copy of
        its own, and nothing read back. What ``base.draft_batch`` runs where the steps are not fused
        (``fused_draft_steps``, off by default).

        Args:
            first: (n, 2) long on the model's device, the greedy epilogue (``verification.greedy_epilogue``:
                argmax column, 1 if finite) of the logits that give each row's first draft token, which step 0
                feeds at ``starts[b]``.
            starts, num_steps, with_tops: As ``draft_steps``.
            head_ids: As ``draft_steps``; None: the logits' columns are the tokens (the caller checks that
                their width is the vocabulary).
            pending: (n,) long on the device, each row's pending token (the last of its sequence), placed
                before the block, so that the verification feeds the returned tokens as they are; None:
                not placed. Only without ``head_ids``.

        Returns:
            ``(tokens, finite, tops)``: (n, 1 + S) long, the first token then the steps' (with ``pending``,
            (n, 2 + S), the pending token first); without head ids a transposed view, not contiguous (use
            ``reshape``, not ``view``); a 0-dim bool, whether the first token's logits and every step's were
            finite; (n, S) float32 top probabilities of the steps or None (``draft_steps``'). Nothing is
            read back.

        Raises:
            InvalidArgumentError: As ``draft_steps`` (``steps_in_buckets(n)`` false in place of
                ``fuses_draft_steps``); ``first`` not (n, 2); ``pending`` not (n,), or with ``head_ids``.
        """
        n = int(first.shape[0])
        self._check_steps("greedy_steps", "greedy steps", n, starts, num_steps=num_steps)
        if first.shape != (n, 2):
            raise InvalidArgumentError(f"{self.name}: greedy_steps' first must be (rows, 2), got {tuple(first.shape)}")
        if pending is not None and head_ids is not None:
            raise InvalidArgumentError(f"{self.name}: greedy_steps places the pending token only without head ids "
                                       "(a truncated head's columns are mapped to tokens after the steps)")
        if pending is not None and pending.shape != (n,):
            raise InvalidArgumentError(f"{self.name}: greedy_steps' pending must be (rows,) = ({n},), "
                                       f"got {tuple(pending.shape)}")
        lead = 1 if pending is None else 2  # the first token's slot, after the pending token's
        # slot j holds an epilogue, (token or column, finite): (n, 1, 2) as the width-1 forward gives it, so a step
        # copies it whole; its (n, 1) token column, the next step's input, is a view made here once
        out = torch.empty((lead + num_steps, n, 1, 2), dtype=torch.long, device=first.device)
        slots, columns = out.unbind(0), out[..., 0].unbind(0)
        if pending is not None:
            columns[0][:, 0].copy_(pending)
        slots[lead - 1][:, 0].copy_(first)
        ids, tops = columns[lead - 1], []
        for i in range(num_steps):
            logits, greedy, _ = self._forward(ids if head_ids is None else head_ids[ids], [s + i for s in starts], 1,
                                              None)  # a bucket's: steps_in_buckets
            if with_tops:  # as the loop: the softmax over every column of the step's logits
                tops.append(torch.softmax(logits[:, -1].float(), -1).amax(-1))
            slots[lead + i].copy_(greedy)
            ids = columns[lead + i]
        chosen = out[..., 0, 0].t()  # (n, lead + S)
        finite = out[..., 1] if pending is None else out[1:, :, :, 1]  # the pending slot's flag is not written
        return chosen if head_ids is None else head_ids[chosen], finite.all(), \
            torch.stack(tops, dim=1) if with_tops else None

    @torch.inference_mode()
    def draft_steps(self, tokens: torch.Tensor, starts: Sequence[int], num_steps: int, head_ids: torch.Tensor | None,
                    vocab: int, with_tops: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``num_steps`` greedy one-token forwards over slots 0 .. n - 1 as one compiled function (the
        module docstring): the same tokens as ``num_steps`` calls of ``self(ids, at, 1)``, each followed
        by the argmax, but with no host work between them.

        Args:
            tokens: (n,) long on the model's device: each row's latest token, fed at ``starts[b]``.
            starts: (n,) Python ints: where each row's token is written (its cached length); step i
                writes at ``starts[b] + i``.
            num_steps: S >= 1, the forwards to run.
            head_ids: (K,) long on the device, a truncated head's token ids (logit column j is token
                ``head_ids[j]``); None: the logits' first ``vocab`` columns are the tokens.
            vocab: V >= 1, the target's vocabulary size (a full head's columns past it are ignored).
            with_tops: Also return each step's top probability (a bucket of its own).

        Returns:
            ``(tokens, finite, tops)``: (n, S) long, step i's argmax per row; a 0-dim bool tensor, whether
            every step's logits of rows 0 .. n - 1 were finite; with ``with_tops``, (n, S) float32, the
            largest probability of each step's softmax over all its logits' columns (an adaptive exit's
            confidence, ``base.draft_batch``), else None. Nothing is read back to the host.

        Raises:
            InvalidArgumentError: ``num_steps`` or ``vocab`` not an integer >= 1; ``starts`` not one int
                >= 0 per row; ``fuses_draft_steps(n)`` false; a row that would write past the cache's
                capacity.
        """
        n = int(tokens.shape[0])
        self._check_steps("draft_steps", "fused draft steps", n, starts, num_steps=num_steps, vocab=vocab)
        rows = next(r for r in self.rows if r >= n)
        bucket = self._steps_bucket(rows, num_steps, head_ids, vocab, with_tops)
        bucket.ids[:n].copy_(tokens.view(n, 1))
        _copy_from_host(bucket.positions, [[s] for s in starts] + [[0]] * (rows - n))
        out, finite, tops = self._run(bucket)
        out, tops = out[:n], tops[:n] if tops is not None else None
        if self._cuda:  # the graph's outputs are overwritten by its next replay
            out, tops = out.clone(), tops.clone() if tops is not None else None
        return out, finite[:n].all(), tops

    @torch.inference_mode()
    def warm_up_draft_steps(self, head_ids: torch.Tensor | None, vocab: int) -> None:
        """Run ``draft_steps``' buckets of each of ``fused_steps`` once at every rows bucket (twice on CUDA), so
        that a server compiles them before its first request (the drafters call it in the model's draft mode
        or under its truncated head, as their rounds run it). Slots hold garbage afterwards, which
        prefills overwrite. Does nothing unless ``fuses_draft_steps(1)``."""
        if not self.fuses_draft_steps(1):
            return
        for rows, (steps, with_tops) in ((r, s) for r in self.rows for s in self.fused_steps):
            bucket = self._steps_bucket(rows, steps, head_ids, vocab, with_tops)
            bucket.ids.zero_()
            for _ in range(self._warm_calls):
                bucket.index.zero_()
                self._run(bucket)

    def _steps_bucket(self, rows: int, num_steps: int, head_ids: torch.Tensor | None, vocab: int,
                      with_tops: bool = False) -> _Bucket:
        """[fused draft steps] The bucket of ``rows`` x ``num_steps`` (made at its first use), its head ids set."""
        key = (rows, num_steps, vocab, None if head_ids is None else int(head_ids.numel()), with_tops)
        bucket = self._steps_buckets.get(key)
        if bucket is None:
            bucket = self._steps_buckets[key] = _Bucket(self, rows, 1, steps=(num_steps, vocab, key[3], with_tops))
        if head_ids is not None and bucket.head_source is not head_ids:  # a device copy, once per head tensor
            bucket.head.copy_(head_ids)
            bucket.head_source = head_ids
        return bucket

    def _bucket(self, rows: int, width: int, tree: bool = False) -> _Bucket:
        bucket = self._buckets.get((rows, width, tree))
        if bucket is None:
            bucket = self._buckets[(rows, width, tree)] = _Bucket(self, rows, width, tree)
        return bucket

    def _run(self, bucket: _Bucket) -> torch.Tensor | tuple:
        """Call ``bucket``'s function on its buffers: ((R, W, V) logits, (R, W, 2) greedy epilogue), or a steps
        bucket's (tokens, finite, tops or None)."""
        window = self.cache._window
        window.static, window.index = True, bucket.index
        window.tree = (bucket.depth, bucket.ancestors) if bucket.tree else None
        first = bucket.calls < self._warm_calls
        t0 = time.perf_counter() if first else 0.0
        if bucket.graph is not None:  # [captured graphs] a replay: the outputs are the graph's own tensors
            bucket.graph.replay()
            out = bucket.outputs
        elif bucket.capture and bucket.calls >= self._warm_calls - 1:
            out = self._capture(bucket)
        else:
            if self._cuda and not bucket.capture:
                torch.compiler.cudagraph_mark_step_begin()
            out = bucket.forward(*bucket.inputs, self.cache)
        if first:
            bucket.calls += 1
            seconds = time.perf_counter() - t0
            self.compile_time_s += seconds
            if bucket.calls == 1 and self.fast.graphs:
                what = f"{bucket.steps} draft steps" if bucket.steps else f"{bucket.width} tokens"
                logger.info("%s: compiled %d rows x %s in %.1f s", self.name, bucket.rows, what, seconds)
        return out

    def _capture(self, bucket: _Bucket) -> torch.Tensor | tuple:
        """[captured graphs] Record ``bucket``'s compiled function (compiled by the call before) as one CUDA
        graph and replay it once: this call's result, in the graph's output tensors, which every replay
        overwrites (callers clone what they keep). The side-stream run before it writes what the replay
        writes (the same tokens at the same positions); a steps bucket's positions, which it advances, are
        put back. On the cache's device, with a capture stream of that device. A capture that raises is
        logged and the bucket runs its compiled function uncaptured from then on (torch's graphs off)."""
        device = self.cache.device
        index = bucket.index.clone()
        try:
            with torch.cuda.device(device):
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    bucket.forward(*bucket.inputs, self.cache)
                torch.cuda.current_stream(device).wait_stream(side)
                bucket.index.copy_(index)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=torch.cuda.Stream(device), capture_error_mode="thread_local"):
                    outputs = bucket.forward(*bucket.inputs, self.cache)
        except Exception as exc:  # noqa: BLE001 -- logged; the bucket's compiled function still runs
            logger.warning("%s: capturing the CUDA graph of %d rows x %d tokens failed (%s: %s); that bucket runs "
                           "its compiled function uncaptured", self.name, bucket.rows, bucket.width,
                           type(exc).__name__, exc)
            bucket.capture = False
            bucket.index.copy_(index)
            return bucket.forward(*bucket.inputs, self.cache)
        bucket.graph, bucket.outputs = graph, outputs
        graph.replay()
        return outputs


class _Bucket:
    """One (rows, width) bucket: persistent input buffers and its compiled forward (its own, or with
    ``FastPath.dynamic_shapes`` the one its size class shares: ``BatchRunner._forwards``).

    ``steps=(S, V, K, tops)``: [fused draft steps] a width-1 bucket whose function runs S greedy steps
    (``bucket_functions.steps_function``; V the vocabulary, K a truncated head's size or None, ``tops``: whether it
    returns each step's top probability; ``head``: its (K,) token ids, copied from ``head_source``).
    [captured graphs] ``capture``: whether its second call captures a CUDA graph; ``graph``, ``outputs``:
    that graph and its output tensors, once captured."""

    def __init__(self, runner: BatchRunner, rows: int, width: int, tree: bool = False,
                 steps: tuple[int, int, int | None, bool] | None = None) -> None:
        device = runner.cache.device
        self.rows, self.width, self.calls, self.tree = rows, width, 0, tree
        self.steps = steps[0] if steps is not None else 0
        self.depth = self.ancestors = self.head = self.head_source = None
        #: per row, the start its write positions hold (``BatchRunner._write_positions``); None: unknown
        self.starts: list[int] | None = None
        with torch.inference_mode():
            self.ids = torch.zeros((rows, width), dtype=torch.long, device=device)
            self.index = torch.zeros((rows, 1, width, 1), dtype=torch.long, device=device)
            self.positions = self.index.view(rows, width)  # the write positions as (R, W), made once
            if tree:  # [trees] node depths and ancestor masks (``BatchKVCache.static_inputs``)
                self.depth = torch.zeros((rows, width), dtype=torch.long, device=device)
                self.ancestors = torch.zeros((rows, width, width), dtype=torch.bool, device=device)
            if steps is not None and steps[2] is not None:  # [fused draft steps] a truncated head's ids
                self.head = torch.zeros(steps[2], dtype=torch.long, device=device)
        for buffer in (self.ids, self.index, self.depth, self.ancestors, self.head):
            if buffer is not None:
                torch._dynamo.mark_static_address(buffer, guard=False)  # no id guard: buckets share functions
        graphs, cuda = runner.fast.graphs, runner._cuda
        #: [captured graphs] compiled without torch's CUDA graphs, recorded by ``BatchRunner._capture``
        self.capture = cuda and graphs == "captured"
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs = None
        compiled = (bool(graphs), cuda, cuda and graphs is True)  # compile; CUDA; torch.compile's graphs
        if steps is None:
            self.inputs = (self.ids,)
            # [dynamic shapes] rows and widths above 1 are symbolic: the buckets of a size class (rows 1 or more,
            # width 1 or more, tree or not) share one compiled function; a range of one size (2 .. 2) stays
            # static, as dynamo refuses a fully constrained symbol
            dyn_rows, dyn_width = (bool(graphs) and runner.fast.dynamic_shapes and 1 < n and 2 < top
                                   for n, top in ((rows, max(runner.rows)), (width, runner.fast.max_width)))
            if dyn_rows:
                for buffer in (self.ids, self.index, self.depth, self.ancestors):
                    if buffer is not None:
                        torch._dynamo.mark_dynamic(buffer, 0, min=2, max=max(runner.rows))
            if dyn_width:
                top = runner.fast.max_width
                for buffer, dims in ((self.ids, (1,)), (self.index, (2,)), (self.depth, (1,)), (self.ancestors, (1, 2))):
                    for dim in dims if buffer is not None else ():
                        torch._dynamo.mark_dynamic(buffer, dim, min=2, max=top)
            key = ("N" if dyn_rows else rows, "N" if dyn_width else width, tree)
            if key not in runner._forwards:
                tag = f"r{key[0]}w{key[1]}{'t' if tree else ''}"
                runner._forwards[key] = forward_function(runner.model, tag, *compiled,
                                                          dynamic=None if dyn_rows or dyn_width else False)
            self.forward = runner._forwards[key]
        else:
            self.inputs = (self.ids, self.index, self.head)
            tag = f"r{rows}s{self.steps}{'p' if steps[3] else ''}"
            self.forward = steps_function(runner.model, tag, self.steps, steps[1], steps[3], *compiled)


def _copy_from_host(dst: torch.Tensor, values: list) -> None:
    """Copy nested Python ints into ``dst`` (long); on CUDA through pinned memory without blocking
    (the caching host allocator keeps the pinned block until the copy has run)."""
    host = torch.tensor(values, dtype=torch.long)
    if dst.device.type == "cuda":
        host = host.pin_memory()
    dst.copy_(host, non_blocking=dst.device.type == "cuda")
