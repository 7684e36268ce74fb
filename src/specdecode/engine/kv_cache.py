"""KV-cache creation and rollback on top of transformers' ``DynamicCache``.

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
"""

from __future__ import annotations

from transformers import DynamicCache, PreTrainedModel


def new_cache(model: PreTrainedModel) -> DynamicCache:
    """An empty cache laid out for ``model`` (sliding layers where its config has them)."""
    cache = DynamicCache(config=model.config)
    if any(getattr(layer, "is_sliding", False) for layer in cache.layers):
        cache.activate_past_recording()
    return cache


def rollback(cache: DynamicCache, num_cached: int, num_valid: int) -> int:
    """Drop cached positions past ``num_valid``; returns the new cached length.

    Args:
        cache: The cache to trim in place.
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
