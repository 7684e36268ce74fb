"""Models: the offline registry, GGUF assembly with checksum, the dense cache, and loading.

- ``registry``: ``OFFLINE_MODELS`` (packaged GGUF files) and the cache folder;
- ``gguf``: joining an offline model's chunks into one checked GGUF file;
- ``dense_cache``: the de-quantized copy written once, atomically;
- ``loading``: ``load_model`` for every kind of spec, device and dtype choice,
  ``check_vocabularies`` for a target/draft pair;
- ``context_length``: a model's context length read from its files without loading its weights
  (``serve`` checks --max-length against it before loading);
- ``token_frequencies``: token counts on installed Python text for a truncated draft
  head (FR-Spec), stored next to the draft model's dense copy.
- ``quantize``: weight-only int8 / int4 linear layers on CPU and the quantized input
  embedding (``quantized_embedding``: the int8 / int4 storage formats, ``Int8Embedding``,
  ``Int4Embedding``).
"""

from specdecode.models.dense_cache import CACHE_FORMAT_VERSION, dense_cache_valid, dense_dir, write_dense_cache
from specdecode.models.gguf import assemble_gguf, chunk_paths
from specdecode.models.loading import (
    DTYPES,
    LoadedModel,
    check_vocabularies,
    load_model,
    resolve_device,
    resolve_dtype,
)
from specdecode.models.registry import OFFLINE_MODELS, OfflineModel, default_cache_dir
from specdecode.models.token_frequencies import TokenFrequencies, default_corpus, load_or_count

__all__ = [
    "CACHE_FORMAT_VERSION",
    "DTYPES",
    "OFFLINE_MODELS",
    "LoadedModel",
    "OfflineModel",
    "TokenFrequencies",
    "assemble_gguf",
    "check_vocabularies",
    "chunk_paths",
    "default_cache_dir",
    "default_corpus",
    "dense_cache_valid",
    "dense_dir",
    "load_model",
    "load_or_count",
    "resolve_device",
    "resolve_dtype",
    "write_dense_cache",
]
