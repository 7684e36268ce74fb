"""Per-generation statistics, named after vLLM's ``SpecDecodingStats``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


class _Rates:
    """Rates derived alike for one generation and for a batched engine."""

    #: Derived values ``to_dict`` adds to the counters.
    DERIVED: tuple[str, ...] = ("acceptance_rate", "mean_accepted_tokens", "total_time_s", "tokens_per_s")

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted ÷ drafted tokens, or None when nothing was drafted."""
        return self.num_accepted_tokens / self.num_drafted_tokens if self.num_drafted_tokens else None

    @property
    def total_time_s(self) -> float:
        """Prefill plus decode, in seconds (compilation, ``warmup_s``, excluded)."""
        return self.prefill_time_s + self.decode_time_s

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of wall time, prefill included."""
        return self.num_new_tokens / self.total_time_s if self.total_time_s > 0 else 0.0

    def to_dict(self) -> dict:
        """Every counter plus the derived rates, JSON-ready (τ counts the bonus token)."""
        out = asdict(self)
        out.update({name: getattr(self, name) for name in self.DERIVED}, mean_accepted_tokens_counts_bonus=True)
        return out


@dataclass
class SpecDecodingStats(_Rates):
    """Counts and timings of one generation.

    Attributes:
        num_prompt_tokens: Tokens in the prompt (after the chat template).
        num_new_tokens: Tokens generated and returned.
        num_target_forwards: Target forward passes after the prefill; each
            verifies one draft block (or makes one plain step).
        num_draft_forwards: Draft model forward passes (0 for model-free drafters).
        num_drafted_tokens: Draft tokens proposed to the target.
        num_accepted_tokens: Draft tokens the target accepted.
        num_draft_blocks: Target forwards that verified at least one draft token.
        drafted_by_position: Entry i counts blocks that drafted a token at position i.
        accepted_by_position: Entry i counts blocks whose token at position i was accepted.
        prefill_time_s: Seconds spent on the prompt (target and draft prefill).
        decode_time_s: Seconds from the end of the prefill to the last token.
        warmup_s: Seconds spent compiling forwards of the fast path during this generation
            (first calls of compiled widths; ``specdecode.engine.fast_path``), taken out of
            ``prefill_time_s`` and ``decode_time_s`` so they never count in tokens/s.
        final_draft_threshold: The adaptive draft-exit threshold after the last
            block (``specdecode.drafters.control``), or None when adaptive exit is off.
        num_gated_steps: Steps the target-confidence gate made plain target steps
            (no drafting) because the target's last token had low probability.
        num_banned_word_rollbacks: Times a banned word completed and the output was
            rolled back to where it began (``GenerationConfig.banned_words``).
        num_banned_word_discarded_tokens: Tokens those rollbacks discarded.
    """

    num_prompt_tokens: int = 0
    num_new_tokens: int = 0
    num_target_forwards: int = 0
    num_draft_forwards: int = 0
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    num_draft_blocks: int = 0
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    prefill_time_s: float = 0.0
    decode_time_s: float = 0.0
    warmup_s: float = 0.0
    final_draft_threshold: float | None = None
    num_gated_steps: int = 0
    num_banned_word_rollbacks: int = 0
    num_banned_word_discarded_tokens: int = 0

    def record_block(self, num_drafted: int, num_accepted: int) -> None:
        """Account one verification forward that checked ``num_drafted`` tokens."""
        self.num_target_forwards += 1
        if num_drafted == 0:
            return
        self.num_draft_blocks += 1
        self.num_drafted_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.drafted_by_position) < num_drafted:
            grow = num_drafted - len(self.drafted_by_position)
            self.drafted_by_position.extend([0] * grow)
            self.accepted_by_position.extend([0] * grow)
        for i in range(num_drafted):
            self.drafted_by_position[i] += 1
        for i in range(num_accepted):
            self.accepted_by_position[i] += 1

    @property
    def mean_accepted_tokens(self) -> float | None:
        """τ: tokens produced per target forward after the prefill, COUNTING the bonus
        (or replacement) token each forward adds. Autoregressive decoding gives 1.0."""
        if self.num_target_forwards == 0:
            return None
        return self.num_tokens_from_forwards / self.num_target_forwards

    @property
    def mean_accepted_draft_tokens(self) -> float | None:
        """Accepted draft tokens per draft block, NOT counting the bonus token."""
        if self.num_draft_blocks == 0:
            return None
        return self.num_accepted_tokens / self.num_draft_blocks

    @property
    def num_tokens_from_forwards(self) -> int:
        """New tokens that came out of decode-phase forwards (all but the first, which the prefill gives)."""
        return max(self.num_new_tokens - 1, 0)

    @property
    def acceptance_by_position(self) -> list[float]:
        """Entry i: fraction of blocks drafting position i whose token i was accepted."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second after the prefill (the first token comes from the prefill)."""
        return self.num_tokens_from_forwards / self.decode_time_s if self.decode_time_s > 0 else 0.0

    DERIVED = _Rates.DERIVED + ("mean_accepted_draft_tokens", "acceptance_by_position", "decode_tokens_per_s")


@dataclass
class BatchStats(_Rates):
    """Counts and timings of a batched engine (``engine.batched``), over its life.

    Attributes:
        num_rounds: Decode rounds: target forwards over the whole batch (prefills excluded).
        num_row_rounds: Sum over rounds of the rows in the batch (a row's verification each).
        num_prefills: Rows prefilled (joined).
        num_new_tokens: Tokens handed to callers, all rows.
        num_drafted_tokens: Draft tokens verified, all rows.
        num_accepted_tokens: Of those, accepted.
        num_draft_forwards: Draft forwards in rounds, each over the whole batch (a draft model's
            prefill of a joining row is not counted).
        prefill_time_s: Seconds in prefills.
        decode_time_s: Seconds in rounds, compilation excluded.
        warmup_s: Seconds rounds spent compiling fast-path buckets at first use
            (``BatchedSpeculativeDecoder.warm_up`` pays them before any request instead).
        max_rows: The most rows one round decoded.
    """

    num_rounds: int = 0
    num_row_rounds: int = 0
    num_prefills: int = 0
    num_new_tokens: int = 0
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    num_draft_forwards: int = 0
    prefill_time_s: float = 0.0
    decode_time_s: float = 0.0
    warmup_s: float = 0.0
    max_rows: int = 0

    @property
    def mean_accepted_tokens(self) -> float | None:
        """τ per row: tokens a row gains per round, COUNTING the bonus token (accepted + 1 per row-round)."""
        if not self.num_row_rounds:
            return None
        return (self.num_accepted_tokens + self.num_row_rounds) / self.num_row_rounds

