"""What a generation returns (``GenerationResult``), shared by ``decoder`` and ``batched``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.engine.stats import SpecDecodingStats


@dataclass
class GenerationResult:
    """What one generation produced.

    Attributes:
        token_ids: The new token ids (prompt excluded), EOS or stop string included.
        text: ``token_ids`` decoded without special tokens ("" when no tokenizer was given).
        finish_reason: "eos", "stop_string", "length", or "banned_word" (a banned word could
            not be avoided without taking back text already streamed; see ``GenerationStream``);
            in the batched engine also "error" (``BatchEvent.error``).
        stats: Counts and timings.
        logprobs: With ``GenerationConfig.logprobs``, one ``engine.processors.TokenLogprob`` per token
            of ``token_ids``; None otherwise.
    """

    token_ids: list[int]
    text: str
    finish_reason: str
    stats: SpecDecodingStats
    logprobs: list | None = None


def as_2d(ids: torch.Tensor | list[int]) -> torch.Tensor:
    """A list of ints or an (n,) tensor as (1, n) long; other shapes unchanged (callers validate)."""
    if not isinstance(ids, torch.Tensor):
        ids = torch.tensor(list(ids), dtype=torch.long)
    return ids.unsqueeze(0) if ids.dim() == 1 else ids
