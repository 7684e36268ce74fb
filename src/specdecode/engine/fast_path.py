"""Model forwards for the decode loop: eager on a ``DynamicCache``, or the fast path.

The fast path (issue "static KV cache and compiled forwards", after gpt-fast's
``generate.py``) runs a model on a ``kv_cache.StaticKVCache`` and compiles its
short forwards with ``torch.compile`` at a few fixed widths ("buckets"):

* A forward over w tokens runs the graph of the smallest bucket >= w, its input
  padded on the right with copies of the last token. The padding writes keys and
  values past the real positions; the cache's write position then advances by w
  only, so the next forward overwrites them, and no real query attends to them
  (the causal mask). Its logits rows are dropped.
* Wider forwards (the prefill, a re-encode after a rollback) run eagerly on the
  same cache: prefill stays dynamic and never compiles.
* Graphs are built on first use of a bucket (``torch.compile`` with
  ``dynamic=False``; ``mode="reduce-overhead"``, i.e. CUDA graphs, on CUDA; options
  feature-detected in ``compat`` for torch 2.11 and later) and
  kept by the runner, which also keeps its cache across generations, so a new
  prompt length never recompiles while it fits the cache. The seconds spent in
  those first calls are counted in ``compile_time_s``, apart from decoding. The
  compiled graphs are also kept on disk (``compile_cache``): a second process with the
  same model, dtype, device and widths loads them instead of compiling again.

On CPU the fast path is off by default (``default_compile``): measured on a
2-core EPYC with AVX512-BF16, torch 2.13, the Qwen2.5-Coder 1.5B in bf16, one
token, 2048-position static cache: eager 142 ms per forward, inductor-compiled
244 ms (35 s to compile each width). See the issue's note for the full table.

``ModelRunner`` is what the decoder and the model-based drafters call for every
forward; with ``compile=False`` it is exactly the eager ``model(...)`` call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from specdecode.engine import compat, kv_cache
from specdecode.engine.compat import RECOMPILE_LIMIT  # noqa: F401 (the fast path's limit, defined with the options)
from specdecode.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

#: Compiled widths of a draft model: 1 or 2 tokens per round, more when the cascade feeds
#: its n-gram tokens. Target caches leave room for a forward padded to the widest.
DRAFT_BUCKETS = (1, 2, 4, 8)

#: Positions a static cache is first allocated with, unless a generation needs more;
#: it grows in steps of this many (a growth recompiles each bucket once).
STATIC_CACHE_STEP = 1024


def default_compile(device: torch.device | str) -> bool:
    """The fast path's default: on for CUDA, off for CPU (where eager measured faster)."""
    return torch.device(device).type == "cuda"


def resolve_compile(compile: bool | None, device: torch.device | str) -> bool:
    """``compile`` itself, or ``default_compile(device)`` for None.

    Raises:
        InvalidArgumentError: If ``compile`` is neither a bool nor None.
    """
    if compile is None:
        return default_compile(device)
    if not isinstance(compile, bool):
        raise InvalidArgumentError(f"compile must be True, False or None (the device default), got {compile!r}")
    return compile


