"""A static KV cache for batched decoding, where each row has its own length.

Rows of a batch accept different numbers of draft tokens, so after a few rounds
their sequences have different lengths. ``BatchKVCache`` keeps one slot per row,
each a preallocated run of ``capacity`` positions, and every forward writes each
row at ITS OWN positions (``start[b] .. start[b] + T - 1``). Rolling a row back is
forgetting how far it got: the decoder holds the row lengths on the host, and the
next forward overwrites what was rejected. Nothing is ever copied or cropped,
except when a row leaves and the last slot's row moves into its place
(``move``), which keeps the active rows in slots ``0 .. n - 1`` so every forward
works on views.

Each row starts at position 0, so no row is padded on the left; a forward whose
rows feed different numbers of tokens is padded on the right, and the padding
lands past the row's length, where the next forward overwrites it. Correctness
rests on the attention mask built here (``attention_mask``): a query at position
p of row b sees that row's keys 0 .. p only (and, in a sliding-window layer, the
last ``window`` of them), so stale, rejected and padding keys, which all lie past
p, are never read. Position ids are per row (``start[b] + t``), so every row's
result is exactly what it would be alone.

A prompt is prefilled (``batch_prefill``) in chunks of at most ``prefill_chunk_tokens``, the
last one padded on the right to a multiple of ``prefill_pad_multiple``, so every forward takes
one of a few fixed widths, which ``warm_up_forwards`` runs once before the first request. On a
CPU, bf16 matmuls run through oneDNN, which JIT-compiles and caches kernels per input shape
(0.3-0.6 MB each): a server prefilling every prompt length it was sent grew by 3-5 MB per
request (``docs/benchmarks/2026-11-24-serve-soak.md``). The chunks are not slower: on the
EPYC of that page a 1000-token bf16 prefill took 7.6 s in chunks of 256 against 8.0 s in one
forward.

The mask is a 4D float mask (0 where allowed, the dtype's minimum elsewhere),
which transformers' eager and SDPA attention both take as given; a model whose
config has ``layer_types`` (Gemma 2/3, Qwen2) gets one mask per attention type.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, StaticLayer

from specdecode.engine.fast_path import FastPath
from specdecode.engine.tree import TokenTree, tree_inputs
from specdecode.errors import InvalidArgumentError, UnsupportedModelError

#: Attention implementations that take a prepared 4D float mask.
SUPPORTED_ATTENTION = ("eager", "sdpa")
#: Default longest prefill forward, in tokens (``BatchKVCache``).
PREFILL_CHUNK_TOKENS = 256
#: Default multiple a prefill chunk is padded to, in tokens (``BatchKVCache``).
PREFILL_PAD_MULTIPLE = 16
_EMBEDDING_ROWS_PER_LOOKUP = 8192


class _Window:
    """What the current forward writes: slots ``lo .. hi - 1``, at per-row positions, seeing ``kv_len`` keys.

    ``static`` (the fast path, ``engine.batch_runner``): the forward runs over slots 0 .. b - 1
    (b: its batch dimension) and sees every allocated position; ``index`` is then a
    persistent buffer of the runner's bucket, so no Python int of the window reaches a graph.
    """

    def __init__(self) -> None:
        self.lo = 0
        self.hi = 0
        self.kv_len = 0
        self.static = False
        self.index: torch.Tensor | None = None  # (b, 1, T, 1) long write positions
        self.tree: tuple | None = None  # a static tree forward: (depth (b, T) long, ancestors (b, T, T) bool)


class _RowLayer(StaticLayer):
    """One layer's keys and values, (num_slots, H, capacity, D), written at per-row positions."""

    def __init__(self, capacity: int, num_slots: int, window: _Window) -> None:
        super().__init__(max_cache_len=capacity)
        self.num_slots = num_slots
        self.window = window

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.num_heads = key_states.shape[1]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        shape = (self.num_slots, self.num_heads, self.max_cache_len)
        self.keys = torch.zeros((*shape, self.k_head_dim), dtype=self.dtype, device=self.device)
        self.values = torch.zeros((*shape, self.v_head_dim), dtype=self.dtype, device=self.device)
        if not torch.compiler.is_compiling():  # compiled graphs (CUDA graphs) write these in place
            torch._dynamo.mark_static_address(self.keys)
            torch._dynamo.mark_static_address(self.values)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write (b, H, T, D) keys/values at each row's positions; return the rows' first ``kv_len``
        keys (on the fast path, ``_Window.static``: slots 0 .. b - 1, every allocated position)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        w = self.window
        b, h, t, _ = key_states.shape
        lo, hi = (0, b) if w.static else (w.lo, w.hi)
        keys, values = self.keys[lo:hi], self.values[lo:hi]
        keys.scatter_(2, w.index.expand(b, h, t, self.k_head_dim), key_states)
        values.scatter_(2, w.index.expand(b, h, t, self.v_head_dim), value_states)
        if w.static:
            return keys, values
        return keys[:, :, : w.kv_len], values[:, :, : w.kv_len]

    def get_seq_length(self) -> int:
        return self.window.kv_len


