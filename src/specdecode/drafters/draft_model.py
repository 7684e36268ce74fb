"""The draft-model drafter: a smaller model with the target's vocabulary drafts for every row at once.

Each row's draft cache holds every token of its sequence except the ones not yet fed: after a
block it lacks the pending token (and, after a fully accepted block, the last draft token
too); the next ``propose`` feeds those in its first forward, so no forward is spent
re-syncing after a fully accepted block. The rows' feeds are aligned on the right: a row
with fewer new tokens than the widest re-feeds some it already holds (same keys, rewritten
in place), so every row's write ends at its sequence length and none pads past it. Rejected
positions are simply overwritten by the next forward (the cache is static, one slot per row).

**Deferred prefill.** A joining row's draft prefill waits for its first ``propose``, where it covers
the prompt and whatever the target emitted meanwhile (``_catch_up``): a row whose policy never
drafts (a cost model that finds plain steps faster, a short answer) costs no draft forward at
all, and a row back from many plain steps catches up by a chunked prefill.

**Where the model runs.** A transformers model gets its own ``BatchKVCache`` (the target's
slots and capacity) and a ``BatchRunner`` (eager, or the fast path's widths 1 and 2 at every
rows bucket when the target's cache is on it, and the widest for drafters that feed wider forwards:
``_runner_widths``). A GGUF draft in llama.cpp comes as a
``runner`` of one sequence (``models.llama_cpp_target.LlamaCppTargetRunner``, same call); it
keeps its positions in llama.cpp's memory, so the engine must have one slot: ``bind``
refuses more, naming why.

**Draft context window** (``context_window=W``): a joining row's draft prefill is its prompt's
last W tokens only, at the slot's positions 0 .. W - 1; every token after them is kept. The
row's draft positions count from the window's start (its ``offset``): rotary attention
depends on the distance between positions only, so the draft sees the window as a prompt of
W tokens. On a CPU an int4 draft's prefill costs about twice a bf16 one per token, but
measured on 6 held-out 705-1154-token Spec-Bench prompts, windows of 128-512 tokens cut the
cascade's acceptance from 77% to 30-46% and made it slower: not a default. The output is
unchanged (the target verifies every token).

**Truncated head** (``head=DraftHead.truncated(ids)``, FR-Spec, ``drafters.draft_head``): every
forward of the draft model (prefills and warm-up included, so that the fast path's graphs are
traced with it) computes the K rows of its LM head only; the draft proposes among those K
tokens, and its q is zero outside them (exact under sampling).

**Draft steps in the runner.** On the fast path a greedy round with no per-step exit, processors or tree runs
its draft steps after the first forward in the runner, one graph a step, each feeding its graph's argmax to
the next with no host read (``base.draft_batch``, ``BatchRunner.greedy_steps``).

**Fused steps** (``fused_draft_steps``, off by default): on the fast path a greedy round with no per-step
exit, processors or tree that drafts the engine's longest block runs its draft steps after the first
forward as one compiled function (``base.draft_batch``, ``BatchRunner.draft_steps`` at its
``fused_steps``; one CUDA graph on CUDA), warmed up with the other buckets. Set the attribute to True
on a drafter to fuse. Off because it did not pay where measured (H200, torch 2.11, the Qwen2.5-Coder
0.5B draft's shape, ``docs/benchmarks/2026-11-27-gpu-h200.md``): 4 fused steps took 6.37 ms against
4 x 1.64 ms step by step, a draft round took longer fused (15.4 ms, against 13.0 ms unfused in
another run), and each rows bucket of the fused steps compiled in 113-124 s against 25-28 s for a
width bucket.

**Token trees** (``tree_depth=D``, off by default; ``drafters.draft_tree``, EAGLE-2's reranking, Li
et al. 2024): a row with no logits processors and no adaptive exit drafts a chain of min(D, c)
tokens (c, the row's budget; greedy, or drawn from q when sampling) and keeps, among the chain and
each step's runners-up, the c nodes of highest joint draft probability (a drawn chain whole), as a
token tree: with ``tree_shape="per-round"`` (a CPU's default) from the round's own values, one more host sync per
round; with "previous-round" (CUDA's default) the shape is chosen before the draft from the row's earlier rounds
(its chain as deep as the shape), read with the engine's round sync (``on_readback``): no host sync in the drafter
(``draft_tree.shaped_trees``). ``tree_expand``'s rounds grow their own trees, whatever the shape setting.
Only the chain is fed to the draft cache; when the target accepts a sibling, the next
``propose`` finds the chain's token at that position differs from the sequence's and re-feeds
from there (``_forget_rejected``). ``tree_expand=M`` grows EAGLE-2's dynamic tree instead, with one
draft tree forward per depth (``draft_tree.expand_trees``), when every row of the round can (greedy
rows only: a round with a sampling row grows the chain's trees).
"""

