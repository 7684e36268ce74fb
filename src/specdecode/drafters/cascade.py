"""The cascade drafter: a free n-gram match first, then the draft model from where it ended.

Prompt lookup costs nothing but proposes only when the text repeats; a draft model
proposes everywhere but costs a forward per token. The cascade takes both: each
round it first copies the continuation of the last n-gram's most recent earlier
match (``prompt_lookup.find_continuation``); when that gives fewer than
``max_tokens`` tokens, the draft model continues the same block from where the
match ended. The draft model is fed the n-gram tokens as part of its input, so its
KV cache stays that of the sequence it drafted after; when the target rejects part
of the block, ``rollback`` crops that cache like ``DraftModelDrafter``'s.

**The n-gram check** (``ngram_check=True``, the default). An n-gram match is often weak
(a single repeated token), and a rejected n-gram token discards the whole block, the
model's tokens after it included. So the draft model first checks the match
(``DraftModelDrafter.check``): it is fed the n-gram tokens, a few per forward, with a
row of logits kept per token, and only the leading tokens that equal its own greedy
choice stay; its logits after them give the next token, and it drafts on from there.
Greedy and without adaptive draft exit, the block is then the one ``draft`` would
propose (up to rounding: a forward over several tokens may round differently from one
over a single token), but a run of agreeing n-gram tokens costs about one draft forward
per 4 tokens instead of one per token. With adaptive exit, agreeing n-gram tokens skip
the confidence test (two sources agree), so blocks can be longer than ``draft``'s. With
a truncated head (FR-Spec) an n-gram token outside its K tokens never agrees, so the
check drops it.
With ``ngram_check=False`` the whole match is proposed unchecked (the first design;
kept to measure against).

**Long prompts** (``max_model_prompt_tokens=N``): a prompt of more than N tokens skips
the draft model for the whole generation. It is not prefilled, and the cascade proposes
the n-gram match alone, unchecked, up to ``LONG_PROMPT_BLOCK`` (5) tokens a block: it is
then ``prompt-lookup`` with its default γ. The reason is the draft model's prefill: an
int4 draft on a CPU prefills at about twice a bf16 draft's cost per token, about 3.4 s
for a 700-token prompt on a 2-core EPYC with AVX512-BF16. Long prompts are mostly
documents to summarize or answer from, whose answers copy from them, where prompt lookup
is strong anyway. On 6 held-out Spec-Bench prompts of 705-1154 tokens (summarization and
rag), ``prompt-lookup`` beat the cascade on all 6, and n-gram blocks of up to the
adaptive exit's 12 tokens were 5% slower than its 5 (more rejected tokens to verify;
``docs/benchmarks/2026-11-25-cascade-long-prompts.md``).

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

from specdecode.config import DEFAULT_NUM_SPECULATIVE_TOKENS
from specdecode.drafters.base import Draft, Drafter, ExitPolicy
from specdecode.drafters.draft_head import DraftHead
from specdecode.drafters.control import check_optional_count
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.prompt_lookup import PromptLookupDrafter, find_continuation
from specdecode.engine.protocol import ModelRunnerProtocol
from specdecode.engine.sampling import Sampler
from specdecode.errors import InvalidArgumentError

#: Most tokens per block when a long prompt leaves the cascade to its n-gram matches: prompt
#: lookup's default γ.
LONG_PROMPT_BLOCK = DEFAULT_NUM_SPECULATIVE_TOKENS


class CascadeDrafter(Drafter):
    """n-gram match first, then a draft model for the rest of the block.

    Args:
        model: The draft model (a transformers causal LM with the target's vocabulary),
            in eval mode, on the target's device, or a ``models.llama_cpp.LlamaCppModel``.
        max_ngram, min_ngram: n-gram sizes of the match (1 <= min_ngram <= max_ngram).
        head: The draft model's LM-head rows (``DraftModelDrafter``'s ``head``); the model part
            proposes only the head's tokens, and so does the n-gram part when checked (unchecked,
            any token).
        runner: The draft model's ``ModelRunner`` or ``LlamaCppModelRunner`` (``DraftModelDrafter``'s).
        ngram_check: Keep only the n-gram tokens the draft model agrees with (module
            docstring); False proposes the whole match.
        context_window: The draft model's context window (``DraftModelDrafter``): the n-gram
            part still matches against the whole sequence.
        max_model_prompt_tokens: N >= 1: a prompt of more than N tokens gets n-gram matches
            alone, with no draft model (module docstring); None: the draft model always runs.

    Attributes:
        num_forwards: Draft-model forwards in the current generation.
        num_ngram_tokens: Tokens the n-gram part proposed (after the check) in the current generation.

    Raises:
        InvalidArgumentError: Unless 1 <= min_ngram <= max_ngram; a truncated head's id past the model's rows;
            ``context_window`` or ``max_model_prompt_tokens`` not None or an integer >= 1.
    """

    supports_exit_policy = True
    uses_host_sequence = True

    def __init__(
        self,
        model: PreTrainedModel,
        max_ngram: int = 3,
        min_ngram: int = 1,
        head: DraftHead | None = None,
        runner: ModelRunnerProtocol | None = None,
        ngram_check: bool = True,
        context_window: int | None = None,
        max_model_prompt_tokens: int | None = None,
    ) -> None:
        PromptLookupDrafter(max_ngram, min_ngram)  # validates the n-gram sizes
        if not isinstance(ngram_check, bool):
            raise InvalidArgumentError(f"ngram_check must be True or False, got {ngram_check!r}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.ngram_check = ngram_check
        self._model = DraftModelDrafter(model, head, runner, context_window)
        self.max_model_prompt_tokens = check_optional_count("max_model_prompt_tokens", max_model_prompt_tokens,
                                                            "no limit")
        self.model_active = True  # False for this generation: the prompt was longer than max_model_prompt_tokens
        self._sampler: Sampler | None = None
        self.num_ngram_tokens = 0

    @property
    def num_forwards(self) -> int:  # type: ignore[override]
        return self._model.num_forwards if self.model_active else 0

    @property
    def compile_time_s(self) -> float:
        return self._model.compile_time_s

    def begin(self, prompt_ids: torch.Tensor, sampler: Sampler, target_cache: DynamicCache) -> None:
        self._sampler = sampler
        limit = self.max_model_prompt_tokens
        self.model_active = limit is None or prompt_ids.shape[1] <= limit
        if self.model_active:
            self._model.begin(prompt_ids, sampler, target_cache)
        self.num_ngram_tokens = 0

    def propose(
        self,
        sequence: torch.Tensor,
        max_tokens: int,
        exit_policy: ExitPolicy | None = None,
        host_sequence: torch.Tensor | None = None,
    ) -> Draft:
        """Up to ``max_tokens`` tokens: the n-gram continuation, then the draft model's.

        Args:
            sequence: (1, L) long, the sequence so far.
            max_tokens: Most tokens to propose (>= 1).
            exit_policy: Ends the model part early (adaptive draft exit).
            host_sequence: The same tokens as an (L,) int64 numpy array (the decoder's host
                copy): the n-gram match runs there, with no host sync.

        Returns:
            A ``Draft`` of k <= max_tokens tokens; ``probs`` (k, V) when sampling, with
            one-hot rows for the n-gram tokens.
        """
        seq = sequence[0] if host_sequence is None else host_sequence
        if not self.model_active:  # a long prompt: n-gram matches alone, as prompt lookup
            ngram = find_continuation(seq, min(max_tokens, LONG_PROMPT_BLOCK), self.max_ngram, self.min_ngram)
            self.num_ngram_tokens += int(ngram.shape[0])
            return Draft(torch.as_tensor(ngram))
        ngram = find_continuation(seq, max_tokens, self.max_ngram, self.min_ngram)
        m = int(ngram.shape[0])
        if host_sequence is not None:  # to the draft model's device, without a device read
            ngram = torch.from_numpy(ngram).to(sequence.device, non_blocking=True)
        first_logits = None
        # Greedy without an exit policy, the check's finiteness flags join the draft's (read by the
        # decoder in the round's one host sync); otherwise the check raises at once.
        flags = [] if self._sampler.greedy and exit_policy is None else None
        if m and self.ngram_check:
            m, first_logits = self._model.check(sequence, ngram, finite_out=flags)
            ngram = ngram[:m]
        self.num_ngram_tokens += m
        checked = torch.stack(flags).all() if flags else None
        if m == max_tokens:  # probs None: verification treats the block as one-hot
            return Draft(ngram, None, checked, "draft model")
        fed = torch.cat([sequence, ngram.unsqueeze(0)], dim=1) if m else sequence
        model_part = self._model.propose(fed, max_tokens - m, exit_policy, first_logits)
        finite = model_part.finite
        if checked is not None:
            finite = checked if finite is None else finite & checked
        if not m:  # no n-gram token kept (no match, or the check kept none): the model part alone
            return model_part if finite is model_part.finite else Draft(
                model_part.tokens, model_part.probs, finite, model_part.who
            )
        tokens = torch.cat([ngram, model_part.tokens])
        if model_part.probs is None:
            return Draft(tokens, None, finite, model_part.who)
        return Draft(tokens, torch.cat([self._one_hot(ngram), model_part.probs]))

    def _one_hot(self, tokens: torch.Tensor) -> torch.Tensor:
        """(m, V) float32 point masses at ``tokens``."""
        rows = torch.zeros((tokens.shape[0], self._sampler.vocab_size), dtype=torch.float32, device=tokens.device)
        return rows.scatter_(1, tokens.unsqueeze(1), 1.0)

    def rollback(self, num_valid: int) -> None:
        if self.model_active:
            self._model.rollback(num_valid)
