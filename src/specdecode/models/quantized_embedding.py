"""Quantized storage formats and the quantized input embeddings (``specdecode.models.quantize`` builds on these).

The storage formats, as plain, portable tensors (what the dense cache stores):

* int8: per-row symmetric, ``w = q * s`` with ``q`` in [-127, 127] and ``s = max|w_row| /
  127`` (``quantize_int8``);
* int4: per-group asymmetric along the row, ``w = (q - 8) * s + z`` with ``q`` in [0, 15],
  ``s = (max - min) / 15`` and ``z = min + 8 s`` per group of ``g`` values, two ``q`` per
  byte (``quantize_int4``, ``pack_nibbles``, ``unpack_nibbles``).

The input embeddings read a few rows per step and de-quantize only those (a gather, then
elementwise arithmetic; no matmul kernel): ``Int8Embedding`` (an untied embedding under
``--quantize int8``, or one tied to the int8 LM head, on the head's own buffers) and
``Int4Embedding`` (an untied embedding under ``--quantize int4``: 0.625 bytes per weight
at g = 32 and 0.5625 at g = 64 with bf16 scales and zeros, against 1 for int8; or one
tied to an int4 LM head, on the head's kept source tensors). Both reproduce Gemma's
``*ScaledWordEmbedding`` constant scale. ``embedding_refusal`` says which embedding modules they may replace.
"""

from __future__ import annotations

import torch
from torch import nn

from specdecode.errors import InvalidArgumentError

INT4_GROUP_SIZES = (32, 64, 128, 256)
INT4_GROUP_SIZE = 32
_ALIGNMENT = 64  # bytes; the CPU kernels read weights with aligned vector loads
_QUANTIZE_BLOCK_ROWS = 8192  # rows quantized at once: float32 temporaries of tens of MB, not GB


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and starting on a 64-byte boundary, copied only if it is not.

    Tensors read from a safetensors file start wherever the file puts them; the int8 kernel
    segfaults on such a weight once a block of tokens is multiplied (seen at 200 tokens).
    """
    t = t.contiguous()
    return t if t.data_ptr() % _ALIGNMENT == 0 else t.clone()


def check_known_group_size(group_size: object) -> int:
    """Return ``group_size`` if it is one of ``INT4_GROUP_SIZES``.

    Raises:
        InvalidArgumentError: It is not, naming it and the allowed sizes.
    """
    if group_size not in INT4_GROUP_SIZES:
        raise InvalidArgumentError(f"int4 group size {group_size!r} is not supported; allowed: {INT4_GROUP_SIZES}")
    return group_size


def check_int4_group_size(group_size: object, k: int) -> int:
    """Return ``group_size`` if it is one of ``INT4_GROUP_SIZES`` and divides ``k`` (the row length).

    Raises:
        InvalidArgumentError: It does not.
    """
    if group_size not in INT4_GROUP_SIZES or k % group_size:
        raise InvalidArgumentError(
            f"int4 group size {group_size!r} does not fit {k} inputs; allowed: a divisor of {k} among {INT4_GROUP_SIZES}"
        )
    return group_size


# ---------------------------------------------------------------------------------------------
# quantizing weights (plain, portable tensors; the cache stores these)


def quantize_int8(weight: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Per-output-channel symmetric int8 of a (N, K) weight: ``{"qweight": (N, K) int8, "scales": (N,) dtype}``.

    Rows are independent, so they are quantized in blocks of ``_QUANTIZE_BLOCK_ROWS``: the
    float32 temporaries of a whole vocabulary matrix would be gigabytes (measured: 3.1 GB
    above the resident memory for Qwen2.5-Coder 1.5B's 151,936 x 1536 LM head).
    """
    n, k = weight.shape
    q = torch.empty(n, k, dtype=torch.int8, device=weight.device)
    scales = torch.empty(n, dtype=dtype, device=weight.device)
    for start in range(0, n, _QUANTIZE_BLOCK_ROWS):
        w = weight[start:start + _QUANTIZE_BLOCK_ROWS].detach().float()
        # Round the scale to the dtype the kernel uses before choosing q (as for int4).
        s = (w.abs().amax(dim=1).clamp(min=1e-12) / 127.0).to(dtype).float()
        q[start:start + _QUANTIZE_BLOCK_ROWS] = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)
        scales[start:start + _QUANTIZE_BLOCK_ROWS] = s.to(dtype)
    return {"qweight": q, "scales": scales}