from __future__ import annotations

import time

import torch

from specdecode.drafters.base import Drafter, draft_batch, draft_views, first_forward_greedy
from specdecode.drafters.control import check_optional_count
from specdecode.drafters.draft_head import DraftHead
from specdecode.drafters.draft_tree import (
    TREE_TOP_K,
    RankEstimates,
    TopK,
    check_tree_depth,
    check_tree_expand,
    check_tree_shape,
    default_tree_shape,
    expand_trees,
    grow_trees,
    read_shapes,
    shape_nodes,
    shaped_trees,
    tree_draft,
)
from specdecode.engine.batch_cache import BatchKVCache, batch_prefill, to_device, warm_up_forwards, warm_up_widths
from specdecode.engine.batch_runner import BatchRunner
from specdecode.engine.kv_cache import context_length
from specdecode.engine.protocol import Draft
from specdecode.engine.sampling import Sampler, logits_width
from specdecode.engine.shared_prefill import check_shared_prefill, consecutive_runs, prefill_bodies
from specdecode.errors import InvalidArgumentError

__all__ = ["DraftModelDrafter"]

#: A row whose draft cache lacks more than this many of its tokens at a round's start (or holds none yet)
#: catches up with a chunked prefill first (``DraftModelDrafter._catch_up``); fewer go with the round's
#: first forward, as after a fully accepted block (2 tokens) or a tree's accepted path (its depth + 1). The
#: cascade lowers it on the fast path to what its widest bucket takes (``CascadeDrafter._catch_up_limit``).
CATCH_UP_TOKENS = 16