class BatchKVCache(Cache):
    """Preallocated keys and values for ``num_slots`` rows of ``capacity`` positions each.

    Args:
        model: The model it is for (layer count, attention types and sliding window from
            its text config; tensors are allocated at the first forward, with that forward's
            dtype, device and head shapes).
        num_slots: Rows it can hold at once (>= 1).
        capacity: Positions per row (>= 1).
        prefill_chunk_tokens: The longest prefill forward, in tokens (``batch_prefill``).
        prefill_pad_multiple: A prefill chunk is padded on the right to a multiple of this many
            tokens (at most ``prefill_chunk_tokens``, which it must divide); 1 pads nothing.
        fast: The fast path's settings (``FastPath``), or None (eager forwards only). Its
            ``max_width`` positions are allocated past ``capacity``: the fast path's padding
            tokens land there near a slot's end; no real token is ever written there.

    Attributes:
        owner: The model it was made for.
        device: That model's device.
        num_slots, capacity, prefill_chunk_tokens, prefill_pad_multiple, fast: As given.
        num_positions: Positions allocated per row (``capacity``, plus ``fast.max_width``).

    Raises:
        InvalidArgumentError: If ``num_slots``, ``capacity``, ``prefill_chunk_tokens`` or
            ``prefill_pad_multiple`` is not an integer >= 1, or the pad multiple does not divide
            the chunk.
        UnsupportedModelError: If the model's attention implementation is not eager or SDPA
            (they take a prepared 4D mask), or its config names an attention type other than
            full and sliding-window attention.
    """

    #: Rolled back by position, never cropped; skipped sublayers need no placeholders (``kv_cache.is_static``).
    static = True

    torch_threads: int | None = None  # the engine keeps torch's thread count (``runner_target.torch_threads``)

    def __init__(
        self,
        model: PreTrainedModel,
        num_slots: int,
        capacity: int,
        *,
        prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS,
        prefill_pad_multiple: int = PREFILL_PAD_MULTIPLE,
        fast: FastPath | None = None,
    ) -> None:
        for name, value in (
            ("num_slots", num_slots),
            ("capacity", capacity),
            ("prefill_chunk_tokens", prefill_chunk_tokens),
            ("prefill_pad_multiple", prefill_pad_multiple),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"batch cache {name} must be an integer >= 1, got {value!r}")
        if prefill_chunk_tokens % prefill_pad_multiple:
            raise InvalidArgumentError(
                f"prefill_pad_multiple ({prefill_pad_multiple}) must divide prefill_chunk_tokens "
                f"({prefill_chunk_tokens}): allowed are its divisors"
            )
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.prefill_pad_multiple = prefill_pad_multiple
        config = model.config.get_text_config(decoder=True)
        attn = getattr(config, "_attn_implementation", None) or "eager"
        if attn not in SUPPORTED_ATTENTION:
            raise UnsupportedModelError(
                f"batched decoding builds its own 4D attention masks, which need attn_implementation in "
                f"{SUPPORTED_ATTENTION}; the model uses {attn!r} (load it with attn_implementation='sdpa')"
            )
        self.layer_types = tuple(getattr(config, "layer_types", None) or ())
        for kind in set(self.layer_types):
            if kind not in ("full_attention", "sliding_attention"):
                raise UnsupportedModelError(
                    f"batched decoding knows full and sliding-window attention; the model has {kind!r} layers"
                )
        use_window = getattr(config, "use_sliding_window", True) is not False
        self.sliding_window = getattr(config, "sliding_window", None) if use_window else None
        limit = getattr(config, "max_position_embeddings", None)
        #: Padding positions past the model's context are clamped in the position ids (never in the
        #: write positions or masks); real tokens never reach it (``check_context_length``).
        self.max_position = int(limit) - 1 if isinstance(limit, int) and limit > 0 else None
        self.owner = model  # the model whose keys it holds (self-speculative drafters check it)
        self.device = model.device
        self.num_slots = num_slots
        self.capacity = capacity
        self.fast = fast
        self.num_positions = capacity + (fast.max_width if fast is not None else 0)
        #: Counts the generations that took the cache, when one-sequence decoders share it
        #: (``SpeculativeDecoder``), so that an older one can tell it was taken over.
        self.generation = 0
        #: What engines sharing this cache keep with it (a self-speculative drafter's runner, whose
        #: compiled buckets are this cache's), by the user's key.
        self.shared: dict = {}
        self._window = _Window()
        layers = [_RowLayer(self.num_positions, num_slots, self._window) for _ in range(config.num_hidden_layers)]
        super().__init__(layers=layers)

    def prepare(self, lo: int, starts: Sequence[int], width: int, dtype: torch.dtype, device,
                trees: Sequence[TokenTree] | None = None) -> tuple:
        """Set up a forward of ``width`` tokens for slots ``lo .. lo + len(starts) - 1``.

        Args:
            lo: The first slot.
            starts: Per row, the position its first token goes to (its cached length).
            width: T, tokens per row (rows with fewer real tokens are padded on the right).
            dtype: The mask's dtype (the model's).
            device: Where the model runs.
            trees: A tree forward (``engine.tree``): per row a ``TokenTree`` of at most T nodes.
                Token t is still written at index ``start + t``, but its position id is
                ``start + depth(t)`` and it sees the row's keys before ``start`` and its own
                ancestors in the block only. None: a linear block (token t at ``start + t``,
                seeing everything before it).

        Returns:
            ``(position_ids, attention_mask)``: (b, T) long, and a (b, 1, T, kv_len) float mask
            (a dict of them by attention type for models with ``layer_types``).

        Raises:
            InvalidArgumentError: If a row would write past ``capacity`` (the batched decoder's
                ``max_length``) or the slots past ``num_slots``.
        """
        b = len(starts)
        if lo < 0 or lo + b > self.num_slots:
            raise InvalidArgumentError(f"slots {lo}..{lo + b - 1} are outside the cache's 0..{self.num_slots - 1}")
        end = max(starts) + width
        if end > self.capacity:
            raise InvalidArgumentError(
                f"a forward would write position {end - 1}, past the batch cache's capacity of {self.capacity}"
            )
        w = self._window
        w.lo, w.hi, w.kv_len, w.static = lo, lo + b, end, False
        positions = to_device(starts, device)[:, None] + torch.arange(width, device=device)
        w.index = positions[:, None, :, None]
        allowed = None
        if trees is not None:
            written = positions  # (b, T): node t's cache index start + t
            positions, ancestors = tree_inputs(trees, starts, width, device)
            context = torch.arange(end, device=device)[None, :] < written[:, :1]  # (b, end): keys before start
            allowed = context[:, None, None, :].expand(b, 1, width, end).clone()
            allowed[:, 0].scatter_(2, written[:, None, :].expand(b, width, width), ancestors)
        mask = self.attention_mask(positions, end, dtype, allowed)
        if self.max_position is not None and end - 1 > self.max_position:
            positions = positions.clamp(max=self.max_position)  # only padding lies past the context
        return positions, mask

    def static_inputs(self, dtype: torch.dtype) -> tuple:
        """The fast path's ``(position_ids, attention_mask)`` from the write positions its runner
        put in the window: (R, W) long, and (R, 1, W, num_positions) masks over every allocated
        position (a dict by layer type where the model has ``layer_types``). Traced into graphs."""
        index = self._window.index
        positions = index.view(index.shape[0], index.shape[2])
        allowed = None
        if self._window.tree is not None:  # [trees] node t at index start + t, position start + depth
            depth, ancestors = self._window.tree
            rows, width = positions.shape
            start = positions[:, :1]
            rel = torch.arange(self.num_positions, device=positions.device)[None, :] - start  # (R, P)
            block = ancestors.gather(2, rel.clamp(0, width - 1)[:, None, :].expand(rows, width, self.num_positions))
            allowed = ((rel < 0)[:, None, :] | ((rel < width)[:, None, :] & (rel >= 0)[:, None, :] & block))[:, None]
            positions = start + depth
        mask = self.attention_mask(positions, self.num_positions, dtype, allowed)
        if self.max_position is not None:
            positions = positions.clamp(max=self.max_position)  # only padding lies past the context
        return positions, mask

    def attention_mask(self, positions: torch.Tensor, kv_len: int, dtype: torch.dtype,
                       allowed: torch.Tensor | None = None):
        """The 4D float mask for queries at ``positions`` (b, T) over keys 0 .. kv_len - 1 of each row.

        Query (b, t) sees key j iff j <= positions[b, t] (and j > positions[b, t] - window in
        a sliding-window layer). Returns one (b, 1, T, kv_len) tensor, or a dict by layer type.
        ``allowed``: (b, 1, T, kv_len) bool, the keys each query may see in place of j <=
        positions[b, t] (a tree forward, ``prepare``); the window still applies.
        """
        keys = torch.arange(kv_len, device=positions.device)
        query = positions[:, None, :, None]
        causal = keys <= query if allowed is None else allowed
        low = torch.finfo(dtype).min

        def as_float(allowed: torch.Tensor) -> torch.Tensor:
            return torch.zeros(allowed.shape, dtype=dtype, device=positions.device).masked_fill_(~allowed, low)

        def sliding() -> torch.Tensor:
            return as_float(causal & (keys > query - self.sliding_window))

        if not self.layer_types:
            return sliding() if self.sliding_window else as_float(causal)
        masks = {}
        if "full_attention" in self.layer_types:
            masks["full_attention"] = as_float(causal)
        if "sliding_attention" in self.layer_types:
            masks["sliding_attention"] = sliding()
        return masks

    def move(self, src: int, dst: int, num_positions: int) -> None:
        """Copy slot ``src``'s first ``num_positions`` keys/values into slot ``dst`` (a row changes slot).

        Args:
            src, dst: Slots in 0 .. num_slots - 1 (``src`` keeps its data; it is free afterwards).
            num_positions: Positions of ``src`` to copy: its confirmed tokens (and, from ``_retire``, the pending
                token's position, which a forward run ahead may have written: ``engine.overlap``).
        """
        if src == dst or num_positions <= 0:
            return
        with torch.inference_mode():  # the tensors are inference tensors (allocated in a forward)
            for layer in self.layers:
                if layer.is_initialized:
                    layer.keys[dst, :, :num_positions] = layer.keys[src, :, :num_positions]
                    layer.values[dst, :, :num_positions] = layer.values[src, :, :num_positions]

    def keep_path(self, slot: int, start: int, path: Sequence[int]) -> None:
        """After a tree forward (``prepare(..., trees=)``): move the accepted path's keys and values
        into place, node ``path[i]`` (written at ``start + path[i]``) to ``start + i``, one gather per
        layer. Nothing moves when the path is ``0, 1, .., n - 1`` (a linear draft's prefix).

        Args:
            slot: The row's slot.
            start: Its cached length before the tree forward.
            path: Node indices from node 0 on, increasing (``tree.greedy_tree_verify``'s path).

        Raises:
            InvalidArgumentError: A path that does not start at node 0 or does not increase.
        """
        path = [int(p) for p in path]
        if not path or path[0] != 0 or any(b <= a for a, b in zip(path, path[1:])):
            raise InvalidArgumentError(f"a kept path starts at node 0 and increases, got {path!r}")
        if path == list(range(len(path))):
            return
        index = torch.tensor(path, dtype=torch.long, device=self.device) + start
        end = start + len(path)
        with torch.inference_mode():  # the tensors are inference tensors (allocated in a forward)
            for layer in self.layers:
                if layer.is_initialized:
                    layer.keys[slot, :, start:end] = layer.keys[slot, :, index]
                    layer.values[slot, :, start:end] = layer.values[slot, :, index]

    def prefill_row(self, model: PreTrainedModel, prompt_ids: torch.Tensor, slot: int, start: int = 0) -> torch.Tensor:
        """``batch_prefill(model, self, prompt_ids, slot, start)``: the engine's prefill of a row, which a
        target run outside torch does itself (``runner_target.RunnerTargetCache.prefill_row``)."""
        return batch_prefill(model, self, prompt_ids, slot, start)

    def warm_up_shapes(self, model: PreTrainedModel, widths: Sequence[int], logit_widths: set[int]) -> None:
        """``warm_up_forwards(model, self, widths, logit_widths)``: every forward shape once, before requests."""
        warm_up_forwards(model, self, widths, logit_widths)

    def load_prefix(self, slot: int, prefix) -> int:
        """Copy a transformers cache's positions into ``slot`` (a request's prompt cache).

        Args:
            slot: The slot a joining row takes (0 .. num_slots - 1).
            prefix: A ``DynamicCache`` of the same model holding a prompt's first m positions
                (``SpeculativeDecoder.prompt_cache``); read, never modified.

        Returns:
            m, the positions now in the slot; 0 (nothing copied) when a layer of ``prefix`` no
            longer holds them all (a sliding-window layer trimmed to its window), its shapes
            are another model's, or m does not fit the slot's capacity: the caller then
            prefills the whole prompt.
        """
        layers = getattr(prefix, "layers", None) or []
        m = prefix.get_seq_length() if layers else 0
        if len(layers) != len(self.layers) or not 1 <= m <= self.capacity:
            return 0
        for layer in layers:
            keys = getattr(layer, "keys", None)
            if keys is None or keys.dim() != 4 or keys.shape[0] != 1 or keys.shape[-2] != m:
                return 0
        with torch.inference_mode():  # the cache's tensors are inference tensors (allocated in a forward)
            for src, dst in zip(layers, self.layers):
                if not dst.is_initialized:
                    dst.lazy_initialization(src.keys, src.values)
                if dst.keys.shape[1] != src.keys.shape[1] or dst.keys.shape[-1] != src.keys.shape[-1]:
                    return 0
            for src, dst in zip(layers, self.layers):
                dst.keys[slot, :, :m] = src.keys[0]
                dst.values[slot, :, :m] = src.values[0]
        return m

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._window.kv_len


