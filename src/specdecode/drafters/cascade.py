"""The cascade drafter: a free n-gram match first, then the draft model from where it ended.

Prompt lookup costs nothing but proposes only when the text repeats; a draft model
proposes everywhere but costs a forward per token. The cascade takes both: each
round it first copies the continuation of the last n-gram's most recent earlier
match (``prompt_lookup.find_continuation``); when that gives fewer than
``max_tokens`` tokens, the draft model continues the same block from where the
match ended. The draft model is fed the n-gram tokens as part of its input, so its
KV cache stays that of the sequence it drafted after; when the target rejects part
of the block, ``rollback`` crops that cache like ``DraftModelDrafter``'s.

Verification sees one block. The n-gram part is deterministic: its rows of
``Draft.probs`` are one-hot when sampling, so speculative sampling accepts such a
token with the target's probability and otherwise resamples from the target with
it removed (exact, Leviathan et al. 2022 with a point-mass q); the model part
carries the draft model's own distributions. Adaptive draft exit applies to the
model part only: an n-gram token has no confidence to test.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from specdecode.drafters.base import Draft, Drafter, ExitPolicy
from specdecode.drafters.draft_head import DraftHead
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.prompt_lookup import PromptLookupDrafter, find_continuation
from specdecode.engine.fast_path import ModelRunner
from specdecode.engine.sampling import Sampler


class CascadeDrafter(Drafter):
    """n-gram match first, then a draft model for the rest of the block.

    Args:
        model: The draft model (a transformers causal LM with the target's vocabulary),
            in eval mode, on the target's device.
        max_ngram, min_ngram: n-gram sizes of the match (1 <= min_ngram <= max_ngram).
        head: The draft model's LM-head rows (``DraftModelDrafter``'s ``head``); the n-gram
            part may propose any token, the model part only the head's.
        runner: The draft model's ``ModelRunner`` (``DraftModelDrafter``'s ``runner``).

    Attributes:
        num_forwards: Draft-model forwards in the current generation.
        num_ngram_tokens: Tokens the n-gram part proposed in the current generation.

    Raises:
        InvalidArgumentError: Unless 1 <= min_ngram <= max_ngram; a truncated head's id past the model's rows.
    """

    supports_exit_policy = True

    def __init__(
        self,
        model: PreTrainedModel,
        max_ngram: int = 3,
        min_ngram: int = 1,
        head: DraftHead | None = None,
        runner: ModelRunner | None = None,
    ) -> None:
        PromptLookupDrafter(max_ngram, min_ngram)  # validates the n-gram sizes
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._model = DraftModelDrafter(model, head, runner)
        self._sampler: Sampler | None = None
        self.num_ngram_tokens = 0

    @property
    def num_forwards(self) -> int:  # type: ignore[override]
        return self._model.num_forwards

    @property
    def compile_time_s(self) -> float:
        return self._model.compile_time_s

    def begin(self, prompt_ids: torch.Tensor, sampler: Sampler, target_cache: DynamicCache) -> None:
        self._sampler = sampler
        self._model.begin(prompt_ids, sampler, target_cache)
        self.num_ngram_tokens = 0

    def propose(self, sequence: torch.Tensor, max_tokens: int, exit_policy: ExitPolicy | None = None) -> Draft:
        """Up to ``max_tokens`` tokens: the n-gram continuation, then the draft model's.

        Args:
            sequence: (1, L) long, the sequence so far.
            max_tokens: Most tokens to propose (>= 1).
            exit_policy: Ends the model part early (adaptive draft exit).

        Returns:
            A ``Draft`` of k <= max_tokens tokens; ``probs`` (k, V) when sampling, with
            one-hot rows for the n-gram tokens.
        """
        ngram = find_continuation(sequence[0], max_tokens, self.max_ngram, self.min_ngram)
        m = int(ngram.shape[0])
        self.num_ngram_tokens += m
        if m == max_tokens:
            return Draft(ngram)  # probs None: verification treats the block as one-hot
        fed = torch.cat([sequence, ngram.unsqueeze(0)], dim=1) if m else sequence
        model_part = self._model.propose(fed, max_tokens - m, exit_policy)
        if not m:
            return model_part
        tokens = torch.cat([ngram, model_part.tokens])
        if model_part.probs is None:
            return Draft(tokens, None, model_part.finite, model_part.who)
        return Draft(tokens, torch.cat([self._one_hot(ngram), model_part.probs]))

    def _one_hot(self, tokens: torch.Tensor) -> torch.Tensor:
        """(m, V) float32 point masses at ``tokens``."""
        rows = torch.zeros((tokens.shape[0], self._sampler.vocab_size), dtype=torch.float32, device=tokens.device)
        return rows.scatter_(1, tokens.unsqueeze(1), 1.0)

    def rollback(self, num_valid: int) -> None:
        self._model.rollback(num_valid)
