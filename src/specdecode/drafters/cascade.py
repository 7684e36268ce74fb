"""The cascade drafter: a free n-gram match first, then the draft model from where it ended.

Prompt lookup costs nothing but proposes only when the text repeats; a draft model
proposes everywhere but costs a forward per token. The cascade takes both: each
round it first copies the continuation of the last n-gram's most recent earlier
match (``prompt_lookup.find_continuation``); when that gives fewer than
``max_tokens`` tokens, the draft model continues the same block from where the
match ended.

**The n-gram check** (``ngram_check=True``, the default). An n-gram match is often weak
(a single repeated token), and a rejected n-gram token discards the whole block, the
model's tokens after it included. So the draft model first checks the match, and only the
leading tokens that equal its own greedy choice stay; its logits after them give the
next token, and it drafts on from there.
Greedy and without adaptive draft exit, the block is then the one ``draft`` would
propose (up to rounding: a forward over several tokens may round differently from one
over a single token), but a run of agreeing n-gram tokens costs one draft forward
instead of one per token. With adaptive exit, agreeing n-gram tokens skip
the confidence test (two sources agree), so blocks can be longer than ``draft``'s.
With ``ngram_check=False`` the whole match is proposed unchecked (the first design;
kept to measure against).

**Long prompts** (``max_model_prompt_tokens=N``): a row whose prompt has more than N tokens
skips the draft model for its whole generation. It is not prefilled, and proposes its n-gram
match alone, unchecked, up to ``LONG_PROMPT_BLOCK`` (5) tokens a block: it is then
``prompt-lookup`` with its default γ. The reason is the draft model's prefill: an
int4 draft on a CPU prefills at about twice a bf16 draft's cost per token, about 3.4 s
for a 700-token prompt on a 2-core EPYC with AVX512-BF16. Long prompts are mostly
documents to summarize or answer from, whose answers copy from them, where prompt lookup
is strong anyway. On 6 held-out Spec-Bench prompts of 705-1154 tokens (summarization and
rag), ``prompt-lookup`` beat the cascade on all 6, and n-gram blocks of up to the
adaptive exit's 12 tokens were 5% slower than its 5 (more rejected tokens to verify;
``docs/benchmarks/2026-11-25-cascade-long-prompts.md``). Every forward still spans slots
0 .. n - 1 (the fast path's buckets take the active rows as a prefix of the slots), so such a
row gets placeholder tokens at positions 0 .. of its own draft slot, which no real row reads;
its logits are ignored.

**The round, for every row at once.** 1. **n-gram match**: ``prompt_lookup.find_continuation`` on the row's
   host copy (``prompt_lookup.HostSequences``; no torch op, so no host sync), up to the row's ``max_tokens``.
2. **check** (``ngram_check=True``): one draft-model forward over the batch feeds each row's
   tokens not yet in the draft cache, then its n-gram candidates, aligned on the right as in
   ``DraftModelDrafter.propose`` (a row with fewer new tokens re-feeds some it already
   holds; only a sequence shorter than the width pads on the right). Row b keeps its leading
   candidates that equal the draft model's greedy choice (``DraftModelDrafter.check``, batched:
   all candidates in one forward, where the single-sequence check feeds 4 per forward and stops
   at the first disagreement). The logits after the kept candidates give the first token of the
   row's model part, with no forward of its own. Reading the kept counts is one host sync, in
   rounds where some row has candidates. Where the forward runs in a bucket, its graph also gives every
   position's argmax and finiteness (``BatchRunner.forward_greedy``): the check compares those, the round's
   finiteness flag is theirs, and the greedy steps start from them (``base.draft_batch``'s ``first_greedy``),
   so the drafter launches no argmax or finiteness kernel over the logits (except where the head has columns
   past the vocabulary, whose epilogue is not the check's choice, and with per-step exits, whose finiteness is
   checked on the host); the forward's ids and the check's candidates and indices go to the device in one copy.
   On the fast path this forward runs the draft runner's widest bucket (the cache's ``max_width``, the engine's
   longest block + 1); a row whose uncached tokens and candidates would not fit keeps the leading candidates
   that do (``_fit``), so the check runs compiled. On the fast path the blocks can therefore differ from the
   eager path's: greedy output is the same (the target verifies every token), and sampling follows the same law,
   but a seed's sampled tokens may differ between the two. With ``ngram_check=False`` every n-gram
   token is kept unchecked; the first forward feeds them (as context for the model part) only to
   rows whose block the match leaves unfilled.
3. **model part**: ``batched.draft_batch`` drafts the rest of each row's block from where its
   check stopped (positions ``len + kept``), as ``DraftModelDrafter`` does. The draft model is
   fed the n-gram tokens as part of its input, so its KV cache stays that of the sequence it
   drafted after; when the target rejects part of the block, the next forward overwrites the
   rejected positions.

**Exactness.** The target verifies every token, so greedy output equals target-only decoding
whatever the check keeps. When sampling, the n-gram tokens get one-hot rows of ``probs`` (a
point-mass q: speculative sampling accepts such a token with the target's probability and
otherwise resamples from the target with it removed, Leviathan et al. 2022); the model part
carries the draft model's own distributions; a row drafted by n-grams alone gives None (the
engine then treats its block as one-hot). Greedy agreement with the draft model is a
deterministic function of the context, so kept candidates stay point masses. Adaptive draft
exit applies to the model part only: an n-gram token has no confidence to test.

**Draft context window** (``context_window=W``): the draft model is prefilled with a row's last W
prompt tokens only (``DraftModelDrafter``); the n-gram part still matches against the whole
sequence. **Truncated head** (``head``, FR-Spec): the model part proposes among the head's K
tokens, and a checked n-gram token outside them never agrees, so the check drops it (unchecked,
any token).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from specdecode.config import DEFAULT_NUM_SPECULATIVE_TOKENS
from specdecode.drafters.base import draft_batch, draft_views, reads_per_step
from specdecode.drafters.control import check_optional_count
from specdecode.drafters.draft_head import DraftHead
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.draft_tree import TREE_TOP_K, TopK
from specdecode.drafters.prompt_lookup import HostSequences, check_ngram_sizes, find_continuation
from specdecode.engine.batch_cache import to_device
from specdecode.engine.protocol import Draft
from specdecode.engine.sampling import Sampler, check_finite, finite_rows, greedy_tokens
from specdecode.errors import InvalidArgumentError

__all__ = ["LONG_PROMPT_BLOCK", "CascadeDrafter"]

#: Most tokens per block when a long prompt leaves the cascade to its n-gram matches: prompt
#: lookup's default γ.
LONG_PROMPT_BLOCK = DEFAULT_NUM_SPECULATIVE_TOKENS


class CascadeDrafter(DraftModelDrafter):
    """n-gram match first, checked by the draft model, then the draft model, for every row at once.

    Args:
        model: The draft model (the target's vocabulary; eager or SDPA attention).
        max_ngram, min_ngram: n-gram sizes of the match (1 <= min_ngram <= max_ngram).
        ngram_check: Keep only the n-gram tokens the draft model agrees with (module docstring);
            False keeps the whole match.
        max_model_prompt_tokens: N >= 1: a row whose prompt has more than N tokens gets n-gram
            matches alone (module docstring); None: the draft model runs for every row.
        context_window: The draft model's context window W (module docstring), or None.
        head: The draft model's LM-head rows (``DraftModelDrafter``'s ``head``).
        runner, one_sequence_reason: A one-sequence runner instead of ``model`` (the llama.cpp
            draft; ``DraftModelDrafter``'s).
        tree_depth: D, the model part's chain steps per round of a token tree, or None: linear
            (``DraftModelDrafter``'s; the tree hangs from the block's last n-gram token, module docstring).
        tree_shape: How its trees are shaped (``DraftModelDrafter``'s); None: the device's default.

    Attributes:
        num_forwards: Draft-model forwards since ``bind`` (prefills included).
        num_ngram_tokens: n-gram tokens proposed (after the check) since ``bind``.
        num_ngram_accepted: Of those, the ones the target accepted (known at ``rollback``).

    Raises:
        InvalidArgumentError: Unless 1 <= min_ngram <= max_ngram; ``ngram_check`` not a bool;
            ``max_model_prompt_tokens`` or ``context_window`` not None or an integer >= 1;
            ``DraftModelDrafter``'s.
        UnsupportedModelError: At ``bind``, if the model's attention cannot take batch masks.
    """

    supports_exit_policy = True
    who = "draft model"

    def __init__(
        self,
        model: PreTrainedModel | None = None,
        max_ngram: int = 3,
        min_ngram: int = 1,
        ngram_check: bool = True,
        max_model_prompt_tokens: int | None = None,
        context_window: int | None = None,
        head: DraftHead | None = None,
        *,
        runner=None,
        one_sequence_reason: str = "the draft model runs one sequence",
        tree_depth: int | None = None,
        tree_shape: str | None = None,
    ) -> None:
        check_ngram_sizes(max_ngram, min_ngram)
        if not isinstance(ngram_check, bool):
            raise InvalidArgumentError(f"ngram_check must be True or False, got {ngram_check!r}")
        super().__init__(model, context_window, head, runner=runner, one_sequence_reason=one_sequence_reason,
                         tree_depth=tree_depth, tree_shape=tree_shape)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.ngram_check = ngram_check
        self.max_model_prompt_tokens = check_optional_count(
            "max_model_prompt_tokens", max_model_prompt_tokens, "no limit"
        )
        self._model_rows: list[bool] = []  # per slot: whether the draft model drafts for the row
        self._last: list[tuple[int, int]] | None = None  # per row of the last block: (length, n-gram tokens)
        self._host = HostSequences()  # each row's tokens for the match
        self.num_ngram_tokens = 0
        self.num_ngram_accepted = 0

    def bind(self, target_cache) -> None:
        super().bind(target_cache)
        self._model_rows = [False] * target_cache.num_slots
        self._last = None
        self._host = HostSequences()
        self.num_ngram_tokens = self.num_ngram_accepted = 0

    def check_context(self, num_prompt_tokens: int, max_new_tokens: int) -> None:
        """As ``DraftModelDrafter.check_context``, except for a prompt longer than ``max_model_prompt_tokens``,
        which never reaches the draft model."""
        limit = self.max_model_prompt_tokens
        if limit is None or num_prompt_tokens <= limit:
            super().check_context(num_prompt_tokens, max_new_tokens)

    def join(self, slot: int, prompt_ids: torch.Tensor, sampler: Sampler) -> None:
        """Take the row: the draft model's prefill waits for the row's first round that uses the model
        (``DraftModelDrafter._catch_up``); a prompt longer than ``max_model_prompt_tokens`` never uses it."""
        limit = self.max_model_prompt_tokens
        self._host.join(slot)
        self._model_rows[slot] = limit is None or prompt_ids.shape[1] <= limit
        if self._model_rows[slot]:
            super().join(slot, prompt_ids, sampler)
        else:
            self._num_cached[slot] = self._offsets[slot] = 0
            self._samplers[slot] = sampler
            self._chains[slot] = None

    @torch.inference_mode()
    def propose(self, sequences, max_tokens, exits=None, exit_rule="row") -> Draft:
        """Per row, up to ``max_tokens[b]`` tokens: its (checked) n-gram match, then the draft model's.

        Args:
            sequences: Per row, its tokens so far (a list of ints; the last one in no cache).
            max_tokens: Per row, the most tokens to propose (>= 0).
            exits: Per row, an ``ExitPolicy`` or None (the model part's adaptive exit), or None.
            exit_rule: "row" or "batch" (``base.draft_batch``).

        Returns:
            A ``Draft``; a sampling row's ``probs`` have one-hot rows for its n-gram tokens.

        Raises:
            NonFiniteLogitsError: If a draft forward gives NaN or inf (checked on the host with per-step
                exits; otherwise the flag goes to ``Draft.finite``).
        """
        self._forget_rejected(sequences)
        n = len(sequences)
        lengths = [len(s) for s in sequences]
        uses_model = self._model_rows[:n]
        ngrams = []
        for s, cap, own in zip(self._host.arrays(sequences), max_tokens, uses_model):
            limit = cap if own else min(cap, LONG_PROMPT_BLOCK)
            ngrams.append(find_continuation(s, limit, self.max_ngram, self.min_ngram).tolist() if limit > 0 else [])
        # The n-gram tokens fed to the draft model: all of them to check them, or unchecked as the
        # context of a model part that follows them.
        fed = [
            ng if own and (self.ngram_check or len(ng) < cap) else []
            for ng, cap, own in zip(ngrams, max_tokens, uses_model)
        ]
        needs = [own and cap > 0 and (self.ngram_check or len(ng) < cap)
                 for ng, cap, own in zip(ngrams, max_tokens, uses_model)]
        if not any(needs):
            self._last = [(length, len(ng)) for length, ng in zip(lengths, ngrams)]
            self.num_ngram_tokens += sum(len(ng) for ng in ngrams)
            width = max(1, max(len(ng) for ng in ngrams))
            ids = to_device([ng + [0] * (width - len(ng)) for ng in ngrams], self._device)
            sure = torch.ones(ids.shape, device=ids.device) if exits is not None and not reads_per_step(exits) else None
            return Draft(ids, [len(ng) for ng in ngrams], None, None, self.who, top_probs=sure)  # n-gram tokens: sure
        with self.head.applied():
            return self._propose_with_model(sequences, lengths, max_tokens, uses_model, ngrams, fed, exits, exit_rule)

    def _runner_widths(self, max_width: int) -> tuple[int, ...]:
        """The check's forward (each row's uncached tokens and its n-gram candidates) on the fast path too:
        ``max_width`` (``_fit``), as ``DraftModelDrafter._runner_widths``."""
        return (1, 2, max_width)

    def _catch_up_limit(self) -> int:
        """On the fast path, a row whose uncached tokens would not fit the widest bucket catches up by a chunked
        prefill first (rounds drafted by n-grams alone leave the draft model behind), so ``_fit`` can always
        fit the check; else ``DraftModelDrafter``'s."""
        if self.cache is None or self.cache.fast is None:
            return super()._catch_up_limit()
        return min(super()._catch_up_limit(), self.runner.widths[-1] - 1)

    def _fit(self, lengths, uses_model, ngrams, fed) -> None:
        """On the fast path, keep each row's first forward within the runner's widest bucket: a row whose
        uncached tokens and fed n-gram tokens would not fit keeps the leading n-gram tokens that do (its
        model part drafts on from there), so the forward runs a compiled graph, not eagerly. In place."""
        if self.cache is None or self.cache.fast is None:
            return
        widest = self.runner.widths[-1]
        for b, (length, own) in enumerate(zip(lengths, uses_model)):
            room = max(0, widest - (length - self._num_cached[b]))  # ``_catch_up`` left <= widest uncached
            if own and room < len(fed[b]):
                ngrams[b], fed[b] = ngrams[b][:room], fed[b][:room]

    def _propose_with_model(self, sequences, lengths, max_tokens, uses_model, ngrams, fed, exits, exit_rule):
        self._catch_up(sequences, uses_model)
        self._fit(lengths, uses_model, ngrams, fed)
        n, device = len(sequences), self._device
        samplers, offsets = self._samplers[:n], self._offsets[:n]
        # The first forward: each drafting row's uncached tokens and fed n-gram tokens, on the right.
        ends = [length + len(f) for length, f in zip(lengths, fed)]
        width = max(end - cached for end, cached, own in zip(ends, self._num_cached[:n], uses_model) if own)
        starts, feeds, at_fed = [], [], []
        for b in range(n):
            if uses_model[b]:  # the row's draft-cache positions are offsets[b] fewer (context window)
                start = max(ends[b] - width, offsets[b])  # <= the row's cached length <= its length - 1
                feed = sequences[b][start:] + fed[b]
                starts.append(start - offsets[b])
            else:  # a long-prompt row: placeholders in its own unused draft slot
                feed = [0]
                starts.append(0)
            at_fed.append(len(feed) - 1 - len(fed[b]))  # feed index whose logits predict fed[b][0]
            feeds.append(feed + feed[-1:] * (width - len(feed)))
        keep = width - min(at_fed)
        at_fed = [o - (width - keep) for o in at_fed]  # into the kept logits
        longest = max(len(f) for f in fed)
        checks = self.ngram_check and longest > 0
        # One host-to-device copy for the forward and the check. Per row: its feed; with the check, its candidates
        # (-1 pads: matches nothing) and the kept logits' index of each; the kept logits' index after its fed
        # tokens (with the check, after none: the kept count is added on the device); its row index.
        host = []
        for b, (feed, f, o) in enumerate(zip(feeds, fed, at_fed)):
            check = f + [-1] * (longest - len(f)) + [o + min(j, max(len(f) - 1, 0)) for j in range(longest)] \
                if checks else []
            host.append(feed + check + [o if checks else o + len(f), b])
        packed = to_device(host, device)
        ids, after_fed, rows = packed[:, :width], packed[:, -2], packed[:, -1]
        model_caps = [cap - (0 if checks else len(ng)) if own else 0
                      for cap, ng, own in zip(max_tokens, ngrams, uses_model)]  # at most (the check may keep fewer)
        # logits (n, keep, V), or K columns (FR-Spec); greedy (n, keep, 2) from the forward's graph, or None
        logits, greedy = self._first_forward(ids, starts, keep, model_caps, exits, checks)
        self.head.check_logits(logits)
        self.num_forwards += 1
        truncated = self.head.ids is not None
        if greedy is not None and not truncated and logits.shape[-1] > samplers[0].vocab_size:
            greedy = None  # its argmax may fall past the vocabulary: not the check's choice
        deferred = not reads_per_step(exits)  # as ``draft_batch``'s
        finite = None
        if not deferred:
            check_finite(logits, self.who)
        elif greedy is not None:
            finite = greedy[..., 1].all()
        else:
            finite = finite_rows(logits).all()
        if checks:
            # (n, keep): the draft's greedy token after each fed token (a truncated head's: among its K)
            if greedy is not None:
                choice = greedy[..., 0]
            else:
                choice = greedy_tokens(logits if truncated else logits[..., : samplers[0].vocab_size])
            if truncated:
                choice = self.head.ids[choice]
            candidates, index = packed[:, width:width + longest], packed[:, width + longest:-2]
            kept_t = (choice.gather(1, index) == candidates).long().cumprod(1).sum(1)  # (n,) leading agreeing ones
            at = after_fed + kept_t
            kept = kept_t.tolist()  # the check's one host sync
        else:
            kept, at = [len(f) for f in fed], after_fed
        first = logits[rows, at]  # (n, V'): each row's logits after its kept candidates
        first_greedy = greedy[rows, at] if greedy is not None else None
        blocks = [ng[:k] if f else ng for ng, f, k in zip(ngrams, fed, kept)]  # the n-gram tokens proposed
        valid = [length + k if own else 0 for length, k, own in zip(lengths, kept, uses_model)]
        model_tokens = [cap - len(blk) if own else 0 for cap, blk, own in zip(max_tokens, blocks, uses_model)]
        model = tops = shapes = None
        steps = 1
        if max(model_tokens) > 0:
            at = [v - o for v, o in zip(valid, offsets)]  # draft-cache positions
            views = draft_views(samplers, [s + blk for s, blk in zip(sequences, blocks)], self.head)  # [processors]
            tree_rows = [t and c > 0 for t, c in zip(self._tree_rows(n, exits, views), model_tokens)]
            tops = TopK(TREE_TOP_K, self.head.ids) if any(tree_rows) else None
            shapes = self._shapes(tree_rows, model_tokens)
            caps = self._tree_caps(model_tokens, tree_rows, shapes)
            model, steps = draft_batch(self._step, first, at, caps, samplers, exits, exit_rule, self.who,
                                       self.head, views, tops, self._steps_runner(), self.fused_draft_steps,
                                       first_greedy)
            self.num_forwards += steps - 1
        num = [len(blk) + (model.num_tokens[b] if model is not None else 0) for b, blk in enumerate(blocks)]
        for b in range(n):
            if uses_model[b]:
                self._num_cached[b] = valid[b] + min(num[b] - len(blocks[b]), steps - 1)
        self._last = [(length, len(blk)) for length, blk in zip(lengths, blocks)]
        self.num_ngram_tokens += sum(len(blk) for blk in blocks)
        if model is not None and model.finite is not None:
            finite = model.finite if finite is None else finite & model.finite
        if tops is not None:  # [trees] the model part's tree hangs from each row's n-gram block
            return self._trees(model, tops, tree_rows, model_tokens, shapes, valid, steps,
                               self._probs(blocks, model, samplers), finite, blocks)
        with_tops = exits is not None and not reads_per_step(exits)  # the n-gram tokens count as sure
        tokens, tops = self._join(blocks, num, model, with_tops)
        block = model.probs_block if model is not None and not any(blocks) else None  # no n-gram part: aligned
        return Draft(tokens, num, self._probs(blocks, model, samplers), finite, self.who, top_probs=tops,
                     probs_block=block)

    def _join(self, blocks: list[list[int]], num: list[int], model: Draft | None,
              with_tops: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(n, max(1, max(num))) long: each row's n-gram tokens, then its model part's tokens, then padding;
        and with ``with_tops`` the same layout of top probabilities (float32, 1.0 at the n-gram tokens'
        positions), both gathered by one index."""
        device, n = self._device, len(blocks)
        longest = max(len(blk) for blk in blocks)
        padded = [blk + [0] * (longest - len(blk)) for blk in blocks]
        sure = torch.ones((n, longest), dtype=torch.float32, device=device) if with_tops and longest else None
        if model is None:
            if not longest:
                return torch.zeros((n, 1), dtype=torch.long, device=device), \
                    torch.ones((n, 1), device=device) if with_tops else None
            return to_device(padded, device), sure
        if not longest:
            return model.tokens, model.top_probs if with_tops else None
        last, total = longest + model.tokens.shape[1] - 1, max(1, max(num))
        packed = to_device([row + [j if j < len(blk) else min(longest + j - len(blk), last) for j in range(total)]
                            for row, blk in zip(padded, blocks)], device)  # one copy: the n-gram tokens, the index
        ngram, index = packed[:, :longest], packed[:, longest:]
        tokens = torch.cat([ngram, model.tokens], dim=1).gather(1, index)  # (n, A + S) -> (n, total)
        return tokens, torch.cat([sure, model.top_probs], dim=1).gather(1, index) if with_tops else None

    def _probs(self, blocks, model: Draft | None, samplers) -> list[torch.Tensor | None] | None:
        """Per row, one-hot rows for its n-gram tokens, then the model part's distributions (sampling rows)."""
        if model is None or model.probs is None:
            return None  # no sampling row drafted with the model: every q is one-hot
        out: list[torch.Tensor | None] = []
        for blk, q, sampler in zip(blocks, model.probs, samplers):
            if q is None or not blk:
                out.append(q)
                continue
            index = to_device(blk, q.device).unsqueeze(1)
            one_hot = torch.zeros((len(blk), sampler.vocab_size), dtype=torch.float32, device=q.device)
            out.append(torch.cat([one_hot.scatter_(1, index, 1.0), q]))
        return out

    def rollback(self, num_valid: list[int]) -> None:
        if self._last is not None:
            for (length, m), valid in zip(self._last, num_valid):
                self.num_ngram_accepted += max(0, min(m, valid - length))
            self._last = None
        self._host.rollback(num_valid)
        super().rollback(num_valid)

    def move(self, src: int, dst: int, num_valid: int) -> None:
        super().move(src, dst, num_valid)
        self._host.move(src, dst, num_valid)
        self._model_rows[dst] = self._model_rows[src]
        self._model_rows[src] = False