def to_device(values: Sequence, device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A ``dtype`` (long) tensor of (nested) Python numbers on ``device``; on CUDA through pinned memory with
    a non-blocking copy, so that building a forward's inputs never waits for the GPU."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def batch_forward(
    model: PreTrainedModel,
    cache: BatchKVCache,
    ids: torch.Tensor,
    lo: int,
    starts: Sequence[int],
    logits_to_keep: int,
    trees: Sequence[TokenTree] | None = None,
) -> torch.Tensor:
    """One forward of ``model`` over rows in slots ``lo ..``, each continuing at its own position.

    Args:
        model: The model ``cache`` belongs to (possibly in layer-skip draft mode).
        cache: Its batch cache.
        ids: (b, T) long; row i goes to slot ``lo + i`` at positions ``starts[i] .. + T - 1``.
        lo: First slot.
        starts: (b,) cached length of each row, as Python ints.
        logits_to_keep: Last positions to compute logits for.
        trees: A tree forward: per row a ``TokenTree`` (``BatchKVCache.prepare``), or None.

    Returns:
        (b, logits_to_keep, V) logits.

    Raises:
        InvalidArgumentError: As ``BatchKVCache.prepare``.
    """
    positions, mask = cache.prepare(lo, starts, ids.shape[1], model.dtype, ids.device, trees)
    out = model(
        input_ids=ids,
        position_ids=positions,
        attention_mask=mask,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=logits_to_keep,
    )
    return out.logits