class DraftModelDrafter(Drafter):
    """A smaller model drafts for every row at once (module docstring).

    Args:
        model: The draft model, a transformers causal LM in eval mode on the target's device,
            its vocabulary mapped like the target's (``specdecode.models.check_vocabularies``;
            eager or SDPA attention). None with ``runner``.
        context_window: W >= 1, or None: the whole prompt.
        head: Which LM-head rows drafting computes (``DraftHead.full()`` when None).
        runner: A one-sequence runner of a model outside torch (``LlamaCppTargetRunner`` of the
            llama.cpp draft; full head only), used instead of ``model``; None: ``model`` in torch.
        one_sequence_reason: Why ``runner`` runs one sequence, for ``bind``'s refusal.
        tree_depth: D, the chain's draft steps per round of a token tree (module docstring), or None:
            linear drafts.
        tree_expand: M, with ``tree_depth``: EAGLE-2's expansion instead of the chain (module docstring),
            the M best nodes of each depth expanded by one draft tree forward; None: the chain's tree.
        tree_shape: How the chain's tree is shaped (``tree_shape``, ``draft_tree.TREE_SHAPES``); None: the
            device's default.

    Raises:
        InvalidArgumentError: ``context_window`` not None or an integer >= 1; ``tree_depth`` not None or
            an integer in 1 .. ``draft_tree.MAX_TREE_DEPTH``; ``tree_expand`` likewise, or without
            ``tree_depth``; ``tree_shape`` (the argument, or the attribute at ``bind`` and each round) not None
            or one of ``draft_tree.TREE_SHAPES``, or the argument given without ``tree_depth``; neither or both
            of ``model`` and ``runner``; a truncated head with ``runner``; a truncated head's id past the
            model's head rows, or (at ``join``) past the target's vocabulary; at ``bind``, more than one slot
            with ``runner``.
        UnsupportedModelError: At ``bind``, if the model's attention cannot take batch masks; a
            truncated head the model's forward does not apply.
    """

    supports_exit_policy = True
    who = "draft model"
    #: True: greedy rounds run their draft steps as one compiled function on the fast path (module docstring);
    #: False (the default, measured faster on an H200): one graph a step (``BatchRunner.greedy_steps``).
    fused_draft_steps = False
    #: Rows joining together share their deferred prompt prefill's forwards (``engine.shared_prefill``): True,
    #: False, or None for the device's default (CUDA only); the engine that binds the drafter sets it to its own.
    shared_prefill: bool | None = None
    #: How a token tree's shape is chosen (``draft_tree.TREE_SHAPES``): "per-round", from the round's own draft
    #: values, read back by one host sync in the drafter (``draft_tree.grow_trees``); "previous-round", from the row's
    #: earlier rounds, so that nothing is read before the verification (``draft_tree.shaped_trees``); None (the
    #: default): ``draft_tree.default_tree_shape`` of the engine's device. Checked at ``bind``, read each round.
    tree_shape: str | None = None

    def __init__(self, model=None, context_window: int | None = None, head: DraftHead | None = None, *,
                 runner=None, one_sequence_reason: str = "the draft model runs one sequence",
                 tree_depth: int | None = None, tree_expand: int | None = None,
                 tree_shape: str | None = None) -> None:
        self.context_window = check_optional_count("context_window", context_window, "the whole prompt")
        self.tree_depth = check_tree_depth(tree_depth)
        if tree_shape is not None:
            self.tree_shape = check_tree_shape(tree_shape)
            if tree_depth is None:
                raise InvalidArgumentError(f"draft_tree_shape={tree_shape!r} shapes a draft tree: give "
                                           "draft_tree_depth too")
        self.tree_expand = check_tree_expand(tree_expand, tree_depth)
        if (model is None) == (runner is None):
            raise InvalidArgumentError("DraftModelDrafter takes a draft model or a one-sequence runner, not "
                                       f"{'both' if model is not None else 'neither'}")
        if runner is not None and head is not None and head.ids is not None:
            raise InvalidArgumentError(f"a truncated draft head (FR-Spec, K={len(head.ids)}) needs the draft's torch "
                                       "LM head; a draft run by its own runner computes every logit: leave it out")
        self.model = model
        self.head = (head or DraftHead.full()).bind(model)
        self._sequence_runner = runner
        self._one_sequence_reason = one_sequence_reason
        self.cache: BatchKVCache | None = None
        self.runner = runner
        self._num_cached: list[int] = []  # per slot, in sequence positions
        self._offsets: list[int] = []  # per slot, the prompt positions the context window left out
        self._samplers: list[Sampler | None] = []
        self._chains: list[tuple[int, list[int]] | None] = []  # [trees] per slot: (position, chain tokens fed)
        self._device = None
        self._target = None  # the target (its vocabulary), from ``bind``

    def check_context(self, num_prompt_tokens: int, max_new_tokens: int) -> None:
        """Raise unless the draft model's context length (``kv_cache.context_length``: its config's, or a llama.cpp
        draft's training context) holds the positions it will see: the prompt (its last ``context_window`` tokens)
        plus ``max_new_tokens``.

        Raises:
            InvalidArgumentError: Naming the positions, the draft model's limit and the largest max_new_tokens.
        """
        limit = context_length(self.model if self.model is not None else self._sequence_runner)
        prompt = num_prompt_tokens if self.context_window is None else min(num_prompt_tokens, self.context_window)
        if limit is not None and prompt + max_new_tokens > limit:
            raise InvalidArgumentError(
                f"the draft model sees {prompt} prompt tokens and max_new_tokens is {max_new_tokens}: "
                f"{prompt + max_new_tokens} positions, past the draft model's context length of {limit}; shorten the "
                f"prompt (or set a draft context window) or lower max_new_tokens to at most {max(limit - prompt, 0)}"
            )

    def bind(self, target_cache) -> None:
        if self._sequence_runner is not None:
            if target_cache.num_slots > 1:
                raise InvalidArgumentError(
                    f"max_batch_size is {target_cache.num_slots}, but {self._one_sequence_reason}: use "
                    "max_batch_size=1 (or another draft backend)"
                )
            self.runner = self._sequence_runner
        else:
            # Drafters of this model (and head) on one target cache share the draft cache and its
            # compiled buckets: decoders that alternate on a generator's cache compile once. The entry holds
            # the head's ids, so that their id is not reused by another head's while it lives: the compiled
            # graphs do not guard the head's swapped ``forward`` (``engine.compat``).
            key = ("draft model", id(self.model), None if self.head.ids is None else id(self.head.ids))
            shared = target_cache.shared.get(key)
            widths = self._runner_widths(target_cache.fast.max_width) if target_cache.fast is not None else (1, 2)
            if shared is not None:
                shared[1].add_widths(widths)
            else:
                cache = BatchKVCache(
                    self.model,
                    target_cache.num_slots,
                    target_cache.capacity,
                    prefill_chunk_tokens=target_cache.prefill_chunk_tokens,
                    prefill_pad_multiple=target_cache.prefill_pad_multiple,
                    fast=target_cache.fast,
                )
                shared = target_cache.shared[key] = (cache, BatchRunner(self.model, cache, widths, self.who),
                                                     self.head.ids)
            self.cache, self.runner = shared[:2]
        self._device = target_cache.device
        self._target = target_cache.owner  # its vocabulary: the fused steps' argmax (``warm_up``)
        self._num_cached = [0] * target_cache.num_slots
        self._offsets = [0] * target_cache.num_slots
        self._samplers = [None] * target_cache.num_slots
        self._chains = [None] * target_cache.num_slots
        self._tree_shape()  # checked now, read each round
        self._estimates = RankEstimates(target_cache.num_slots)  # [trees] "previous-round"
        self._read = None  # [trees] what ``on_readback`` reads: (tree rows, starts, steps, chain lengths, k)
        self.num_forwards = 0
        self.prefill_time_s = 0.0

    def _runner_widths(self, max_width: int) -> tuple[int, ...]:
        """The draft runner's width buckets on the fast path, so that a round's draft forwards run compiled (an
        eager forward costs many graph replays on CUDA): 1 (a draft step) and 2 (a round's first forward after
        a block accepted whole); with ``tree_expand`` also ``max_width``, the cache's widest (its tree forwards
        take up to 1 + M (D - 1) <= the round's budget nodes). A row that fell further behind (plain steps)
        feeds one wider forward, eager, shared by the rows, or catches up by a chunked prefill
        (``_catch_up``)."""
        return (1, 2, max_width) if self.tree_expand is not None else (1, 2)

    def warm_up(self, max_rows: int, max_block: int) -> None:
        if self.cache is None:  # a one-sequence runner: nothing compiled
            return
        with self.head.applied():
            warm_up_forwards(self.model, self.cache, *warm_up_widths(self.cache, max_rows, max_block))
            if self.cache.fast is not None:
                self.runner.warm_up()
                if self.fused_draft_steps:
                    self.runner.warm_up_draft_steps(self.head.ids, logits_width(self._target))

    def join(self, slot: int, prompt_ids: torch.Tensor, sampler: Sampler) -> None:
        """Take the row in ``slot``; its draft prefill waits for its first ``propose`` (``_catch_up``)."""
        self.head.check_vocab(sampler.vocab_size)
        n, window = prompt_ids.shape[1], self.context_window
        self._offsets[slot] = max(0, n - window) if window is not None else 0
        self._num_cached[slot] = self._offsets[slot]  # nothing in the draft cache yet
        self._samplers[slot] = sampler
        self._chains[slot] = None
        self._estimates.reset(slot)

    def _catch_up(self, sequences: list[list[int]], rows: list[bool] | None = None) -> None:
        """Before a round's first forward: each row (of ``rows``, all when None) whose draft cache holds
        nothing yet or lacks more than ``CATCH_UP_TOKENS`` of its tokens gets them, all but the last, by a
        chunked prefill
        (``batch_prefill`` from its cached length; a one-sequence runner: its ``prefill``, for a row
        with nothing cached). So a row that never drafts costs no draft forward (the join's prefill is
        deferred to here), and a row back from plain steps catches up in prefill chunks, not in one wide
        forward of a width nothing was warmed up for (``_catch_up_limit``). Rows with nothing cached in
        consecutive slots share their prefill's forwards where ``shared_prefill`` says so
        (``engine.shared_prefill.prefill_bodies``)."""
        limit = self._catch_up_limit()
        share = self.cache is not None and check_shared_prefill(self.shared_prefill, self._device)
        fresh: list[int] = []
        for b, seq in enumerate(sequences):
            if rows is not None and not rows[b]:
                continue
            cached, offset, end = self._num_cached[b], self._offsets[b], len(seq) - 1
            if end <= cached or (cached > offset and end - cached <= limit):
                continue
            if share and cached == offset:
                fresh.append(b)
                continue
            t0, compiling = time.perf_counter(), self.compile_time_s
            if self.cache is None:
                if cached > offset:  # llama.cpp: the first forward feeds the rest, as before
                    continue
                self.runner.prefill(seq[offset:end])
            else:
                ids = torch.tensor([seq[offset:end]], dtype=torch.long, device=self._device)
                batch_prefill(self.model, self.cache, ids, b, start=cached - offset)
            if cached > offset:  # a catch-up is decode work; the deferred prompt prefill is not counted
                self.num_forwards += 1
            else:  # nor timed as drafting (``Drafter.prefill_time_s``)
                self.prefill_time_s += time.perf_counter() - t0 - (self.compile_time_s - compiling)
            self._num_cached[b] = end
        for run in consecutive_runs(fresh):
            t0, compiling = time.perf_counter(), self.compile_time_s
            bodies = [sequences[b][self._offsets[b]:len(sequences[b]) - 1] for b in run]
            prefill_bodies(self.model, self.cache, bodies, run[0], [0] * len(run))
            self.prefill_time_s += time.perf_counter() - t0 - (self.compile_time_s - compiling)
            for b, body in zip(run, bodies):
                self._num_cached[b] = self._offsets[b] + len(body)

    def _catch_up_limit(self) -> int:
        """Most uncached tokens (besides the last) a row's first forward feeds; more are caught up first."""
        return CATCH_UP_TOKENS

    @torch.inference_mode()
    def propose(self, sequences, max_tokens, exits=None, exit_rule="row") -> Draft:
        """Draft up to ``max_tokens[b]`` tokens for each row (``Drafter.propose``); the first forward
        feeds each row's tokens not yet in the draft cache (module docstring)."""
        self._forget_rejected(sequences)
        with self.head.applied():
            self._catch_up(sequences)
            n = len(sequences)
            lengths = [len(s) for s in sequences]
            offsets = self._offsets[:n]
            width = max(length - cached for length, cached in zip(lengths, self._num_cached[:n]))
            starts = [max(length - width, offset) for length, offset in zip(lengths, offsets)]
            feeds = [s[start:] for s, start in zip(sequences, starts)]
            ids = to_device([f + f[-1:] * (width - len(f)) for f in feeds], self._device)
            logits, greedy = self._first_forward(ids, [s - o for s, o in zip(starts, offsets)], width,
                                                 max_tokens, exits)
            self.head.check_logits(logits)
            last = (slice(None), -1) if all(len(f) == width for f in feeds) else \
                (torch.arange(n, device=logits.device), to_device([len(f) - 1 for f in feeds], logits.device))
            first, first_greedy = logits[last], greedy[last] if greedy is not None else None  # each feed's last
            at = [length - o for length, o in zip(lengths, offsets)]
            views = draft_views(self._samplers[:n], sequences, self.head)  # [processors]
            tree_rows = self._tree_rows(n, exits, views)
            # The expansion's widest tree forward, 1 + M (D - 1) nodes, must fit the round's budget: the
            # draft cache has room past a row's sequence for the verification's width only.
            if self.tree_expand is not None and all(tree_rows) and min(max_tokens) > 0 \
                    and all(sampler.greedy for sampler in self._samplers[:n]) \
                    and self.tree_expand * (self.tree_depth - 1) <= min(max_tokens) \
                    and getattr(self.runner, "takes_trees", False):
                return self._expand(sequences, first, [a - 1 for a in at], max_tokens)
            tops = TopK(TREE_TOP_K, self.head.ids) if any(tree_rows) else None
            shapes = self._shapes(tree_rows, max_tokens)
            caps = self._tree_caps(max_tokens, tree_rows, shapes)
            draft, steps = draft_batch(self._step, first, at, caps, self._samplers[:n], exits, exit_rule,
                                       self.who, self.head, views, tops, self._steps_runner(), self.fused_draft_steps,
                                       first_greedy, ids[:, -1])  # each row's pending token: its feed's last
        self.num_forwards += steps
        for b in range(n):
            self._num_cached[b] = lengths[b] + min(draft.num_tokens[b], steps - 1)
        if tops is None:
            return draft
        return self._trees(draft, tops, tree_rows, max_tokens, shapes, lengths, steps, draft.probs, draft.finite)

    def _shapes(self, tree_rows: list[bool], budgets: list[int]) -> list | None:
        """[trees] With ``tree_shape="previous-round"``, per tree row its shape (``draft_tree.shape_nodes``) from its
        rank estimates and its budget of nodes, else None; None altogether for "per-round" or no tree row. A step
        gives ``TREE_TOP_K`` candidates, or as many as the head has columns (``TopK``)."""
        if not any(tree_rows) or self._tree_shape() != "previous-round":
            return None
        k = min(TREE_TOP_K, len(self.head.ids) if self.head.ids is not None else self._samplers[0].vocab_size)
        return [shape_nodes(self._estimates.of(b)[:k], self.tree_depth, budgets[b], not self._samplers[b].greedy)
                if t else None for b, t in enumerate(tree_rows)]

    def _tree_shape(self) -> str:
        """[trees] The shape the trees take now: ``tree_shape``, or the engine device's default where it is None.

        Raises:
            InvalidArgumentError: ``tree_shape`` not None or one of ``draft_tree.TREE_SHAPES``.
        """
        shape = check_tree_shape(self.tree_shape)
        return shape if shape is not None else default_tree_shape(self._device)

    def _tree_caps(self, caps: list[int], tree_rows: list[bool], shapes: list | None) -> list[int]:
        """[trees] Per row, the draft steps of the round: a tree row's chain depth (its shape's depth), else its cap."""
        if shapes is None:
            return [min(c, self.tree_depth) if t else c for c, t in zip(caps, tree_rows)]
        return [max((d for d, _ in s[0]), default=0) if s is not None else c for c, s in zip(caps, shapes)]

    def _trees(self, draft: Draft, tops: TopK, tree_rows: list[bool], budgets: list[int], shapes: list | None,
               starts: list[int], steps: int, probs, finite, prefixes: list[list[int]] | None = None) -> Draft:
        """[trees] The round's ``Draft`` of trees from the draft loop's ``draft`` (its chains) and ``tops``: grown
        from their values (one host sync, ``grow_trees``), or of the ``shapes`` chosen before the round
        (``shaped_trees``: the chains and values are read with the round's sync, ``on_readback``). ``starts``: per
        row, the sequence position its chain was fed from; ``probs``, ``finite``: the round's (with ``prefixes``,
        the cascade's n-gram blocks, their one-hot q's first)."""
        if shapes is None:
            ids, num, trees, chains, sampled = grow_trees(draft.tokens, draft.num_tokens, tops, tree_rows, budgets,
                                                          prefixes, draft.probs)
            self._keep_chains(tree_rows, starts, chains, steps)
            return tree_draft(ids, num, probs, finite, self.who, trees, sampled)
        ids, num, trees, sampled, readback = shaped_trees(draft.tokens, draft.num_tokens, tops, shapes, prefixes,
                                                          draft.probs)
        self._read = (tree_rows, starts, steps, list(draft.num_tokens), tops.log_probs[0].shape[-1])
        self._keep_chains(tree_rows, starts, [[] for _ in tree_rows], steps)  # the chains: once read back
        return tree_draft(ids, num, probs, finite, self.who, trees, sampled, readback)

    def on_readback(self, values: list[int]) -> None:
        """[trees] "previous-round" shapes: the round's chains and candidates' probabilities, read with its sync
        (``draft_tree.read_shapes``): each tree row's chain tokens fed to the draft cache (``_forget_rejected``) and
        its rank estimates (``draft_tree.RankEstimates``)."""
        if self._read is None:
            return
        tree_rows, starts, steps, num, k = self._read
        self._read = None
        chains, probs = read_shapes(values, len(tree_rows), steps, k)
        for b, is_tree in enumerate(tree_rows):
            if is_tree and num[b]:
                self._chains[b] = (starts[b], chains[b][: min(num[b], steps - 1)])
                self._estimates.update(b, probs[b][: num[b]])

    def _expand(self, sequences: list[list[int]], first: torch.Tensor, starts: list[int],
                budgets: list[int]) -> Draft:
        """[trees] EAGLE-2's expansion (``draft_tree.expand_trees``) for every row, after the first forward
        (``first``: each row's logits after its pending token, at draft-cache index ``starts[b]``). The tree
        forwards write past the pending token only: each row's draft cache stays valid up to its length."""
        vocab = self._samplers[0].vocab_size
        tokens, num, trees, finite, forwards = expand_trees(
            self.runner, first, [s[-1] for s in sequences], starts, self.tree_depth, self.tree_expand, budgets,
            self.head.ids, vocab)
        self.num_forwards += 1 + forwards
        for b, s in enumerate(sequences):
            self._num_cached[b], self._chains[b] = len(s), None
        return Draft(tokens, num, None, finite, self.who, [t if not t.is_chain else None for t in trees])

    def _tree_rows(self, n: int, exits, views) -> list[bool]:
        """[trees] Per row, whether it drafts a tree: the option on, no processors, no exit policy."""
        if self.tree_depth is None:
            return [False] * n
        return [s is not None and (views is None or views[b] is None)
                and (exits is None or exits[b] is None) for b, s in enumerate(self._samplers[:n])]

    def _keep_chains(self, tree_rows: list[bool], starts: list[int], chains: list[list[int]], steps: int) -> None:
        """[trees] Remember, per tree row, the chain tokens fed to the draft cache from sequence position
        ``starts[b]`` on (the first ``steps - 1``), for ``_forget_rejected``."""
        for b, is_tree in enumerate(tree_rows):
            if is_tree:
                self._chains[b] = (starts[b], chains[b][: steps - 1])

    def _forget_rejected(self, sequences: list[list[int]]) -> None:
        """[trees] A tree row's draft cache holds its chain; where the accepted path left it for a sibling
        (or the target's own token), the cached chain token differs from the sequence's: the row's cached
        length drops to the first such position, so this round's first forward re-feeds from there."""
        for b, record in enumerate(self._chains[: len(sequences)]):
            if record is None:
                continue
            start, fed = record
            seq, same = sequences[b], 0
            while same < len(fed) and start + same < len(seq) and seq[start + same] == fed[same]:
                same += 1
            self._num_cached[b] = min(self._num_cached[b], start + same)
            self._chains[b] = None

    def _first_forward(self, ids: torch.Tensor, starts: list[int], keep: int, max_tokens: list[int],
                       exits: list | None, checks: bool = False) -> tuple:
        """A round's first forward, (n, width) ids at draft-cache positions ``starts``, its last ``keep`` positions'
        logits kept: ``(logits (n, keep, V'), greedy (n, keep, 2) or None)``, greedy the epilogue of a bucket's
        graph (``BatchRunner.forward_greedy``) where the greedy steps may start from it
        (``base.first_forward_greedy``, for ``max_tokens``) or, with ``checks``, where the cascade's check reads
        every position's argmax; None otherwise."""
        runner, (n, width) = self.runner, ids.shape
        if isinstance(runner, BatchRunner) and ((checks and runner.in_bucket(n, width)) or first_forward_greedy(
                runner, n, width, self._samplers, max_tokens, exits, self.fused_draft_steps)):
            return runner.forward_greedy(ids, starts, keep)
        return runner(ids, starts, keep), None

    def _step(self, token: torch.Tensor, at: list[int]) -> torch.Tensor:
        """One more token per row: (n, 1) ids at draft-cache positions ``at``; (n, V') logits."""
        return self.runner(token, at, 1)[:, -1]

    def _steps_runner(self) -> BatchRunner | None:
        """The runner ``draft_batch`` may run the round's greedy steps in (``base``'s docstring), or None
        (a llama.cpp draft)."""
        return self.runner if isinstance(self.runner, BatchRunner) else None

    def rollback(self, num_valid: list[int]) -> None:
        for b, valid in enumerate(num_valid):
            self._num_cached[b] = min(self._num_cached[b], valid)

    def move(self, src: int, dst: int, num_valid: int) -> None:
        self.cache.move(src, dst, min(self._num_cached[src], num_valid) - self._offsets[src])
        self._num_cached[dst] = min(self._num_cached[src], num_valid)
        self._offsets[dst] = self._offsets[src]
        self._samplers[dst] = self._samplers[src]
        self._samplers[src] = None
        self._chains[dst], self._chains[src] = self._chains[src], None
        self._estimates.move(src, dst)