class ModelRunner:
    """Runs one model's forwards for the decode loop, eagerly or on the fast path
    (``engine.protocol.ModelRunnerProtocol``).

    Args:
        model: A transformers causal LM in eval mode.
        compile: True: static cache and compiled forwards (see the module docstring);
            False: eager forwards on a ``DynamicCache``; None: ``default_compile``.
        buckets: Forward widths (tokens) that get a compiled graph, e.g. (1, γ + 1) for a
            target (one-token steps and verification) or (1, 2) for a draft model.
            Ignored when not compiling.
        name: For log messages ("target model", "draft model", "layer-skip draft").
        graphs: False keeps the static cache but runs every forward eagerly (no
            ``torch.compile``): the fast path's cache logic without its compile time, for
            tests and debugging. Ignored when not compiling.

    Attributes:
        compile: Whether forwards use the fast path.
        compile_time_s: Seconds spent in first calls of compiled buckets (compilation,
            and on CUDA graph capture), summed over the runner's life.
        num_eager_forwards: Forwards run eagerly (prefills, wide re-encodes, or all of
            them when not compiling).

    Raises:
        InvalidArgumentError: A bad ``compile`` or a bucket that is not an integer >= 1.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        compile: bool | None = None,
        buckets: tuple[int, ...] = (1,),
        name: str = "model",
        graphs: bool = True,
    ) -> None:
        self.model = model
        self.name = name
        self.compile = resolve_compile(compile, model.device)
        for b in buckets:
            if isinstance(b, bool) or not isinstance(b, int) or b < 1:
                raise InvalidArgumentError(f"compile buckets must be integers >= 1, got {buckets!r}")
        self.buckets = tuple(sorted(set(buckets))) if graphs else ()
        self.graphs = graphs
        self.compile_time_s = 0.0
        self.num_eager_forwards = 0
        self._compiled: Callable | None = None
        self._calls: dict[tuple[int, int], int] = {}  # (bucket, cache capacity) -> calls so far
        # First calls of a graph that compile or (CUDA graphs) record: timed as warm-up.
        self._warm_calls = 2 if model.device.type == "cuda" else 1
        self._warned_wide: set[int] = set()
        self._cache: kv_cache.StaticKVCache | None = None
        self._inputs: dict[int, torch.Tensor] = {}  # bucket -> its (1, bucket) input ids

    @property
    def static_cache(self) -> bool:
        """Whether ``new_cache`` gives a static cache (``kv_cache.StaticKVCache``): on the fast path."""
        return self.compile

    @property
    def max_bucket(self) -> int:
        """The widest compiled forward (0 when nothing is compiled)."""
        return self.buckets[-1] if self.buckets and self.compile else 0

    def with_buckets(self, buckets: tuple[int, ...]) -> None:
        """Add compiled widths (e.g. γ + 1 once γ is known); existing graphs are kept."""
        if self.graphs:
            self.buckets = tuple(sorted(set(self.buckets) | set(buckets)))

    def new_cache(self, num_positions: int):
        """An empty cache for a generation that writes at most ``num_positions`` positions.

        Eager: a fresh ``DynamicCache`` (``kv_cache.new_cache``). Fast path: the runner's own
        ``StaticKVCache``, reset to position 0 and reused across generations (same tensors,
        so compiled graphs stay valid); reallocated, larger by whole ``STATIC_CACHE_STEP``s,
        only when ``num_positions`` exceeds its capacity.
        """
        if not self.compile:
            return kv_cache.new_cache(self.model)
        if self._cache is None or self._cache.capacity < num_positions:
            capacity = -(-max(num_positions, 1) // STATIC_CACHE_STEP) * STATIC_CACHE_STEP
            if self._cache is not None:
                logger.info("%s: static cache grows from %d to %d positions (each compiled width recompiles once)",
                            self.name, self._cache.capacity, capacity)
            self._cache = None  # free the old tensors first
            self._cache = kv_cache.StaticKVCache(self.model, capacity)
        self._cache.set_length(0)
        self._cache.generation += 1
        return self._cache

    def check_owner(self, cache, generation: int) -> None:
        """Raise unless ``cache`` still belongs to the generation that took it as number ``generation``.

        The fast path keeps one static cache per runner; a second generation started on the
        same runner before the first finished (two interleaved streams) takes it over.

        Raises:
            InvalidArgumentError: If another generation took the cache since.
        """
        if kv_cache.is_static(cache) and cache.generation != generation:
            raise InvalidArgumentError(
                f"{self.name}: another generation started on the same fast-path runner and took over its static "
                "cache; fast-path generations of one SpeculativeGenerator cannot be interleaved (finish a stream "
                "before starting the next, or use compile=False)"
            )

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, cache, logits_to_keep: int) -> torch.Tensor:
        """One forward over ``ids`` (1, w), appended to ``cache`` after what it holds.

        Args:
            ids: (1, w) long token ids, w >= 1.
            cache: A ``DynamicCache``, or on the fast path a ``StaticKVCache`` (from this
                runner's ``new_cache`` or, for a self-speculative drafter, the target's).
            logits_to_keep: How many of the last positions to return logits for (1..w).

        Returns:
            (1, logits_to_keep, V) logits. On the fast path they are a fresh tensor, safe
            to keep across later forwards (CUDA graphs reuse their output buffers).

        Raises:
            torch._dynamo.exc.FailOnRecompileLimitHit: If a runner's graphs keep recompiling
                (more than ``RECOMPILE_LIMIT`` variants): loud, never a silent eager fallback.
        """
        w = ids.shape[1]
        static = kv_cache.is_static(cache)
        bucket = None
        if static and self.compile and cache.layers[0].is_initialized:  # the first forward allocates: eager
            bucket = next((b for b in self.buckets if b >= w), None)
        if bucket is None:  # eager: any cache, any width (the prefill and re-encodes on the fast path)
            self.num_eager_forwards += 1
            if static and self.compile and self.buckets and w > self.buckets[-1] and w not in self._warned_wide:
                self._warned_wide.add(w)
                logger.debug("%s: a forward over %d tokens runs eagerly (widest compiled width %d)",
                             self.name, w, self.buckets[-1])
            logits = self.model(ids, past_key_values=cache, use_cache=True, logits_to_keep=logits_to_keep).logits
            if static:
                cache.advance(w)
            return logits
        # A persistent input per bucket: no allocation per forward, and one stride for the graph's guards.
        inputs = self._inputs.get(bucket)
        if inputs is None:
            inputs = self._inputs[bucket] = torch.zeros((1, bucket), dtype=torch.long, device=ids.device)
        inputs[:, :w] = ids
        if bucket > w:
            inputs[:, w:] = ids[:, -1:]
        key = (bucket, cache.capacity)
        calls = self._calls.get(key, 0)
        first = calls < self._warm_calls
        t0 = time.perf_counter() if first else 0.0
        if self._compiled is None:
            self._compiled = _compile(self.model)
        if self.model.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        logits = self._compiled(inputs, cache)[:, w - logits_to_keep : w].clone()
        cache.advance(w)
        if first:
            self._calls[key] = calls + 1
            seconds = time.perf_counter() - t0
            self.compile_time_s += seconds
            if calls == 0:
                logger.info("%s: compiled width %d (cache of %d positions) in %.1f s", self.name, bucket,
                            cache.capacity, seconds)
        return logits


def _compile(model: PreTrainedModel) -> Callable:
    """``torch.compile`` of one full-width forward on a static cache (all logits rows).

    Through ``compat.compile_function``: the options of this torch (``compat.compile_kwargs``:
    ``dynamic=False``, ``fullgraph=True``, CUDA graphs on CUDA, and each runner's own graphs
    and budget of ``RECOMPILE_LIMIT`` variants, also on torch 2.11), with torch's compile
    caches in specdecode's cache folder (``compile_cache``), so a later process reuses them.
    """

    def forward(ids: torch.Tensor, cache: kv_cache.StaticKVCache) -> torch.Tensor:
        return model(ids, past_key_values=cache, use_cache=True).logits

    return compat.compile_function(forward, model.device.type)
