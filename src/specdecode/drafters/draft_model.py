"""The draft-model drafter: a smaller model with the target's vocabulary drafts autoregressively."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from specdecode.drafters.base import Draft, Drafter, ExitPolicy, draft_autoregressively
from specdecode.drafters.control import check_optional_count
from specdecode.drafters.draft_head import DraftHead
from specdecode.engine import kv_cache
from specdecode.engine.fast_path import DRAFT_BUCKETS, ModelRunner
from specdecode.engine.protocol import ModelRunnerProtocol
from specdecode.engine.sampling import Sampler, check_finite
from specdecode.errors import InvalidArgumentError

#: Tokens per forward of ``DraftModelDrafter.check``: the quantized CPU kernels cost about
#: one token's time up to 4 rows and twice that at 5-8 (README, "Quantized weights on CPU").
CHECK_WIDTH = 4


class DraftModelDrafter(Drafter):
    """A smaller model with the target's vocabulary drafts autoregressively.

    Its KV cache holds every token of the sequence except the ones not yet fed:
    after a block it lacks the pending token (and, after a fully accepted block,
    the last draft token too); the next ``propose`` feeds those in one forward,
    so no extra forward is spent re-syncing after a fully accepted block.

    **Draft context window** (``context_window=W``): the draft model is prefilled with
    the prompt's last W tokens only, and keeps every token after them. Its prefill is
    then W tokens instead of the whole prompt: on a CPU an int4 draft's prefill costs
    about twice a bf16 one per token (0.48 s for 96 tokens, 2-core EPYC with
    AVX512-BF16), so on ~700-token prompts it was ~3.4 s per prompt, more than the whole
    decode of a short answer. The draft then proposes from less context; the output is
    unchanged (the target verifies every token). Measured on 6 held-out 705-1154-token
    Spec-Bench prompts (summarization, rag), windows of 128-512 tokens cut the cascade's
    acceptance from 77% to 30-46% and made it slower: not a default.
    The draft's positions count from the window's start: rotary attention depends on
    the distance between positions only, so the draft sees the window as a prompt of W
    tokens. Internally every length is in sequence positions, the draft cache's being
    ``_num_cached - _offset``.

    Args:
        model: The draft model (a transformers causal LM), in eval mode, on the
            target's device. Its vocabulary must map like the target's
            (see ``specdecode.models.check_vocabularies``). Or a model whose ``runner``
            runs it elsewhere (``models.llama_cpp.LlamaCppModel``; full head only).
        head: Which LM-head rows drafting computes (``DraftHead.full()`` when None, or
            ``DraftHead.truncated(ids)``: FR-Spec's K frequent tokens). The rows are
            gathered here, once.
        runner: Runs the model's forwards (``engine.fast_path.ModelRunner`` of ``model``, or
            ``models.llama_cpp.LlamaCppModelRunner``, which keeps its own cache);
            None makes one with the device's default ``compile``. Its fast path is used when
            the target's cache is static (the decoder's fast path): the draft then gets a
            static cache of the same capacity; with a dynamic target cache it runs eagerly.
        context_window: W >= 1: prefill the draft with the prompt's last W tokens only (see
            above); None: the whole prompt.

    Raises:
        InvalidArgumentError: If a truncated head names a token id past the model's head rows,
            or ``context_window`` is not None or an integer >= 1.
        UnsupportedModelError: If a truncated head is given and the model's LM head cannot be found.
    """

    supports_exit_policy = True

    def __init__(self, model: PreTrainedModel, head: DraftHead | None = None, runner: ModelRunnerProtocol | None = None,
                 context_window: int | None = None) -> None:
        self.context_window = check_optional_count("context_window", context_window, "the whole prompt")
        self.model = model
        # Widths: 1 or 2 per round (the pending token, plus the last draft token after a fully
        # accepted block); the cascade feeds its n-gram tokens too (padded up to 4 or 8).
        self.runner = runner if runner is not None else ModelRunner(model, buckets=DRAFT_BUCKETS, name="draft model")
        self.head = (head or DraftHead.full()).bind(model)
        self._cache = None
        self._generation = 0
        self._num_cached = 0  # sequence positions the draft has seen (its cache holds the last _num_cached - _offset)
        self._offset = 0  # leading prompt positions left out by the context window
        self._sampler: Sampler | None = None

    @torch.inference_mode()
    def begin(self, prompt_ids: torch.Tensor, sampler: Sampler, target_cache: DynamicCache) -> None:
        self.head.check_vocab(sampler.vocab_size)
        self._sampler = sampler
        if kv_cache.is_static(target_cache):
            # Sized by the target, which leaves room for a draft forward padded to DRAFT_BUCKETS[-1].
            self._cache = self.runner.new_cache(target_cache.capacity)
        elif self.runner.compile:  # a dynamic target cache: the draft runs eagerly too
            self._cache = kv_cache.new_cache(self.model)
        else:  # a DynamicCache (ModelRunner), or a runner's own (models.llama_cpp.LlamaCppModelRunner)
            self._cache = self.runner.new_cache(prompt_ids.shape[1])
        self._generation = getattr(self._cache, "generation", 0)
        n = prompt_ids.shape[1]
        self._offset = max(0, n - self.context_window) if self.context_window is not None else 0
        with self.head.applied():  # the prefill's one row of logits is not used: spend K rows, not V
            self.runner(prompt_ids[:, self._offset:], self._cache, 1)
        self._rollback_to(n, n)  # trims sliding layers, as after every forward
        self.num_forwards = 1

    @torch.inference_mode()
    def propose(
        self, sequence: torch.Tensor, max_tokens: int, exit_policy: ExitPolicy | None = None,
        first_logits: torch.Tensor | None = None,
    ) -> Draft:
        """Draft up to ``max_tokens`` tokens; ``exit_policy`` as in the module docstring.

        ``first_logits``: the first token's (1, V') logits from ``check`` (no forward for it).

        Raises:
            InvalidArgumentError: If another generation took over this drafter's static cache
                (``ModelRunner.check_owner``).
        """
        self.runner.check_owner(self._cache, self._generation)
        feed = sequence[:, self._num_cached :]
        processing = self._sampler.drafting(sequence) if self.head.ids is None else None  # [processors]
        draft = draft_autoregressively(
            self.runner, self._cache, feed, max_tokens, self._sampler, exit_policy, "draft model", self.head,
            first_logits, processing,
        )
        self.num_forwards += len(draft) - (first_logits is not None)
        fed = 0 if first_logits is not None and len(draft) == 1 else feed.shape[1]  # no forward fed ``feed``
        self._num_cached += fed + len(draft) - 1
        return draft

    @torch.inference_mode()
    def check(
        self,
        sequence: torch.Tensor,
        candidates: torch.Tensor,
        width: int = CHECK_WIDTH,
        finite_out: list | None = None,
    ) -> tuple[int, torch.Tensor]:
        """How many leading ``candidates`` the draft model itself would draft greedily after ``sequence``.

        Forwards of at most ``width`` tokens feed the uncached tokens and then the candidates,
        keeping a row of logits per candidate: row i is the draft's choice after
        ``candidates[:i]``. Feeding stops at the first candidate that differs from the
        draft's argmax (through ``head``), or when all are fed. A forward of up to 4 tokens
        costs about one token's (the quantized CPU kernels work in blocks of 4 rows), so a
        run of agreeing candidates costs about a forward per 4 instead of one per token.

        The cache then holds ``sequence`` and the ``a`` agreeing candidates, the rest rolled
        back; the next ``propose`` gets ``first_logits``, the draft's logits after them, so
        the model continues the block with no extra forward.
        Greedy agreement with the draft model is a deterministic function of the context,
        so kept candidates stay point-mass proposals under sampling (exact verification).

        Args:
            sequence: (1, L) long, the sequence so far (its last token not yet cached).
            candidates: (m,) long, m >= 1, proposed continuation (an n-gram match).
            width: Most tokens per forward (>= 2).

        Returns:
            ``a`` (0 <= a <= m) and the (1, V') logits after ``sequence`` + ``candidates[:a]``.

        Raises:
            NonFiniteLogitsError: If a forward gives NaN or infinite logits (unless ``finite_out``
                is given: each forward's finiteness, a 0-dim bool tensor, is then appended to it
                for the caller to read with the round's other values, and nothing syncs here).
            InvalidArgumentError: See ``propose``; ``width`` < 2; empty ``candidates``; nothing of
                ``sequence`` left to feed (its last token must not be cached yet).
            UnsupportedModelError: A truncated head the model's forward does not apply.
        """
        if isinstance(width, bool) or not isinstance(width, int) or width < 2:
            raise InvalidArgumentError(f"check width must be an integer >= 2, got {width!r}")
        m = int(candidates.shape[0])
        if m < 1:
            raise InvalidArgumentError("check needs at least one candidate token")
        self.runner.check_owner(self._cache, self._generation)
        length = sequence.shape[1]
        if self._num_cached >= length:
            raise InvalidArgumentError(
                f"check needs the sequence's last token uncached: the draft has seen {self._num_cached} of its "
                f"{length} tokens"
            )
        tokens = torch.cat([sequence, candidates.view(1, -1)], dim=1)
        a, previous = 0, None  # previous: the last row of the previous forward (predicts candidates[a])
        with self.head.applied():
            while True:
                start = self._num_cached
                pending = length + a - start  # tokens before candidates[a] not yet cached (0 after the first)
                end = min(m, a + max(1, width - pending))  # candidates [a, end) go in this forward
                logits = self.runner(tokens[:, start:length + end], self._cache, end - a + (previous is None))[0]
                self.num_forwards += 1
                self._num_cached = length + end
                if finite_out is None:
                    check_finite(logits, "draft model")
                else:
                    finite_out.append(torch.isfinite(logits).all())
                self.head.check_logits(logits)
                rows = logits if previous is None else torch.cat([previous, logits])  # (end - a + 1, V')
                choice = self.head.token(self._sampler, rows[:-1])
                matched = int((choice == candidates[a:end]).int().cumprod(0).sum())
                a += matched
                if a < end or end == m:
                    break
                previous = rows[-1:]
        self._rollback_to(self._num_cached, length + a)
        return a, rows[matched : matched + 1]

    @property
    def compile_time_s(self) -> float:
        return self.runner.compile_time_s

    def rollback(self, num_valid: int) -> None:
        self._rollback_to(self._num_cached, num_valid)

    def _rollback_to(self, num_cached: int, num_valid: int) -> None:
        """``kv_cache.rollback`` in sequence positions: the draft cache's are ``_offset`` fewer."""
        self._num_cached = self._offset + kv_cache.rollback(self._cache, num_cached - self._offset,
                                                            num_valid - self._offset)
