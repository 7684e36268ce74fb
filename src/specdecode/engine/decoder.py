"""The decode loop: target-only (autoregressive) and speculative decoding.

One round is four named steps, as in Medusa's loop and gpt-fast's ``generate.py``:

1. **draft**: the drafter proposes k <= γ tokens after the sequence (an optional
   draft policy, ``specdecode.drafters.control.DraftControl``, may change γ per
   round, end a block early when the draft is unsure, or skip drafting after a
   low-confidence target token; the engine sees it through
   ``engine.protocol.DraftPolicy``);
2. **verify**: one target forward over ``[pending token, d_1 .. d_k]`` gives k + 1
   distributions; greedy or speculative-sampling verification accepts n of the
   draft tokens and yields one more token (replacement or bonus);
3. **accept**: the target's and the drafter's caches drop the k - n rejected
   positions (no prompt is ever re-encoded);
4. **emit**: the n + 1 new tokens are cut at EOS, a stop string or
   ``max_new_tokens``, checked for banned words (``engine.banned_words``: on a
   match, both caches rewind to where the word began and that token is masked
   there), and handed to the caller.

Autoregressive decoding is the same loop with k = 0: one target forward, one token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from specdecode.config import GenerationConfig
from specdecode.engine import kv_cache
from specdecode.engine.fast_path import DRAFT_BUCKETS, ModelRunner
from specdecode.engine.banned_rows import BannedRow
from specdecode.engine.processors import TokenLogprob
from specdecode.engine.protocol import Draft, Drafter, DraftPolicy
from specdecode.engine.sampling import Sampler, check_finite, logits_width, raise_non_finite
from specdecode.engine.stats import SpecDecodingStats
from specdecode.engine.stopping import StopStrings, emit
from specdecode.engine.verification import greedy_verify, rejection_sample
from specdecode.errors import InvalidArgumentError

logger = logging.getLogger(__name__)


@dataclass
class GenerationResult:
    """What one generation produced.

    Attributes:
        token_ids: The new token ids (prompt excluded), EOS or stop string included.
        text: ``token_ids`` decoded without special tokens ("" when no tokenizer was given).
        finish_reason: "eos", "stop_string", "length", or "banned_word" (a banned word could
            not be avoided without taking back text already streamed; see ``GenerationStream``).
        stats: Counts and timings.
        logprobs: With ``GenerationConfig.logprobs``, one ``TokenLogprob`` per token of
            ``token_ids`` (``engine.processors``); None otherwise.
    """

    token_ids: list[int]
    text: str
    finish_reason: str
    stats: SpecDecodingStats
    logprobs: list[TokenLogprob] | None = None


class GenerationStream:
    """Iterates over verified tokens, one list per target forward, as soon as they exist.

    After the iteration ends, ``token_ids``, ``finish_reason`` and ``stats`` hold the
    outcome. Made by ``SpeculativeDecoder.stream``.

    With ``GenerationConfig.banned_words``, a list holds only tokens that can no longer
    become part of a banned word (the tail that may still start one is held back), so
    no prefix of the stream ever contains a banned word. ``forbidden_tokens`` then maps
    each generated position (0 = the first new token) to the token ids masked there.
    The rollback, the masks and the draft cut are ``engine.banned_rows.BannedRow``'s,
    which the batched engine uses per row too.

    Semantics: under greedy decoding the output is the target's greedy output with
    those (position, token) pairs masked, a deterministic function of the prompt and
    the list. A mask holds for the prefix it was made for: rolling back to an earlier
    position drops the masks after it. Under sampling, rolling back and masking is *not* exact conditioning of
    the target's distribution on "contains no banned word": the masked token's
    probability mass moves to the other tokens at that one position only, whereas
    exact conditioning would reweight every earlier token by how likely its
    continuations are to avoid the words (intractable without enumerating them).
    """

    def __init__(
        self,
        decoder: SpeculativeDecoder,
        input_ids: torch.Tensor,
        config: GenerationConfig,
        prompt_cache: DynamicCache | None = None,
    ):
        self._decoder = decoder
        self._input_ids = input_ids
        self._prompt_cache = prompt_cache
        self.config = config
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stats = SpecDecodingStats(num_prompt_tokens=int(input_ids.shape[1]))
        self._state: _Round | None = None
        self._started = False

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """With ``GenerationConfig.logprobs``: one ``TokenLogprob`` per token of ``token_ids``; else None."""
        proc = self._state.sampler.processors if self._state is not None else None  # [processors]
        return list(proc.logprobs[: len(self.token_ids)]) if proc is not None and proc.wants_logprobs else None

    @property
    def forbidden_tokens(self) -> dict[int, list[int]]:
        """Banned-word masks: generated position (0 = the first new token) -> masked token ids."""
        if self._state is None or self._state.banned is None:
            return {}
        return self._state.banned.forbidden_tokens

    def __iter__(self) -> Iterator[list[int]]:
        if self._started:
            raise RuntimeError("a GenerationStream can be iterated only once")
        self._started = True
        return self._run()

    def _run(self) -> Iterator[list[int]]:
        dec, config, stats = self._decoder, self.config, self.stats
        stop = StopStrings(dec.tokenizer, config.stop_strings)
        eos = (dec.eos_token_ids if config.stop_on_eos else frozenset()) | frozenset(config.stop_token_ids)
        banned = BannedRow.from_config(config, dec.tokenizer, dec.vocab_size, int(self._input_ids.shape[1]))
        state = self._state = _Round(dec, self._input_ids, config, stats, self._prompt_cache, banned)
        # Compilation (first calls of compiled forwards) is timed apart: warmup_s, never in prefill or decode.
        c0, t0 = dec.compile_time_s(), time.perf_counter()
        new = state.prefill()
        warm = dec.compile_time_s() - c0
        stats.warmup_s += warm
        stats.prefill_time_s = time.perf_counter() - t0 - warm
        stats.num_prefills = 1
        # Draft forwards count from here: a draft model's prefill is not a decode-phase forward
        # (the batched engine counts its rounds' draft forwards alike).
        prefill_draft_forwards = dec.drafter.num_forwards if dec.drafter is not None else 0
        released = 0  # tokens handed to the caller; with banned words, the rest may still be rolled back
        # Decode time counts the loop's own work, not the consumer's between yields.
        while True:
            t1 = time.perf_counter()
            # emit: cut at EOS, the length budget and stop strings.
            self.finish_reason = emit(self.token_ids, new, eos, config.max_new_tokens, stop)
            safe = len(self.token_ids)
            if banned is not None:  # match; on a banned word, roll back and mask (BannedRow.check)
                self.finish_reason, rewind = banned.check(self.token_ids, self.finish_reason, stats)
                if rewind is not None:
                    state.rewind(rewind)
                safe = banned.released
            if state.sampler.processors is not None:  # [processors] counts and logprobs follow the output
                state.sampler.processors.sync(self.token_ids)
            stats.num_new_tokens = len(self.token_ids)
            stats.decode_time_s += time.perf_counter() - t1
            if safe > released:
                yield self.token_ids[released:safe]
                released = safe
            if self.finish_reason is not None:
                break
            c0, t1 = dec.compile_time_s(), time.perf_counter()
            new = state.step(config.max_new_tokens - len(self.token_ids))
            warm = dec.compile_time_s() - c0
            stats.warmup_s += warm
            stats.decode_time_s += time.perf_counter() - t1 - warm
        stats.num_draft_forwards = dec.drafter.num_forwards - prefill_draft_forwards if dec.drafter is not None else 0


class _Round:
    """The mutable state of one generation: token buffer, target cache, sampler, banned-word masks."""

    def __init__(
        self,
        dec: SpeculativeDecoder,
        input_ids: torch.Tensor,
        config: GenerationConfig,
        stats,
        prompt_cache: DynamicCache | None = None,
        banned: BannedRow | None = None,
    ):
        self.dec = dec
        self.banned = banned  # banned-word masks by position in buf, matcher, released tokens
        self.stats = stats
        self.config = config
        self.gamma = config.num_speculative_tokens if dec.drafter is not None else 0
        device = input_ids.device
        n = self.num_prompt_tokens = input_ids.shape[1]
        self.buf = torch.empty((1, n + config.max_new_tokens + self.gamma + 1), dtype=torch.long, device=device)
        self.buf[:, :n] = input_ids
        self.length = n  # tokens in buf; the last one, once generated, is in no cache yet
        # A CPU copy of buf's confirmed tokens for drafters that match on the host (prompt lookup,
        # the cascade), written from the values each round reads back anyway: no extra host sync.
        self.host: np.ndarray | None = None  # (capacity,) int64
        if dec.drafter is not None and dec.drafter.uses_host_sequence:
            self.host = np.empty(self.buf.shape[1], dtype=np.int64)
            self.host[:n] = input_ids[0].cpu().numpy()
        self.sampler = Sampler(config, dec.vocab_size, device)
        self.sampler.start(input_ids)  # [processors] penalties, logit_bias, logprobs (engine.processors)
        control = dec.draft_control
        # Fresh per-generation state; None keeps the plain γ-per-round path.
        self.control = (
            control.controller(self.gamma)
            if dec.drafter is not None and control is not None and control.active
            else None
        )
        if self.control is not None and self.control.exit is not None:
            stats.final_draft_threshold = self.control.exit.threshold
        runner = dec.runner
        if runner.compile and self.gamma:  # verification widths: γ + 1, and the policy's longest block + 1
            runner.with_buckets((self.gamma + 1, (self.control.max_tokens if self.control else self.gamma) + 1))
        # Positions written at most: the buffer, plus a forward padded to its bucket (the target's, or
        # a draft model's, whose static cache takes this capacity too).
        room = max(runner.max_bucket, DRAFT_BUCKETS[-1]) if runner.compile else 0
        self.cache, self.num_cached = runner.new_cache(self.buf.shape[1] + room), 0
        self.generation = getattr(self.cache, "generation", 0)
        if prompt_cache is not None:  # holds the first m prompt tokens (checked by stream)
            m = prompt_cache.get_seq_length()
            if not runner.static_cache:
                self.cache, self.num_cached = prompt_cache, m
            elif kv_cache.load_prefix(self.cache, prompt_cache, m):
                self.num_cached = m
            else:
                logger.debug("prompt cache not usable by the static cache (a trimmed sliding layer): re-encoded")

    def rewind(self, length: int) -> None:
        """Go back to the first ``length`` tokens of the buffer (prompt included, ``length`` > prompt - 1).

        The last of them becomes the pending token again; both caches drop what follows
        (``kv_cache.rollback`` may empty a sliding-window cache, which the next forward
        then refills from the buffer).
        """
        self.length = length
        self.num_cached = kv_cache.rollback(self.cache, self.num_cached, length - 1)
        if self.dec.drafter is not None:
            self.dec.drafter.rollback(length - 1)

    def _confidence(self, logits: torch.Tensor, probs: torch.Tensor | None, row: int, token: int) -> float:
        """The target's probability of ``token`` at ``row`` (warped when sampling); one host sync."""
        if probs is None:
            return float(torch.softmax(logits[row].float(), dim=-1)[token])
        return float(probs[row, token])

    @torch.inference_mode()
    def prefill(self) -> list[int]:
        n, m = self.length, self.num_cached
        logits = self.dec.runner(self.buf[:, m:n], self.cache, 1)[:, -1]
        check_finite(logits, "target model")
        # Like every forward, the prefill is followed by a rollback (trims sliding layers).
        self.num_cached = kv_cache.rollback(self.cache, n, n)
        token = self.sampler.choose(logits)
        if self.control is not None and self.control.gate is not None:
            probs = None if self.sampler.greedy else self.sampler.probs(logits)
            self.control.gate.observe(self._confidence(logits, probs, 0, token))
        if self.dec.drafter is not None:
            self.dec.drafter.begin(self.buf[:, :n], self.sampler, self.cache)
        self.buf[0, n] = token
        if self.host is not None:
            self.host[n] = token
        self.length = n + 1
        return [token]

    @torch.inference_mode()
    def step(self, remaining: int) -> list[int]:
        """One target forward; returns the 1 .. k + 1 tokens it confirms."""
        L, buf, sampler, drafter, control = self.length, self.buf, self.sampler, self.dec.drafter, self.control
        self.dec.runner.check_owner(self.cache, self.generation)
        # draft (never more than the length budget can use)
        host = {} if self.host is None else {"host_sequence": self.host[:L]}
        if control is None:
            k = min(self.gamma, remaining - 1)
            draft = drafter.propose(buf[:, :L], k, **host) if k > 0 else None
        else:
            if control.gated and remaining > 1:
                self.stats.num_gated_steps += 1
            cap = k = min(control.round_cap(), remaining - 1)
            if k <= 0:
                draft = None
            elif control.exit is None:
                draft = drafter.propose(buf[:, :L], k, **host)
            else:
                draft = drafter.propose(buf[:, :L], k, exit_policy=control.exit, **host)
        if draft is not None and self.banned is not None and len(draft):
            keep = self.banned.cut_draft(draft.tokens.tolist(), L)
            if keep < len(draft):
                probs = None if draft.probs is None else draft.probs[:keep]
                draft = Draft(draft.tokens[:keep], probs, draft.finite, draft.who)
        k = len(draft) if draft is not None else 0
        if k:  # a host draft (prompt lookup) goes to the device without a device read
            buf[0, L : L + k].copy_(draft.tokens, non_blocking=draft.tokens.device != buf.device)
        drafted = buf[0, L : L + k]  # the draft on the model's device
        # verify (the cache holds L - 1 positions, or fewer after a banned-word rewind emptied it)
        logits = self.dec.runner(buf[:, self.num_cached : L + k], self.cache, k + 1)[0]
        self.num_cached = L + k
        probs = None
        if sampler.greedy:
            # The round's one host sync: the draft, the target's choices and the finiteness flags.
            finite = torch.isfinite(logits).all().view(1)  # before the banned-word masks add -inf
            logits = sampler.process(logits, drafted)  # [processors] row i sees drafted[:i]
            if self.banned is not None:
                self.banned.mask(logits, L)
            draft_finite = draft.finite.view(1) if k and draft.finite is not None else finite
            ids = torch.cat([drafted, sampler.argmax(logits)]) if k else sampler.argmax(logits)
            ids = torch.cat([ids, finite.long(), draft_finite.long()]).tolist()
            if not ids[-2]:
                raise_non_finite("target model", logits.dtype)
            if not ids[-1]:
                raise_non_finite(draft.who, logits.dtype)
            ids = ids[:-2]
            if k:
                verdict = greedy_verify(ids[:k], ids[k:])
                new = ids[: verdict.num_accepted] + [verdict.next_token]
            else:
                new = ids
                verdict = None
        else:
            check_finite(logits, "target model")
            logits = sampler.process(logits, drafted)  # [processors] row i sees drafted[:i]
            if self.banned is not None:
                self.banned.mask(logits, L)
            probs = sampler.probs(logits)
            if k:
                verdict = rejection_sample(drafted, draft.probs, probs, sampler)
                new = drafted[: verdict.num_accepted].tolist() + [verdict.next_token]
            else:
                new = [int(sampler.sample(probs)[0])]
                verdict = None
        accepted = verdict.num_accepted if verdict is not None else 0
        if sampler.processors is not None:  # [processors] logprobs of the new tokens, when asked
            sampler.processors.record(L - self.num_prompt_tokens, logits, new)
        # accept: roll both caches back to the confirmed tokens
        self.length = L + accepted + 1
        buf[0, self.length - 1] = new[-1]
        if self.host is not None:
            self.host[L : self.length] = new
        self.num_cached = kv_cache.rollback(self.cache, self.num_cached, self.length - 1)
        if drafter is not None:
            drafter.rollback(self.length - 1)
        self.stats.record_block(k, accepted)
        self.stats.record_round(1)
        if control is not None:
            if k:
                control.record(cap, k, accepted)
                if control.exit is not None:
                    self.stats.final_draft_threshold = control.exit.threshold
            if control.gate is not None:
                control.gate.observe(self._confidence(logits, probs, accepted, new[-1]))
        return new


