"""A batched engine's per-request state (``BatchRow``) and what a step reports for it (``BatchEvent``)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdecode.config import GenerationConfig
from specdecode.engine.banned_rows import BannedRow
from specdecode.engine.decoder import GenerationResult
from specdecode.engine.processors import TokenLogprob
from specdecode.engine.sampling import Sampler
from specdecode.engine.stats import SpecDecodingStats
from specdecode.engine.stopping import StopStrings, emit

if TYPE_CHECKING:
    from specdecode.engine.batched import BatchedSpeculativeDecoder


@dataclass
class BatchEvent:
    """What one ``step`` produced for one request.

    Attributes:
        request_id: As returned by ``add``.
        token_ids: The request's new tokens this step (may be empty; with banned words, only those
            that can no longer become part of one, ``BannedRow.released``: never taken back).
        finish_reason: None while it runs; then "eos", "stop_string", "length", "banned_word"
            (a banned word could not be avoided without taking back tokens already given out,
            as in ``decoder.GenerationStream``), or "error" (its prefill failed, or the target
            gave it NaN or infinite logits; see ``error``).
        result: The whole generation once finished (None before).
        error: What went wrong, when ``finish_reason`` is "error".
        logprobs: With ``GenerationConfig.logprobs``, one ``TokenLogprob`` per token of
            ``token_ids``; None otherwise.
    """

    request_id: int
    token_ids: list[int]
    finish_reason: str | None = None
    result: GenerationResult | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None


class BatchRow:
    """One request's state in ``engine.batched.BatchedSpeculativeDecoder``: its sequence (prompt + accepted tokens), sampler, policy and output."""

    def __init__(self, request_id: int, prompt: list[int], config: GenerationConfig, dec: BatchedSpeculativeDecoder):
        self.request_id = request_id
        self.config = config
        self.tokens = list(prompt)  # the last one, once generated, is in no cache yet
        self.num_prompt_tokens = len(prompt)
        self.output: list[int] = []
        self.sampler = Sampler(config, dec.vocab_size, dec.target.device)
        self.sampler.start(prompt)  # [processors] penalties, logit_bias, logprobs (engine.processors)
        self.controller = dec.draft_control.controller(dec.gamma) if dec.adaptive else None
        self.stop = StopStrings(dec.tokenizer, config.stop_strings)
        self.eos = (dec.eos_token_ids if config.stop_on_eos else frozenset()) | frozenset(config.stop_token_ids)
        self.stats = SpecDecodingStats(num_prompt_tokens=len(prompt))
        self.banned = BannedRow.from_config(config, dec.tokenizer, dec.vocab_size, len(prompt))
        self.finish_reason: str | None = None
        self.joined_at = time.perf_counter()

    @property
    def remaining(self) -> int:
        return self.config.max_new_tokens - len(self.output)

    def emit(self, new: list[int], *stats: SpecDecodingStats) -> list[int]:
        """Append verified tokens; cut at EOS, the length budget, a stop string; check banned words
        (a rollback shortens ``tokens``; ``stats`` count it too). Returns the tokens to release."""
        self.tokens.extend(new)
        before = len(self.output) if self.banned is None else self.banned.released
        self.finish_reason = emit(self.output, new, self.eos, self.config.max_new_tokens, self.stop)
        if self.banned is not None:
            self.finish_reason, rewind = self.banned.check(self.output, self.finish_reason, self.stats, *stats)
            if rewind is not None:
                del self.tokens[rewind:]  # the caches' positions past it are overwritten, never read
        if self.sampler.processors is not None:  # [processors] counts and logprobs follow the output
            self.sampler.processors.sync(self.output)
        self.stats.num_new_tokens = len(self.output)
        return self.output[before : len(self.output) if self.banned is None else self.banned.released]

    def logprobs_of(self, released: list[int]) -> list[TokenLogprob] | None:
        """The logprobs of ``released``, the tokens ``emit`` just released (None unless asked)."""
        proc = self.sampler.processors
        if proc is None or not proc.wants_logprobs:
            return None
        end = len(self.output) if self.banned is None else self.banned.released
        return proc.logprobs[end - len(released) : end]

    def result(self, tokenizer) -> GenerationResult:
        text = tokenizer.decode(self.output, skip_special_tokens=True) if tokenizer is not None else ""
        proc = self.sampler.processors
        logprobs = list(proc.logprobs[: len(self.output)]) if proc is not None and proc.wants_logprobs else None
        return GenerationResult(list(self.output), text, self.finish_reason, self.stats, logprobs)
