"""Atomic file writes: a reader (or a killed writer) never sees a half-written results file."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_atomic(path: str | Path, write: Callable[[Path], None]) -> None:
    """Write through ``write(tmp)`` to a unique temporary file next to ``path``, then rename it into place.

    The rename is atomic on POSIX and Windows (``os.replace``), and the temporary name is
    unique, so concurrent writers (e.g. several search workers) never mix their bytes; the
    last rename wins. The temporary file is removed when ``write`` raises.

    Raises:
        OSError: The folder is missing or not writable (whatever ``write`` raises passes through).
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_text_atomic(path: str | Path, text: str) -> None:
    """``write_atomic`` of UTF-8 text."""
    write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_png_atomic(figure, path: str | Path, dpi: int = 120) -> None:
    """``write_atomic`` of a matplotlib ``Figure`` as PNG (tight bounding box, ``dpi`` dots per inch)."""
    write_atomic(path, lambda tmp: figure.savefig(tmp, format="png", dpi=dpi, bbox_inches="tight"))
