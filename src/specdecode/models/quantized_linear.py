"""Weight-only quantized linear layers on PyTorch's CPU kernels: ``Int8Linear`` and ``Int4Linear``.

The formats, the quantizers and the model-level replacement (``quantize_model``,
``apply_quantized``) are in ``specdecode.models.quantize``, which re-exports these classes; the
shared tensor formats (``quantize_int4``'s nibbles, scales and zeros) are in
``specdecode.models.quantized_embedding``.
"""

from __future__ import annotations

import torch
from torch import nn

from specdecode.errors import InvalidArgumentError
from specdecode.models.quantized_embedding import (
    INT4_GROUP_SIZE,
    aligned,
    check_known_group_size,
    unpack_nibbles,
)

_INT4_ROW_MULTIPLE = 16  # the CPU int4 kernel packs output rows in blocks of 16
PACK_ROWS = 4096  # rows packed at a time (a multiple of the kernel's 64-row blocks); see _pack_int4


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
        self.register_buffer("qweight", aligned(qweight))
        self.register_buffer("scales", aligned(scales))
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


def _pack_int4(nibbles: torch.Tensor) -> torch.Tensor:
    """The CPU int4 kernel's packed weight ((N, K / 2) uint8, blocked layout) from (N, K / 2) nibbles.

    The kernel's packing takes int32 values, 4 bytes per weight: for a 151,936 x 896 LM head
    that is 545 MB at once. It packs rows in blocks of 64 (a tail in smaller blocks), so
    packing ``PACK_ROWS`` rows at a time (a multiple of 64) gives the same tensor with a
    bounded temporary (tested against one-shot packing).
    """
    n = nibbles.shape[0]
    if n <= PACK_ROWS:
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_nibbles(nibbles).to(torch.int32), 1)
    return torch.cat([
        torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_nibbles(nibbles[i:i + PACK_ROWS]).to(torch.int32), 1)
        for i in range(0, n, PACK_ROWS)
    ])


class Int4Linear(nn.Module):
    """A linear layer with per-group asymmetric int4 weights (groups along the input dimension).

    ``w[n, k] = (q[n, k] - 8) * s[n, k // g] + z[n, k // g]``, multiplied through
    ``torch.ops.aten._weight_int4pack_mm_for_cpu``.

    Args:
        nibbles: (N, K / 2) uint8, ``q[:, 2j]`` in the low and ``q[:, 2j + 1]`` in the high nibble.
        scales, zeros: (N, K / g) in the activations' dtype.
        bias: (N,) or None.
        group_size: g, one of ``INT4_GROUP_SIZES``; K must be a multiple of it and N of 16.
        keep_rows: Also keep ``nibbles`` as a buffer (N x K/2 bytes more), so that rows can be
            cut (``select_rows``) and read (a tied ``Int4Embedding``). The kernel's packed
            layout is blocked across rows and cannot be indexed by row; ``scales`` and
            ``zeros`` are always there, as (N, K / g) strided views of the kernel's
            ``scales_and_zeros``. Used for the LM head only.

    Shapes: input (..., K), output (..., N), in the input's dtype.

    Raises:
        InvalidArgumentError: A group size outside ``INT4_GROUP_SIZES``, or shapes that do
            not fit it (K not a multiple of g, N not a multiple of 16, scales not (N, K / g)).
    """

    def __init__(
        self, nibbles: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bias: torch.Tensor | None,
        group_size: int = INT4_GROUP_SIZE, *, keep_rows: bool = False,
    ) -> None:
        super().__init__()
        self.out_features = nibbles.shape[0]
        self.in_features = nibbles.shape[1] * 2
        self.group_size = group_size
        n, k = self.out_features, self.in_features
        check_known_group_size(group_size)
        if k % group_size or n % _INT4_ROW_MULTIPLE or tuple(scales.shape) != (n, k // group_size) \
                or tuple(zeros.shape) != tuple(scales.shape):
            raise InvalidArgumentError(
                f"int4 weights of {n}x{k} with group size {group_size} need K a multiple of {group_size}, N a "
                f"multiple of {_INT4_ROW_MULTIPLE} and scales/zeros of {n}x{k // group_size}; got "
                f"{tuple(scales.shape)} and {tuple(zeros.shape)}"
            )
        self.register_buffer("packed", aligned(_pack_int4(nibbles)))
        # The kernel takes (K / g, N, 2): scale and zero per group and output row.
        self.register_buffer("scales_and_zeros", aligned(torch.stack([scales, zeros], dim=-1).transpose(0, 1)))
        self.register_buffer("nibbles", aligned(nibbles) if keep_rows else None)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @property
    def scales(self) -> torch.Tensor:
        """(N, K / g): a view of ``scales_and_zeros`` (no copy)."""
        return self.scales_and_zeros[..., 0].t()

    @property
    def zeros(self) -> torch.Tensor:
        """(N, K / g): a view of ``scales_and_zeros`` (no copy)."""
        return self.scales_and_zeros[..., 1].t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != self.scales_and_zeros.dtype:
            flat = flat.to(self.scales_and_zeros.dtype)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat.contiguous(), self.packed, self.group_size,
                                                       self.scales_and_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def select_rows(self, ids: torch.Tensor) -> nn.Module:
        """A new module computing only output rows ``ids`` ((R,) long), e.g. a truncated LM head.

        The rows are cut from the kept source tensors and packed again, so the result computes
        the same int4 weights as this layer. With R a multiple of 16 it is an ``Int4Linear`` of
        those rows; otherwise (the kernel packs rows in blocks of 16) an
        ``Int4LinearPaddedRows``: the rows padded to the next multiple of 16 with copies of
        the last one, the padding's columns dropped from the output. Shapes: (..., K) ->
        (..., R).

        Raises:
            InvalidArgumentError: The layer was built without ``keep_rows=True``, or ``ids`` is
                not a non-empty 1-D tensor.
        """
        if self.nibbles is None:
            raise InvalidArgumentError(
                f"this Int4Linear ({self.out_features}x{self.in_features}) did not keep its rows (keep_rows=False): "
                "its packed weight cannot be cut by row; build it with keep_rows=True (the LM head is built so)"
            )
        if ids.dim() != 1 or ids.numel() == 0:
            raise InvalidArgumentError(
                f"select_rows needs a non-empty 1-D tensor of row ids, got shape {tuple(ids.shape)}"
            )
        rows = ids.numel()
        pad = -rows % _INT4_ROW_MULTIPLE
        padded = ids if pad == 0 else torch.cat([ids, ids[-1:].expand(pad)])
        bias = None if self.bias is None else self.bias[padded]
        layer = Int4Linear(self.nibbles[padded], self.scales[padded], self.zeros[padded], bias, self.group_size)
        return layer if pad == 0 else Int4LinearPaddedRows(layer, rows)

    def extra_repr(self) -> str:
        kept = ", rows kept" if self.nibbles is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group {self.group_size}{kept}"


class Int4LinearPaddedRows(nn.Module):
    """The first ``rows`` outputs of an ``Int4Linear`` whose further rows are padding (``Int4Linear.select_rows``).

    Args:
        layer: The padded layer, (N', K) with N' a multiple of 16.
        rows: R <= N', the rows that count.

    Shapes: input (..., K), output (..., R), a view of the layer's (..., N') output.
    """

    def __init__(self, layer: Int4Linear, rows: int) -> None:
        super().__init__()
        self.layer, self.out_features, self.in_features = layer, rows, layer.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)[..., :self.out_features]

    def extra_repr(self) -> str:
        return f"out_features={self.out_features} of {self.layer.out_features} (padding rows dropped)"