def quantize_int4(weight: torch.Tensor, dtype: torch.dtype, group_size: int = INT4_GROUP_SIZE) -> dict[str, torch.Tensor]:
    """Per-group asymmetric int4 (min-max) of a (N, K) weight, in blocks of rows as ``quantize_int8``.

    Returns ``{"nibbles": (N, K/2) uint8, "scales": (N, K/g) dtype, "zeros": (N, K/g) dtype}``
    with ``w ≈ (q - 8) * scale + zero`` (the CPU int4 kernel's form).

    Raises:
        InvalidArgumentError: ``group_size`` not in ``INT4_GROUP_SIZES`` or not dividing K.
    """
    n, k = weight.shape
    check_int4_group_size(group_size, k)
    groups = k // group_size
    nibbles = torch.empty(n, k // 2, dtype=torch.uint8, device=weight.device)
    scales = torch.empty(n, groups, dtype=dtype, device=weight.device)
    zeros = torch.empty(n, groups, dtype=dtype, device=weight.device)
    for start in range(0, n, _QUANTIZE_BLOCK_ROWS):
        stop = min(start + _QUANTIZE_BLOCK_ROWS, n)
        w = weight[start:stop].detach().float().view(stop - start, groups, group_size)
        lo, hi = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
        # Round the scale and zero to the dtype they are used in before choosing q, so q is
        # chosen for the arithmetic the kernel does.
        s = ((hi - lo) / 15.0).clamp(min=1e-8).to(dtype).float()
        z = (lo + 8.0 * s).to(dtype).float()
        q = torch.round((w - z) / s + 8.0).clamp(0, 15).to(torch.uint8).view(stop - start, k)
        nibbles[start:stop] = pack_nibbles(q)
        scales[start:stop] = s.view(stop - start, groups).to(dtype)
        zeros[start:stop] = z.view(stop - start, groups).to(dtype)
    return {"nibbles": nibbles, "scales": scales, "zeros": zeros}


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(N, K) uint8 values in [0, 15] -> (N, K/2) uint8, even columns in the low nibble."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_nibbles``: (N, K/2) uint8 -> (N, K) uint8."""
    return torch.stack([nibbles & 0x0F, nibbles >> 4], dim=-1).view(nibbles.shape[0], -1)


def dequantize_int4(nibbles: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """``(q - 8) * s + z`` of (R, K/2) nibbles and (R, K/g) scales and zeros: (R, K), in the scales' dtype.

    Computed in float32 and rounded once to the scales' dtype.
    """
    r, groups = scales.shape
    q = unpack_nibbles(nibbles).float().view(r, groups, -1)
    w = (q - 8.0) * scales.float()[:, :, None] + zeros.float()[:, :, None]
    return w.view(r, -1).to(scales.dtype)


# ---------------------------------------------------------------------------------------------
# input embeddings


def embed_scale_of(emb: nn.Module) -> torch.Tensor | float | None:
    """The constant a ``*ScaledWordEmbedding`` multiplies its rows by (a 0-d tensor or a number), else None."""
    scale = getattr(emb, "embed_scale", None)
    if isinstance(scale, torch.Tensor) and scale.numel() == 1:
        return scale
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return float(scale)
    return None


def embedding_refusal(emb: nn.Module) -> str | None:
    """Why ``emb`` cannot become a quantized embedding without changing what it computes, or None if it can."""
    kind = type(emb).__name__
    if not isinstance(emb, nn.Embedding):
        return f"{kind} is not an nn.Embedding"
    if type(emb) is not nn.Embedding and not (kind.endswith("ScaledWordEmbedding") and embed_scale_of(emb) is not None):
        return (f"{kind} may compute more than a row lookup; allowed: nn.Embedding and transformers' "
                "*ScaledWordEmbedding (a lookup times a constant embed_scale)")
    if emb.max_norm is not None:
        return f"{kind} has max_norm={emb.max_norm}, which rescales rows on lookup; allowed: max_norm=None"
    return None


class QuantizedEmbedding(nn.Module):
    """Base of the quantized input embeddings: the lookup's shapes and the constant ``embed_scale``.

    ``out = rows(ids)``, the de-quantized rows in the storage's scale dtype, then times
    ``embed_scale`` when the replaced module had one (Gemma's ``*ScaledWordEmbedding``
    multiply by ``embed_scale.to(weight.dtype)``, a few others by a float; both are
    reproduced as they were).

    It has no ``weight``: code that needs the dense matrix (resizing the vocabulary,
    re-tying weights, training) does not apply to a quantized model.

    Args:
        num_embeddings, embedding_dim: V and K.
        padding_idx: Kept from the replaced embedding (it matters to training only).
        embed_scale: None, a 0-d tensor or a float (see above).

    Shapes: ids (...) integer, output (..., K).
    """

    storage = "?"

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None,
                 embed_scale: torch.Tensor | float | None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        if isinstance(embed_scale, torch.Tensor):
            self.register_buffer("embed_scale", embed_scale.detach().clone(), persistent=False)
        else:
            self.embed_scale = embed_scale

    def rows(self, flat_ids: torch.Tensor) -> torch.Tensor:
        """The de-quantized rows of (R,) ids: (R, K)."""
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.rows(input_ids.reshape(-1))
        if isinstance(self.embed_scale, torch.Tensor):
            rows = rows * self.embed_scale.to(rows.dtype)
        elif self.embed_scale is not None:
            rows = rows * self.embed_scale
        return rows.view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        scale = "" if self.embed_scale is None else ", scaled"
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.storage}{scale}"


class Int8Embedding(QuantizedEmbedding):
    """An input embedding with per-row symmetric int8 rows (``quantize_int8``'s scheme).

    ``rows(ids) = q[ids].to(s.dtype) * s[ids, None]``, then ``embed_scale`` (see
    ``QuantizedEmbedding``).

    Args:
        qweight: (V, K) int8, values in [-127, 127]; may be a tied LM head's own buffer.
        scales: (V,) in the activations' dtype; likewise.
        padding_idx, embed_scale: As ``QuantizedEmbedding``.

    Shapes: ids (...) integer, output (..., K) in the scales' dtype.

    Raises:
        InvalidArgumentError: ``qweight`` is not a 2-D int8 tensor or ``scales`` is not (V,).
    """

    storage = "int8 per row"

    def __init__(
        self, qweight: torch.Tensor, scales: torch.Tensor, padding_idx: int | None = None,
        embed_scale: torch.Tensor | float | None = None,
    ) -> None:
        if qweight.dtype != torch.int8 or qweight.dim() != 2 or tuple(scales.shape) != tuple(qweight.shape[:1]):
            raise InvalidArgumentError(
                f"an int8 embedding needs qweight (V, K) int8 and scales (V,); got {qweight.dtype} "
                f"{tuple(qweight.shape)} and scales {tuple(scales.shape)}"
            )
        super().__init__(qweight.shape[0], qweight.shape[1], padding_idx, embed_scale)
        self.register_buffer("qweight", aligned(qweight))
        self.register_buffer("scales", aligned(scales))

    def rows(self, flat_ids: torch.Tensor) -> torch.Tensor:
        return self.qweight.index_select(0, flat_ids).to(self.scales.dtype) * self.scales.index_select(0, flat_ids)[:, None]


class Int4Embedding(QuantizedEmbedding):
    """An input embedding with per-group asymmetric int4 rows (``quantize_int4``'s scheme).

    ``rows(ids) = dequantize_int4(nibbles[ids], scales[ids], zeros[ids])``: only the
    looked-up rows are unpacked, in float32, and rounded once to the scales' dtype; then
    ``embed_scale`` (see ``QuantizedEmbedding``).

    Args:
        nibbles: (V, K/2) uint8, ``q[:, 2j]`` in the low and ``q[:, 2j + 1]`` in the high nibble.
        scales, zeros: (V, K/g) in the activations' dtype.
        group_size: g, one of ``INT4_GROUP_SIZES``; K must be a multiple of it.
        padding_idx, embed_scale: As ``QuantizedEmbedding``.
        align: Copy the tensors to contiguous 64-byte aligned memory where they are not (the
            default). False keeps them as they are: the views of a tied int4 LM head's buffers
            (``Int4Linear(keep_rows=True)``: its ``nibbles``, and ``scales`` / ``zeros``,
            strided views of the kernel's ``scales_and_zeros``), shared rather than copied.

    Shapes: ids (...) integer, output (..., K) in the scales' dtype.

    Raises:
        InvalidArgumentError: A group size outside ``INT4_GROUP_SIZES`` or not dividing K, or
            tensors of the wrong dtype or shape.
    """

    storage = "int4"

    def __init__(
        self, nibbles: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int = INT4_GROUP_SIZE,
        padding_idx: int | None = None, embed_scale: torch.Tensor | float | None = None, *, align: bool = True,
    ) -> None:
        if nibbles.dtype != torch.uint8 or nibbles.dim() != 2:
            raise InvalidArgumentError(
                f"an int4 embedding needs nibbles (V, K/2) uint8; got {nibbles.dtype} {tuple(nibbles.shape)}"
            )
        v, k = nibbles.shape[0], nibbles.shape[1] * 2
        check_known_group_size(group_size)
        check_int4_group_size(group_size, k)
        if tuple(scales.shape) != (v, k // group_size) or tuple(zeros.shape) != tuple(scales.shape) \
                or not scales.is_floating_point() or zeros.dtype != scales.dtype:
            raise InvalidArgumentError(
                f"an int4 embedding of {v}x{k} with group size {group_size} needs scales and zeros of "
                f"{v}x{k // group_size} in one floating dtype; got {scales.dtype} {tuple(scales.shape)} and "
                f"{zeros.dtype} {tuple(zeros.shape)}"
            )
        super().__init__(v, k, padding_idx, embed_scale)
        self.group_size = group_size
        keep = aligned if align else (lambda t: t)
        self.register_buffer("nibbles", keep(nibbles))
        self.register_buffer("scales", keep(scales))
        self.register_buffer("zeros", keep(zeros))
        self.storage = f"int4 group {group_size}"

    def rows(self, flat_ids: torch.Tensor) -> torch.Tensor:
        return dequantize_int4(self.nibbles.index_select(0, flat_ids), self.scales.index_select(0, flat_ids),
                               self.zeros.index_select(0, flat_ids))


def embedding_tensors(name: str, weight: torch.Tensor, scheme: str,
                      group_size: int = INT4_GROUP_SIZE) -> dict[str, torch.Tensor]:
    """The stored parts of an untied input embedding ``name`` with (V, K) ``weight`` under ``scheme``.

    int4 (``quantize_int4`` in groups of ``group_size``, with the ``"<name>.int4"``
    group-size marker the linears use) under "int4" when K is a multiple of the group size,
    else int8 (``quantize_int8``).

    Raises:
        InvalidArgumentError: ``group_size`` is not one of ``INT4_GROUP_SIZES`` (int4 only).
    """
    if scheme == "int4" and check_known_group_size(group_size) and int4_embedding_refusal(weight.shape[1], group_size) is None:
        parts = quantize_int4(weight, weight.dtype, group_size)
        parts["int4"] = torch.tensor([group_size], dtype=torch.int32)
    else:
        parts = quantize_int8(weight, weight.dtype)
    return {f"{name}.{part}": t for part, t in parts.items()}


def int4_embedding_refusal(k: int, group_size: int = INT4_GROUP_SIZE) -> str | None:
    """Why an untied embedding of width ``k`` stays int8 under int4 in groups of ``group_size``, or None."""
    return None if k % group_size == 0 else f"{k} inputs is not a multiple of the group size {group_size}"


def build_embedding(name: str, emb: nn.Embedding, tensors: dict[str, torch.Tensor],
                    shared: nn.Module | None) -> QuantizedEmbedding:
    """The quantized replacement of the input embedding ``emb`` (called ``name`` in the model).

    Args:
        name: Its qualified name, the prefix of its parts in ``tensors``.
        emb: The dense embedding (shape, ``padding_idx``, ``embed_scale``).
        tensors: The stored parts (``embedding_tensors``'s, among the linears').
        shared: The LM head it was tied to, or None. An int4 head that kept its rows
            (``Int4Linear(keep_rows=True)``) gives an ``Int4Embedding`` on its ``nibbles`` /
            ``scales`` / ``zeros`` (the same ``quantize_int4`` layout, no copy); an int8 head an
            ``Int8Embedding`` on its ``qweight`` / ``scales``.

    Raises:
        InvalidArgumentError: ``tensors`` hold no parts for it, or parts that do not fit it
            (a stale or foreign cache).
    """
    v, k = emb.weight.shape
    pad, scale = emb.padding_idx, embed_scale_of(emb)
    mismatch = f"the quantized weights do not match the input embedding {name!r} ({v}x{k})"
    try:
        if shared is not None and getattr(shared, "nibbles", None) is not None:
            new = Int4Embedding(shared.nibbles, shared.scales, shared.zeros, shared.group_size, pad, scale, align=False)
        elif shared is not None:
            new = Int8Embedding(shared.qweight, shared.scales, pad, scale)
        elif f"{name}.int4" in tensors:
            new = Int4Embedding(tensors[f"{name}.nibbles"], tensors[f"{name}.scales"], tensors[f"{name}.zeros"],
                                int(tensors[f"{name}.int4"][0]), pad, scale)
        elif f"{name}.qweight" in tensors and f"{name}.scales" in tensors:
            new = Int8Embedding(tensors[f"{name}.qweight"], tensors[f"{name}.scales"], pad, scale)
        else:
            raise InvalidArgumentError(f"{mismatch}: they hold no {name}.qweight / {name}.scales or {name}.int4 for it")
    except KeyError as e:
        raise InvalidArgumentError(f"{mismatch}: they lack {e}") from e
    except InvalidArgumentError as e:
        if str(e).startswith(mismatch):
            raise
        raise InvalidArgumentError(f"{mismatch}: {e}") from e
    if (new.num_embeddings, new.embedding_dim) != (v, k):
        raise InvalidArgumentError(f"{mismatch}: they are {new.num_embeddings}x{new.embedding_dim} ({new.storage})")
    return new
