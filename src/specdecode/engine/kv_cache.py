"""KV-cache helpers: transformers' ``DynamicCache`` (creation, rollback) and context lengths.

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

The round's own cache is ``batch_cache.BatchKVCache`` (static, one slot per row); a
``DynamicCache`` here is a prompt cache (``SpeculativeDecoder.prompt_cache``) or the search's
teacher-forced forwards.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from specdecode.errors import InvalidArgumentError


def new_cache(model: PreTrainedModel) -> DynamicCache:
    """An empty cache laid out for ``model`` (sliding layers where its config has them)."""
    cache = DynamicCache(config=model.config)
    if any(getattr(layer, "is_sliding", False) for layer in cache.layers):
        cache.activate_past_recording()
    return cache


def is_static(cache) -> bool:
    """Whether ``cache`` is rolled back by position rather than cropped (the layer-skip hooks ask).

    transformers' ``DynamicCache`` is the cropped cache, and None (no cache) is not static;
    every other cache states it with a ``static`` attribute: True for the round's
    ``batch_cache.BatchKVCache`` (whose skipped sublayers need no placeholders).

    Raises:
        InvalidArgumentError: A cache of another kind that does not state it (never guessed).
    """
    if cache is None or isinstance(cache, DynamicCache):
        return False
    static = getattr(cache, "static", None)
    if not isinstance(static, bool):
        raise InvalidArgumentError(
            f"a {type(cache).__name__} cannot be used here: the decoder knows transformers' DynamicCache and "
            "specdecode's BatchKVCache, which states that it is static"
        )
    return static


def rollback(cache, num_cached: int, num_valid: int) -> int:
    """Drop cached positions past ``num_valid``; returns the new cached length.

    Args:
        cache: The ``DynamicCache`` to trim in place.
        num_cached: Positions it holds now.
        num_valid: Positions whose keys and values belong to confirmed tokens.

    Returns:
        ``min(num_cached, num_valid)``; or 0 when a sliding-window layer no longer holds
        every key the position after ``num_valid`` attends to, and the cache was emptied.
    """
    excess = max(num_cached - num_valid, 0)
    if excess and _loses_window(cache, num_cached, num_valid):
        cache.crop(-num_cached)
        return 0
    cache.crop(-excess)
    return num_cached - excess


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
