"""Float32 linear layers on oneDNN's kernel for CPUs: ``PrepackedLinear``, ``prepack_linears``, ``unpack_linears``.

A float32 model's stock ``nn.Linear`` runs ``F.linear`` (MKL's sgemm on x86), whose time grows with the
rows fed almost as if each row were a separate step at 2-6 rows: a verification forward over a few
draft tokens costs several plain steps. oneDNN's inner product (``torch.ops.aten.mkldnn_linear``, the
kernel under ``torch.utils.mkldnn``) on weights held as oneDNN tensors grows far less. Measured on a
2-core AMD EPYC with AVX2 only (no native bf16: the "auto" dtype is float32), Qwen2.5-Coder 1.5B Instruct
in float32, 200 tokens of context, ms per target forward by tokens fed (2026-11-26,
``docs/benchmarks/forward_cost.py``; record ``docs/benchmarks/2026-11-26-prepacked-linears-avx2.md``):

    tokens fed       1      2      3      5      9     13
    nn.Linear      609   1032   1513   1772   1890   1886
    PrepackedLinear 446   666    671    776    882   1011

So plain decoding is faster too, and a 5-token verification costs 1.7 plain steps instead of 2.9.
Rows are computed as the stock layer computes them, up to float32 rounding (both kernels give a row
slightly different low bits at 1 row than in a batch of rows; greedy equality holds as it does for the
stock layer).

``prepack_linears`` replaces a model's plain ``nn.Linear`` modules, in place, with ``PrepackedLinear``
ones holding the same weights (the LM head too; a head tied to the input embedding keeps the embedding's
dense weight, so its prepacked copy is the one extra copy); ``unpack_linears`` puts back plain
``nn.Linear`` modules with bit-identical weights. Which models get it: ``models.loading.load_model``'s
``prepack_linears`` (None: float32 on an x86 CPU with AVX2, unquantized, where oneDNN is available:
``why_no_auto_prepack``).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from specdecode.errors import InvalidArgumentError

logger = logging.getLogger(__name__)


def why_no_prepack() -> str | None:
    """Why this torch cannot run ``PrepackedLinear`` (for messages), or None when it can: a build with
    oneDNN (``torch.backends.mkldnn.is_available()``) and the ``aten::mkldnn_linear`` operator, feature-detected."""
    mkldnn = getattr(torch.backends, "mkldnn", None)
    if mkldnn is None or not mkldnn.is_available():
        return f"torch {torch.__version__} was built without oneDNN (torch.backends.mkldnn.is_available() is False)"
    if not hasattr(torch.ops.aten, "mkldnn_linear"):
        return f"torch {torch.__version__} has no aten::mkldnn_linear operator"
    return None


#: torch's CPU capabilities (``torch.backends.cpu.get_cpu_capability()``) where ``load_model`` prepacks by
#: default: where it was measured, AVX2 (module docstring). AVX512 CPUs with native bf16 run bfloat16 by
#: default, where the stock layer already calls oneDNN; those without it (capability "AVX512" too) run
#: float32 and were not measured, nor were others (ARM included): there ``prepack_linears=True`` asks for it.
AUTO_PREPACK_CPU_CAPABILITIES = ("AVX2",)


def why_no_auto_prepack() -> str | None:
    """Why ``load_model`` does not prepack a float32 CPU model by default here (for its log), or None when it
    does: the kernel (``why_no_prepack``) and a CPU capability in ``AUTO_PREPACK_CPU_CAPABILITIES``."""
    reason = why_no_prepack()
    if reason is not None:
        return reason
    get = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
    capability = get() if get is not None else None
    if capability not in AUTO_PREPACK_CPU_CAPABILITIES:
        return (f"this CPU's capability is {capability or 'unknown to this torch'}, where it was not measured "
                f"(default on {', '.join(AUTO_PREPACK_CPU_CAPABILITIES)}); prepack_linears=True asks for it")
    return None


class PrepackedLinear(nn.Module):
    """``y = x @ W.T + b`` in float32 on oneDNN's CPU inner product, W held as a oneDNN tensor (module docstring).

    Args:
        linear: A plain float32 ``nn.Linear`` on the CPU; its weight and bias are copied (the layer is not kept).

    Shapes: input (..., in_features) float32 on the CPU, output (..., out_features) float32, a dense tensor.

    Attributes:
        weight: (out_features, in_features) oneDNN tensor (``Tensor.is_mkldnn``); ``dense_weight()`` gives
            a dense copy.
        bias: (out_features,) dense float32, or None.

    Raises:
        InvalidArgumentError: ``linear`` is not float32, not on the CPU, or this torch lacks the kernel
            (``why_no_prepack``).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        check_prepackable(linear.weight, "the layer")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", linear.weight.detach().to_mkldnn())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        y = torch.ops.aten.mkldnn_linear(flat.to_mkldnn(), self.weight, self.bias).to_dense()
        return y.view(*x.shape[:-1], self.out_features)

    def dense_weight(self) -> torch.Tensor:
        """A dense (out_features, in_features) float32 copy of the weight, bit-identical to the layer's origin."""
        return self.weight.to_dense()

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` with this layer's weight and bias (bit-identical)."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = nn.Parameter(self.dense_weight(), requires_grad=False)
        if self.bias is not None:
            linear.bias = nn.Parameter(self.bias.clone(), requires_grad=False)
        return linear

    def select_rows(self, ids: torch.Tensor) -> PrepackedLinear:
        """A new layer computing only output rows ``ids`` ((R,) long, each in 0 .. out_features - 1), e.g. a
        truncated LM head (``drafters.draft_head``).

        Raises:
            InvalidArgumentError: An id out of that range.
        """
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.out_features):
            raise InvalidArgumentError(f"row ids must be in 0..{self.out_features - 1}, got {int(ids.min())}.."
                                       f"{int(ids.max())}")
        rows = nn.Linear(self.in_features, int(ids.numel()), bias=self.bias is not None, device="meta")
        rows.weight = nn.Parameter(self.dense_weight()[ids].contiguous(), requires_grad=False)
        if self.bias is not None:
            rows.bias = nn.Parameter(self.bias[ids].contiguous(), requires_grad=False)
        return PrepackedLinear(rows)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, oneDNN"


def check_prepackable(weight: torch.Tensor, what: str) -> None:
    """Raise unless ``weight`` (a model's parameter, naming it ``what`` in messages) can run ``PrepackedLinear``.

    Raises:
        InvalidArgumentError: Not float32, not on the CPU, or no kernel in this torch (``why_no_prepack``).
    """
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        raise InvalidArgumentError(
            f"prepacked linears run float32 on a CPU; {what} is {str(weight.dtype).removeprefix('torch.')} on "
            f"{weight.device}: use dtype float32 and device cpu, or turn prepacking off (prepack_linears=False)")
    reason = why_no_prepack()
    if reason is not None:
        raise InvalidArgumentError(f"prepacked linears need oneDNN: {reason}; turn prepacking off (prepack_linears=False)")


def _places(model: nn.Module, kind: type) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of every child of exactly type ``kind`` in ``model``: places, not layers, so that a
    replaced layer's weight can be freed before the next one is copied."""
    return [(parent, attr) for parent in model.modules() for attr, child in parent.named_children()
            if type(child) is kind]


def prepack_linears(model: nn.Module) -> int:
    """Replace every plain ``nn.Linear`` of ``model`` (exact type: subclasses and quantized layers are left
    alone; hooks registered on a replaced ``nn.Linear`` are not carried over) in place by a ``PrepackedLinear``
    with the same weights; returns how many. ``unpack_linears`` undoes it.

    One layer at a time: each replaced layer's dense weight is freed at once where it owns its memory; a
    model read from a memory-mapped file keeps the map (and the pages read) until every tensor of it is gone
    (``models.loading`` then copies the remaining parameters off it). A head tied to the input embedding
    keeps the embedding's dense weight beside its oneDNN copy.

    Raises:
        InvalidArgumentError: A layer that is not float32 on the CPU, or no kernel in this torch
            (``check_prepackable``), checked for every layer before any is replaced.
    """
    places = _places(model, nn.Linear)
    for parent, attr in places:
        check_prepackable(getattr(parent, attr).weight, f"layer {attr!r}")
    with torch.no_grad():
        for parent, attr in places:
            setattr(parent, attr, PrepackedLinear(getattr(parent, attr)))
    if places:
        logger.debug("prepacked %d float32 linear layers for oneDNN", len(places))
    return len(places)


def unpack_linears(model: nn.Module) -> int:
    """Put plain ``nn.Linear`` layers back in place of ``model``'s ``PrepackedLinear`` ones (bit-identical
    weights; a tied LM head gets its own dense copy); returns how many."""
    places = _places(model, PrepackedLinear)
    with torch.no_grad():
        for parent, attr in places:
            setattr(parent, attr, getattr(parent, attr).to_linear())
    return len(places)


def has_prepacked_linears(model: nn.Module) -> bool:
    """Whether any layer of ``model`` is a ``PrepackedLinear``."""
    return any(isinstance(m, PrepackedLinear) for m in model.modules())
