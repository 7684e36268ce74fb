"""A retrieval datastore for prompt lookup: continuations of n-grams found in a corpus of text.

REST (He et al. 2024, "REST: Retrieval-Based Speculative Decoding", NAACL) drafts from a datastore
of text instead of a draft model: the context's last tokens are looked up in an index of a corpus
(REST: a suffix array of The Stack for code) and the continuations found there are drafted. Here
the corpus is a folder of text files, by default the Python standard library's own sources, which
every Python installation carries (no download), tokenized with the target's tokenizer.

The index is a suffix array sorted by each position's first ``max_ngram`` tokens (numpy's
``lexsort``), with those tokens kept as columns, so the positions that start with an n-gram are one
contiguous range found by ``searchsorted`` on each column in turn. A lookup takes the longest n-gram
of the context's end (``min_ngram`` .. ``max_ngram`` tokens) that occurs at least ``min_count`` times
in the corpus and drafts its most frequent continuation, token by token (at each depth the
plurality among the occurrences that agree so far). It drafts only where that first token is at
least ``min_share`` of the continuations: replayed over llama.cpp's greedy outputs of 10 HumanEval
prompts (``docs/benchmarks/prompt_lookup_sources_replay.py``), a datastore of the standard library
drafted where the prompt had no match of two tokens or more and raised the rate over plain steps by
about 4% at the 2-core Xeon's llama.cpp costs, and only with that threshold (without it: no gain);
measured, 1.10x -> 1.19x llama.cpp's own decoding (docs/benchmarks/2026-11-27-datastore.md).

Memory: 4 bytes per corpus token for the tokens, 4 for the suffix array and 4 per column
(``max_ngram`` of them): about 98 MB for the 3.1M tokens of CPython 3.11's standard library with
Qwen2.5's tokenizer at ``max_ngram`` 6. The tokens and the suffix array are cached on disk
(``load_or_build``), keyed by the corpus, the tokenizer and the files, so a second process reads them
back; a changed corpus replaces its file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sysconfig
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from specdecode.errors import InvalidArgumentError
from specdecode.files import write_atomic

logger = logging.getLogger(__name__)

#: The corpus name of the Python standard library's sources (``python_stdlib_files``).
PYTHON_STDLIB = "python-stdlib"
#: Separates documents in the token array (no token id is negative).
SEPARATOR = -1
#: Bump when the cached arrays' layout or the tokenization of the corpus changes.
FORMAT_VERSION = 1
#: The longest n-gram looked up, and the columns the suffix array is sorted by.
DEFAULT_MAX_NGRAM = 6
#: Folders of the standard library left out of ``python_stdlib_files``: tests and bundled third-party code.
STDLIB_EXCLUDED = frozenset({"test", "tests", "site-packages", "dist-packages", "idle_test", "__pycache__"})


def python_stdlib_files() -> list[Path]:
    """The ``.py`` files of this Python's standard library (``sysconfig``'s "stdlib" folder), without tests
    and installed packages (``STDLIB_EXCLUDED``), sorted.

    Raises:
        InvalidArgumentError: The folder has no ``.py`` file (a Python installed without its sources).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not STDLIB_EXCLUDED.intersection(p.relative_to(root).parts[:-1]))
    if not files:
        raise InvalidArgumentError(f"no .py files under this Python's standard library folder {str(root)!r}; "
                                   "pass a folder of text files as the datastore instead")
    return files


def corpus_files(corpus: str | Path) -> list[Path]:
    """The files of a corpus: ``PYTHON_STDLIB``, a folder (its files with the suffixes of source code and
    text, ``TEXT_SUFFIXES``, recursively, sorted), or one file.

    Raises:
        InvalidArgumentError: A path that does not exist, or a folder without such files.
    """
    if str(corpus) == PYTHON_STDLIB:
        return python_stdlib_files()
    path = Path(corpus).expanduser()
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise InvalidArgumentError(f"datastore {str(corpus)!r} is neither {PYTHON_STDLIB!r}, a folder nor a file")
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))
    if not files:
        raise InvalidArgumentError(f"datastore folder {str(path)!r} has no text files (suffixes: "
                                   f"{', '.join(sorted(TEXT_SUFFIXES))})")
    return files


#: File suffixes a datastore folder's files are read with.
TEXT_SUFFIXES = frozenset({".py", ".pyi", ".md", ".rst", ".txt", ".c", ".h", ".cc", ".cpp", ".hpp", ".rs", ".go",
                           ".java", ".js", ".ts", ".tsx", ".jsx", ".sh", ".toml", ".yaml", ".yml", ".json", ".html",
                           ".css", ".sql", ".rb", ".kt", ".swift", ".scala", ".lua", ".jl", ".r", ".m", ".cs"})


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):  # not text, or unreadable: counted by ``tokenize_corpus``
        return None


