"""specdecode: speculative decoding for Hugging Face causal language models.

The output is the target model's own: greedy decoding gives the target's greedy
tokens, sampling gives the target's sampling distribution, only sooner.
"""

from specdecode.config import GenerationConfig
from specdecode.decoding import GenerationResult, GenerationStream, SpeculativeDecoder
from specdecode.draft_control import DraftControl
from specdecode.drafters import Draft, DraftModelDrafter, Drafter
from specdecode.early_exit import EarlyExitDrafter
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
from specdecode.layer_skip import LayerSkipDrafter, SkipSet, draft_mode
from specdecode.models import OFFLINE_MODELS, LoadedModel, load_model
from specdecode.pipeline import SpeculativeGenerator
from specdecode.prompt_lookup import PromptLookupDrafter
from specdecode.stats import SpecDecodingStats

__version__ = "0.1.0"

__all__ = [
    "OFFLINE_MODELS",
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
