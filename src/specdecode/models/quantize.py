"""Weight-only quantized linear layers for CPU decoding: int8 and int4, on PyTorch's own kernels.

On a CPU one decode step reads every weight once, so tokens/s is set by the bytes of
weights. ``quantize_model`` replaces a model's ``nn.Linear`` modules (the LM head
included) with modules that keep their weights in 8 or 4 bits and multiply through
PyTorch's CPU kernels for weight-only quantized matmul:

* ``int8``: per-output-channel symmetric int8, ``w = q * s`` with ``q`` in [-127, 127]
  and ``s = max|w_row| / 127``; ``torch._weight_int8pack_mm`` (the kernel gpt-fast and
  torchao's former CPU int8 path use).
* ``int4``: per-group asymmetric int4 along the input dimension (groups of 32 by default,
  as GGUF's Q4 block formats; ``group_size`` 64, 128 or 256 on request: a bf16 scale and
  zero per group cost 0.125 bytes a weight at 32 and 0.0625 at 64, on top of the 0.5 of
  the nibbles), ``w = (q - 8) * s + z`` with ``q`` in [0, 15], ``s =
  (max - min) / 15`` and ``z = min + 8 s`` per group;
  ``torch.ops.aten._weight_int4pack_mm_for_cpu``. The LM head stays int8 by default (as
  llama.cpp's Q4_K_M keeps its output matrix at higher precision), and so does any layer
  whose shape the int4 kernel refuses (output rows not a multiple of 16, input not a
  multiple of the group size); ``QuantizationSummary`` counts and names them.
  ``head="int4"`` makes the LM head int4 too: the pipeline's default for an int4 *draft*
  model, whose head's precision changes acceptance only, never the output (measured on a
  2-core EPYC with avx512_bf16, bf16 1.5B target, int4 Qwen2.5-Coder 0.5B draft: the int8
  151,936 x 896 head was 36% of the draft's one-token forward, 11.3 of 31 ms; the int4
  head cut the forward by about 7 ms and made cascade with adaptive exit 7.9% faster on 8
  held-out HumanEval prompts, 11.56 -> 12.47 tok/s at acceptance 84.6% -> 84.2%, and 3.9%
  on 5 Spec-Bench prompts, 8.00 -> 8.31 tok/s at 65.2% -> 65.6%). An int4 head keeps its
  nibbles beside the kernel's blocked layout, so it can cut rows (``Int4Linear.select_rows``,
  the truncated draft head) and a tied embedding can read them; so it holds more memory
  than the int8 head (at K = 896 in bf16, computed: 1.12x its bytes) while its forward
  reads fewer (0.62x).

The input embedding is replaced too (``specdecode.models.quantized_embedding``): it is
read a few rows per step, so its bytes cost memory, not time, and they are large
(Qwen2.5-Coder's 151,936 x 1536 bf16 embedding is 0.47 GB, a quarter of the int4 1.5B's
resident memory). When it is tied to the LM head it becomes an ``Int8Embedding`` on the
int8 head's own ``qweight`` / ``scales`` buffers, or an ``Int4Embedding`` on an int4
head's kept ``nibbles`` / ``scales`` / ``zeros``, so it costs no bytes at all. An untied
one is quantized on its own, in the scheme's format (``Int8Embedding``, or
``Int4Embedding`` in the int4 linears' groups, int8 when its width is not a multiple of
the group size), and stored with the other quantized tensors. An embedding subclass whose
forward does more than a lookup (and a constant scale, as Gemma's
``*ScaledWordEmbedding``) stays dense, named in ``QuantizationSummary.dense_modules``.

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
from specdecode.models.quantized_embedding import (  # noqa: F401  (the formats are re-exported from here)
    INT4_GROUP_SIZE,
    INT4_GROUP_SIZES,
    Int4Embedding,
    Int8Embedding,
    QuantizedEmbedding,
    aligned,
    build_embedding,
    embedding_refusal,
    embedding_tensors,
    int4_embedding_refusal,
    pack_nibbles,
    quantize_int4,
    quantize_int8,
    unpack_nibbles,
)

from specdecode.models.quantized_linear import (  # noqa: F401  (re-exported from here)
    _INT4_ROW_MULTIPLE,
    PACK_ROWS,
    Int4Linear,
    Int4LinearPaddedRows,
    Int8Linear,
)

logger = logging.getLogger(__name__)

QUANTIZE_SCHEMES = ("none", "int8", "int4")
QUANTIZE_HEADS = ("int8", "int4")  # the LM head's storage; "int4" only under the int4 scheme
QUANTIZER_VERSION = 4  # bump when the stored tensors would change; older cached files are then recomputed


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


def check_quantize_head(head: object, scheme: str) -> str | None:
    """The LM head's storage under ``scheme``: ``head``, or the scheme's default ("int8") for None.

    Returns:
        "int8" or "int4" for a quantized scheme; None for "none" (nothing is quantized; "int8"
        is accepted there and means nothing).

    Raises:
        InvalidArgumentError: ``head`` is not None or one of ``QUANTIZE_HEADS``, or it is "int4"
            with a scheme other than "int4" (the other linears would be int8 or dense).
    """
    if head is not None and head not in QUANTIZE_HEADS:
        raise InvalidArgumentError(
            f"unknown quantize head {head!r}; allowed: {', '.join(QUANTIZE_HEADS)} (or None: the scheme's default, int8)"
        )
    if head == "int4" and scheme != "int4":
        raise InvalidArgumentError(
            f"an int4 LM head needs quantize='int4', but quantize={scheme!r}; allowed head with {scheme!r}: "
            "int8 (or None)"
        )
    return None if scheme == "none" else (head or "int8")


def check_quantize_group_size(group_size: object, scheme: str) -> int:
    """The int4 group size under ``scheme``: ``group_size``, or ``INT4_GROUP_SIZE`` (32) for None.

    Args:
        group_size: Inputs per int4 scale and zero, one of ``INT4_GROUP_SIZES``, or None.
        scheme: The quantization it is for (``QUANTIZE_SCHEMES``).

    Returns:
        The group size int4 weights get (32 for None). Under "int8" and "none" nothing is int4,
        and only 32 (or None) is accepted.

    Raises:
        InvalidArgumentError: ``group_size`` is not None or one of ``INT4_GROUP_SIZES``, or it is
            not 32 with a scheme other than "int4" (it would be ignored).
    """
    if group_size is None:
        return INT4_GROUP_SIZE
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size not in INT4_GROUP_SIZES:
        raise InvalidArgumentError(
            f"unknown int4 group size {group_size!r}; allowed: {', '.join(map(str, INT4_GROUP_SIZES))} "
            f"(or None: {INT4_GROUP_SIZE})"
        )
    if group_size != INT4_GROUP_SIZE and scheme != "int4":
        raise InvalidArgumentError(
            f"int4 group size {group_size} needs quantize='int4', but quantize={scheme!r}; allowed group size with "
            f"{scheme!r}: {INT4_GROUP_SIZE} (or None)"
        )
    return int(group_size)


def resolve_pair_quantization(quantize: str, draft_quantize: str | None, draft_quantize_head: str | None,
                              quantize_group_size: int | None, *, has_draft: bool) -> tuple[str, str | None, int]:
    """The draft's scheme and head and the int4 group size of a target/draft pair
    (``SpeculativeGenerator.from_pretrained``), checked before anything is loaded.

    ``draft_quantize`` None follows ``quantize``; ``draft_quantize_head`` None gives an int4 draft
    an int4 head, any other draft the int8 default (None); ``quantize_group_size`` None is 32.

    Returns:
        (draft scheme, draft head or None, group size).

    Raises:
        InvalidArgumentError: An unknown draft scheme or head, or a head the scheme cannot have;
            a group size not one of 32, 64, 128, 256, or other than 32 when neither model is int4.
    """
    draft_scheme = quantize if draft_quantize is None else draft_quantize
    draft_head = draft_quantize_head
    if has_draft:
        check_quantize(draft_scheme)
        if draft_head is None:
            draft_head = "int4" if draft_scheme == "int4" else None
        check_quantize_head(draft_head, draft_scheme)
    group = check_quantize_group_size(quantize_group_size, "int4")
    if group != INT4_GROUP_SIZE and "int4" not in (quantize, draft_scheme if has_draft else None):
        check_quantize(quantize)
        draft_here = (f"draft_quantize={draft_quantize!r}" if draft_quantize is not None
                      else f"as quantize={quantize!r}") if has_draft else "no draft model"
        raise InvalidArgumentError(
            f"quantize_group_size={group} applies to int4 weights, but neither the target "
            f"(quantize={quantize!r}) nor the draft ({draft_here}) is int4; use quantize='int4' or "
            "draft_quantize='int4', or leave quantize_group_size out"
        )
    return draft_scheme, draft_head, group


def check_draft_quantize_head_flag(head: str | None, scheme: str, why: str) -> None:
    """Refuse --draft-quantize-head ``head`` for a draft quantized as ``scheme`` (generate and bench).

    An int4 head needs an int4 draft, and a dense ("none") draft has no quantized head, so any
    --draft-quantize-head would be silently ignored there. ``why`` says where ``scheme`` came
    from (the flags, or why generate's int4 default did not apply), in the flags' words.

    Raises:
        InvalidArgumentError: ``head`` is given and does not fit ``scheme``.
    """
    if head is None or scheme == "int4" or (scheme == "int8" and head == "int8"):
        return
    here = f"dense (none: {why})" if scheme == "none" else f"{scheme} ({why})"
    if head == "int4":
        raise InvalidArgumentError(
            f"--draft-quantize-head int4 needs an int4 draft (--draft-quantize int4); the draft here is {here}"
        )
    raise InvalidArgumentError(
        f"--draft-quantize-head {head} applies to a quantized draft, but the draft here is {here}: it has no "
        "quantized LM head, so the flag would be ignored; leave it out or quantize the draft "
        "(--draft-quantize int8 or int4)"
    )


def check_quantize_group_size_flag(group_size: int | None, quantize: str, draft: str | None, why: str) -> None:
    """Refuse --quantize-group-size ``group_size`` (other than 32) when nothing is int4 (generate and bench).

    The group size applies to every int4 model of the pair, so it needs the target
    (--quantize ``quantize``) or the draft (quantized as ``draft``; None: there is no draft
    model) to be int4; else it would be silently ignored. ``why`` says, in the flags' words,
    where the draft's quantization (or its absence) came from.

    Raises:
        InvalidArgumentError: ``group_size`` is given, is not 32, and neither model is int4.
    """
    if group_size in (None, INT4_GROUP_SIZE) or "int4" in (quantize, draft):
        return
    storage = {"none": "dense"}
    here = (f"there is no draft model ({why})" if draft is None
            else f"the draft {storage.get(draft, draft)} ({why})")
    raise InvalidArgumentError(
        f"--quantize-group-size {group_size} applies to int4 weights, but neither model is int4: the target is "
        f"{storage.get(quantize, quantize)} (--quantize {quantize}) and {here}; leave it out, or make one of them "
        "int4 (--quantize int4 or --draft-quantize int4)"
    )


def stored_group_size(tensors: dict[str, torch.Tensor]) -> int:
    """The int4 group size of quantized ``tensors`` (``quantized_tensors``'s): their first ``"<module>.int4"``
    marker's, or ``INT4_GROUP_SIZE`` when no module is int4."""
    marker = next((t for name, t in tensors.items() if name.endswith(".int4")), None)
    return int(marker[0]) if marker is not None else INT4_GROUP_SIZE


@dataclass
class QuantizationSummary:
    """What ``quantize_model`` / ``apply_quantized`` did to a model.

    Attributes:
        scheme: "int8" or "int4".
        layers: Number of linear layers per storage ("int8", "int4").
        int8_layers: Names of the modules kept at int8 under the int4 scheme (linears, and an
            input embedding), and why.
        embedding: "int8" / "int4" when the input embedding became an ``Int8Embedding`` /
            ``Int4Embedding``, else "dense".
        dense_modules: Names of the modules kept dense (an input embedding of an unknown
            kind), and why.
        bytes_before, bytes_after: Bytes of the replaced modules' weights before and after.
            A tied weight counts once before, and an embedding sharing the head's buffers
            adds nothing after (an int4 head's count includes its kept ``nibbles``); when a
            tied embedding stays dense, the head's weight is not counted before (it stays as
            the embedding).
        tied_head: The LM head shared its weight with the input embedding; the quantized
            embedding then reads the head's buffers (one copy for both).
        head: The LM head's storage, "int8" or "int4" (``quantized_tensors``'s ``head``, or
            int8 where the int4 kernel refused its shape: named in ``int8_layers``); None
            when the model has no ``nn.Linear`` LM head.
        group_size: Inputs per scale and zero of the int4 modules (32, 64, 128 or 256) under
            the int4 scheme, also when every module stayed int8; None under "int8".
    """

    scheme: str
    layers: dict[str, int] = field(default_factory=dict)
    int8_layers: dict[str, str] = field(default_factory=dict)
    embedding: str = "dense"
    dense_modules: dict[str, str] = field(default_factory=dict)
    bytes_before: int = 0
    bytes_after: int = 0
    tied_head: bool = False
    head: str | None = None
    group_size: int | None = None

    def as_dict(self) -> dict:
        return {"scheme": self.scheme, "layers": dict(self.layers), "int8_layers": dict(self.int8_layers),
                "embedding": self.embedding, "dense_modules": dict(self.dense_modules),
                "bytes_before": self.bytes_before, "bytes_after": self.bytes_after, "tied_head": self.tied_head,
                "head": self.head, "group_size": self.group_size}


def _linears(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, nn.Linear]]:
    """(qualified name, parent, attribute, layer) for every plain ``nn.Linear`` in ``model``."""
    for parent_name, parent in list(model.named_modules()):
        for attr, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                yield (f"{parent_name}.{attr}" if parent_name else attr), parent, attr, child


def _int4_refusal(name: str, layer: nn.Linear, head_name: str | None, group_size: int,
                  head: str = "int8") -> str | None:
    """Why ``layer`` stays int8 under the int4 scheme (``head``: the LM head's asked-for storage), or None."""
    n, k = layer.weight.shape
    shape = (f"{n} output rows is not a multiple of {_INT4_ROW_MULTIPLE}" if n % _INT4_ROW_MULTIPLE
             else f"{k} inputs is not a multiple of the group size {group_size}" if k % group_size else None)
    if name != head_name:
        return shape
    if head == "int8":
        return "LM head (kept at int8, as Q4_K_M keeps the output matrix at higher precision)"
    return None if shape is None else f"LM head: {shape} (the int4 kernel's limit)"


def _head_name(model: nn.Module) -> str | None:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get else None
    return next((n for n, m in model.named_modules() if m is head), None) if head is not None else None


def _input_embedding(model: nn.Module) -> tuple[str, nn.Module, str, nn.Module] | None:
    """(qualified name, parent, attribute, module) of ``model.get_input_embeddings()``, or None without one."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        emb = get() if get else None
    except NotImplementedError:  # transformers' default for a model without a base model
        return None
    if emb is None:
        return None
    for parent_name, parent in model.named_modules():
        for attr, child in parent.named_children():
            if child is emb:
                return (f"{parent_name}.{attr}" if parent_name else attr), parent, attr, emb
    return None


def _is_tied(model: nn.Module, head_name: str | None, emb: nn.Module) -> bool:
    """Whether the LM head is a plain ``nn.Linear`` whose weight is the input embedding's."""
    head = dict(model.named_modules()).get(head_name) if head_name is not None else None
    return type(head) is nn.Linear and getattr(emb, "weight", None) is head.weight


@torch.no_grad()
def quantized_tensors(model: nn.Module, scheme: str, head: str | None = "int8",
                      group_size: int | None = INT4_GROUP_SIZE) -> dict[str, torch.Tensor]:
    """Quantize every ``nn.Linear`` weight of ``model``, and its input embedding, without changing the model.

    Args:
        model: A dense model.
        scheme: "int8" or "int4".
        head: The LM head's storage (``QUANTIZE_HEADS``; None: "int8"). "int4" needs the int4
            scheme; a head whose shape the int4 kernel refuses stays int8 (logged, and named
            in ``QuantizationSummary.int8_layers`` once applied).
        group_size: Inputs per scale and zero of the int4 weights (``INT4_GROUP_SIZES``; None:
            32), the linears', the head's and an untied embedding's alike; a module whose
            input width is not a multiple of it stays int8 (refused shapes, as at 32).

    Returns:
        A flat dict ``"<module>.<part>" -> tensor`` (parts as in ``quantize_int8`` /
        ``quantize_int4``; ``"<layer>.int4"`` marks int4 layers, the head's too, and holds
        their group size), in the weights' dtype. The input embedding has parts of its own
        (``embedding_tensors``: int4 under "int4" where its width allows, else int8) only
        when it is not tied to the LM head (a tied one reads the head's). It is what the
        cache stores and
        ``apply_quantized`` reads.

    Raises:
        InvalidArgumentError: ``scheme`` is not "int8" or "int4"; ``head`` is unknown, or
            "int4" with the int8 scheme (``check_quantize_head``); ``group_size`` is unknown,
            or not 32 with the int8 scheme (``check_quantize_group_size``).
    """
    if scheme not in ("int8", "int4"):
        raise InvalidArgumentError(f"quantized_tensors needs scheme 'int8' or 'int4', got {scheme!r}")
    head_storage = check_quantize_head(head, scheme)
    group_size = check_quantize_group_size(group_size, scheme)
    head_name = _head_name(model)
    out: dict[str, torch.Tensor] = {}
    for name, _parent, _attr, layer in _linears(model):
        refusal = _int4_refusal(name, layer, head_name, group_size, head_storage) if scheme == "int4" else ""
        if refusal is None:
            parts = quantize_int4(layer.weight, layer.weight.dtype, group_size)
            out[f"{name}.int4"] = torch.tensor([group_size], dtype=torch.int32)
        else:
            if name == head_name and head_storage == "int4":
                logger.info("the LM head %s stays int8: %s", name, refusal)
            parts = quantize_int8(layer.weight, layer.weight.dtype)
        out.update({f"{name}.{part}": t for part, t in parts.items()})
    found = _input_embedding(model)
    if found is not None and embedding_refusal(found[3]) is None and not _is_tied(model, head_name, found[3]):
        out.update(embedding_tensors(found[0], found[3].weight, scheme, group_size))
    return out


def _own_remaining_tensors(model: nn.Module) -> None:
    """Copy the tensors the quantized modules did not replace (norms, biases, a dense embedding) into memory of their own.

    transformers may load weights as views of the memory-mapped checkpoint file; the
    mapping, and with it every page of the dense weights read while quantizing, stays
    resident as long as any view of it lives. Copying the few remaining tensors lets the
    mapping go, so the process holds the quantized model and not the dense one too. The
    quantized modules are skipped: their buffers are already their own, and a tied
    embedding shares the head's, which a copy would duplicate.
    """
    quantized = (Int8Linear, Int4Linear, QuantizedEmbedding)
    for module in model.modules():
        if isinstance(module, quantized):
            continue
        for name, param in list(module.named_parameters(recurse=False)):
            param.data = param.data.clone()
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf is not None:
                module._buffers[name] = buf.clone()


def _replace_embedding(found: tuple[str, nn.Module, str, nn.Module], tensors: dict[str, torch.Tensor],
                       shared: nn.Module | None, summary: QuantizationSummary, group_size: int) -> None:
    """Put a quantized embedding in place of the input embedding: on ``shared``'s buffers, else on its own tensors."""
    name, parent, attr, emb = found
    new = build_embedding(name, emb, tensors, shared)
    if shared is None:  # a tied weight was counted with the head, and shared buffers cost nothing more
        summary.bytes_before += emb.weight.numel() * emb.weight.element_size()
        summary.bytes_after += sum(t.numel() * t.element_size() for t in new.buffers(recurse=False)
                                   if t is not getattr(new, "embed_scale", None))
    summary.embedding = "int4" if isinstance(new, Int4Embedding) else "int8"
    if summary.scheme == "int4" and isinstance(new, Int8Embedding):
        summary.int8_layers[name] = ("tied to the LM head: reads its int8 rows" if shared is not None
                                     else int4_embedding_refusal(emb.weight.shape[1], group_size)
                                     or "int8 in the cache")
    setattr(parent, attr, new)


@torch.no_grad()
def apply_quantized(model: nn.Module, tensors: dict[str, torch.Tensor], scheme: str,
                    group_size: int | None = None) -> QuantizationSummary:
    """Replace ``model``'s ``nn.Linear`` layers and input embedding, in place, by quantized modules built from ``tensors``.

    The linears become ``Int8Linear`` / ``Int4Linear`` as ``tensors`` say (an int4 LM head
    with ``keep_rows=True``); the input embedding, when the two were tied, an
    ``Int8Embedding`` on the int8 LM head's buffers or an ``Int4Embedding`` on the int4
    head's, else an ``Int8Embedding`` / ``Int4Embedding`` as stored in ``tensors``. An
    embedding of a kind that is more than a lookup stays dense
    (``QuantizationSummary.dense_modules``).

    Args:
        model: A dense model on the CPU.
        tensors: What ``quantized_tensors`` returned for this model (or its cached copy).
        scheme: "int8" or "int4" (recorded in the summary).
        group_size: The int4 group size ``tensors`` were made with (recorded in the summary,
            and named in the reasons a module stayed int8); None: read from their int4 markers
            (``stored_group_size``; 32 when no module is int4). Each int4 module is built with
            the group size its own marker holds.

    Returns:
        The summary, also stored as ``model.specdecode_quantization``.

    Raises:
        InvalidArgumentError: ``tensors`` lacks a layer or the embedding of the model or does
            not match its shape (a stale or foreign cache).
    """
    head = _head_name(model)
    found = _input_embedding(model)
    tied = found is not None and _is_tied(model, head, found[3])
    refusal = embedding_refusal(found[3]) if found is not None else None
    group = (stored_group_size(tensors) if group_size is None else group_size) if scheme == "int4" else None
    summary = QuantizationSummary(scheme, tied_head=tied, group_size=group)
    new_head = None
    for name, parent, attr, layer in _linears(model):
        n, k = layer.weight.shape
        bias = layer.bias
        try:
            if f"{name}.int4" in tensors:
                g = int(tensors[f"{name}.int4"][0])
                new = Int4Linear(tensors[f"{name}.nibbles"], tensors[f"{name}.scales"], tensors[f"{name}.zeros"], bias, g,
                                 keep_rows=name == head)
                kind = "int4"
            else:
                new = Int8Linear(tensors[f"{name}.qweight"], tensors[f"{name}.scales"], bias)
                kind = "int8"
                if scheme == "int4":  # the head: the kernel's refusal if any, else the int8 default's reason
                    summary.int8_layers[name] = (_int4_refusal(name, layer, head, group, "int4")
                                                 or _int4_refusal(name, layer, head, group)
                                                 or "int8 in the cache")
        except (KeyError, RuntimeError) as e:
            raise InvalidArgumentError(f"the quantized weights do not match layer {name!r} ({n}x{k}): {e}") from e
        if (new.out_features, new.in_features) != (n, k):
            raise InvalidArgumentError(
                f"the quantized weights do not match layer {name!r}: they are {new.out_features}x{new.in_features}, "
                f"the layer is {n}x{k}"
            )
        summary.layers[kind] = summary.layers.get(kind, 0) + 1
        if name == head:
            new_head, summary.head = new, kind
        if not (name == head and tied and refusal is not None):  # else the weight stays as the dense embedding
            summary.bytes_before += layer.weight.numel() * layer.weight.element_size()
        summary.bytes_after += sum(b.numel() * b.element_size() for b in new.buffers())
        setattr(parent, attr, new)
    if found is not None and refusal is not None:
        summary.dense_modules[found[0]] = refusal
        logger.info("the input embedding %s stays dense: %s", found[0], refusal)
    elif found is not None:
        _replace_embedding(found, tensors, new_head if tied else None, summary, group)
    _own_remaining_tensors(model)
    model.specdecode_quantization = summary
    logger.info("quantized %s: %s%s, LM head %s, input embedding %s%s, weights %.2f GB -> %.2f GB",
                type(model).__name__, summary.layers, f" (int4 groups of {group})" if group else "",
                summary.head, summary.embedding,
                f" (on the LM head's {summary.head} rows, to which it was tied)" if tied and summary.embedding != "dense"
                else "", summary.bytes_before / 1e9, summary.bytes_after / 1e9)
    return summary


def quantize_model(model: nn.Module, scheme: str, head: str | None = None,
                   group_size: int | None = None) -> QuantizationSummary | None:
    """Quantize ``model``'s linear layers and input embedding in place (``quantized_tensors`` + ``apply_quantized``).

    Args:
        model: A dense model on the CPU (float32 or bfloat16).
        scheme: One of ``QUANTIZE_SCHEMES``; "none" leaves the model as it is and returns None.
        head: The LM head's storage, "int8" or "int4" (int4 scheme only); None: "int8".
        group_size: Inputs per scale and zero of the int4 weights, one of ``INT4_GROUP_SIZES``
            (int4 scheme only; ``quantized_tensors``); None: 32.

    Raises:
        InvalidArgumentError: Unknown scheme, head (``check_quantize_head``) or group size
            (``check_quantize_group_size``: also one other than 32 without the int4 scheme),
            or a model not on the CPU.
    """
    check_quantize(scheme, next(model.parameters()).device)
    head = check_quantize_head(head, scheme)
    group_size = check_quantize_group_size(group_size, scheme)
    if scheme == "none":
        return None
    return apply_quantized(model, quantized_tensors(model, scheme, head, group_size), scheme, group_size)


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
