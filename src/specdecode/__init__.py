"""specdecode: speculative decoding for Hugging Face causal language models.

The output is the target model's own: greedy decoding gives the target's greedy
tokens, sampling gives the target's sampling distribution, only sooner.

Layers, each importing only those below it:

- ``config``, ``errors``, ``files``: shared by all;
- ``engine``: the decode loop, verification, sampling, KV cache, statistics;
- ``drafters``: draft model, layer skip, early exit, prompt lookup, draft control;
- ``models``: offline registry, GGUF assembly, dense cache, loading;
- ``pipeline``: ``SpeculativeGenerator`` (text in, text out);
- ``bench`` and ``search``: the benchmark and the skip-set search, built on the pipeline;
- ``cli``: argument parsing for ``specdecode generate|bench|search``.
"""

from specdecode.config import GenerationConfig
from specdecode.drafters import (
    CascadeDrafter,
    Draft,
    DraftControl,
    Drafter,
    DraftModelDrafter,
    EarlyExitDrafter,
    LayerSkipDrafter,
    PromptLookupDrafter,
    SkipSet,
    draft_mode,
)
from specdecode.engine import (
    BatchedSpeculativeDecoder,
    BatchEvent,
    GenerationResult,
    GenerationStream,
    SpecDecodingStats,
    SpeculativeDecoder,
)
from specdecode.errors import (
    ChecksumMismatchError,
    DatasetError,
    InvalidArgumentError,
    ModelNotFoundError,
    NonFiniteLogitsError,
    SpecDecodeError,
    StorageError,
    StudyMismatchError,
    UnsupportedModelError,
    VocabularyMismatchError,
)
from specdecode.models import OFFLINE_MODELS, LoadedModel, load_model
from specdecode.pipeline import SpeculativeGenerator
from specdecode.version import __version__

__all__ = [
    "OFFLINE_MODELS",
    "BatchEvent",
    "BatchedSpeculativeDecoder",
    "CascadeDrafter",
    "ChecksumMismatchError",
    "DatasetError",
    "Draft",
    "DraftControl",
    "DraftModelDrafter",
    "Drafter",
    "EarlyExitDrafter",
    "GenerationConfig",
    "GenerationResult",
    "GenerationStream",
    "InvalidArgumentError",
    "LayerSkipDrafter",
    "LoadedModel",
    "ModelNotFoundError",
    "NonFiniteLogitsError",
    "PromptLookupDrafter",
    "SkipSet",
    "SpecDecodeError",
    "SpecDecodingStats",
    "SpeculativeDecoder",
    "SpeculativeGenerator",
    "StorageError",
    "StudyMismatchError",
    "UnsupportedModelError",
    "VocabularyMismatchError",
    "draft_mode",
    "load_model",
]
