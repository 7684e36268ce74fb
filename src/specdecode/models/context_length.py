"""A model's context length read from its files without loading its weights.

``specdecode serve`` checks --max-length against the models' context lengths before it loads them
(minutes for the offline models' first start), with what this module reads, and again once they are
loaded (``engine.kv_cache.context_length``, ``LlamaCppModel.n_ctx_train``), which stays the check
that counts. The value read here is the one the loaded model states:

- a model folder, a hub id in the local Hugging Face cache, or an offline model's dense copy: the
  ``max_position_embeddings`` of its config (``AutoConfig``, the text config of a multimodal one),
  which the loaded model keeps;
- a GGUF file (an offline model's assembled file, else its chunk files, whose bytes it is): the
  metadata's ``{architecture}.context_length``, which transformers' GGUF loader makes the config's
  ``max_position_embeddings`` and llama.cpp its ``n_ctx_train``. Only the metadata up to that key
  is read: ``gguf.GGUFReader`` parses every key and tensor first (5-8 s for the offline models,
  their vocabularies' arrays), this reads a few kilobytes.

Where the files do not say it before loading (a hub id not cached locally, an architecture whose
GGUF key transformers does not map, a GGUF file in another byte order), ``stored_context_length``
gives None, and only the check after loading applies.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
from gguf import GGUF_MAGIC, GGUFValueType, Keys

from specdecode.models.dense_cache import dense_cache_valid, dense_dir
from specdecode.models.gguf import chunk_paths
from specdecode.models.registry import OFFLINE_MODELS, default_cache_dir

logger = logging.getLogger(__name__)

#: GGUF scalar value types -> their struct format (little-endian files).
_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
#: The GGUF versions read (little-endian; version 1's counts were 32-bit).
GGUF_VERSIONS = (2, 3)
#: Where a GGUF file's metadata keys are past this, its context length is not read (the load reads it).
MAX_METADATA_KEYS = 4096


@dataclass(frozen=True)
class StoredContextLength:
    """A context length read from a model's files.

    Attributes:
        positions: The most positions the model handles.
        source: Where it was read, for messages ("max_position_embeddings", "the GGUF file's
            qwen2.context_length").
    """

    positions: int
    source: str


def stored_context_length(spec: str, *, cache_dir=None, backend: str = "torch") -> StoredContextLength | None:
    """The context length of the model ``spec`` names (``load_model``'s specs) as the model will state it once
    loaded with ``backend`` ("torch", or "llama-cpp": a GGUF file in llama.cpp), read without loading the
    weights; None where its files do not say it before loading (module docstring). Never raises for a spec
    that does not load: the load reports that."""
    try:
        return _stored(spec, Path(cache_dir) if cache_dir is not None else default_cache_dir(), backend)
    except (OSError, ValueError, KeyError, struct.error, UnicodeDecodeError) as e:
        logger.debug("the context length of %r is read once it is loaded: %s: %s", spec, type(e).__name__, e)
        return None


def _stored(spec: str, cache: Path, backend: str) -> StoredContextLength | None:
    if spec in OFFLINE_MODELS:
        entry = OFFLINE_MODELS[spec]
        if backend == "torch":
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                folder = dense_dir(cache, entry.name, dtype)
                if dense_cache_valid(folder):
                    return _from_config(str(folder), local_only=True)
        assembled = cache / "gguf" / entry.gguf_filename
        return _from_gguf(_ChunkStream([assembled] if assembled.is_file() else chunk_paths(entry)), backend)
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        return _from_gguf(_ChunkStream([path]), backend) if path.is_file() else None
    if backend != "torch":
        return None  # llama.cpp runs GGUF files only (its loading refuses the rest)
    if path.is_dir():
        return _from_config(str(path), local_only=True)
    if spec.count("/") == 1 and " " not in spec and not spec.startswith((".", "/", "~")):
        return _from_config(spec, local_only=True)  # a hub id: only from the local cache, no download here
    return None


def _from_config(source: str, *, local_only: bool) -> StoredContextLength | None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source, local_files_only=local_only)
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        config = get_text(decoder=True)
    value = getattr(config, "max_position_embeddings", None)
    if isinstance(value, int) and value > 0:
        return StoredContextLength(value, "max_position_embeddings")
    return None


def _from_gguf(stream: BinaryIO, backend: str) -> StoredContextLength | None:
    with stream:
        found = gguf_context_length(stream)
    if found is None:
        return None
    arch, positions = found
    if backend == "torch" and not _transformers_maps_context_length(arch):
        return None
    return StoredContextLength(positions, f"the GGUF file's {Keys.LLM.CONTEXT_LENGTH.format(arch=arch)}")


def _transformers_maps_context_length(arch: str) -> bool:
    """Whether transformers' GGUF loader makes ``{arch}.context_length`` the config's max_position_embeddings."""
    try:
        from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    except ImportError:
        return False
    return GGUF_CONFIG_MAPPING.get(arch, {}).get("context_length") == "max_position_embeddings"


def gguf_context_length(stream: BinaryIO) -> tuple[str, int] | None:
    """(architecture, ``{architecture}.context_length``) from a GGUF file's metadata, reading it from the start
    of ``stream`` only up to those keys; None where the file does not state them (or is not a little-endian
    GGUF file of version 2 or 3, or they come past ``MAX_METADATA_KEYS`` keys).

    Raises:
        ValueError, struct.error: A file that is not GGUF, or is cut short.
    """
    magic, version = struct.unpack("<II", _read(stream, 8))
    if magic != GGUF_MAGIC:
        raise ValueError("not a GGUF file (its first bytes are not 'GGUF')")
    if version not in GGUF_VERSIONS:
        return None
    _, num_keys = struct.unpack("<QQ", _read(stream, 16))
    arch, lengths = None, {}
    for _ in range(min(num_keys, MAX_METADATA_KEYS)):
        key = _read_string(stream)
        kind = GGUFValueType(struct.unpack("<I", _read(stream, 4))[0])
        value = _read_value(stream, kind, keep=key == Keys.General.ARCHITECTURE or key.endswith(".context_length"))
        if key == Keys.General.ARCHITECTURE:
            arch = value
        elif key.endswith(".context_length"):
            lengths[key] = value
        if arch is not None and Keys.LLM.CONTEXT_LENGTH.format(arch=arch) in lengths:
            positions = lengths[Keys.LLM.CONTEXT_LENGTH.format(arch=arch)]
            return (arch, int(positions)) if isinstance(positions, int) and positions > 0 else None
    return None


def _read_value(stream: BinaryIO, kind: GGUFValueType, keep: bool):
    """A metadata value (``keep``: returned; else skipped, arrays included: None)."""
    if kind == GGUFValueType.STRING:
        return _read_string(stream, keep)
    if kind == GGUFValueType.ARRAY:
        item = GGUFValueType(struct.unpack("<I", _read(stream, 4))[0])
        count = struct.unpack("<Q", _read(stream, 8))[0]
        if item in _SCALARS:
            _skip(stream, count * struct.calcsize(_SCALARS[item]))
        else:
            for _ in range(count):
                _read_value(stream, item, keep=False)
        return None
    fmt = _SCALARS[kind]
    return struct.unpack(fmt, _read(stream, struct.calcsize(fmt)))[0]


def _read_string(stream: BinaryIO, keep: bool = True) -> str | None:
    size = struct.unpack("<Q", _read(stream, 8))[0]
    if not keep:
        _skip(stream, size)
        return None
    return _read(stream, size).decode("utf-8")


def _read(stream: BinaryIO, size: int) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise ValueError(f"the GGUF file ends inside its metadata ({len(data)} of {size} bytes)")
    return data


def _skip(stream: BinaryIO, size: int) -> None:
    while size > 0:
        size -= len(_read(stream, min(size, 1 << 20)))


class _ChunkStream:
    """The files ``paths`` read as one stream (an offline model's chunk files are its GGUF file's bytes)."""

    def __init__(self, paths: Iterable[Path]) -> None:
        self._paths = iter(paths)
        self._file = None

    def read(self, size: int) -> bytes:
        out = b""
        while len(out) < size:
            if self._file is None:
                path = next(self._paths, None)
                if path is None:
                    break
                self._file = open(path, "rb")
            data = self._file.read(size - len(out))
            if not data:
                self._file.close()
                self._file = None
            out += data
        return out

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            self._file.close()
