"""Drafters: what proposes the tokens the target model verifies, and how many per round.

- ``base``: the ``Drafter`` protocol and ``Draft`` (defined by the engine, re-exported),
  ``draft_batch``, the draft loop over every row shared by the model-based drafters;
- ``draft_model``: ``DraftModelDrafter``, a smaller model with the target's vocabulary;
- ``cascade``: ``CascadeDrafter``, a free n-gram match first, then the draft model;
- ``draft_head``: ``DraftHead``, the draft model's LM head in full or cut to K frequent
  tokens (FR-Spec), for the two drafters above;
- ``layer_skip``: Draft & Verify's self-speculative drafter (``SkipSet``, ``draft_mode``);
- ``early_exit``: the first N layers, then the final norm and LM head;
- ``prompt_lookup``: n-gram match against the prompt and the output, no model cost (with
  ``branches`` > 1 several matches as a token tree);
- ``token_recycling``: Token Recycling, a token tree from the target's recycled top-k, no model;
- ``control``: adaptive draft exit, draft-length schedules, target-confidence gating
  (``DraftControl``).

Every drafter is batch-native (one protocol): it drafts for the round's active rows at once,
B >= 1, so ``generate`` (one row) and ``serve`` (many) run the same drafter.
Drafters import only the engine's protocol, sampler, cache and runner helpers, never the decoder.
"""

from specdecode.drafters.base import Draft, Drafter, ExitPolicy, draft_batch
from specdecode.drafters.cascade import CascadeDrafter
from specdecode.drafters.control import (
    LENGTH_SCHEDULES,
    AdaptiveDraftExit,
    ConfidenceGate,
    DraftControl,
    DraftController,
    HeuristicDraftLength,
)
from specdecode.drafters.draft_head import BoundDraftHead, DraftHead
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.early_exit import EarlyExitDrafter, exit_skip_set
from specdecode.drafters.layer_skip import SUBLAYERS, LayerSkipDrafter, SkipSet, decoder_layers, draft_mode
from specdecode.drafters.prompt_lookup import PromptLookupDrafter, find_continuation
from specdecode.drafters.token_recycling import TokenRecyclingDrafter

__all__ = [
    "LENGTH_SCHEDULES",
    "SUBLAYERS",
    "AdaptiveDraftExit",
    "BoundDraftHead",
    "CascadeDrafter",
    "ConfidenceGate",
    "Draft",
    "DraftControl",
    "DraftHead",
    "DraftController",
    "DraftModelDrafter",
    "Drafter",
    "EarlyExitDrafter",
    "ExitPolicy",
    "HeuristicDraftLength",
    "LayerSkipDrafter",
    "PromptLookupDrafter",
    "SkipSet",
    "TokenRecyclingDrafter",
    "decoder_layers",
    "draft_batch",
    "draft_mode",
    "exit_skip_set",
    "find_continuation",
]
