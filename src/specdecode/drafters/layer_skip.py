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
from transformers import PreTrainedModel

from specdecode.drafters.base import Draft, Drafter, draft_batch, first_forward_greedy
from specdecode.engine import kv_cache
from specdecode.engine.batch_cache import BatchKVCache, to_device
from specdecode.engine.batch_runner import BatchRunner
from specdecode.engine.sampling import Sampler, logits_width
from specdecode.errors import InvalidArgumentError, UnsupportedModelError

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
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int):
            raise InvalidArgumentError(f"{where} must hold integer layer indices, got {v!r} in {list(value)!r}")
    return tuple(value)


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
            for n, i in enumerate(idx):
                if i in idx[:n]:
                    raise InvalidArgumentError(f"skip set {name!r} repeats layer index {i} in {list(idx)!r}")
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


def _skipped(attn: torch.nn.Module, layer_idx: int, whole_layer: bool) -> Callable:
    """A skipped attention sublayer's forward: zero output (adds nothing to the residual, also through Gemma's
    post-norm); with ``whole_layer``, a bypassed layer's (its input). Either appends a placeholder cache entry
    so this layer's length follows the others."""
    def forward(hidden_states, *args, **kwargs):
        _append_placeholder(_cache_arg(kwargs), layer_idx, hidden_states, attn)
        return hidden_states if whole_layer else (torch.zeros_like(hidden_states), None)

    return forward


def _skipped_mlp(hidden_states, *args, **kwargs):
    return torch.zeros_like(hidden_states)


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
    is fine (each level restores what it found). A compiled function does not see
    the swap (its graphs do not guard the modules, ``engine.compat``): call one
    always inside the same draft mode, or always outside, as the engine's runners do.

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
                patch(layer, _skipped(layer.self_attn, layer_idx, True))
            elif i in attn:
                patch(layer.self_attn, _skipped(layer.self_attn, layer_idx, False))
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
    """The target itself, some sublayers skipped, drafts for every row (Draft & Verify).

    KV cache: the drafter has none of its own, so drafting costs no prefill and no memory
    beyond the block. It writes into the target's batch cache at each row's next positions,
    past its confirmed ones, attending to the confirmed positions' full-model keys and
    values in its non-skipped layers (Draft & Verify reuses them too); the target's
    verification then overwrites the drafted positions, so nothing is restored, and skipped
    sublayers need no placeholders (each row's positions are given to every layer). On the
    fast path its forwards get graphs of their own, traced in draft mode (one set per skip set).

    Args:
        model: The target model.
        skip_set: Sublayers skipped while drafting.

    Raises:
        InvalidArgumentError: If a skip-set index is out of range, or at ``bind`` if the cache
            belongs to another model.
    """

    supports_exit_policy = True
    who = "layer-skip draft"
    #: True: greedy rounds run their draft steps as one compiled function on the fast path (``base.draft_batch``,
    #: ``BatchRunner.draft_steps`` at its ``fused_steps``, warmed up); False (the default, as the draft model's,
    #: ``drafters.draft_model``): one graph a step (``BatchRunner.greedy_steps``).
    fused_draft_steps = False

    def __init__(self, model: PreTrainedModel, skip_set: SkipSet) -> None:
        skip_set.check(len(decoder_layers(model)))
        self.model = model
        self.skip_set = skip_set
        self.cache: BatchKVCache | None = None
        self.runner: BatchRunner | None = None
        self._samplers: list[Sampler | None] = []

    def bind(self, target_cache) -> None:
        if target_cache.owner is not self.model:
            raise InvalidArgumentError(
                f"the {self.who}er must wrap the batched decoder's own target model: its cache belongs to another model"
            )
        self.cache = target_cache
        key = ("layer-skip runner", self.skip_set)  # another drafter of the skip set reuses its graphs
        self.runner = target_cache.shared.get(key) or BatchRunner(self.model, target_cache, (1,), self.who)
        target_cache.shared[key] = self.runner
        self._samplers = [None] * target_cache.num_slots
        self.num_forwards = 0

    def warm_up(self, max_rows: int, max_block: int) -> None:
        """On the fast path, every bucket of the draft-mode graphs once (the eager widths are the target's)."""
        if self.cache.fast is not None:
            with draft_mode(self.model, self.skip_set):
                self.runner.warm_up()
                if self.fused_draft_steps:
                    self.runner.warm_up_draft_steps(None, logits_width(self.model))

    def join(self, slot: int, prompt_ids: torch.Tensor, sampler: Sampler) -> None:
        self._samplers[slot] = sampler

    @torch.inference_mode()
    def propose(self, sequences, max_tokens, exits=None, exit_rule="row") -> Draft:
        n = len(sequences)
        pending = to_device([s[-1:] for s in sequences], self.cache.device)
        starts = [len(s) - 1 for s in sequences]  # the target cache holds len - 1 positions of each row

        with draft_mode(self.model, self.skip_set):
            first_greedy = None
            if first_forward_greedy(self.runner, n, 1, self._samplers, max_tokens, exits, self.fused_draft_steps):
                first, first_greedy = self.runner.forward_greedy(pending, starts, 1)  # where the greedy steps start
                first, first_greedy = first[:, -1], first_greedy[:, -1]
            else:
                first = self._step(pending, starts)
            draft, steps = draft_batch(
                self._step, first, [s + 1 for s in starts], max_tokens, self._samplers[:n], exits, exit_rule, self.who,
                runner=self.runner, fuse=self.fused_draft_steps, first_greedy=first_greedy, pending=pending.view(n),
            )
        self.num_forwards += steps
        return draft

    def _step(self, token: torch.Tensor, at: list[int]) -> torch.Tensor:
        """(n, 1) ids at positions ``at`` of the target's cache, in draft mode: (n, V) logits."""
        return self.runner(token, at, 1)[:, -1]

    def rollback(self, num_valid: list[int]) -> None:
        """Nothing to do: the engine keeps the target rows' lengths."""

    def move(self, src: int, dst: int, num_valid: int) -> None:
        self._samplers[dst] = self._samplers[src]
        self._samplers[src] = None


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
