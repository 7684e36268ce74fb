"""Batched speculative decoding: many sequences at once, each row advancing at its own rate.

Each round (Medusa's four steps, for every active row at once):

1. **draft**: the drafter (``engine.protocol.Drafter``, batch-native) proposes k_b <= γ
   tokens per row; rows may draft different numbers (prompt lookup finds no match,
   adaptive draft exit stops a row, a row is near its length budget);
2. **verify**: ONE target forward over (n, K + 1), K = max k_b: row b feeds its pending
   token and its draft, padded on the right. Each row continues at its own position
   in the ``batch_cache.BatchKVCache`` (per-row position ids and attention masks), so
   its logits are those it would get alone. Greedy rows accept the longest prefix
   equal to the target's argmax; sampling rows run speculative sampling with their own temperature, top-k,
   top-p and ``torch.Generator`` (Leviathan et al. 2022), on the device (``verification.sample_rows``), read back
   with the round's one host sync (a "masked" exit's cut made on the device, ``draft_exit.exit_blocks``;
   with banned words, a row keeps all its block drew, and its emit rolls back a word);
3. **accept**: each row's length grows by its own n_b + 1; rejected and padded
   positions stay in the cache past the row's length and are overwritten by the next
   round (never copied);
4. **emit**: each row's tokens are cut at EOS, its stop strings and its own
   ``max_new_tokens``, and checked for its banned words (``engine.banned_rows``, as in the
   single-sequence decoder: on a match the row rewinds to where the word began and that
   token is masked there; the other rows are untouched); finished rows leave.

Continuous batching (``engine.batch_requests.BatchRequests``): queued requests join at each ``step``
while slots are free (prefilled into their slots alone, or on CUDA together in 2 forwards:
``engine.shared_prefill``). vLLM batches speculative decoding with the same per-row accounting (its
``SpecDecodingStats`` names).

The number of draft tokens γ is an engine setting, as in vLLM: a request's
``GenerationConfig.num_speculative_tokens`` is not used (``SpeculativeDecoder``, which runs
this engine with one row, sizes an engine per γ). Banned words work per row; a request may
bring a prompt cache (``add``: its keys and values are copied into the row's slot, and only
the rest of the prompt is prefilled). A drafter whose model runs one sequence (the llama.cpp draft)
refuses an engine of more than one row, as does a target run outside torch (llama.cpp,
``engine.runner_target``). Decode-time forwards run on the fast path (``batch_runner``: compiled
at a few (rows, width) buckets, CUDA graphs on CUDA) where ``compile`` is on; prefills run eagerly.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Sequence

import torch
from transformers import PreTrainedModel

from specdecode.config import DEFAULT_NUM_SPECULATIVE_TOKENS, check_num_speculative_tokens
from specdecode.engine.banned_rows import mask_batch
from specdecode.engine.batch_cache import (PREFILL_CHUNK_TOKENS, PREFILL_PAD_MULTIPLE, BatchKVCache, to_device,
                                           warm_up_widths)
from specdecode.engine.batch_requests import BatchRequests
from specdecode.engine.batch_rows import BatchEvent, greedy_gate_probs, observe_gates, take_gate_probs, trimmed_blocks
from specdecode.engine.batch_runner import BatchRunner
from specdecode.engine.bucket_functions import check_row_buckets
from specdecode.engine.cost_model import check_count
from specdecode.engine.draft_exit import exit_blocks, exit_points, observe_exits
from specdecode.engine.fast_path import check_graphs, default_compile, engine_fast_path
from specdecode.engine.overlap import HostReader, can_run_ahead, engine_overlap_rounds, run_ahead, taken
from specdecode.engine.processors import process_rows
from specdecode.engine.protocol import BATCH_EXIT_RULES, Draft, Drafter, DraftPolicy
from specdecode.engine.runner_target import is_runner_target, runner_target_parts, torch_threads
from specdecode.engine.sampling import (check_finite, greedy_tokens, logits_width, raise_invalid_distribution,
                                       raise_non_finite)
from specdecode.engine.shared_prefill import admit_shared, engine_shared_prefill, load_prompt_cache
from specdecode.engine.stats import SpecDecodingStats
from specdecode.engine.tree import TokenTree, greedy_tree_verify, round_trees
from specdecode.engine.verification import greedy_epilogue, greedy_verify, sample_rows
from specdecode.errors import INVALID_DISTRIBUTION, InvalidArgumentError

logger = logging.getLogger(__name__)

class BatchedSpeculativeDecoder(BatchRequests):
    """Target-only or speculative decoding of many sequences at once, with continuous batching.

    Args:
        target: The target model (transformers causal LM, eval mode, eager or SDPA attention), or one
            run outside torch (``protocol.TargetRunnerProtocol``: llama.cpp, one row; ``engine.runner_target``).
        drafter: A ``Drafter`` (``specdecode.drafters``); None decodes
            autoregressively (the batched baseline).
        max_batch_size: Rows decoded at once (>= 1); more requests wait in a queue.
        max_length: Positions per row in the cache: a request needs its prompt plus
            ``max_new_tokens`` plus the longest draft block + 1.
        num_speculative_tokens: γ for every row (with adaptive draft exit, the policy's
            ``max_draft_tokens`` is the longest block instead).
        eos_token_ids: Token ids that end a row.
        tokenizer: For stop strings and ``GenerationResult.text``.
        draft_control: Per-row draft-length policy (``drafters.control.DraftControl``: adaptive
            draft exit, heuristic length schedule, confidence gating); each row gets its own
            controller. Blocks never exceed ``max_block`` (γ, or adaptive exit's
            ``max_draft_tokens``), which sizes the cache's margin: a heuristic schedule that would
            grow past it drafts ``max_block`` tokens. Under ``exit_rule="batch"`` a row's threshold
            learns from every token it kept, also those drafted after its own unsure one.
        exit_rule: With adaptive exit, "row" (a row stops at its own unsure token) or "batch"
            (the block ends once every row has been unsure; all rows keep what they drafted).
        max_verify_tokens: Most tokens one verification forward may take, or None (no limit).
            Each round every row drafts at most ``max_verify_tokens // n - 1`` tokens (n rows),
            so the block shrinks as the batch grows and speculation stops (plain batched
            decoding, whose forward takes the n tokens whatever the limit) once
            ``n >= max_verify_tokens / 2``: a forward over more tokens than the
            hardware verifies at about the cost of one step costs more than speculation saves
            (``docs/benchmarks/batched_forward_cost.py`` measures the knee).
        prefill_chunk_tokens, prefill_pad_multiple: A prompt (target and draft model) is
            prefilled in forwards of at most ``prefill_chunk_tokens``, the last padded to a multiple
            of ``prefill_pad_multiple`` (``batch_cache.batch_prefill``): a stream of prompt lengths
            gives a few forward shapes, so oneDNN's per-shape kernels stop piling up on a CPU.
        compile: The fast path (``batch_runner``) for the target's and the drafter's decode-time
            forwards: True, False, or None for the device's default (``fast_path.default_compile``).
        graphs: With ``compile``, False runs the fast path's static-shape forwards without
            ``torch.compile`` (tests, debugging); "captured": CUDA graphs of specdecode's own
            (``fast_path.FastPath``; CUDA only, elsewhere as True).
        row_buckets, dynamic_shapes: With ``compile``, the rows buckets (integers in 1 .. ``max_batch_size``;
            None: 1, 2, 4, .. and it, ``bucket_functions.row_buckets``; fewer compile faster, padding more rows),
            and whether buckets share compiled functions with symbolic sizes (``fast_path.FastPath``).
        shared_prefill: Requests admitted in one step share 2 prefill forwards (``shared_prefill``;
            plus the leading chunks of prompts longer than ``prefill_chunk_tokens``, alone) rather
            than one each: True, False, or None for the device's default (CUDA only; never with a
            llama.cpp target, which refuses True).
        overlap_rounds: Without a drafter, enqueue each round's successor forward on the device's chosen tokens
            before reading the round back, so the host's read and emit overlap it (``engine.overlap``): True,
            False, or None for the device's default (CUDA only; a llama.cpp target refuses True).
        shared_with: An idle engine whose cache and target runner this one takes over when they
            fit (same target, slots, fast-path settings and widths, capacity >= ``max_length``,
            which then becomes that capacity; its widest verification at least this one's): its
            compiled buckets are reused. The two must never run requests at the same time
            (``SpeculativeDecoder`` checks with ``BatchKVCache.generation``).

    Attributes:
        compile: Whether the fast path is on.
        overlap_rounds: Whether rounds without a drafter overlap (may be set between steps).
        shared_prefill: Whether requests admitted together share their prefill forwards (the drafter's
            deferred prompt prefills too: the engine sets a draft model drafter's ``shared_prefill``).
        runner: The target's ``BatchRunner``.
        generator: What requests without a ``seed`` draw from, together (``sampling.draw_tokens``).

    Raises:
        InvalidArgumentError: On a value outside its range (named in the message), or adaptive
            draft exit with a drafter that gives no probabilities.
        UnsupportedModelError: If the target's attention cannot take the batch masks
            (``batch_cache.BatchKVCache``).
    """

    def __init__(
        self,
        target: PreTrainedModel,
        drafter: Drafter | None = None,
        *,
        max_batch_size: int = 8,
        max_length: int = 2048,
        num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS,
        eos_token_ids: Iterable[int] = (),
        tokenizer=None,
        draft_control: DraftPolicy | None = None,
        exit_rule: str = "row",
        max_verify_tokens: int | None = None,
        prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS,
        prefill_pad_multiple: int = PREFILL_PAD_MULTIPLE,
        compile: bool | None = None,
        graphs: bool | str = True,
        row_buckets: Sequence[int] | None = None,
        dynamic_shapes: bool = False,
        shared_with: BatchedSpeculativeDecoder | None = None,
        shared_prefill: bool | None = None,
        overlap_rounds: bool | None = None,
    ) -> None:
        check_graphs(graphs)
        if compile is not None and not isinstance(compile, bool):
            raise InvalidArgumentError(f"compile must be True, False or None (the device default), got {compile!r}")
        if max_verify_tokens is not None and (
            isinstance(max_verify_tokens, bool) or not isinstance(max_verify_tokens, int) or max_verify_tokens < 1
        ):
            raise InvalidArgumentError(f"max_verify_tokens must be an integer >= 1 or None, got {max_verify_tokens!r}")
        check_count("max_batch_size", max_batch_size, 1)
        if exit_rule not in BATCH_EXIT_RULES:
            raise InvalidArgumentError(f"exit_rule must be one of {BATCH_EXIT_RULES}, got {exit_rule!r}")
        self.gamma = check_num_speculative_tokens(num_speculative_tokens) if drafter is not None else 0
        self.adaptive = drafter is not None and draft_control is not None and draft_control.active
        if self.adaptive and draft_control.adaptive_exit and not drafter.supports_exit_policy:
            raise InvalidArgumentError(
                f"adaptive draft exit needs a drafter that gives probabilities; {type(drafter).__name__} does not"
            )
        self.target = target
        self.drafter = drafter
        self.draft_control = draft_control
        #: How the rows' adaptive exits read the draft's confidence (``engine.draft_exit``), or None.
        self.exit_mode = draft_control.exit_mode if self.adaptive and draft_control.adaptive_exit else None
        self.exit_rule = exit_rule
        self.max_verify_tokens = max_verify_tokens
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.vocab_size = logits_width(target)
        self.max_batch_size = max_batch_size
        probe = draft_control.controller(self.gamma) if self.adaptive else None
        #: The longest block a round drafts (the verification is at most this + 1 wide).
        self.max_block = probe.max_tokens if probe is not None else self.gamma
        self.compile = default_compile(target.device) if compile is None else compile
        self.shared_prefill = engine_shared_prefill(shared_prefill, target, drafter)
        self.overlap_rounds = engine_overlap_rounds(overlap_rounds, target)
        # The widest bucket: a verification (max_block + 1) or a draft model's first feed (2).
        rows = check_row_buckets(row_buckets, max_batch_size)
        fast = engine_fast_path(self.compile, rows, max(self.max_block + 1, 2), graphs, dynamic_shapes)
        previous = shared_with
        if is_runner_target(target):  # its own memory, one sequence: refuses max_batch_size > 1 and compile
            self.cache, self.runner = runner_target_parts(target, max_batch_size, max_length, self.compile, previous,
                                                          prefill_chunk_tokens, prefill_pad_multiple)
        elif previous is not None and previous.target is target and previous.cache.num_slots == max_batch_size \
                and previous.cache.capacity >= max_length and previous.compile == self.compile \
                and (fast is None or fast == previous.cache.fast) \
                and previous.runner.widths[-1] >= self.max_block + 1 \
                and (previous.cache.prefill_chunk_tokens, previous.cache.prefill_pad_multiple) == (
                    prefill_chunk_tokens, prefill_pad_multiple):
            # One sequence at a time (``SpeculativeDecoder``): the cache and the compiled buckets
            # of an engine of the same shape are reused, so a new decoder recompiles nothing.
            self.cache, self.runner = previous.cache, previous.runner
            max_length = self.cache.capacity
        else:
            self.cache = BatchKVCache(target, max_batch_size, max_length, prefill_chunk_tokens=prefill_chunk_tokens,
                                      prefill_pad_multiple=prefill_pad_multiple, fast=fast)
            self.runner = BatchRunner(target, self.cache, (1, self.max_block + 1), "target model")
        self.max_length = max_length
        if self.cache.fast is not None and drafter is not None and self.max_block > 1:  # what a draft runner fuses
            self.cache.fast.draft_steps.add((self.max_block - 1, self.exit_mode in ("masked", "previous-round")))
        if drafter is not None:
            drafter.bind(self.cache)
        self.stats = SpecDecodingStats()
        self.generator = torch.Generator(device=target.device)
        self.generator.seed()
        #: True: a request that fails (its prefill raises, its target logits are not finite, its sampling
        #: raises or draws from a law that is not one) ends alone with ``finish_reason="error"``; False: the
        #: error propagates from ``step`` (``SpeculativeDecoder``, one sequence, raises as it always did).
        self.contain_errors = True
        #: Whether ``warm_up`` ran (a bench warms a compiling engine up once).
        self.warmed_up = False
        #: Whether the draft policy was calibrated (``DraftPolicy.calibrate``, before the first round).
        self._calibrated = False
        self._measured_s = 0.0  # seconds of ``_measure_forwards`` in the latest calibration
        self._reader = HostReader(target.device)
        self._init_requests()

    @property
    def compile_time_s(self) -> float:
        """Seconds spent compiling fast-path buckets (target and drafter), over the engine's life."""
        return self.runner.compile_time_s + getattr(self.drafter, "compile_time_s", 0.0)

    def warm_up(self) -> float:
        """Run the target, and a draft model, once at every token count this engine's forwards can take
        (``batch_cache.warm_up_widths``), before any request: on a CPU each new matmul shape JIT-compiles
        oneDNN kernels that stay in memory, so a server's memory would grow while rare shapes turn up.
        On the fast path it then runs every compiled bucket of the target and the drafter once, so
        compilation happens here. Returns the seconds it took.

        Raises:
            InvalidArgumentError: If requests are queued or running.
        """
        if self.has_work:
            raise InvalidArgumentError("warm_up runs before any request: requests are queued or running")
        t0 = time.perf_counter()
        widths, logit_widths = warm_up_widths(self.cache, self.max_batch_size, self.max_block)
        self.cache.warm_up_shapes(self.target, widths, logit_widths)
        if self.compile:
            self.runner.warm_up()
        if self.drafter is not None:
            self.drafter.warm_up(self.max_batch_size, self.max_block)
        seconds = time.perf_counter() - t0
        self.warmed_up = True
        logger.info("warm-up: %d forward widths (%d..%d tokens)%s in %.1f s", len(widths), widths[0], widths[-1],
                    f", {len(self.runner.buckets)} compiled target buckets" if self.compile else "", seconds)
        return seconds

    # -- the loop -----------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, *, decode: bool = True) -> list[BatchEvent]:
        """Admit queued requests into free slots (prefilled alone, or together: ``shared_prefill``), then
        run one round over every row, new ones included; finished rows leave.

        Args:
            decode: False admits only (no round): a stream of one sequence yields the prefill's
                token before the first round.

        Returns:
            One event per request that got tokens or finished in this step.

        Raises:
            NonFiniteLogitsError: If the draft model gives NaN or infinite logits (the target's
                non-finite logits end only the rows concerned, with ``finish_reason="error"``).

        A request whose prefill raises, or whose target logits are not finite, ends alone with
        ``finish_reason="error"`` (``BatchEvent.error`` says why); the others are untouched.
        """
        events: dict[int, BatchEvent] = {}
        with torch_threads(self.cache.torch_threads):  # 1 around a llama.cpp target's forwards
            self._admit(events)
            self._retire()  # rows done at their first token (EOS, max_new_tokens=1) leave before the round
            if self._rows and decode:
                self._round(events)
                self._retire()
        return list(events.values())

    def _admit(self, events: dict) -> None:
        free = min(len(self._waiting), self.max_batch_size - len(self._rows))
        shared = admit_shared(self.target, self.cache, list(itertools.islice(self._waiting, free)),
                              len(self._rows)) if self.shared_prefill and free > 1 else {}
        while self._waiting and len(self._rows) < self.max_batch_size:
            row = self._waiting.popleft()
            slot = len(self._rows)
            t0 = time.perf_counter()
            compiling = self.compile_time_s
            prompt = torch.tensor([row.tokens], dtype=torch.long, device=self.target.device)
            planned, share = shared.get(row.request_id), 0.0
            try:
                if planned is not None and planned[0] == slot:  # its slot as planned: no row before it failed
                    _, logits, share = planned
                    row.prompt_cache = None
                else:
                    start = load_prompt_cache(self.cache, slot, row)
                    row.prompt_cache = None  # not kept: the slot holds it now
                    logits = self.cache.prefill_row(self.target, prompt, slot, start)  # llama.cpp: its own
                check_finite(logits, "target model")
                token = row.sampler.choose(logits)
                if self.drafter is not None:
                    self.drafter.join(slot, prompt, row.sampler)
            except Exception as exc:  # noqa: BLE001 -- the request ends ("error", logged); the batch goes on
                if not self.contain_errors:
                    self._forget(row, "error")
                    raise
                self._fail(events, row, f"request {row.request_id} failed in its prefill: {type(exc).__name__}: {exc}")
                continue
            if row.controller is not None and row.controller.gate is not None:
                probs = torch.softmax(logits.float(), -1) if row.sampler.greedy else row.sampler.probs(logits)
                row.controller.gate.observe(float(probs[0, token]))
            self._rows.append(row)
            new = row.emit([token], self.stats)
            compiled = self.compile_time_s - compiling  # a drafter's first calls of buckets: warm-up
            elapsed = time.perf_counter() - t0 - compiled + share
            row.stats.warmup_s += compiled
            self.stats.warmup_s += compiled
            row.stats.prefill_time_s = elapsed
            row.stats.num_prefills = 1
            self.stats.prefill_time_s += elapsed
            self.stats.num_prefills += 1
            self.stats.num_prompt_tokens += row.num_prompt_tokens
            self.stats.num_new_tokens += len(new)
            self._event(events, row, new)
        if self.drafter is not None and any(row.banned is not None for row in self._rows):
            self.drafter.rollback([len(row.tokens) - 1 for row in self._rows])  # a first token rolled back

    def _caps(self) -> tuple[list[int], list[int]]:
        """Per row, the most tokens to draft this round (its policy, its length budget, γ, and the
        share of ``max_verify_tokens`` each of the n rows gets), and the same within a "previous-round"
        exit's ``next_length`` (what the round drafts; the first is what its controller learns from)."""
        caps = []
        share = self.max_block if self.max_verify_tokens is None else self.max_verify_tokens // len(self._rows) - 1
        for row in self._rows:
            cap = min(self.gamma, share)
            if row.controller is not None:
                if row.controller.gated and row.remaining > 1:
                    row.stats.num_gated_steps += 1
                    self.stats.num_gated_steps += 1
                cap = min(row.controller.round_cap(), self.max_block, share)
            caps.append(max(0, min(cap, row.remaining - 1)))
        if self.exit_mode != "previous-round":
            return caps, caps
        return caps, [min(c, r.controller.exit.next_length) if r.controller.exit is not None else c
                      for c, r in zip(caps, self._rows)]

    def _calibrate(self) -> None:
        """Once per engine, before its first round with a drafter: ``DraftPolicy.calibrate`` with this
        engine's target forwards (``_measure_forwards``); the seconds those take count as warm-up."""
        self._calibrated = True
        if self.draft_control is None or self.drafter is None:
            return
        self._measured_s = 0.0
        self.draft_control.calibrate(self._measure_forwards, self.max_block + 1, self.drafter)
        seconds = self._measured_s
        if not seconds:
            return
        self.stats.warmup_s += seconds
        for row in self._rows:
            row.stats.warmup_s += seconds

    def _measure_forwards(self, widths: Sequence[int], repeats: int = 2) -> dict[int, float]:
        """Seconds of one target forward over the active rows at each of ``widths`` (tokens per row,
        1 .. ``max_block`` + 1), the fastest of ``repeats`` after an untimed first call (which compiles
        a fast-path bucket). Each row is written at its own pending position, where the round's
        verification writes next, so nothing a row holds is touched. On the fast path a width runs
        its bucket (the smallest compiled width >= it), so each bucket is timed once and widths
        between take its cost.

        Raises:
            InvalidArgumentError: A width outside 1 .. ``max_block`` + 1.
        """
        bad = [w for w in widths if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= self.max_block + 1]
        if bad:
            raise InvalidArgumentError(f"forward widths must be integers in 1..{self.max_block + 1}, got {bad[0]!r}")
        t_start = time.perf_counter()
        n = len(self._rows)
        starts = [len(row.tokens) - 1 for row in self._rows]
        buckets = getattr(self.runner, "widths", ()) if self.compile else ()
        timed: dict[int, float] = {}
        out = {}
        for w in sorted(set(widths)):
            run = next((b for b in buckets if b >= w), w)
            if run not in timed:
                ids = torch.zeros((n, w), dtype=torch.long, device=self.target.device)  # the runner pads to run
                best = float("inf")
                for i in range(repeats + 1):
                    t0 = time.perf_counter()
                    float(self.runner(ids, starts, 1)[0, -1, 0])  # a host sync: the forward has run
                    if i:
                        best = min(best, time.perf_counter() - t0)
                timed[run] = best
            out[w] = timed[run]
        self._measured_s += time.perf_counter() - t_start
        return out

    def _round(self, events: dict) -> None:
        if not self._calibrated:
            self._calibrate()
        rows, device = self._rows, self.target.device
        t0, compiling = time.perf_counter(), self.compile_time_s
        caps, limits = self._caps() if self.drafter is not None else ([0] * len(rows),) * 2
        sequences = [row.tokens for row in rows]
        draft: Draft | None = None
        n = len(rows)
        k = [0] * n
        stat_caps = limits  # a trimmed row's: what it kept (``trimmed_blocks``)
        draft_s = draft_prefill = 0.0
        depths: list[int | None] = [None] * n
        forwards_before = self.drafter.num_forwards if self.drafter is not None else 0
        exits = [row.controller.exit for row in rows] if self.adaptive else None
        if exits is not None and all(e is None for e in exits):
            exits = None  # gating or a schedule only: no per-step host sync
        if max(limits) > 0:
            t_draft, draft_compiling = time.perf_counter(), self.drafter.compile_time_s
            draft_prefill = self.drafter.prefill_time_s
            draft = self.drafter.propose(sequences, limits, exits, self.exit_rule)
            draft_prefill = self.drafter.prefill_time_s - draft_prefill
            # drafting only: no compilation, no deferred prompt prefill
            draft_s = time.perf_counter() - t_draft - (self.drafter.compile_time_s - draft_compiling) - draft_prefill
            k = list(draft.num_tokens)
            if draft.ngram_sizes is not None:  # each row's policy keeps what its match's evidence pays for
                k, stat_caps = trimmed_blocks(rows, k, draft, limits, self.stats)
        trees, tokens, probs = round_trees(draft, k, rows, getattr(self.runner, "takes_trees", False)) \
            if draft is not None else (None, None, None)
        K = max(k)
        # verify: one forward, row b at its own position len_b - 1, padded on the right to K + 1.
        starts = [len(s) - 1 for s in sequences]
        ahead, self._ahead = taken(self._ahead, rows, K, self.stats), None  # [overlap] the last round's forward
        if ahead is not None:
            ids, logits, greedy = ahead
        else:
            block = draft.block_ids if draft is not None and trees is None else None  # the draft's, on the device
            ids = block[:, : K + 1] if block is not None else to_device([[s[-1]] for s in sequences], device)
            ids = torch.cat([ids, tokens[:, :K]], dim=1) if K and block is None else ids  # pending token, then draft
            chains = None if trees is None else [t or TokenTree.chain(k[b]) for b, t in enumerate(trees)]  # [trees]
            logits, greedy = self.runner.forward_greedy(ids, starts, K + 1, trees=chains)  # rows without a tree: a chain
        if logits.shape[-1] > self.vocab_size:
            logits, greedy = logits[..., : self.vocab_size], greedy_epilogue(logits[..., : self.vocab_size])
        target_logits = logits
        # The round's one host sync: drafts, the target's argmax, finiteness flags (per position, raw: ``greedy``)
        finite = greedy[..., 1]  # (n, K + 1) long, 1 where finite, from the forward (its graph on the fast path)
        logits = process_rows(logits, [row.sampler.processors for row in rows], ids)  # [processors]
        masked = any(row.banned is not None for row in rows)  # [banned words]
        if masked:  # row b's [b, i] predicts position len_b + i
            mask_batch(logits, [row.banned for row in rows], [len(s) for s in sequences])
        draft_finite = draft.finite.view(1) if draft is not None and draft.finite is not None else finite.new_ones(1)
        parts = [ids[:, 1:].flatten()] if K else []
        points = exit_points(draft.top_probs, exits) if draft is not None and draft.top_probs is not None else None
        if points is not None:  # [exits read with the sync] each row's first unsure position
            parts = [*parts, points]
        # [sampling] every sampling row samples on the device: (accepted, next token)
        block = draft.probs_block if draft is not None and probs is draft.probs else None  # the q's as one tensor
        prob_nodes = draft.prob_nodes if draft is not None else None
        cut = exit_blocks(points, exits, k, self.exit_rule) if points is not None and any(
            e is not None and e.mode == "masked" for e in exits) else None  # [exits] masked rows' kept blocks
        sampled = sample_rows(rows, logits, finite, ids, k, trees, probs, self.contain_errors, probs_block=block,
                              prob_nodes=prob_nodes, cut=cut)
        verdicts = sampled.to_read()
        processed = logits is not target_logits or masked
        choice = greedy_tokens(logits) if processed else greedy[..., 0]  # (n, K + 1): the target's greedy choices
        readback = draft.readback if draft is not None else None  # what the drafter reads with the sync
        gated, gate_bits = greedy_gate_probs(rows, logits, ids, choice, k, trees, cut)  # [gates] read with it
        host = torch.cat([*parts, *verdicts, choice.flatten(), finite.flatten(), *([] if gate_bits is None else
                          [gate_bits]), *([readback] if readback is not None else []), draft_finite.long()])
        # [overlap] the next forward first, where no request can join (or the batch is full: one joins only
        # where a row leaves)
        joinable = bool(self._waiting)
        if self.overlap_rounds and self.drafter is None and (not joinable or n == self.max_batch_size) \
                and can_run_ahead(rows, sampled, self.cache.capacity, joinable):
            self._ahead, host = run_ahead(self.runner, self._reader, host, choice, sampled, rows, starts)
        else:
            host = host.tolist()
        if readback is not None:  # the drafter's values, just before the draft's finiteness flag
            self.drafter.on_readback(host[len(host) - 1 - readback.shape[0] : -1])
            del host[len(host) - 1 - readback.shape[0] : -1]
        gate_values = take_gate_probs(gated, host)  # after the readback: just before the last value
        exit_at = host[n * K : n * K + n] if points is not None else None
        if exit_at is not None:
            del host[n * K : n * K + n]
        decided, paths, size = sampled.read(host[n * K :])
        del host[n * K : n * K + size]
        if not host[-1]:
            if self.drafter is not None:  # the rows did not move: keep the drafter in step with them
                self.drafter.rollback([len(row.tokens) - 1 for row in rows])
            raise_non_finite(draft.who, logits.dtype)
        if exit_at is not None:
            k = observe_exits(exits, k, exit_at, self.exit_rule)
        drafted = [host[b * K : (b + 1) * K] for b in range(n)]
        argmax = host[n * K : n * K + n * (K + 1)]
        flags = host[n * (2 * K + 1) : n * (3 * K + 2)]
        for b in (b for b, verdict in decided.items() if verdict[1] < 0):  # not a distribution (``sampling.race``)
            if not self.contain_errors:
                if self.drafter is not None:  # the rows did not move: keep the drafter in step with them
                    self.drafter.rollback([len(r.tokens) - 1 for r in rows])
                raise_invalid_distribution()
            sampled.errors[b] = f"request {rows[b].request_id} failed in its sampling: {INVALID_DISTRIBUTION}"
        gate_rows = []
        for b, row in enumerate(rows):
            kb = k[b]
            if not all(flags[b * (K + 1) : b * (K + 1) + kb + 1]):  # the row's own positions, not padding
                if not self.contain_errors:
                    if self.drafter is not None:
                        self.drafter.rollback([len(r.tokens) - 1 for r in rows])
                    raise_non_finite("target model", logits.dtype)
                self._fail(events, row, f"the target model produced non-finite logits (NaN or inf) in a "
                           f"{logits.dtype} forward for request {row.request_id}")
                continue
            tree = trees[b] if trees is not None else None
            if b in sampled.errors:  # [sampling] its sampling raised: this row ends, the others go on
                self._fail(events, row, sampled.errors[b])
                continue
            if tree is not None:  # [trees] the accepted path's keys and values move into place
                if row.sampler.greedy:
                    path, token = greedy_tree_verify(tree, [sequences[b][-1], *drafted[b][:kb]],
                                                     argmax[b * (K + 1) : (b + 1) * (K + 1)])
                else:  # [sampling] decided on the device, read with the round's sync
                    path, token = paths[b], decided[b][1]
                self.cache.keep_path(b, len(row.tokens) - 1, path)
                a, node = len(path) - 1, path[-1]
                new = [drafted[b][n - 1] for n in path[1:]] + [token]
            elif row.sampler.greedy:
                verdict = greedy_verify(drafted[b][:kb], argmax[b * (K + 1) : (b + 1) * (K + 1)])
                a = node = verdict.num_accepted
                new = drafted[b][:a] + [verdict.next_token]
            else:  # [sampling] decided on the device, read with the round's sync
                a = node = decided[b][0]
                new = drafted[b][:a] + [decided[b][1]]
            if row.sampler.processors is not None:  # [processors] logprobs of the new tokens, when asked
                row.sampler.processors.record(len(row.tokens) - row.num_prompt_tokens, logits[b], new)
            depth = max(tree.depths) if tree is not None else None  # [trees] acceptance by depth
            depths[b] = depth if depth is not None else (kb or None)
            row.stats.record_block(kb, a, depth)
            cap = stat_caps[b]
            row.stats.record_cap(cap)  # where the policy trimmed the block, what it kept
            if row.controller is not None:
                if kb:
                    row.controller.record(limits[b], kb, a)
                if row.controller.exit is not None:
                    row.stats.final_draft_threshold = row.controller.exit.threshold
                if b in gate_values:
                    row.controller.gate.observe(gate_values[b])
                elif row.controller.gate is not None:
                    gate_rows.append((b, node, new[-1]))
            self.stats.record_block(kb, a, depth)
            self.stats.record_cap(cap)
            out = row.emit(new, self.stats)
            self.stats.num_new_tokens += len(out)
            self._event(events, row, out)
        if gate_rows:
            observe_gates(rows, logits, gate_rows)
        if self.drafter is not None and self.drafter.observes_target:  # [trees] Token Recycling learns
            self.drafter.observe(ids, target_logits, [kb + 1 for kb in k])
        draft_forwards = 0
        if self.drafter is not None:
            self.drafter.rollback([len(row.tokens) - 1 for row in rows])
            draft_forwards = self.drafter.num_forwards - forwards_before
            self.stats.num_draft_forwards += draft_forwards
        compiled = self.compile_time_s - compiling  # first calls of buckets: warm-up, not decoding
        elapsed = time.perf_counter() - t0 - compiled
        self.stats.warmup_s += compiled
        self.stats.record_round(n)
        self.stats.decode_time_s += elapsed
        for b, row in enumerate(rows):
            if row.controller is not None:  # a policy priced by measured rounds learns from every round
                row.controller.record_round(caps[b], k[b], elapsed - draft_prefill, draft_seconds=draft_s,
                                            depth=depths[b])
            row.stats.record_round(n)
            row.stats.decode_time_s += elapsed
            row.stats.warmup_s += compiled
            row.stats.num_draft_forwards += draft_forwards

