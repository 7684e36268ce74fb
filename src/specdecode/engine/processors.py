"""Logits processors that depend on the tokens before each position, exact under speculation.

``GenerationConfig``'s ``logit_bias``, ``repetition_penalty``, ``frequency_penalty`` and
``presence_penalty`` change the target's logits as a function of the context. Autoregressive
decoding applies them to one row of logits per forward; a verification forward gives a block of
W = k + 1 rows, and row i must be processed as autoregressive decoding would process it: with
the prompt, the output so far and the drafted tokens d_1 .. d_i before it. ``LogitsProcessing``
keeps the output's token counts on the device (updated once per round from the tokens the round
confirmed, ``sync``), with the context's distinct tokens: a penalty changes only their columns and
the drafted tokens'. A block gathers those columns, counts the drafted tokens before each row with
a cumulative sum over rows, and scatters the penalized values back: O(W x (context + W)) work past
the float32 copy of the logits, and no host sync.

The order and the definitions follow vLLM's sampler (``vllm/v1/sample/sampler.py``):

1. ``logit_bias`` (OpenAI): ``bias[j]`` added to logit j;
2. ``repetition_penalty`` (CTRL, Keskar et al. 2019; transformers'
   ``RepetitionPenaltyLogitsProcessor``): for every token j in the prompt or the output, a
   logit < 0 is multiplied by the penalty, any other divided by it. transformers' processor
   gathers and scatters over the whole ``input_ids``; here the same arithmetic is selected with
   a (W, V) mask of the tokens seen (the tests check equality with transformers' processor);
3. ``frequency_penalty`` and ``presence_penalty`` (OpenAI's definition, which transformers has
   no processor for): ``logit[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty``,
   c[j] the number of times token j occurs in the output (prompt excluded, as in vLLM).

``min_p`` depends on the logits alone: it is transformers' ``MinPLogitsWarper``, applied by
``sampling.Sampler`` after temperature, top-k and top-p (transformers' order).

**logprobs** (``GenerationConfig.logprobs``, ``top_logprobs``): the log-softmax, in float32, of
the logits after these processors (and a banned-word mask, when there is one), before
temperature and the truncating warpers: the log-probability of each emitted token under the
target's distribution at its position, as OpenAI reports it. The rows come from the
verification forward (no extra forward); reading them costs one host sync per round, only when
asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdecode.config import GenerationConfig
from specdecode.engine.batch_cache import to_device
from specdecode.errors import InvalidArgumentError


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability under the target's (processed) distribution.

    Attributes:
        token_id: The generated token.
        logprob: Its natural-log probability (float32 arithmetic), <= 0.
        top: The ``top_logprobs`` most likely tokens at that position as (token id, logprob),
            most likely first (empty when ``top_logprobs`` is 0).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def fit_width(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``logits`` (..., V') cut to V columns, or padded with -inf up to V (a draft's narrower head)."""
    width = logits.shape[-1]
    if width > vocab_size:
        return logits[..., :vocab_size]
    if width < vocab_size:
        pad = logits.new_full((*logits.shape[:-1], vocab_size - width), float("-inf"))
        return torch.cat([logits, pad], dim=-1)
    return logits