def padded_width(cache: BatchKVCache, real: int, at: int) -> int:
    """The width of a prefill forward of ``real`` tokens written from position ``at``: ``real`` rounded up to a
    multiple of ``cache.prefill_pad_multiple``, short of the capacity (never less than ``real``)."""
    multiple = cache.prefill_pad_multiple
    return max(real, min(-(-real // multiple) * multiple, cache.capacity - at))


def batch_prefill(
    model: PreTrainedModel, cache: BatchKVCache, prompt_ids: torch.Tensor, slot: int, start: int = 0
) -> torch.Tensor:
    """Write one prompt into ``slot`` of ``cache``, in fixed-width chunks; return its last logits.

    The prompt goes in chunks of ``cache.prefill_chunk_tokens``; the last chunk is padded on the
    right (repeating its last token) to a multiple of ``cache.prefill_pad_multiple``, short of
    the slot's capacity. The padding lands past the prompt, where the row's next forward
    overwrites it before any query can see it (the module docstring), so the result is the
    unpadded one up to the rounding of a different matmul width. This bounds the set of
    forward shapes a stream of prompts produces (see the module docstring for why).

    Args:
        model: The model ``cache`` belongs to.
        cache: Its batch cache.
        prompt_ids: (1, n) long prompt ids, n >= 1.
        slot: The slot the row takes (its cached length becomes n).
        start: Positions 0 .. start - 1 of the slot already hold the prompt's first tokens
            (``BatchKVCache.load_prefix``, a prompt cache); only tokens start .. n - 1 are fed
            (0 <= start <= n - 1).

    Returns:
        (1, V) logits at the prompt's last token.

    Raises:
        InvalidArgumentError: As ``BatchKVCache.prepare`` (the prompt does not fit the slot).
    """
    n = prompt_ids.shape[1]
    chunk = cache.prefill_chunk_tokens
    logits = None
    for at in range(start, n, chunk):
        ids = prompt_ids[:, at : at + chunk]
        real = ids.shape[1]
        width = padded_width(cache, real, at)
        if width > real:
            ids = torch.cat([ids, ids[:, -1:].expand(1, width - real)], dim=1)
        logits = batch_forward(model, cache, ids, slot, [at], width - real + 1)[:, 0]
    return logits


def warm_up_widths(cache: BatchKVCache, max_rows: int, max_block: int) -> tuple[list[int], set[int]]:
    """Token counts a forward over ``cache`` can take: ``(widths, logit_widths)``.

    Args:
        cache: A batch cache (its prefill chunk and pad multiple).
        max_rows: Most rows of a decode-time forward.
        max_block: Longest draft block; a row's forward takes at most ``max_block + 2`` tokens.

    Returns:
        Sorted forward widths, each at most ``cache.capacity``: the prefill chunks, 1 .. the pad
        multiple, and rows x tokens per row of decode-time forwards. And the widths the LM
        head takes: the decode-time ones, and 1 .. the pad multiple (a prefill keeps its
        padding + 1 positions).
    """
    multiple, chunk = cache.prefill_pad_multiple, cache.prefill_chunk_tokens
    decode = {b * w for b in range(1, max_rows + 1) for w in range(1, max_block + 3)}
    logit_widths = decode | set(range(1, multiple + 1))
    widths = logit_widths | set(range(multiple, chunk + 1, multiple))
    return sorted(w for w in widths if w <= cache.capacity), logit_widths


@torch.inference_mode()
def warm_up_forwards(model: PreTrainedModel, cache: BatchKVCache, widths: Sequence[int], logit_widths: set[int]) -> None:
    """One forward of (1, M) tokens into slot 0 for each M in ``widths`` (``warm_up_widths``).

    On a CPU each new matmul shape JIT-compiles oneDNN kernels that stay cached (the module
    docstring); running every shape once before the first request keeps resident memory flat
    afterwards. Then it looks up every row of the input embedding once (a mapped weight file
    becomes resident page by page). Slot 0 holds garbage afterwards, which a row's prefill
    overwrites.

    Raises:
        InvalidArgumentError: As ``BatchKVCache.prepare`` (a width past the capacity).
    """
    for m in widths:
        ids = torch.zeros((1, m), dtype=torch.long, device=cache.device)
        batch_forward(model, cache, ids, 0, [0], m if m in logit_widths else 1)
    # Weights loaded from a safetensors file are mapped, not copied: a row of the input embedding
    # becomes resident when a prompt first holds its token. Look up every row once (up to
    # 0.5 GB for a 150k x 1536 bf16 table), so resident memory does not creep up with each new
    # token id a request brings.
    embedding = model.get_input_embeddings()
    rows = getattr(embedding, "num_embeddings", None)
    for start in range(0, rows or 0, _EMBEDDING_ROWS_PER_LOOKUP):
        embedding(torch.arange(start, min(rows, start + _EMBEDDING_ROWS_PER_LOOKUP), device=cache.device))
