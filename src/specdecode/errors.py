"""Exceptions raised by specdecode.

Every error names the offending value and what would have been allowed, so a
user can fix the call without reading the source.
"""

from __future__ import annotations


class SpecDecodeError(Exception):
    """Base class of every error specdecode raises on purpose."""


class InvalidArgumentError(SpecDecodeError, ValueError):
    """A parameter is outside its allowed range (e.g. ``top_p=1.5``)."""


class ModelNotFoundError(SpecDecodeError, FileNotFoundError):
    """A model name is not known, or a model file or folder does not exist."""


class ChecksumMismatchError(SpecDecodeError):
    """An assembled model file does not have the expected sha256."""


class UnsupportedModelError(SpecDecodeError):
    """transformers cannot load this architecture as a causal language model."""


class VocabularyMismatchError(SpecDecodeError, ValueError):
    """The draft model's tokenizer does not map tokens to the same ids as the target's."""


class NonFiniteLogitsError(SpecDecodeError, RuntimeError):
    """A model produced NaN or infinite logits (often a float16 overflow), or finite ones whose sampling
    distribution came out NaN or without mass (``INVALID_DISTRIBUTION``)."""


#: The message of a ``NonFiniteLogitsError`` for a sampling distribution that is not one.
INVALID_DISTRIBUTION = ("the target model's sampling distribution was NaN or had no probability mass after "
                        "temperature / top-k / top-p / min-p (warped logits overflowed); try a higher temperature")


class DatasetError(SpecDecodeError, ValueError):
    """A benchmark dataset is missing, unreadable or malformed (names the file and line)."""


class StorageError(SpecDecodeError):
    """An Optuna study storage (SQLAlchemy URL) cannot be opened (names the URL, password hidden)."""


class StudyMismatchError(SpecDecodeError, ValueError):
    """An existing search study was made for another model, layer count, dtype or search settings."""
