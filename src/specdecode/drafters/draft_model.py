"""The draft-model drafter: a smaller model with the target's vocabulary drafts autoregressively."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from specdecode.drafters.base import Draft, Drafter, ExitPolicy, draft_autoregressively
from specdecode.drafters.draft_head import DraftHead
from specdecode.engine import kv_cache
from specdecode.engine.fast_path import DRAFT_BUCKETS, ModelRunner
from specdecode.engine.sampling import Sampler


class DraftModelDrafter(Drafter):
    """A smaller model with the target's vocabulary drafts autoregressively.

    Its KV cache holds every token of the sequence except the ones not yet fed:
    after a block it lacks the pending token (and, after a fully accepted block,
    the last draft token too); the next ``propose`` feeds those in one forward,
    so no extra forward is spent re-syncing after a fully accepted block.

    Args:
        model: The draft model (a transformers causal LM), in eval mode, on the
            target's device. Its vocabulary must map like the target's
            (see ``specdecode.models.check_vocabularies``).
        head: Which LM-head rows drafting computes (``DraftHead.full()`` when None, or
            ``DraftHead.truncated(ids)``: FR-Spec's K frequent tokens). The rows are
            gathered here, once.
        runner: Runs the model's forwards (``engine.fast_path.ModelRunner`` of ``model``);
            None makes one with the device's default ``compile``. Its fast path is used when
            the target's cache is static (the decoder's fast path): the draft then gets a
            static cache of the same capacity; with a dynamic target cache it runs eagerly.

    Raises:
        InvalidArgumentError: If a truncated head names a token id past the model's head rows.
        UnsupportedModelError: If a truncated head is given and the model's LM head cannot be found.
    """

    supports_exit_policy = True

    def __init__(self, model: PreTrainedModel, head: DraftHead | None = None, runner: ModelRunner | None = None) -> None:
        self.model = model
        # Widths: 1 or 2 per round (the pending token, plus the last draft token after a fully
        # accepted block); the cascade feeds its n-gram tokens too (padded up to 4 or 8).
        self.runner = runner if runner is not None else ModelRunner(model, buckets=DRAFT_BUCKETS, name="draft model")
        self.head = (head or DraftHead.full()).bind(model)
        self._cache = None
        self._generation = 0
        self._num_cached = 0
        self._sampler: Sampler | None = None

    @torch.inference_mode()
    def begin(self, prompt_ids: torch.Tensor, sampler: Sampler, target_cache: DynamicCache) -> None:
        self.head.check_vocab(sampler.vocab_size)
        self._sampler = sampler
        if kv_cache.is_static(target_cache):
            # Sized by the target, which leaves room for a draft forward padded to DRAFT_BUCKETS[-1].
            self._cache = self.runner.new_cache(target_cache.capacity)
        else:
            self._cache = kv_cache.new_cache(self.model)
        self._generation = getattr(self._cache, "generation", 0)
        with self.head.applied():  # the prefill's one row of logits is not used: spend K rows, not V
            self.runner(prompt_ids, self._cache, 1)
        n = prompt_ids.shape[1]
        self._num_cached = kv_cache.rollback(self._cache, n, n)  # trims sliding layers, as after every forward
        self.num_forwards = 1

    @torch.inference_mode()
    def propose(self, sequence: torch.Tensor, max_tokens: int, exit_policy: ExitPolicy | None = None) -> Draft:
        """Draft up to ``max_tokens`` tokens; ``exit_policy`` as in the module docstring.

        Raises:
            InvalidArgumentError: If another generation took over this drafter's static cache
                (``ModelRunner.check_owner``).
        """
        self.runner.check_owner(self._cache, self._generation)
        feed = sequence[:, self._num_cached :]
        draft = draft_autoregressively(
            self.runner, self._cache, feed, max_tokens, self._sampler, exit_policy, "draft model", self.head
        )
        self.num_forwards += len(draft)
        self._num_cached += feed.shape[1] + len(draft) - 1
        return draft

    @property
    def compile_time_s(self) -> float:
        return self.runner.compile_time_s

    def rollback(self, num_valid: int) -> None:
        self._num_cached = kv_cache.rollback(self._cache, self._num_cached, num_valid)