class LogitsProcessing:
    """One generation's context-dependent processors and logprobs (module docstring).

    Args:
        config: The generation's parameters.
        vocab_size: V, the target's logits width.
        device: Where the logits live.
        prompt: The prompt's token ids (a list or an (n,) / (1, n) tensor).

    Attributes:
        logprobs: Per generated token (0 = the first new token), its ``TokenLogprob``; kept
            only when ``config.logprobs``.

    Raises:
        InvalidArgumentError: If a ``logit_bias`` or ``stop_token_ids`` id is outside 0..V-1.
    """

    def __init__(
        self, config: GenerationConfig, vocab_size: int, device: torch.device | str,
        prompt: Sequence[int] | torch.Tensor,
    ) -> None:
        for token, _ in config.logit_bias:
            if token >= vocab_size:
                raise InvalidArgumentError(
                    f"logit_bias names token id {token}, outside the target model's vocabulary 0..{vocab_size - 1}"
                )
        for token in config.stop_token_ids:
            if token >= vocab_size:
                raise InvalidArgumentError(
                    f"stop_token_ids names token id {token}, outside the target model's vocabulary "
                    f"0..{vocab_size - 1}"
                )
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.num_prompt_tokens = int(prompt.shape[-1]) if isinstance(prompt, torch.Tensor) else len(prompt)
        self.repetition_penalty = float(config.repetition_penalty)
        self.frequency_penalty = float(config.frequency_penalty)
        self.presence_penalty = float(config.presence_penalty)
        self.changes_logits = config.processes_logits
        self.wants_logprobs = config.logprobs
        self.top_logprobs = config.top_logprobs
        self.logprobs: list[TokenLogprob] = []
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, values) on the device
        if config.logit_bias:
            self._bias = (to_device([t for t, _ in config.logit_bias], self.device),
                          torch.tensor([b for _, b in config.logit_bias], dtype=torch.float32).to(self.device))
        self._counting = self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0
        #: (V,) float32: how often each token occurs in the output so far (``sync``).
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=self.device)
        self._num_output = 0  # output tokens ``counts`` holds (the first ones of the output)
        # The context's distinct tokens (prompt and output): the only columns a penalty changes,
        # besides the drafted tokens. Kept on the host (a set) and on the device (``_cols``).
        self._prompt_ids: list[int] = []
        if self._counting:
            ids = prompt.reshape(-1).tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
            self._prompt_ids = [t for t in dict.fromkeys(ids) if 0 <= t < vocab_size]
        self._reset_context()

    def _reset_context(self) -> None:
        """The context's columns back to the prompt's (start, or a rollback that recounts)."""
        self._col_set = set(self._prompt_ids)
        self._cols = to_device(self._prompt_ids, self.device)
        #: (V,) bool: tokens in the prompt or the output (the repetition penalty's "seen").
        self._seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
        if self._prompt_ids and self.repetition_penalty != 1.0:
            self._seen[self._cols] = True

    @classmethod
    def from_config(
        cls, config: GenerationConfig, vocab_size: int, device: torch.device | str,
        prompt: Sequence[int] | torch.Tensor,
    ) -> LogitsProcessing | None:
        """The processing ``config`` asks for, or None when it asks for none (no processor, no logprobs).

        Raises:
            InvalidArgumentError: As the constructor.
        """
        if not (config.processes_logits or config.logprobs or config.stop_token_ids):
            return None
        return cls(config, vocab_size, device, prompt)

    # -- the verification block ----------------------------------------------------------------

    def block(self, logits: torch.Tensor, drafted: torch.Tensor | None = None) -> torch.Tensor:
        """Process a verification block: row i as after the output so far and ``drafted[:i]``.

        Only the columns of the context's tokens and the drafted ones change (a penalty leaves
        every other token alone), so the work past the float32 copy is O(W x (context + W)),
        not O(W x V): the columns are gathered, processed and scattered back.

        Args:
            logits: (W, V') the target's logits, any float dtype; row i predicts the token after
                the sequence and the first i drafted tokens.
            drafted: (>= W - 1,) long on the logits' device, the drafted tokens (entries past
                W - 1 are ignored; rows past the accepted ones may see padding, never used), or
                None when W = 1.

        Returns:
            (W, V) float32, a new tensor (the input is left as it is).
        """
        scores = self._biased(logits)
        if not self._counting:
            return scores
        width = scores.shape[0]
        if width == 1 or drafted is None:
            return self._penalize(scores, self._cols, self.counts[self._cols].expand(width, -1))
        d = drafted[: width - 1].to(device=scores.device, dtype=torch.long).clamp(0, self.vocab_size - 1)
        cols = torch.cat([self._cols, d])
        # Row i also counts d[:i]: a cumulative sum over the rows of "d[t] is this column's token".
        hits = (d.view(-1, 1) == cols.view(1, -1)).float()  # (W - 1, m)
        counts = self.counts[cols] + torch.cat([hits.new_zeros(1, cols.shape[0]), hits.cumsum(0)])
        return self._penalize(scores, cols, counts)

    def _biased(self, logits: torch.Tensor) -> torch.Tensor:
        """(m, V') -> (m, V) float32 copy with ``logit_bias`` added."""
        scores = fit_width(logits, self.vocab_size).float().clone()
        if self._bias is not None:
            ids, values = self._bias
            scores.index_add_(1, ids, values.expand(scores.shape[0], -1))
        return scores

    def _penalize(self, scores: torch.Tensor, cols: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Apply the penalties to ``scores`` (W, V) in place at the columns ``cols`` (m,), which hold
        every token whose count or "seen" flag is not zero; ``counts`` (W, m): the output's counts
        of ``cols[j]`` as row i sees them. A token listed twice gets the same value twice."""
        index = cols.expand(scores.shape[0], -1)
        sub = scores.gather(1, index)
        if self.repetition_penalty != 1.0:
            seen = self._seen[cols] | (counts > 0)
            p = self.repetition_penalty
            sub = torch.where(seen, torch.where(sub < 0, sub * p, sub / p), sub)
        if self.frequency_penalty != 0.0:
            sub = sub - counts * self.frequency_penalty
        if self.presence_penalty != 0.0:
            sub = sub - (counts > 0).float() * self.presence_penalty
        return scores.scatter_(1, index, sub)

    def drafting(self, sequence: torch.Tensor | Sequence[int]) -> DraftProcessing:
        """Processing for a draft model's block on its own context: ``sequence`` (the prompt, the
        output so far, and any tokens the drafter already put after it, e.g. the cascade's n-gram
        tokens), then each token it drafts. Changes nothing of this object.

        Args:
            sequence: (1, L) or (L,) long on the device, or a list of ids: the tokens the draft
                model's next token follows.
        """
        view = DraftProcessing(self)
        confirmed = self.num_prompt_tokens + self._num_output
        if isinstance(sequence, torch.Tensor):
            tail = sequence.reshape(-1)[confirmed:]
            if tail.numel():
                view.push(tail)
        elif len(sequence) > confirmed:
            view.push(to_device(list(sequence[confirmed:]), self.device))
        return view

    # -- after the round -----------------------------------------------------------------------

    def sync(self, output: Sequence[int]) -> None:
        """Make the counts and the logprobs those of ``output``, the generation's tokens now
        (after a round's emit, or a banned-word rollback). Adds the new tail with one small
        host-to-device copy; a shorter output (a rollback) recounts it."""
        done = self._num_output  # a rollback only shortens the output: a longer one extends the counted prefix
        if len(output) < done:
            self.counts.zero_()
            self._reset_context()
            done = 0
        if self._counting and len(output) > done:
            tail = list(output[done:])
            self.counts.index_add_(0, to_device(tail, self.device).clamp(0, self.vocab_size - 1),
                                   torch.ones(len(tail), device=self.device))
            new = [t for t in dict.fromkeys(tail) if t not in self._col_set and 0 <= t < self.vocab_size]
            if new:
                self._col_set.update(new)
                ids = to_device(new, self.device)
                self._cols = torch.cat([self._cols, ids])
                if self.repetition_penalty != 1.0:
                    self._seen[ids] = True
        self._num_output = len(output)
        del self.logprobs[len(output):]

    def record(self, position: int, scores: torch.Tensor, tokens: Sequence[int]) -> None:
        """Keep the logprobs of ``tokens``, generated at output positions ``position`` .. (one host sync).

        Args:
            position: Output index of ``tokens[0]`` (0 = the first new token).
            scores: (>= len(tokens), V) the processed logits the tokens were chosen from.
            tokens: The emitted tokens; token i was chosen from row i.
        """
        if not self.wants_logprobs or not tokens:
            return
        m = len(tokens)
        logp = torch.log_softmax(scores[:m].float(), dim=-1)
        ids = torch.tensor(list(tokens), dtype=torch.long, device=logp.device)
        parts = [logp.gather(1, ids.view(-1, 1)).flatten().double()]
        top = min(self.top_logprobs, logp.shape[-1])
        if top:
            values, where = logp.topk(top, dim=-1)
            parts += [values.flatten().double(), where.flatten().double()]
        host = torch.cat(parts).tolist()
        chosen = host[:m]
        entries = []
        for i, token in enumerate(tokens):
            pairs = ()
            if top:
                values = host[m + i * top : m + (i + 1) * top]
                ids_i = host[m + m * top + i * top : m + m * top + (i + 1) * top]
                pairs = tuple((int(t), float(v)) for t, v in zip(ids_i, values))
            entries.append(TokenLogprob(int(token), float(chosen[i]), pairs))
        del self.logprobs[position:]
        self.logprobs.extend(entries)


class DraftProcessing:
    """A draft model's view of ``LogitsProcessing`` during one block: the same processors on its
    own context (the output so far, then each drafted token). Exactness never depends on it; it
    keeps the draft's q close to the target's processed p, so acceptance does not drop."""

    def __init__(self, processing: LogitsProcessing) -> None:
        self.processing = processing
        self.active = processing.changes_logits
        self._ids: torch.Tensor | None = None  # (k,) the tokens drafted (or put ahead) in this block
        self._extra: torch.Tensor | None = None  # (V,) their counts

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """(m, V') draft logits -> (m, V) float32 processed as after the drafted tokens so far
        (every row alike: one draft step's rows); unchanged when no processor changes logits."""
        if not self.active:
            return logits
        proc = self.processing
        scores = proc._biased(logits.reshape(-1, logits.shape[-1]))
        if proc._counting:
            if self._ids is None:
                cols, counts = proc._cols, proc.counts[proc._cols]
            else:
                cols = torch.cat([proc._cols, self._ids])
                counts = proc.counts[cols] + self._extra[cols]
            proc._penalize(scores, cols, counts.expand(scores.shape[0], -1))
        return scores.view(*logits.shape[:-1], -1)

    def push(self, token: torch.Tensor) -> None:
        """Count the drafted ``token`` (any-shaped long tensor of ids, on the device) for the next steps."""
        if not self.active or not self.processing._counting:
            return
        proc = self.processing
        ids = token.reshape(-1).to(device=proc.device, dtype=torch.long).clamp(0, proc.vocab_size - 1)
        if self._extra is None:
            self._extra = torch.zeros_like(proc.counts)
        self._extra.index_add_(0, ids, torch.ones(ids.shape[0], device=proc.device))
        self._ids = ids if self._ids is None else torch.cat([self._ids, ids])


def process_rows(
    logits: torch.Tensor, processings: Sequence[LogitsProcessing | None], ids: torch.Tensor
) -> torch.Tensor:
    """The batched engine's verification logits after each row's processors.

    Args:
        logits: (n, W, V) the target's logits; row b's position i follows ``ids[b, 1 : i + 1]``.
        processings: Per row, its ``LogitsProcessing`` or None.
        ids: (n, W) long, what the forward fed: each row's pending token then its draft (padded).

    Returns:
        ``logits`` itself when no row changes its logits; else an (n, W, V) float32 copy with
        those rows processed (``LogitsProcessing.block``; no host sync).
    """
    if not any(p is not None and p.changes_logits for p in processings):
        return logits
    out = logits.float().clone() if logits.dtype == torch.float32 else logits.float()
    for b, proc in enumerate(processings):
        if proc is not None and proc.changes_logits:
            out[b] = proc.block(out[b], ids[b, 1:])
    return out


def process_draft_rows(
    logits: torch.Tensor, views: Sequence[DraftProcessing | None], vocab_size: int
) -> torch.Tensor:
    """A batched draft step's (n, V') logits with each row's ``DraftProcessing`` applied: (n, V)
    float32 (rows without one unchanged); no host sync."""
    out = fit_width(logits, vocab_size).float().clone()
    for b, view in enumerate(views):
        if view is not None:
            out[b] = view.apply(out[b : b + 1])[0]
    return out
