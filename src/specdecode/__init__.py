"""specdecode: speculative decoding for Hugging Face causal language models.

The output is the target model's own: greedy decoding gives the target's greedy
tokens, sampling gives the target's sampling distribution, only sooner.
"""

from specdecode.config import GenerationConfig
from specdecode.decoding import GenerationResult, GenerationStream, SpeculativeDecoder
from specdecode.drafters import Draft, DraftModelDrafter, Drafter
from specdecode.errors import (
    ChecksumMismatchError,
    InvalidArgumentError,
    ModelNotFoundError,
    NonFiniteLogitsError,
    SpecDecodeError,
    UnsupportedModelError,
    VocabularyMismatchError,
)
from specdecode.models import OFFLINE_MODELS, LoadedModel, load_model
from specdecode.pipeline import SpeculativeGenerator
from specdecode.stats import SpecDecodingStats

__version__ = "0.1.0"

__all__ = [
    "OFFLINE_MODELS",
    "ChecksumMismatchError",
    "Draft",
    "DraftModelDrafter",
    "Drafter",
    "GenerationConfig",
    "GenerationResult",
    "GenerationStream",
    "InvalidArgumentError",
    "LoadedModel",
    "ModelNotFoundError",
    "NonFiniteLogitsError",
    "SpecDecodeError",
    "SpecDecodingStats",
    "SpeculativeDecoder",
    "SpeculativeGenerator",
    "UnsupportedModelError",
    "VocabularyMismatchError",
    "load_model",
]
