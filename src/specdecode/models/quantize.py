"""Weight-only quantized linear layers for CPU decoding: int8 and int4, on PyTorch's own kernels.

On a CPU one decode step reads every weight once, so tokens/s is set by the bytes of
weights. ``quantize_model`` replaces a model's ``nn.Linear`` modules (the LM head
included) with modules that keep their weights in 8 or 4 bits and multiply through
PyTorch's CPU kernels for weight-only quantized matmul:

* ``int8``: per-output-channel symmetric int8, ``w = q * s`` with ``q`` in [-127, 127]
  and ``s = max|w_row| / 127``; ``torch._weight_int8pack_mm`` (the kernel gpt-fast and
  torchao's former CPU int8 path use).
* ``int4``: per-group asymmetric int4 along the input dimension (groups of 32, as
  GGUF's Q4 block formats), ``w = (q - 8) * s + z`` with ``q`` in [0, 15], ``s =
  (max - min) / 15`` and ``z = min + 8 s`` per group;
  ``torch.ops.aten._weight_int4pack_mm_for_cpu``. The LM head stays int8 (as llama.cpp's
  Q4_K_M keeps its output matrix at higher precision), and so does any layer whose shape
  the int4 kernel refuses (output rows not a multiple of 16, input not a multiple of
  the group size); ``QuantizationSummary`` counts and names them.

Why not torchao: torchao 0.18's ``Int8WeightOnlyConfig`` is fast only under
``torch.compile`` with static shapes (one compiled graph per layer shape and token
count: minutes of warm-up per process, and its tensor subclass defeats inductor's disk
cache), and it offers no int4 kernel for x86 (``Int4WeightOnlyConfig`` needs ``mslk``,
absent from the registry; its other int4 layouts are CUDA, XPU, NPU or Arm only). The
kernels here run eagerly at every width, so every method keeps its dynamic cache and
hooks. Measured on a 2-core EPYC with AVX512-BF16 (Qwen2.5-Coder 1.5B, bf16, one token,
one thread): bf16 197 ms, torchao int8 compiled 130 ms, int8 here 118 ms, int4 here 62 ms.

The quantized weights are computed once from the model's dense weights
(``quantized_tensors``), saved with the dense cache (``specdecode.models.loading``) and
applied to a freshly loaded dense model on later starts (``apply_quantized``), so a
second start does not quantize again. Quantization makes a different model: greedy
speculative output equals the *quantized* model's own autoregressive output, not the
bf16 model's.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from specdecode.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

QUANTIZE_SCHEMES = ("none", "int8", "int4")
QUANTIZER_VERSION = 2  # bump when the stored tensors would change; older cached files are then recomputed
INT4_GROUP_SIZES = (32, 64, 128, 256)
_ALIGNMENT = 64  # bytes; the CPU kernels read weights with aligned vector loads
INT4_GROUP_SIZE = 32
_INT4_ROW_MULTIPLE = 16  # the CPU int4 kernel packs output rows in blocks of 16


def check_quantize(scheme: object, device: torch.device | None = None) -> str:
    """Return ``scheme`` if it names a quantization this device runs.

    Raises:
        InvalidArgumentError: Not one of ``QUANTIZE_SCHEMES``; int8/int4 on a non-CPU device
            (the kernels are PyTorch's CPU kernels); or a torch build without the kernel.
    """
    if scheme not in QUANTIZE_SCHEMES:
        raise InvalidArgumentError(f"unknown quantize {scheme!r}; allowed: {', '.join(QUANTIZE_SCHEMES)}")
    if scheme != "none" and device is not None and device.type != "cpu":
        raise InvalidArgumentError(
            f"quantize={scheme!r} runs on CPU only (PyTorch's CPU kernels for weight-only quantized "
            f"matmul), but the device is {device}; use quantize='none' there"
        )
    kernels = {"int8": ("_weight_int8pack_mm",), "int4": ("_weight_int4pack_mm_for_cpu",
                                                         "_convert_weight_to_int4pack_for_cpu")}
    missing = [op for op in kernels.get(scheme, ()) if not hasattr(torch.ops.aten, op)]
    if missing:
        raise InvalidArgumentError(
            f"quantize={scheme!r} needs the CPU kernel aten.{missing[0]}, which torch {torch.__version__} lacks "
            "(int4 needs torch >= 2.6); upgrade torch or use quantize='int8' or 'none'"
        )
    return scheme


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and starting on a 64-byte boundary, copied only if it is not.

    Tensors read from a safetensors file start wherever the file puts them; the int8 kernel
    segfaults on such a weight once a block of tokens is multiplied (seen at 200 tokens).
    """
    t = t.contiguous()
    return t if t.data_ptr() % _ALIGNMENT == 0 else t.clone()


class Int8Linear(nn.Module):
    """A linear layer with per-output-channel symmetric int8 weights.

    ``y = x @ (q * s[:, None]).T + b`` through ``torch._weight_int8pack_mm``.

    Args:
        qweight: (N, K) int8, values in [-127, 127].
        scales: (N,) in the activations' dtype.
        bias: (N,) or None.

    Shapes: input (..., K), output (..., N), in the input's dtype (float32 or bfloat16).
    """

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", _aligned(qweight))
        self.register_buffer("scales", _aligned(scales))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != self.scales.dtype:
            flat = flat.to(self.scales.dtype)
        y = torch._weight_int8pack_mm(flat, self.qweight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def select_rows(self, ids: torch.Tensor) -> Int8Linear:
        """A new layer computing only output rows ``ids`` ((R,) long), e.g. a truncated LM head."""
        bias = None if self.bias is None else self.bias[ids]
        return Int8Linear(self.qweight[ids], self.scales[ids], bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel"


class Int4Linear(nn.Module):
    """A linear layer with per-group asymmetric int4 weights (groups along the input dimension).

    ``w[n, k] = (q[n, k] - 8) * s[n, k // g] + z[n, k // g]``, multiplied through
    ``torch.ops.aten._weight_int4pack_mm_for_cpu``.

    Args:
        nibbles: (N, K / 2) uint8, ``q[:, 2j]`` in the low and ``q[:, 2j + 1]`` in the high nibble.
        scales, zeros: (N, K / g) in the activations' dtype.
        bias: (N,) or None.
        group_size: g, one of ``INT4_GROUP_SIZES``; K must be a multiple of it and N of 16.

    Shapes: input (..., K), output (..., N), in the input's dtype.

    Raises:
        InvalidArgumentError: A group size outside ``INT4_GROUP_SIZES``, or shapes that do
            not fit it (K not a multiple of g, N not a multiple of 16, scales not (N, K / g)).
    """

    def __init__(
        self, nibbles: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bias: torch.Tensor | None,
        group_size: int = INT4_GROUP_SIZE,
    ) -> None:
        super().__init__()
        self.out_features = nibbles.shape[0]
        self.in_features = nibbles.shape[1] * 2
        self.group_size = group_size
        n, k = self.out_features, self.in_features
        if group_size not in INT4_GROUP_SIZES:
            raise InvalidArgumentError(f"int4 group size {group_size!r} is not supported; allowed: {INT4_GROUP_SIZES}")
        if k % group_size or n % _INT4_ROW_MULTIPLE or tuple(scales.shape) != (n, k // group_size) \
                or tuple(zeros.shape) != tuple(scales.shape):
            raise InvalidArgumentError(
                f"int4 weights of {n}x{k} with group size {group_size} need K a multiple of {group_size}, N a "
                f"multiple of {_INT4_ROW_MULTIPLE} and scales/zeros of {n}x{k // group_size}; got "
                f"{tuple(scales.shape)} and {tuple(zeros.shape)}"
            )
        q = unpack_nibbles(nibbles).to(torch.int32)
        self.register_buffer("packed", _aligned(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)))
        # The kernel takes (K / g, N, 2): scale and zero per group and output row.
        self.register_buffer("scales_and_zeros", _aligned(torch.stack([scales, zeros], dim=-1).transpose(0, 1)))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != self.scales_and_zeros.dtype:
            flat = flat.to(self.scales_and_zeros.dtype)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat.contiguous(), self.packed, self.group_size,
                                                       self.scales_and_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group {self.group_size}"


# ---------------------------------------------------------------------------------------------
# quantizing weights (plain, portable tensors; the cache stores these)


def quantize_int8(weight: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Per-output-channel symmetric int8 of a (N, K) weight: ``{"qweight": (N, K) int8, "scales": (N,) dtype}``."""
    w = weight.detach().float()
    # Round the scale to the dtype the kernel uses before choosing q (as for int4).
    scales = (w.abs().amax(dim=1).clamp(min=1e-12) / 127.0).to(dtype).float()
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return {"qweight": q, "scales": scales.to(dtype)}


def quantize_int4(weight: torch.Tensor, dtype: torch.dtype, group_size: int = INT4_GROUP_SIZE) -> dict[str, torch.Tensor]:
    """Per-group asymmetric int4 (min-max) of a (N, K) weight.

    Returns ``{"nibbles": (N, K/2) uint8, "scales": (N, K/g) dtype, "zeros": (N, K/g) dtype}``
    with ``w ≈ (q - 8) * scale + zero`` (the CPU int4 kernel's form).

    Raises:
        InvalidArgumentError: ``group_size`` not in ``INT4_GROUP_SIZES`` or not dividing K.
    """
    n, k = weight.shape
    if group_size not in INT4_GROUP_SIZES or k % group_size:
        raise InvalidArgumentError(
            f"int4 group size {group_size!r} does not fit {k} inputs; allowed: a divisor of {k} among {INT4_GROUP_SIZES}"
        )
    w = weight.detach().float().view(n, k // group_size, group_size)
    lo, hi = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
    scales = ((hi - lo) / 15.0).clamp(min=1e-8)
    # Round the scale and zero to the dtype they are used in before choosing q, so q is
    # chosen for the arithmetic the kernel does.
    scales = scales.to(dtype).float()
    zeros = (lo + 8.0 * scales).to(dtype).float()
    q = torch.round((w - zeros) / scales + 8.0).clamp(0, 15).to(torch.uint8).view(n, k)
    return {"nibbles": pack_nibbles(q), "scales": scales.view(n, -1).to(dtype), "zeros": zeros.view(n, -1).to(dtype)}


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(N, K) uint8 values in [0, 15] -> (N, K/2) uint8, even columns in the low nibble."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_nibbles``: (N, K/2) uint8 -> (N, K) uint8."""
    return torch.stack([nibbles & 0x0F, nibbles >> 4], dim=-1).view(nibbles.shape[0], -1)


@dataclass
class QuantizationSummary:
    """What ``quantize_model`` / ``apply_quantized`` did to a model.

    Attributes:
        scheme: "int8" or "int4".
        layers: Number of linear layers per storage ("int8", "int4").
        int8_layers: Names of the layers kept at int8 under the int4 scheme, and why.
        bytes_before, bytes_after: Bytes of the replaced layers' weights before and after (a
            tied LM head's weight is not counted before: it stays as the input embedding).
        tied_head: The LM head shared its weight with the input embedding, which keeps the
            dense weight, so the int8 head is an extra copy.
    """

    scheme: str
    layers: dict[str, int] = field(default_factory=dict)
    int8_layers: dict[str, str] = field(default_factory=dict)
    bytes_before: int = 0
    bytes_after: int = 0
    tied_head: bool = False

    def as_dict(self) -> dict:
        return {"scheme": self.scheme, "layers": dict(self.layers), "int8_layers": dict(self.int8_layers),
                "bytes_before": self.bytes_before, "bytes_after": self.bytes_after, "tied_head": self.tied_head}


def _linears(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, nn.Linear]]:
    """(qualified name, parent, attribute, layer) for every plain ``nn.Linear`` in ``model``."""
    for parent_name, parent in list(model.named_modules()):
        for attr, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                yield (f"{parent_name}.{attr}" if parent_name else attr), parent, attr, child


def _int4_refusal(name: str, layer: nn.Linear, head_name: str | None, group_size: int) -> str | None:
    if name == head_name:
        return "LM head (kept at int8, as Q4_K_M keeps the output matrix at higher precision)"
    n, k = layer.weight.shape
    if n % _INT4_ROW_MULTIPLE:
        return f"{n} output rows is not a multiple of {_INT4_ROW_MULTIPLE}"
    if k % group_size:
        return f"{k} inputs is not a multiple of the group size {group_size}"
    return None


def _is_tied(model: nn.Module, head: nn.Linear) -> bool:
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if get else None
    return emb is not None and getattr(emb, "weight", None) is head.weight


def _head_name(model: nn.Module) -> str | None:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get else None
    return next((n for n, m in model.named_modules() if m is head), None) if head is not None else None


@torch.no_grad()
def quantized_tensors(model: nn.Module, scheme: str) -> dict[str, torch.Tensor]:
    """Quantize every ``nn.Linear`` weight of ``model`` without changing the model.

    Returns:
        A flat dict ``"<layer>.<part>" -> tensor`` (parts as in ``quantize_int8`` /
        ``quantize_int4``; ``"<layer>.int4"`` marks int4 layers), in the layers' dtype.
        It is what the cache stores and ``apply_quantized`` reads.

    Raises:
        InvalidArgumentError: ``scheme`` is not "int8" or "int4".
    """
    if scheme not in ("int8", "int4"):
        raise InvalidArgumentError(f"quantized_tensors needs scheme 'int8' or 'int4', got {scheme!r}")
    head = _head_name(model)
    out: dict[str, torch.Tensor] = {}
    for name, _parent, _attr, layer in _linears(model):
        if scheme == "int4" and _int4_refusal(name, layer, head, INT4_GROUP_SIZE) is None:
            parts = quantize_int4(layer.weight, layer.weight.dtype)
            out[f"{name}.int4"] = torch.tensor([INT4_GROUP_SIZE], dtype=torch.int32)
        else:
            parts = quantize_int8(layer.weight, layer.weight.dtype)
        out.update({f"{name}.{part}": t for part, t in parts.items()})
    return out


def _own_remaining_tensors(model: nn.Module) -> None:
    """Copy the tensors the quantized layers did not replace (embeddings, norms, biases) into memory of their own.

    transformers may load weights as views of the memory-mapped checkpoint file; the
    mapping, and with it every page of the dense weights read while quantizing, stays
    resident as long as any view of it lives. Copying the few remaining tensors lets the
    mapping go, so the process holds the quantized model and not the dense one too.
    """
    quantized = (Int8Linear, Int4Linear)
    for module in model.modules():
        if isinstance(module, quantized):
            continue
        for name, param in list(module.named_parameters(recurse=False)):
            param.data = param.data.clone()
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf is not None:
                module._buffers[name] = buf.clone()


@torch.no_grad()
def apply_quantized(model: nn.Module, tensors: dict[str, torch.Tensor], scheme: str) -> QuantizationSummary:
    """Replace ``model``'s ``nn.Linear`` layers, in place, by ``Int8Linear`` / ``Int4Linear`` built from ``tensors``.

    Args:
        model: A dense model on the CPU.
        tensors: What ``quantized_tensors`` returned for this model (or its cached copy).
        scheme: "int8" or "int4" (recorded in the summary).

    Returns:
        The summary, also stored as ``model.specdecode_quantization``.

    Raises:
        InvalidArgumentError: ``tensors`` lacks a layer of the model or does not match its
            shape (a stale or foreign cache).
    """
    head = _head_name(model)
    summary = QuantizationSummary(scheme)
    for name, parent, attr, layer in _linears(model):
        n, k = layer.weight.shape
        bias = layer.bias
        try:
            if f"{name}.int4" in tensors:
                g = int(tensors[f"{name}.int4"][0])
                new = Int4Linear(tensors[f"{name}.nibbles"], tensors[f"{name}.scales"], tensors[f"{name}.zeros"], bias, g)
                kind = "int4"
            else:
                new = Int8Linear(tensors[f"{name}.qweight"], tensors[f"{name}.scales"], bias)
                kind = "int8"
                if scheme == "int4":
                    summary.int8_layers[name] = _int4_refusal(name, layer, head, INT4_GROUP_SIZE) or "int8 in the cache"
        except (KeyError, RuntimeError) as e:
            raise InvalidArgumentError(f"the quantized weights do not match layer {name!r} ({n}x{k}): {e}") from e
        if (new.out_features, new.in_features) != (n, k):
            raise InvalidArgumentError(
                f"the quantized weights do not match layer {name!r}: they are {new.out_features}x{new.in_features}, "
                f"the layer is {n}x{k}"
            )
        summary.layers[kind] = summary.layers.get(kind, 0) + 1
        if name == head and _is_tied(model, layer):
            summary.int8_layers.setdefault(name, "LM head")
            summary.tied_head = True  # its weight stays as the input embedding: nothing is freed
        else:
            summary.bytes_before += layer.weight.numel() * layer.weight.element_size()
        summary.bytes_after += sum(b.numel() * b.element_size() for b in new.buffers())
        setattr(parent, attr, new)
    _own_remaining_tensors(model)
    model.specdecode_quantization = summary
    logger.info("quantized %s: %s, weights %.2f GB -> %.2f GB%s", type(model).__name__, summary.layers,
                summary.bytes_before / 1e9, summary.bytes_after / 1e9,
                " (the LM head was tied to the input embedding, which stays dense)" if summary.tied_head else "")
    return summary


def quantize_model(model: nn.Module, scheme: str) -> QuantizationSummary | None:
    """Quantize ``model``'s linear layers in place (``quantized_tensors`` + ``apply_quantized``).

    Args:
        model: A dense model on the CPU (float32 or bfloat16).
        scheme: One of ``QUANTIZE_SCHEMES``; "none" leaves the model as it is and returns None.

    Raises:
        InvalidArgumentError: Unknown scheme, or a model not on the CPU.
    """
    check_quantize(scheme, next(model.parameters()).device)
    if scheme == "none":
        return None
    return apply_quantized(model, quantized_tensors(model, scheme), scheme)


def quantization_of(model: nn.Module) -> str:
    """"int8" / "int4" for a model quantized here, else "none"."""
    summary = getattr(model, "specdecode_quantization", None)
    return summary.scheme if summary is not None else "none"


def release_freed_memory() -> bool:
    """Hand memory freed while quantizing back to the operating system (glibc's ``malloc_trim``).

    Replacing the dense layers frees gigabytes in pieces that glibc keeps in its heap
    (measured: 1.2 GB of the 1.5B/0.5B int4 pair's 3.8 GB resident after loading). Elsewhere
    (musl, macOS, Windows) this does nothing and returns False.
    """
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is None:
        logger.debug("no malloc_trim in this C library; freed memory stays with the allocator")
        return False
    trim(0)
    return True
