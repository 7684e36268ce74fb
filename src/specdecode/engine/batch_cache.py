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

The mask is a 4D float mask (0 where allowed, the dtype's minimum elsewhere),
which transformers' eager and SDPA attention both take as given; a model whose
config has ``layer_types`` (Gemma 2/3, Qwen2) gets one mask per attention type.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, StaticLayer

from specdecode.errors import InvalidArgumentError, UnsupportedModelError

#: Attention implementations that take a prepared 4D float mask.
SUPPORTED_ATTENTION = ("eager", "sdpa")


class _Window:
    """What the current forward writes: slots ``lo .. hi - 1``, at per-row positions, seeing ``kv_len`` keys."""

    def __init__(self) -> None:
        self.lo = 0
        self.hi = 0
        self.kv_len = 0
        self.index: torch.Tensor | None = None  # (b, 1, T, 1) long write positions


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
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write (b, H, T, D) keys/values at each row's positions; return the rows' first ``kv_len`` keys."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        w = self.window
        keys, values = self.keys[w.lo : w.hi], self.values[w.lo : w.hi]
        b, h, t, _ = key_states.shape
        keys.scatter_(2, w.index.expand(b, h, t, self.k_head_dim), key_states)
        values.scatter_(2, w.index.expand(b, h, t, self.v_head_dim), value_states)
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

    Attributes:
        owner: The model it was made for.
        device: That model's device.
        num_slots, capacity: As given.

    Raises:
        InvalidArgumentError: If ``num_slots`` or ``capacity`` is not an integer >= 1.
        UnsupportedModelError: If the model's attention implementation is not eager or SDPA
            (they take a prepared 4D mask), or its config names an attention type other than
            full and sliding-window attention.
    """

    #: Rolled back by position, never cropped; skipped sublayers need no placeholders.
    rolls_back_by_position = True

    def __init__(self, model: PreTrainedModel, num_slots: int, capacity: int) -> None:
        for name, value in (("num_slots", num_slots), ("capacity", capacity)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"batch cache {name} must be an integer >= 1, got {value!r}")
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
        self._window = _Window()
        layers = [_RowLayer(capacity, num_slots, self._window) for _ in range(config.num_hidden_layers)]
        super().__init__(layers=layers)

    def prepare(self, lo: int, starts: Sequence[int], width: int, dtype: torch.dtype, device) -> tuple:
        """Set up a forward of ``width`` tokens for slots ``lo .. lo + len(starts) - 1``.

        Args:
            lo: The first slot.
            starts: Per row, the position its first token goes to (its cached length).
            width: T, tokens per row (rows with fewer real tokens are padded on the right).
            dtype: The mask's dtype (the model's).
            device: Where the model runs.

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
        w.lo, w.hi, w.kv_len = lo, lo + b, end
        positions = to_device(starts, device)[:, None] + torch.arange(width, device=device)
        w.index = positions[:, None, :, None]
        mask = self.attention_mask(positions, end, dtype)
        if self.max_position is not None and end - 1 > self.max_position:
            positions = positions.clamp(max=self.max_position)  # only padding lies past the context
        return positions, mask

    def attention_mask(self, positions: torch.Tensor, kv_len: int, dtype: torch.dtype):
        """The 4D float mask for queries at ``positions`` (b, T) over keys 0 .. kv_len - 1 of each row.

        Query (b, t) sees key j iff j <= positions[b, t] (and j > positions[b, t] - window in
        a sliding-window layer). Returns one (b, 1, T, kv_len) tensor, or a dict by layer type.
        """
        keys = torch.arange(kv_len, device=positions.device)
        query = positions[:, None, :, None]
        causal = keys <= query
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
            num_positions: Positions of ``src`` that hold confirmed tokens.
        """
        if src == dst or num_positions <= 0:
            return
        with torch.inference_mode():  # the tensors are inference tensors (allocated in a forward)
            for layer in self.layers:
                if layer.is_initialized:
                    layer.keys[dst, :, :num_positions] = layer.keys[src, :, :num_positions]
                    layer.values[dst, :, :num_positions] = layer.values[src, :, :num_positions]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._window.kv_len


def to_device(values: Sequence, device) -> torch.Tensor:
    """A long tensor of (nested) Python ints on ``device``; on CUDA through pinned memory with a
    non-blocking copy, so that building a forward's inputs never waits for the GPU."""
    host = torch.tensor(values, dtype=torch.long)
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
) -> torch.Tensor:
    """One forward of ``model`` over rows in slots ``lo ..``, each continuing at its own position.

    Args:
        model: The model ``cache`` belongs to (possibly in layer-skip draft mode).
        cache: Its batch cache.
        ids: (b, T) long; row i goes to slot ``lo + i`` at positions ``starts[i] .. + T - 1``.
        lo: First slot.
        starts: (b,) cached length of each row, as Python ints.
        logits_to_keep: Last positions to compute logits for.

    Returns:
        (b, logits_to_keep, V) logits.

    Raises:
        InvalidArgumentError: As ``BatchKVCache.prepare``.
    """
    positions, mask = cache.prepare(lo, starts, ids.shape[1], model.dtype, ids.device)
    out = model(
        input_ids=ids,
        position_ids=positions,
        attention_mask=mask,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=logits_to_keep,
    )
    return out.logits