def tokenize_corpus(files: Sequence[Path], encode: Callable[[str], Sequence[int]]) -> np.ndarray:
    """The files' tokens, each file's followed by ``SEPARATOR``: an (N,) int32 array. Empty files are left out;
    files that are not UTF-8 text (or not readable) too, with one warning that counts them.

    Raises:
        InvalidArgumentError: No file could be read as text.
    """
    parts, skipped = [], []
    for path in files:
        text = _read_text(path)
        if text is None:
            skipped.append(path)
        elif text.strip():
            parts.append(np.asarray(list(encode(text)), dtype=np.int32))
            parts.append(np.asarray([SEPARATOR], dtype=np.int32))
    if skipped:
        logger.warning("datastore: %d of %d files are not UTF-8 text or not readable and were left out (first: %s)",
                       len(skipped), len(files), skipped[0])
    if not parts:
        raise InvalidArgumentError(f"datastore: none of the {len(files)} files holds UTF-8 text "
                                   f"(first: {str(files[0]) if files else None!r})")
    return np.concatenate(parts)


class NgramDatastore:
    """An n-gram index of a token corpus (module docstring): ``lookup`` drafts a continuation of a context.

    Args:
        tokens: (N,) integer token ids, documents separated by ``SEPARATOR``.
        max_ngram: The longest n-gram looked up, and the columns the suffix array is sorted by (1 .. 16).
        min_ngram: The shortest (1 .. max_ngram).
        min_count: Occurrences an n-gram needs in the corpus to be drafted from (>= 1).
        min_share: The share of its occurrences the drafted first token must continue, in (0, 1].
        suffix_array: (N,) the positions sorted by their first ``max_ngram`` tokens (None: sorted here;
            ``load_or_build`` passes the cached one).

    Raises:
        InvalidArgumentError: A value outside its range, or a suffix array of another length.
    """

    def __init__(self, tokens: np.ndarray, max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = 2, min_count: int = 5,
                 min_share: float = 0.8, suffix_array: np.ndarray | None = None) -> None:
        for name, value, low, high in (("max_ngram", max_ngram, 1, 16), ("min_ngram", min_ngram, 1, max_ngram),
                                       ("min_count", min_count, 1, None)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
                raise InvalidArgumentError(f"datastore {name} must be an integer in {low}..{high or 'inf'}, "
                                           f"got {value!r}")
        if isinstance(min_share, bool) or not isinstance(min_share, (int, float)) or not 0 < min_share <= 1:
            raise InvalidArgumentError(f"datastore min_share must be in (0, 1], got {min_share!r}")
        self.tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        n = self.tokens.shape[0]
        if self.tokens.ndim != 1 or n == 0:
            raise InvalidArgumentError(f"datastore tokens must be a non-empty 1-D array, got shape {self.tokens.shape}")
        self.max_ngram, self.min_ngram, self.min_count, self.min_share = max_ngram, min_ngram, min_count, min_share
        padded = np.concatenate([self.tokens, np.full(max_ngram, SEPARATOR, dtype=np.int32)])
        if suffix_array is None:
            t0 = time.perf_counter()
            suffix_array = np.lexsort([padded[j:j + n] for j in reversed(range(max_ngram))]).astype(np.int32)
            logger.info("datastore: suffix array of %d tokens sorted in %.1f s", n, time.perf_counter() - t0)
        suffix_array = np.asarray(suffix_array, dtype=np.int32)
        if suffix_array.shape != (n,):
            raise InvalidArgumentError(f"datastore suffix_array must have shape ({n},), got {suffix_array.shape}")
        self.suffix_array = suffix_array
        self.columns = [padded[suffix_array + j] for j in range(max_ngram)]  # column j: token j of each suffix

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def _range(self, query: np.ndarray) -> tuple[int, int]:
        """The suffix array's range [lo, hi) whose suffixes start with ``query`` (<= max_ngram tokens)."""
        lo, hi = 0, len(self)
        for j, token in enumerate(query.astype(np.int32)):  # an int32 key: a Python int would cast the column
            column = self.columns[j][lo:hi]
            lo, hi = lo + int(column.searchsorted(token, "left")), lo + int(column.searchsorted(token, "right"))
            if lo >= hi:
                break
        return lo, hi

    def lookup(self, context: np.ndarray, max_tokens: int) -> tuple[list[int], int]:
        """Up to ``max_tokens`` tokens continuing ``context`` ((L,) int ids), and the n-gram size matched.

        The longest n-gram of the context's end (``max_ngram`` .. ``min_ngram``) with at least
        ``min_count`` occurrences decides; its continuation's first token must be at least
        ``min_share`` of them, else nothing is drafted (a shorter n-gram is not tried: where a longer
        context is ambiguous, a shorter one is no better evidence).

        Returns:
            ``(tokens, n)``; ``([], 0)`` when nothing is drafted.
        """
        if max_tokens < 1:
            return [], 0
        length = context.shape[0]
        for n in range(min(self.max_ngram, length), self.min_ngram - 1, -1):
            lo, hi = self._range(context[length - n:])
            if hi - lo >= self.min_count:
                break
        else:
            return [], 0
        positions = None  # past the sorted columns: the occurrences that agree so far
        out: list[int] = []
        for depth in range(max_tokens):
            j = n + depth
            if j < self.max_ngram:  # sorted within [lo, hi): the plurality is the longest run
                nxt = self.columns[j][lo:hi]
            else:
                if positions is None:
                    positions = self.suffix_array[lo:hi].astype(np.int64)
                ahead = positions + j
                nxt = self.tokens[np.minimum(ahead, len(self) - 1)]
                nxt = np.where(ahead < len(self), nxt, SEPARATOR)
            values, counts = np.unique(nxt, return_counts=True)
            best = int(counts.argmax())
            token = int(values[best])
            if token == SEPARATOR or (depth == 0 and counts[best] < self.min_share * nxt.shape[0]):
                break
            out.append(token)
            if j < self.max_ngram:
                key = values[best]  # the column's dtype (int32)
                lo, hi = lo + int(nxt.searchsorted(key, "left")), lo + int(nxt.searchsorted(key, "right"))
            else:
                positions = positions[nxt == token]
        return out, (n if out else 0)


def _is_sorted(columns: list[np.ndarray]) -> bool:
    """Whether consecutive rows of the columns are in lexicographic order (a cached suffix array's check)."""
    if columns[0].shape[0] < 2:
        return True
    ok = np.ones(columns[0].shape[0] - 1, dtype=bool)
    decided = np.zeros_like(ok)
    for column in columns:
        step = np.diff(column.astype(np.int64))
        ok &= decided | (step >= 0)
        decided |= step != 0
    return bool(ok.all())


def _digest(*parts: str) -> str:
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _fingerprint(files: Sequence[Path], encode: Callable[[str], Sequence[int]]) -> str:
    digest = hashlib.sha256(f"v{FORMAT_VERSION}|".encode())
    digest.update(repr(list(encode("def f(x):\n    return x  # ünïcode 数据 <|im_end|>"))).encode())
    for path in files:
        stat = path.stat()
        digest.update(f"{path}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def load_or_build(corpus: str | Path, encode: Callable[[str], Sequence[int]], tokenizer_id: str,
                  cache_dir: str | Path | None, **options) -> NgramDatastore:
    """The ``NgramDatastore`` of ``corpus`` (``corpus_files``) under ``encode`` (text -> token ids, no special
    tokens), read from ``cache_dir``/datastore when built there before, else tokenized, sorted, and written
    there atomically (replacing the file of an earlier state of the same corpus and tokenizer; skipped with
    ``cache_dir`` None). ``tokenizer_id`` names the tokenizer (with a probe encoding and the files' sizes and
    times, the cache key); ``options`` as ``NgramDatastore``'s.

    A cached file that cannot be read or fails its checks (lengths, the suffix array's order) is rebuilt, with
    a warning; a cache that cannot be written is warned about, and the datastore is used from memory.

    Raises:
        InvalidArgumentError: As ``corpus_files``, ``tokenize_corpus`` and ``NgramDatastore``.
    """
    files = corpus_files(corpus)
    max_ngram = options.get("max_ngram", DEFAULT_MAX_NGRAM)
    stem = f"{_digest(str(corpus), tokenizer_id, str(max_ngram))}-"  # this corpus and tokenizer
    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / "datastore" / f"{stem}{_fingerprint(files, encode)}.npz"
        store = _read_cached(path, options)
        if store is not None:
            logger.info("datastore %s: %d tokens of %d files, read from %s", corpus, len(store), len(files), path)
            return store
    t0 = time.perf_counter()
    tokens = tokenize_corpus(files, encode)
    logger.info("datastore %s: %d tokens of %d files, tokenized in %.1f s", corpus, len(tokens), len(files),
                time.perf_counter() - t0)
    store = NgramDatastore(tokens, **options)
    if path is not None:
        try:
            os.makedirs(path.parent, exist_ok=True)
            write_atomic(path, lambda tmp: _save(tmp, store))
            for old in path.parent.glob(f"{stem}*.npz"):  # an earlier state of this corpus
                if old != path:
                    old.unlink(missing_ok=True)
        except OSError as exc:
            logger.warning("datastore cache %s not written (%s): it is built again at the next start", path, exc)
    return store


def _read_cached(path: Path, options: dict) -> NgramDatastore | None:
    """The datastore cached at ``path``, or None (no file; a damaged or inconsistent one, with a warning)."""
    if not path.is_file():
        return None
    try:
        with np.load(path) as saved:
            tokens, suffix_array = saved["tokens"], saved["suffix_array"]
        store = NgramDatastore(tokens, suffix_array=suffix_array, **options)
        if tokens.dtype != np.int32 or not _is_sorted(store.columns):
            raise ValueError("its suffix array is not in order")
        return store
    except Exception as exc:  # noqa: BLE001 (a zip, pickle or numpy error of any kind: the file is rebuilt)
        logger.warning("datastore cache %s unreadable (%s: %s): rebuilding it", path, type(exc).__name__, exc)
        return None


def _save(tmp: Path, store: NgramDatastore) -> None:
    with open(tmp, "wb") as f:  # a file object: np.savez would append ".npz" to the temporary name
        np.savez(f, tokens=store.tokens, suffix_array=store.suffix_array)
