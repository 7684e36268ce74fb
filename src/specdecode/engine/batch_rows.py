"""A batched engine's per-request state (``BatchRow``) and what a step reports for it (``BatchEvent``)."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdecode.config import GenerationConfig
from specdecode.engine.banned_rows import BannedRow
from specdecode.engine.batch_cache import to_device
from specdecode.engine.processors import TokenLogprob
from specdecode.engine.results import GenerationResult, as_2d
from specdecode.engine.sampling import Sampler
from specdecode.engine.stats import SpecDecodingStats
from specdecode.engine.stopping import StopStrings, emit
from specdecode.errors import InvalidArgumentError

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
        self.sampler = Sampler(config, dec.vocab_size, dec.target.device, dec.generator)
        self.sampler.start(prompt)  # [processors] penalties, logit_bias, logprobs (engine.processors)
        self.controller = dec.draft_control.controller(dec.gamma) if dec.adaptive else None
        self.stop = StopStrings(dec.tokenizer, config.stop_strings)
        self.eos = (dec.eos_token_ids if config.stop_on_eos else frozenset()) | frozenset(config.stop_token_ids)
        self.stats = SpecDecodingStats(num_prompt_tokens=len(prompt))
        self.banned = BannedRow.from_config(config, dec.tokenizer, dec.vocab_size, len(prompt), dec.banned_lists)
        self.finish_reason: str | None = None
        self.prompt_cache = None  # a DynamicCache of the first prompt tokens, until the row joins
        if self.controller is not None and self.controller.exit is not None:
            self.controller.exit.mode = dec.exit_mode  # ``DraftControl.exit_mode``
            self.stats.final_draft_threshold = self.controller.exit.threshold

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


def request_prompt(input_ids, vocab_size: int) -> list[int]:
    """A request's prompt as a list of ids, checked (``BatchedSpeculativeDecoder.add``).

    Raises:
        InvalidArgumentError: Not integer ids, not one row, empty, or an id outside 0 .. vocab_size - 1.
    """
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise InvalidArgumentError(f"input_ids must hold integer token ids, got a {input_ids.dtype} tensor")
    elif isinstance(input_ids, (str, bytes)) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in input_ids
    ):
        raise InvalidArgumentError(
            f"input_ids must be token ids (a list of ints or a long tensor), got {str(input_ids)[:80]!r}; "
            "encode text with the tokenizer first"
        )
    ids = as_2d(input_ids)
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise InvalidArgumentError(f"a request's input_ids must have shape (1, n), got {tuple(ids.shape)}")
    prompt = ids[0].tolist()
    if not prompt:
        raise InvalidArgumentError("the prompt is empty: it must contain at least one token")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgumentError(
            f"token id {bad[0]} is outside the target model's vocabulary 0..{vocab_size - 1} "
            "(a prompt tokenized for another model?)"
        )
    return prompt


def check_prompt_cache(prompt_cache, num_prompt_tokens: int) -> None:
    """Raise unless ``prompt_cache`` (or None) holds 1 .. n - 1 of the prompt's n tokens.

    Raises:
        InvalidArgumentError: Naming the count it holds and the allowed range.
    """
    if prompt_cache is None:
        return
    m, n = prompt_cache.get_seq_length(), num_prompt_tokens
    if not 1 <= m <= n - 1:
        raise InvalidArgumentError(
            f"prompt_cache holds {m} tokens; it must hold 1..{n - 1} of the {n} prompt tokens "
            "(at least the last prompt token is encoded by the generation itself)"
        )


def trimmed_blocks(rows, k: list[int], draft, caps: list[int], *stats) -> tuple[list[int], list[int]]:
    """Each row's block (``k``: tokens proposed per row; ``draft``: the round's ``protocol.Draft``) after its
    controller's ``trim`` (``Draft.ngram_sizes``, ``match_sources``), and the caps the stats record (a trimmed
    row's: what it kept; a block trimmed to nothing is a gated step, counted in the row's stats and ``stats``).

    Raises:
        InvalidArgumentError: A controller kept a count outside 0 .. the tokens proposed.
    """
    kept, stat_caps, sources = list(k), list(caps), draft.match_sources or ["sequence"] * len(rows)
    for b, row in enumerate(rows):
        trim = row.controller.trim if k[b] and row.controller is not None else None
        n = trim(k[b], draft.ngram_sizes[b], sources[b]) if trim is not None else k[b]
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= k[b]:
            raise InvalidArgumentError(f"a round controller's trim must keep 0..{k[b]} tokens (those proposed), "
                                       f"got {n!r}")
        if n < k[b]:
            stat_caps[b] = n
            for s in (row.stats, *stats):
                s.num_gated_steps += n == 0
        kept[b] = n
    return kept, stat_caps


def greedy_gate_probs(rows, logits: torch.Tensor, ids: torch.Tensor, choice: torch.Tensor, k: list[int], trees,
                      cut: torch.Tensor | None) -> tuple[list[int], torch.Tensor | None]:
    """The confidence gates' values on the device, read with the round's one host sync, where every gated row is a
    greedy linear one: the target's probability of the token its verification emits (its argmax after the draft
    tokens it accepts, counted here as the host's ``greedy_verify`` counts them), as ``observe_gates`` computes it
    after the read. Otherwise ([], None): ``observe_gates`` reads them once more. On a 2-core CPU this takes about
    0.14 ms a round for one row (K = 12, V = 151,936; 0.08 ms read after the round); a softmax at every position a
    row may stop at would take about 2 ms.

    Args:
        rows: The round's ``BatchRow``s.
        logits: (n, K + 1, V) the verification's logits (after processors and masks).
        ids: (n, K + 1) its input: each row's pending token, then its draft.
        choice: (n, K + 1) the target's greedy choices (the argmax of ``logits``).
        k: Per row, the tokens it drafted; ``cut``: (n,) on the device, the blocks a masked exit keeps, or None.
        trees: Per row, a ``TokenTree`` or None, or None altogether.

    Returns:
        (the gated rows, in order; (g,) long, each one's probability as float32 bits), or ([], None).
    """
    gated = [b for b, row in enumerate(rows) if row.controller is not None and row.controller.gate is not None]
    if not gated or any(not rows[b].sampler.greedy or (trees is not None and trees[b] is not None) for b in gated):
        return [], None
    device, width = logits.device, ids.shape[1] - 1
    index = to_device(gated, device)
    kept = cut.index_select(0, index) if cut is not None else to_device([k[b] for b in gated], device)
    agree = ids.index_select(0, index)[:, 1:] == choice.index_select(0, index)[:, :width]
    agree &= torch.arange(width, device=device) < kept[:, None]
    accepted = agree.long().cumprod(1).sum(1)  # (g,): leading draft tokens equal to the target's choice
    at = logits[index, accepted]  # (g, V): each row's logits where its emitted token is chosen
    token = choice[index, accepted]  # (g,): that token, the target's argmax there
    return gated, torch.softmax(at.float(), -1).gather(-1, token[:, None])[:, 0].view(torch.int32).long()


def take_gate_probs(gated: list[int], host: list[int]) -> dict[int, float]:
    """``greedy_gate_probs``' values, read: taken from ``host`` (the round's read, where they stand just before its
    last value once the drafter's readback is taken out), in place; row -> probability."""
    if not gated:
        return {}
    values = host[len(host) - 1 - len(gated) : -1]
    del host[len(host) - 1 - len(gated) : -1]
    return dict(zip(gated, struct.unpack(f"{len(gated)}f", struct.pack(f"{len(gated)}i", *values))))


def observe_gates(rows, logits: torch.Tensor, gate_rows: list[tuple[int, int, int]]) -> None:
    """Feed confidence gates the target's probability of each row's new token (one host sync; where every gated
    row is greedy and linear, ``greedy_gate_probs`` computes them with the round's read instead).

    Args:
        rows: The round's ``BatchRow``s.
        logits: (n, K + 1, V) the verification's logits (after processors and masks).
        gate_rows: Per gated row, (row index b, the node its new token follows, the new token).
    """
    values = []
    for b, node, token in gate_rows:
        row = rows[b]
        p = torch.softmax(logits[b, node].float(), -1) if row.sampler.greedy else \
            row.sampler.probs(logits[b, node : node + 1])[0]
        values.append(p[token])
    for (b, _, _), p in zip(gate_rows, torch.stack(values).tolist()):
        rows[b].controller.gate.observe(p)
