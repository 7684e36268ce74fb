"""Self-speculative drafting by skipping layers of the target model.

Draft & Verify (Zhang et al. 2023, "Draft & Verify: Lossless Large Language Model
Acceleration via Self-Speculative Decoding", arXiv 2309.08168) drafts with the
target model itself, bypassing a chosen set of attention and MLP sublayers, then
verifies the draft with the full model. No second model, no extra weights.

A skipped sublayer contributes nothing to the residual stream: its forward is
replaced, for the duration of ``draft_mode``, by one that returns zeros of the
output's shape. Every pre-norm decoder layer in transformers adds the sublayer
output to the residual (``h = h + f(norm(h))``); Gemma 2/3 first apply a
post-sublayer RMSNorm, and ``RMSNorm(0) = 0 * rsqrt(0 + eps) * w = 0``, so zeros
still add nothing. A layer with both sublayers skipped is bypassed as a whole
(its norms are not even computed). The stock modeling code runs unchanged; only
``forward`` attributes of module instances are swapped, and restored in ``finally``.

Skip sets are written ``attn=2,15,18;mlp=2,15,18`` or stored as JSON, either bare
(``{"attn": [...], "mlp": [...]}``) or inside a result file
(``{"skip_set": {"attn": [...], "mlp": [...]}, "model": ..., ...}``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache, PreTrainedModel

from specdecode.drafters.base import Draft, Drafter, ExitPolicy, draft_autoregressively
from specdecode.engine import kv_cache
from specdecode.engine.batch_cache import BatchKVCache, batch_forward
from specdecode.engine.fast_path import ModelRunner
from specdecode.errors import InvalidArgumentError, UnsupportedModelError
from specdecode.engine.sampling import Sampler

logger = logging.getLogger(__name__)

SUBLAYERS = ("attn", "mlp")


def decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    """The decoder layers of a transformers causal LM, found without naming the architecture.

    Tries ``model.get_decoder().layers`` then ``model.model.layers``; each layer
    must have ``self_attn`` and ``mlp`` submodules (true of Llama, Qwen2, Mistral,
    Gemma 2/3 and most decoder-only models in transformers).

    Raises:
        UnsupportedModelError: If no such list of layers is found.
    """
    candidates = []
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        candidates.append(get_decoder())
    candidates.append(getattr(model, "model", None))
    for module in candidates:
        layers = getattr(module, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0:
            if all(hasattr(layer, "self_attn") and hasattr(layer, "mlp") for layer in layers):
                return layers
    raise UnsupportedModelError(
        f"cannot find the decoder layers of {type(model).__name__}: layer skipping needs "
        "model.get_decoder().layers (or model.model.layers) whose layers have .self_attn and .mlp"
    )


def _index_list(value, where: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise InvalidArgumentError(f"{where} must be a list of layer indices, got {value!r}")
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int):
            raise InvalidArgumentError(f"{where} must hold integer layer indices, got {v!r} in {list(value)!r}")
        out.append(v)
    return tuple(out)


@dataclass(frozen=True)
class SkipSet:
    """Which sublayers the draft pass skips (layer indices count from 0).

    Attributes:
        attn: Indices of decoder layers whose self-attention is skipped, ascending.
        mlp: Indices of decoder layers whose MLP (feed-forward) is skipped, ascending.

    Raises:
        InvalidArgumentError: On a negative index, a repeated index within one list,
            or when both lists are empty (that would draft with the full model).
            The upper bound (L - 1) is checked by ``check(num_layers)``, which every
            user of a skip set calls once the model is known.
    """

    attn: tuple[int, ...] = ()
    mlp: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in SUBLAYERS:
            idx = _index_list(getattr(self, name), f"skip set {name!r}")
            for i in idx:
                if i < 0:
                    raise InvalidArgumentError(
                        f"skip set {name!r} has layer index {i}; indices must be >= 0 (allowed 0..L-1)"
                    )
            seen: set[int] = set()
            for i in idx:
                if i in seen:
                    raise InvalidArgumentError(f"skip set {name!r} repeats layer index {i} in {list(idx)!r}")
                seen.add(i)
            object.__setattr__(self, name, tuple(sorted(idx)))
        if not self.attn and not self.mlp:
            raise InvalidArgumentError(
                "the skip set is empty: name at least one attention or MLP sublayer to skip, "
                "e.g. 'attn=2,5;mlp=3'"
            )

    @classmethod
    def parse(cls, text: str) -> SkipSet:
        """From ``'attn=2,15,18;mlp=2,15,18'``; either part may be left out or empty (``'mlp='``).

        Raises:
            InvalidArgumentError: Malformed text (unknown part name, non-integer index,
                a part given twice), or any error of the constructor.
        """
        if not isinstance(text, str) or not text.strip():
            raise InvalidArgumentError(f"skip set text is empty; expected e.g. 'attn=2,15;mlp=3', got {text!r}")
        parts: dict[str, tuple[int, ...]] = {}
        for chunk in text.split(";"):
            chunk = chunk.strip()
            if not chunk:
                continue
            name, eq, values = chunk.partition("=")
            name = name.strip()
            if not eq or name not in SUBLAYERS:
                raise InvalidArgumentError(
                    f"malformed skip set {text!r}: part {chunk!r} must be 'attn=i,j,...' or 'mlp=i,j,...'"
                )
            if name in parts:
                raise InvalidArgumentError(f"malformed skip set {text!r}: {name!r} is given twice")
            idx = []
            for v in values.split(","):
                v = v.strip()
                if not v:
                    continue
                try:
                    idx.append(int(v))
                except ValueError:
                    raise InvalidArgumentError(
                        f"malformed skip set {text!r}: {v!r} in {name!r} is not an integer layer index"
                    ) from None
            parts[name] = tuple(idx)
        return cls(**parts)

    @classmethod
    def from_dict(cls, obj) -> SkipSet:
        """From ``{"attn": [...], "mlp": [...]}`` or ``{"skip_set": {...}, <other fields>}``.

        Raises:
            InvalidArgumentError: If neither form is found, an entry is not a list of
                integers, or a key other than "attn"/"mlp" appears in the skip set.
        """
        if not isinstance(obj, dict):
            raise InvalidArgumentError(f"a skip set must be a JSON object, got {type(obj).__name__}: {obj!r}")
        inner = obj["skip_set"] if "skip_set" in obj else obj
        if not isinstance(inner, dict) or not any(k in inner for k in SUBLAYERS):
            raise InvalidArgumentError(
                'a skip set needs "attn" and/or "mlp" lists of layer indices, either at the top level or '
                f'under "skip_set"; got keys {sorted(obj) if isinstance(obj, dict) else obj!r}'
            )
        if inner is not obj:
            unknown = sorted(set(inner) - set(SUBLAYERS))
            if unknown:
                raise InvalidArgumentError(f'"skip_set" has unknown key(s) {unknown}; allowed: "attn", "mlp"')
        return cls(**{k: _index_list(inner.get(k, []), f"skip set {k!r}") for k in SUBLAYERS})

    @classmethod
    def from_json(cls, path: str | Path) -> SkipSet:
        """Read a skip set from a JSON file (either form of ``from_dict``).

        Raises:
            InvalidArgumentError: Missing or unreadable file, invalid JSON, or a bad skip set.
        """
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise InvalidArgumentError(f"cannot read skip-set file {str(path)!r}: {e.strerror or e}") from None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise InvalidArgumentError(
                f"skip-set file {str(path)!r} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
            ) from None
        try:
            return cls.from_dict(obj)
        except InvalidArgumentError as e:
            raise InvalidArgumentError(f"skip-set file {str(path)!r}: {e}") from None

    def check(self, num_layers: int) -> None:
        """Raise unless every index is in 0..num_layers-1.

        Raises:
            InvalidArgumentError: Naming the first out-of-range index and the allowed range.
        """
        for name in SUBLAYERS:
            for i in getattr(self, name):
                if i >= num_layers:
                    raise InvalidArgumentError(
                        f"skip set {name!r} has layer index {i}, out of range: the model has {num_layers} "
                        f"decoder layers, allowed 0..{num_layers - 1}"
                    )

    def to_dict(self) -> dict[str, list[int]]:
        """``{"attn": [...], "mlp": [...]}``, the bare JSON form."""
        return {"attn": list(self.attn), "mlp": list(self.mlp)}

    def __str__(self) -> str:
        return f"attn={','.join(map(str, self.attn))};mlp={','.join(map(str, self.mlp))}"


def _append_placeholder(cache, layer_idx: int, hidden_states: torch.Tensor, attn: torch.nn.Module) -> None:
    """Append zero keys/values for ``hidden_states``' (batch, tokens, hidden) positions to cache layer
    ``layer_idx`` so all layers keep one length (dtype and device: the hidden states', which also holds
    for a quantized attention whose weights are int8 buffers)."""
    num_new = hidden_states.shape[1]
    if cache is None or kv_cache.is_static(cache):  # a static cache's one position serves every layer
        return
    layer = cache.layers[layer_idx] if layer_idx < len(cache.layers) else None
    keys = getattr(layer, "keys", None) if getattr(layer, "is_initialized", False) else None
    if keys is not None and keys.dim() == 4:  # (batch, kv heads, positions, head dim)
        b, h, _, d = keys.shape
        zeros = keys.new_zeros((b, h, num_new, d))
    else:  # a cache that has not seen a forward yet (batch size 1): shape from the module's config
        config = attn.config
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(attn, "head_dim", None) or config.hidden_size // config.num_attention_heads
        zeros = hidden_states.new_zeros((1, heads, num_new, head_dim))
    cache.update(zeros, zeros, layer_idx)


def _cache_arg(kwargs: dict):
    # transformers' decoder layers pass the cache by keyword (older releases: singular name).
    cache = kwargs.get("past_key_values")
    return cache if cache is not None else kwargs.get("past_key_value")


def _skipped_attention(attn: torch.nn.Module, layer_idx: int) -> Callable:
    def forward(hidden_states, *args, **kwargs):
        # Zero output (adds nothing to the residual, also through Gemma's post-norm),
        # and a placeholder cache entry so this layer's length follows the others.
        _append_placeholder(_cache_arg(kwargs), layer_idx, hidden_states, attn)
        return torch.zeros_like(hidden_states), None

    return forward


def _skipped_mlp(hidden_states, *args, **kwargs):
    return torch.zeros_like(hidden_states)


def _bypassed_layer(attn: torch.nn.Module, layer_idx: int) -> Callable:
    def forward(hidden_states, *args, **kwargs):
        _append_placeholder(_cache_arg(kwargs), layer_idx, hidden_states, attn)
        return hidden_states

    return forward


@contextmanager
def draft_mode(model: PreTrainedModel, skip_set: SkipSet) -> Iterator[None]:
    """Within the block, ``model`` runs with the sublayers of ``skip_set`` skipped.

    A skipped attention sublayer returns zeros and appends zero placeholder
    keys/values (one per input position) to its layer of the cache passed to the
    forward, so every cache layer keeps the same length; a skipped MLP returns
    zeros; a layer skipped in both is bypassed whole (placeholders included).
    Everything is restored when the block exits, also on an exception.

    It swaps ``forward`` attributes on the model's module instances, so another
    thread running the same model meanwhile would run in draft mode too; nesting
    is fine (each level restores what it found).

    Args:
        model: A transformers causal LM (see ``decoder_layers``).
        skip_set: Sublayers to skip; indices must be in 0..L-1.

    Raises:
        InvalidArgumentError: If an index is out of range (checked before anything changes).
        UnsupportedModelError: If the decoder layers cannot be found.
    """
    layers = decoder_layers(model)
    skip_set.check(len(layers))
    attn, mlp = set(skip_set.attn), set(skip_set.mlp)
    patched: list[tuple[torch.nn.Module, object]] = []  # (module, its own previous forward or None)

    def patch(module: torch.nn.Module, forward: Callable) -> None:
        patched.append((module, module.__dict__.get("forward")))
        module.forward = forward

    try:
        for i, layer in enumerate(layers):
            layer_idx = getattr(layer.self_attn, "layer_idx", i)
            if i in attn and i in mlp:
                patch(layer, _bypassed_layer(layer.self_attn, layer_idx))
            elif i in attn:
                patch(layer.self_attn, _skipped_attention(layer.self_attn, layer_idx))
            elif i in mlp:
                patch(layer.mlp, _skipped_mlp)
        yield
    finally:
        for module, previous in reversed(patched):
            if previous is None:
                del module.forward
            else:
                module.forward = previous


class LayerSkipDrafter(Drafter):
    """Drafts with the target model itself, some sublayers skipped (Draft & Verify).

    KV cache: the drafter has none of its own. It writes into the TARGET's cache
    (given to ``begin``: a ``DynamicCache``, or the fast path's ``StaticKVCache``)
    and restores it before ``propose`` returns, so drafting costs no prefill and no
    extra memory beyond the block.

    Args:
        model: The target model (the one the decoder verifies with), in eval mode.
        skip_set: Sublayers skipped while drafting.
        runner: Runs the draft-mode forwards (a ``ModelRunner`` of ``model``, not the
            decoder's own: its compiled graphs are those of the skipped model, one set per
            skip set); None makes one with the device's default ``compile``. Used on the fast
            path when the target cache is static; eager otherwise.

    Raises:
        InvalidArgumentError: If a skip-set index is outside 0..L-1 (L decoder layers).
        UnsupportedModelError: If the decoder layers cannot be found.
    """

    supports_exit_policy = True
    who = "layer-skip draft"

    def __init__(self, model: PreTrainedModel, skip_set: SkipSet, runner: ModelRunner | None = None) -> None:
        self.num_layers = len(decoder_layers(model))
        skip_set.check(self.num_layers)
        self.model = model
        self.skip_set = skip_set
        self.runner = runner if runner is not None else ModelRunner(model, buckets=(1,), name="layer-skip draft")
        self._cache: DynamicCache | None = None
        self._sampler: Sampler | None = None

    def begin(self, prompt_ids: torch.Tensor, sampler: Sampler, target_cache: DynamicCache) -> None:
        """Start a sequence. ``target_cache`` must be the cache of ``model`` (the decoder's target).

        Raises:
            InvalidArgumentError: If ``target_cache`` has a layer count other than the model's.
        """
        if len(target_cache.layers) != self.num_layers:
            raise InvalidArgumentError(
                f"the target cache has {len(target_cache.layers)} layers but the layer-skip drafter's model has "
                f"{self.num_layers}: a self-speculative drafter must wrap the decoder's own target model"
            )
        self._cache = target_cache
        self._sampler = sampler
        self.num_forwards = 0

    @torch.inference_mode()
    def propose(self, sequence: torch.Tensor, max_tokens: int, exit_policy: ExitPolicy | None = None) -> Draft:
        """Draft up to ``max_tokens`` tokens after ``sequence`` (1, L) in draft mode.

        Args:
            sequence: (1, L) long; the target cache holds its first L - 1 positions.
            max_tokens: Most tokens to draft (>= 1).
            exit_policy: Optional object with ``should_stop(top_prob) -> bool``
                (``AdaptiveDraftExit``): drafting ends after the first token whose
                top probability is below its threshold.

        Returns:
            A ``Draft`` of k <= max_tokens tokens; ``probs`` (k, V) when sampling.
        """
        cache, sampler = self._cache, self._sampler
        # KV cache sharing. The cache is the target's: it holds the confirmed positions
        # 0 .. L-2 with full-model keys/values, which are exactly what the draft pass
        # should attend to in its non-skipped layers (Draft & Verify reuses them too).
        # Each draft forward appends its positions to EVERY layer: real (draft-mode)
        # keys/values in the layers that run attention, zero placeholders in skipped
        # ones (draft_mode does that). Equal lengths matter because transformers derives
        # the position ids and the attention-mask sizes from the cache length
        # (get_seq_length / get_mask_sizes of one layer per attention type), and
        # DynamicCache.crop removes the same count from every layer. The draft-mode
        # entries are wrong for the full model, so before returning we crop back by
        # exactly what drafting appended (kv_cache.truncate): the verification forward
        # then sees the cache as it was and writes full-model entries for the same
        # positions. No crop happens between draft forwards: sliding-window layers are in
        # "past recording" mode (kv_cache.new_cache) and keep every entry until the one
        # crop, which also trims them back to the window; a crop(0) in between would drop
        # pre-draft entries still needed after the rollback.
        # A static cache (the fast path) is simpler: one write position serves all layers,
        # so skipped layers need no placeholders, and restoring is moving that position
        # back. Its cache never empties, so it holds exactly L - 1 positions here.
        if isinstance(cache, BatchKVCache):  # the batched round at B = 1 (a wrapped drafter): slot 0
            return self._propose_in_slot(cache, sequence, max_tokens, exit_policy)
        start = sequence.shape[1] - 1 if kv_cache.is_static(cache) else cache.get_seq_length()
        try:
            with draft_mode(self.model, self.skip_set):
                draft = draft_autoregressively(
                    self.runner, cache, sequence[:, start:], max_tokens, sampler, exit_policy, "layer-skip draft"
                )
        finally:
            kv_cache.truncate(cache, start)
        self.num_forwards += len(draft)
        return draft

    def _propose_in_slot(self, cache: BatchKVCache, sequence: torch.Tensor, max_tokens: int,
                         exit_policy: ExitPolicy | None) -> Draft:
        """Draft into slot 0 of the batched engine's cache, eagerly, after its L - 1 confirmed
        positions; the positions drafted into lie past them, where the verification overwrites them."""
        position = [sequence.shape[1] - 1]

        def forward(ids: torch.Tensor, _cache, logits_to_keep: int) -> torch.Tensor:
            logits = batch_forward(self.model, cache, ids, 0, position, logits_to_keep)
            position[0] += ids.shape[1]
            return logits

        with draft_mode(self.model, self.skip_set):
            draft = draft_autoregressively(
                forward, cache, sequence[:, position[0]:], max_tokens, self._sampler, exit_policy, self.who
            )
        self.num_forwards += len(draft)
        return draft

    def batch_drafter(self):
        """``drafters.batched.BatchLayerSkipDrafter`` with this skip set (the batched round's form);
        None for a subclass that changes a call (it is then driven itself, drafting into slot 0)."""
        from specdecode.drafters.batched import BatchLayerSkipDrafter  # it imports this module

        if not _calls_unchanged(self, LayerSkipDrafter):
            return None
        return BatchLayerSkipDrafter(self.model, self.skip_set)

    @property
    def compile_time_s(self) -> float:
        return self.runner.compile_time_s

    def rollback(self, num_valid: int) -> None:
        """Nothing to do: the decoder rolls back the shared target cache itself."""


def _calls_unchanged(drafter, base: type) -> bool:
    """Whether ``drafter``'s class keeps ``base``'s ``begin``, ``propose`` and ``rollback``."""
    return all(getattr(type(drafter), name) is getattr(base, name) for name in ("begin", "propose", "rollback"))


def resolve_skip_set(skip_set: SkipSet | None, skip_layers: str | None, skip_config: str | Path | None) -> SkipSet:
    """The one skip set given as a ``SkipSet``, as text or as a JSON file (``SpeculativeGenerator.make_drafter``).

    Raises:
        InvalidArgumentError: None given, or more than one; ``SkipSet.parse`` / ``from_json``'s errors.
    """
    given = [v for v in (skip_set, skip_layers, skip_config) if v is not None]
    if not given:
        raise InvalidArgumentError(
            "method 'layer-skip' needs a skip set: pass skip_layers='attn=2,15;mlp=3' "
            "(--skip-layers), skip_config=FILE.json (--skip-config) or skip_set=SkipSet(...)"
        )
    if len(given) > 1:
        raise InvalidArgumentError(
            "give the layer-skip skip set once: skip_set, skip_layers (--skip-layers) and "
            "skip_config (--skip-config) exclude each other"
        )
    if skip_layers is not None:
        return SkipSet.parse(skip_layers)
    if skip_config is not None:
        return SkipSet.from_json(skip_config)
    return skip_set
