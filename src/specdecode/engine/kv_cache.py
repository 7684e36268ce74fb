"""KV-cache creation and rollback: transformers' ``DynamicCache``, and a static cache.

**Dynamic cache (the eager path).**

Rollback after a rejection is ``DynamicCache.crop(-num_rejected)``. Sliding-window
layers (Gemma 2/3, Mistral) drop old keys as they go, which would make a crop
past the window impossible, so for models that have such layers the cache is
put in transformers' "past recording" mode: every layer keeps what it needs
until the next ``crop``, and each crop (including ``crop(0)``) trims it back
to the window. Every forward of a speculative round is therefore followed by
exactly one ``rollback`` call, also when nothing is rejected.

A rollback deeper than one round (a banned-word rollback, ``engine.banned_words``)
can reach past what a sliding layer kept: it holds the last ``window - 1``
positions after a trim, so going back r more positions would leave its window r
keys short. Then ``rollback`` empties the whole cache and returns 0, and the
caller re-encodes the sequence (rare; exact either way).

**Static cache (the fast path, ``StaticKVCache``).** gpt-fast's design on
transformers' ``StaticLayer``: every layer's keys and values live in tensors of
``capacity`` positions allocated once, and ONE write-position tensor, shared by
all layers, says where the next forward writes. Rolling back is setting that
position; rejected positions stay in memory and are overwritten by the next
round. They are never read: the causal mask lets a query at position p attend to
keys 0..p only, and every position <= p was written by a confirmed token (or by
the same forward). Every layer is a full-length layer, sliding-window layers
included: transformers builds their sliding mask over the full length, so they
stay exact however far a rollback goes, at the memory cost of full-length keys.
Because the position is shared, a layer whose attention is skipped (layer-skip
drafting) needs no placeholder entries to keep in step.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, StaticLayer

from specdecode.errors import InvalidArgumentError


def new_cache(model: PreTrainedModel) -> DynamicCache:
    """An empty cache laid out for ``model`` (sliding layers where its config has them)."""
    cache = DynamicCache(config=model.config)
    if any(getattr(layer, "is_sliding", False) for layer in cache.layers):
        cache.activate_past_recording()
    return cache


class _SharedPositionLayer(StaticLayer):
    """A ``StaticLayer`` that writes at a position tensor shared by all layers and never moves it.

    ``StaticCache``'s layers each keep and advance their own counter; here the cache
    (``StaticKVCache``) owns the one position and advances it once per forward.
    """

    def __init__(self, max_cache_len: int, position: torch.Tensor) -> None:
        super().__init__(max_cache_len=max_cache_len)
        self.cumulative_length = position

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        position = self.cumulative_length
        super().lazy_initialization(key_states, value_states)
        self.cumulative_length = position  # the parent moves it to the device: keep the shared one

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write (B, H, w, D) keys/values at positions ``position .. position + w - 1``; return all of them."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        index = torch.arange(key_states.shape[-2], device=self.device) + self.cumulative_length
        self.keys.index_copy_(2, index, key_states)
        self.values.index_copy_(2, index, value_states)
        return self.keys, self.values


class StaticKVCache(Cache):
    """A preallocated cache of ``capacity`` positions per layer, rolled back by moving one position.

    Args:
        model: The model it is for (layer count from its text config; tensors are allocated
            at the first forward, with that forward's dtype, device and head shapes).
        capacity: Positions per layer (>= 1).

    Attributes:
        position: 0-dim long tensor on the model's device: positions written so far, where
            the next forward writes. ``get_seq_length()`` returns it, so transformers derives
            position ids from it without a host sync.
        capacity: As given.
        generation: Counts the generations that took this cache (``ModelRunner.new_cache``),
            so that a generation can tell when another one reused it under it.

    Raises:
        InvalidArgumentError: If ``capacity`` < 1.
    """

    #: Rolled back by position, never cropped (``is_static``); ``fast_path.ModelRunner.new_cache`` makes
    #: one exactly when the runner's ``static_cache`` is True.
    static = True

    def __init__(self, model: PreTrainedModel, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise InvalidArgumentError(f"static cache capacity must be an integer >= 1, got {capacity!r}")
        config = model.config.get_text_config(decoder=True)
        self.capacity = capacity
        self.generation = 0
        # An inference tensor, like the keys and values the first forward allocates (forwards
        # run under inference mode): compiled graphs then see one kind of tensor throughout.
        with torch.inference_mode():
            self.position = torch.zeros((), dtype=torch.long, device=model.device)
        torch._dynamo.mark_static_address(self.position)
        layers = [_SharedPositionLayer(capacity, self.position) for _ in range(config.num_hidden_layers)]
        super().__init__(layers=layers)

    def advance(self, num_tokens: int) -> None:
        """After a forward over ``num_tokens`` positions: the next one writes after them (no host sync)."""
        with torch.inference_mode():
            self.position.add_(num_tokens)

    def set_length(self, num_positions: int) -> None:
        """Roll back (or forward) to ``num_positions`` written positions (no host sync)."""
        with torch.inference_mode():
            self.position.fill_(num_positions)


def is_static(cache) -> bool:
    """Whether ``cache`` is rolled back by position rather than cropped, for code that holds a cache
    but not the runner that made it (``protocol.ModelRunnerProtocol.static_cache`` decides, and the
    cache carries the decision).

    transformers' ``DynamicCache`` is the cropped cache, and None (no cache) is not static;
    every other cache states it with a ``static`` attribute: True for ``StaticKVCache`` and the
    batched engine's ``batch_cache.BatchKVCache`` (whose skipped sublayers need no placeholders
    either), False for ``models.llama_cpp.LlamaCppCache``.

    Raises:
        InvalidArgumentError: A cache of another kind that does not state it (never guessed).
    """
    if cache is None or isinstance(cache, DynamicCache):
        return False
    static = getattr(cache, "static", None)
    if not isinstance(static, bool):
        raise InvalidArgumentError(
            f"a {type(cache).__name__} cannot be used here: the decoder knows transformers' DynamicCache and "
            "specdecode's own caches (StaticKVCache, BatchKVCache), which state whether they are static"
        )
    return static


def rollback(cache, num_cached: int, num_valid: int) -> int:
    """Drop cached positions past ``num_valid``; returns the new cached length.

    A ``StaticKVCache`` only moves its write position (nothing is copied or freed), and
    never loses a window.

    Args:
        cache: The cache to trim in place.
        num_cached: Positions it holds now.
        num_valid: Positions whose keys and values belong to confirmed tokens.

    Returns:
        ``min(num_cached, num_valid)``; or 0 when a sliding-window layer no longer holds
        every key the position after ``num_valid`` attends to, and the cache was emptied.
    """
    excess = max(num_cached - num_valid, 0)
    if is_static(cache):
        if excess:
            cache.set_length(num_valid)
        return num_cached - excess
    if excess and _loses_window(cache, num_cached, num_valid):
        cache.crop(-num_cached)
        return 0
    cache.crop(-excess)
    return num_cached - excess


def truncate(cache, num_positions: int) -> None:
    """Cut every layer of ``cache`` back to ``num_positions`` (after drafting into a shared cache).

    A dynamic cache's layers are each cropped by their own excess: equal after a normal
    block, different after a forward that failed midway. A static cache moves its position.
    """
    if is_static(cache):
        cache.set_length(num_positions)
        return
    for layer in cache.layers:
        layer.crop(-(layer.get_seq_length() - num_positions))


def _loses_window(cache: DynamicCache, num_cached: int, num_valid: int) -> bool:
    """Whether a sliding layer lacks keys that position ``num_valid`` attends to once cropped there."""
    for layer in cache.layers:
        if not getattr(layer, "is_sliding", False) or getattr(layer, "keys", None) is None:
            continue
        oldest_kept = num_cached - layer.keys.shape[-2]
        if oldest_kept > max(0, num_valid - (layer.sliding_window - 1)):
            return True
    return False


def context_length(model: PreTrainedModel) -> int | None:
    """The most positions ``model`` is documented to handle: its config's ``max_position_embeddings``.

    Returns None when the (text) config does not state it. A target run outside torch
    (``protocol.TargetRunnerProtocol``, llama.cpp) states its own ``context_length`` (its GGUF
    file's training context).
    """
    own = getattr(model, "context_length", None)
    if not isinstance(model, torch.nn.Module) and isinstance(own, int):
        return own if own > 0 else None
    config = model.config
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        config = get_text(decoder=True)
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def check_context_length(model: PreTrainedModel, num_prompt_tokens: int, max_new_tokens: int) -> None:
    """Raise unless the prompt plus ``max_new_tokens`` fits the model's context length.

    Called before any forward, so a generation never runs past the positions the model
    was trained for (transformers would keep going, silently, on rotary positions it
    never saw).

    Raises:
        InvalidArgumentError: If ``num_prompt_tokens + max_new_tokens`` exceeds
            ``context_length(model)``; the message names both numbers and the limit.
    """
    limit = context_length(model)
    if limit is not None and num_prompt_tokens + max_new_tokens > limit:
        raise InvalidArgumentError(
            f"the prompt has {num_prompt_tokens} tokens and max_new_tokens is {max_new_tokens}: "
            f"{num_prompt_tokens + max_new_tokens} positions, past the model's context length of {limit} "
            f"(max_position_embeddings); shorten the prompt or lower max_new_tokens to at most "
            f"{max(limit - num_prompt_tokens, 0)}"
        )