def _as_2d(ids: torch.Tensor | list[int]) -> torch.Tensor:
    """A list of ints or an (n,) tensor as (1, n) long; other shapes unchanged (callers validate)."""
    if not isinstance(ids, torch.Tensor):
        ids = torch.tensor(list(ids), dtype=torch.long)
    return ids.unsqueeze(0) if ids.dim() == 1 else ids


class SpeculativeDecoder:
    """Target-only or speculative decoding of one sequence (batch size 1).

    Args:
        target: The target model, a transformers causal LM in eval mode.
        drafter: Proposes draft tokens; ``None`` gives plain autoregressive decoding
            with a KV cache (the baseline).
        eos_token_ids: Token ids that end generation.
        tokenizer: Needed only for ``stop_strings`` and for ``GenerationResult.text``.
        draft_control: Per-round draft length policy (adaptive draft exit, heuristic
            schedule, target-confidence gating); None drafts γ tokens every round.
            Ignored without a drafter.
        compile: The fast path for the target's forwards (static KV cache, compiled
            forwards; ``specdecode.engine.fast_path``); None: the device default (on for
            CUDA, off for CPU). Ignored when ``runner`` is given. A drafter runs its own
            model's forwards; ``SpeculativeGenerator`` gives it the same setting.
        runner: The target's ``ModelRunner``, to reuse its compiled forwards and static
            cache across decoders (``SpeculativeGenerator`` keeps one per model); None
            makes one for this decoder.

    Raises:
        InvalidArgumentError: If adaptive draft exit is asked of a drafter that gives
            no probabilities (``drafter.supports_exit_policy`` is False), or a bad ``compile``.

    The output of greedy decoding equals target-only greedy decoding token for
    token (in float32; in lower precision a multi-token forward may round
    differently from a one-token forward). Sampling is distributed exactly as
    sampling from the target (Leviathan et al. 2022).
    """

    def __init__(
        self,
        target: PreTrainedModel,
        drafter: Drafter | None = None,
        *,
        eos_token_ids: Iterable[int] = (),
        tokenizer=None,
        draft_control: DraftPolicy | None = None,
        compile: bool | None = None,
        runner: ModelRunner | None = None,
    ) -> None:
        if (
            draft_control is not None
            and draft_control.adaptive_exit
            and drafter is not None
            and not getattr(drafter, "supports_exit_policy", False)
        ):
            raise InvalidArgumentError(
                f"adaptive draft exit needs a drafter that gives probabilities (draft model, layer skip, "
                f"early exit); {type(drafter).__name__} does not"
            )
        self.target = target
        self.drafter = drafter
        self.draft_control = draft_control
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.vocab_size = logits_width(target)
        self.runner = runner if runner is not None else ModelRunner(target, compile=compile, name="target model")

    def compile_time_s(self) -> float:
        """Seconds the target's and the drafter's runners have spent compiling (``ModelRunner.compile_time_s``)."""
        drafter = self.drafter.compile_time_s if self.drafter is not None else 0.0
        return self.runner.compile_time_s + drafter

    def stream(
        self,
        input_ids: torch.Tensor | list[int],
        config: GenerationConfig | None = None,
        *,
        prompt_cache: DynamicCache | None = None,
    ) -> GenerationStream:
        """Start a generation whose tokens arrive as they are verified.

        Args:
            input_ids: (1, n) or (n,) long prompt ids, n >= 1; or a list of ints.
            config: Generation parameters; defaults to ``GenerationConfig()``.
            prompt_cache: Optional target cache holding the first m tokens of the prompt,
                1 <= m <= n - 1 (made by ``prompt_cache``); only tokens m..n-1 are then
                encoded. It is used in place and extended, like ``past_key_values`` in
                transformers' ``generate``: pass ``copy.deepcopy(cache)`` to reuse one
                prefix across generations.

        Raises:
            InvalidArgumentError: If the prompt is empty or has a batch size other than 1,
                ``prompt_cache`` holds no tokens or not fewer than n, or n + ``max_new_tokens``
                exceeds the target's context length (``kv_cache.check_context_length``).
        """
        config = config or GenerationConfig()
        device = self.target.device
        input_ids = _as_2d(input_ids)
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise InvalidArgumentError(
                f"input_ids must have shape (1, n) (batch size 1), got {tuple(input_ids.shape)}"
            )
        if input_ids.shape[1] == 0:
            raise InvalidArgumentError("the prompt is empty: it must contain at least one token")
        kv_cache.check_context_length(self.target, int(input_ids.shape[1]), config.max_new_tokens)
        if prompt_cache is not None:
            m, n = prompt_cache.get_seq_length(), input_ids.shape[1]
            if not 1 <= m <= n - 1:
                raise InvalidArgumentError(
                    f"prompt_cache holds {m} tokens; it must hold 1..{n - 1} of the {n} prompt tokens "
                    "(at least the last prompt token is encoded by the generation itself)"
                )
        return GenerationStream(self, input_ids.to(device=device, dtype=torch.long), config, prompt_cache)

    @torch.inference_mode()
    def prompt_cache(self, prefix_ids: torch.Tensor | list[int]) -> DynamicCache:
        """Encode a prompt prefix once, for ``stream(..., prompt_cache=copy.deepcopy(cache))``.

        Generations that share a prompt (a benchmark running several methods, a
        server with a fixed system prompt) can then skip re-encoding it. Pass the
        prompt without its last token: the generation encodes at least that one.

        Args:
            prefix_ids: (1, m) or (m,) long ids, m >= 1.

        Returns:
            A target cache holding the m positions (sliding layers laid out as in
            ``kv_cache.new_cache``).

        Raises:
            InvalidArgumentError: If the prefix is empty or has a batch size other than 1.
        """
        prefix_ids = _as_2d(prefix_ids)
        if prefix_ids.dim() != 2 or prefix_ids.shape[0] != 1 or prefix_ids.shape[1] == 0:
            raise InvalidArgumentError(
                f"prefix_ids must have shape (1, m) with m >= 1, got {tuple(prefix_ids.shape)}"
            )
        cache = kv_cache.new_cache(self.target)
        m = prefix_ids.shape[1]
        self.target(prefix_ids.to(self.target.device), past_key_values=cache, use_cache=True, logits_to_keep=1)
        kv_cache.rollback(cache, m, m)  # trims sliding layers, as after every forward
        return cache

    def generate(
        self,
        input_ids: torch.Tensor | list[int],
        config: GenerationConfig | None = None,
        *,
        prompt_cache: DynamicCache | None = None,
    ) -> GenerationResult:
        """Run a generation to the end. Same arguments and errors as ``stream``."""
        stream = self.stream(input_ids, config, prompt_cache=prompt_cache)
        for _ in stream:
            pass
        text = self.tokenizer.decode(stream.token_ids, skip_special_tokens=True) if self.tokenizer else ""
        return GenerationResult(stream.token_ids, text, stream.finish_reason, stream.stats, stream.logprobs)
