"""Speculative-decoding statistics, named after vLLM's ``SpecDecodingStats``: one class for one
generation and for a batched engine's lifetime, with one definition of τ."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SpecDecodingStats:
    """Counts and timings of one generation, or of a batched engine over its life (all rows).

    One target forward verifies one block per row; the counts below are per row
    ("row-forwards"), so one generation and a batch of them add up alike, and a batched
    engine's lifetime stats are the sum of its requests' (cancelled and failed ones included).

    Attributes:
        num_prompt_tokens: Tokens in the prompt (after the chat template); summed over rows.
        num_new_tokens: Tokens generated and returned.
        num_target_forwards: Row verifications after the prefill: one per row per round, each
            verifying one draft block (or making one plain step). For one generation, its
            target forwards after the prefill.
        num_draft_forwards: Draft forward passes after the prefill (a draft model's prefill is
            not counted; 0 for model-free drafters); a batched forward over every row counts once.
        num_drafted_tokens: Draft tokens proposed to the target.
        num_accepted_tokens: Draft tokens the target accepted.
        num_draft_blocks: Row verifications that checked at least one draft token.
        drafted_by_position: Entry i counts blocks that drafted a token at position i.
        accepted_by_position: Entry i counts blocks whose token at position i was accepted.
        prefill_time_s: Seconds spent on the prompt(s) (target and draft prefill).
        decode_time_s: Seconds from the end of the prefill to the last token (a batched
            engine: seconds in rounds).
        warmup_s: Seconds spent compiling forwards of the fast path during this generation
            (first calls of compiled widths; ``specdecode.engine.fast_path``), taken out of
            ``prefill_time_s`` and ``decode_time_s`` so they never count in tokens/s.
        final_draft_threshold: The adaptive draft-exit threshold after the last
            block (``specdecode.drafters.control``), or None when adaptive exit is off.
        num_gated_steps: Plain target steps (no drafting) a draft policy chose: the target-confidence
            gate (the target's last token had low probability), a cost model, or a block it trimmed to
            nothing (``RoundController.trim``).
        num_banned_word_rollbacks: Times a banned word completed and the output was
            rolled back to where it began (``GenerationConfig.banned_words``).
        num_banned_word_discarded_tokens: Tokens those rollbacks discarded.
        rounds_by_draft_size: Entry n counts row verifications that checked a draft of n tokens (a
            chain) or n nodes (a tree); entry 0 the plain steps.
        rounds_by_draft_cap: Entry n counts row rounds whose draft policy allowed n tokens or nodes
            (the size a cost model chose; a drafter may offer less: prompt lookup without a match; where
            the policy trimmed a proposed block, ``RoundController.trim``, the tokens it kept).
        num_rounds: Decode rounds: target forwards over the whole batch (prefills excluded);
            equals ``num_target_forwards`` for one sequence.
        num_prefills: Rows prefilled (1 for one generation once it started).
        num_discarded_forwards: Target forwards run ahead of a round's read (``engine.overlap``) and
            dropped: a row was not in it (a request joined, a sequence changed), or no row was left to
            use it; the engine's stats only.
        max_rows: The most rows one round decoded (1 for one sequence).
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
    rounds_by_draft_size: list[int] = field(default_factory=list)
    rounds_by_draft_cap: list[int] = field(default_factory=list)
    num_rounds: int = 0
    num_prefills: int = 0
    num_discarded_forwards: int = 0
    max_rows: int = 0

    #: Derived values ``to_dict`` adds to the counters.
    DERIVED = (
        "acceptance_rate", "mean_accepted_tokens", "total_time_s", "tokens_per_s",
        "mean_accepted_draft_tokens", "acceptance_by_position", "decode_tokens_per_s", "mean_draft_size",
        "mean_draft_cap",
    )

    def record_block(self, num_drafted: int, num_accepted: int, depth: int | None = None) -> None:
        """Account one row's verification that checked ``num_drafted`` tokens and accepted
        ``num_accepted`` of them (a plain step: 0 and 0). ``depth``: a token tree's depth
        (``engine.tree``), so that ``drafted_by_position`` / ``accepted_by_position`` count depths
        (acceptance by depth); None: a linear draft, whose depth is ``num_drafted``."""
        self.num_target_forwards += 1
        _count(self.rounds_by_draft_size, num_drafted)
        if num_drafted == 0:
            return
        self.num_draft_blocks += 1
        self.num_drafted_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        depth = num_drafted if depth is None else depth
        if len(self.drafted_by_position) < depth:
            grow = depth - len(self.drafted_by_position)
            self.drafted_by_position.extend([0] * grow)
            self.accepted_by_position.extend([0] * grow)
        for i in range(depth):
            self.drafted_by_position[i] += 1
        for i in range(num_accepted):
            self.accepted_by_position[i] += 1

    def record_cap(self, cap: int) -> None:
        """Account one row round whose draft policy allowed ``cap`` >= 0 tokens or nodes."""
        _count(self.rounds_by_draft_cap, cap)

    @property
    def mean_draft_size(self) -> float | None:
        """Tokens (chains) or nodes (trees) drafted per row verification, plain steps counting 0; None before any."""
        return _mean(self.rounds_by_draft_size)

    @property
    def mean_draft_cap(self) -> float | None:
        """The draft size allowed per row round (``rounds_by_draft_cap``), or None before any."""
        return _mean(self.rounds_by_draft_cap)

    def record_round(self, num_rows: int) -> None:
        """Account one target forward over ``num_rows`` rows (their ``record_block`` calls are apart)."""
        self.num_rounds += 1
        self.max_rows = max(self.max_rows, num_rows)

    @property
    def num_row_rounds(self) -> int:
        """Row verifications: ``num_target_forwards`` (the batched engine's name for it)."""
        return self.num_target_forwards

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted ÷ drafted tokens, or None when nothing was drafted."""
        return self.num_accepted_tokens / self.num_drafted_tokens if self.num_drafted_tokens else None

    @property
    def mean_accepted_tokens(self) -> float | None:
        """τ: tokens a row gains per target forward after the prefill, COUNTING the bonus (or
        replacement) token each forward adds: (accepted + forwards) ÷ forwards, as vLLM's mean
        acceptance length. Autoregressive decoding gives 1.0; None before any forward."""
        if not self.num_target_forwards:
            return None
        return (self.num_accepted_tokens + self.num_target_forwards) / self.num_target_forwards

    @property
    def mean_accepted_draft_tokens(self) -> float | None:
        """Accepted draft tokens per draft block, NOT counting the bonus token."""
        if self.num_draft_blocks == 0:
            return None
        return self.num_accepted_tokens / self.num_draft_blocks

    @property
    def num_tokens_from_forwards(self) -> int:
        """New tokens that came out of decode-phase forwards (each prefill gives a row's first)."""
        return max(self.num_new_tokens - max(self.num_prefills, 1), 0)

    @property
    def acceptance_by_position(self) -> list[float]:
        """Entry i: fraction of blocks drafting position i whose token i was accepted."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    @property
    def total_time_s(self) -> float:
        """Prefill plus decode, in seconds (compilation, ``warmup_s``, excluded)."""
        return self.prefill_time_s + self.decode_time_s

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of wall time, prefill included."""
        return self.num_new_tokens / self.total_time_s if self.total_time_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second after the prefill (the first token comes from the prefill)."""
        return self.num_tokens_from_forwards / self.decode_time_s if self.decode_time_s > 0 else 0.0

    def to_dict(self) -> dict:
        """Every counter plus the derived rates, JSON-ready (τ counts the bonus token)."""
        out = asdict(self)
        out.update({name: getattr(self, name) for name in self.DERIVED}, mean_accepted_tokens_counts_bonus=True)
        return out


def _count(histogram: list[int], value: int) -> None:
    """``histogram[value] += 1``, growing it as needed."""
    if len(histogram) <= value:
        histogram.extend([0] * (value + 1 - len(histogram)))
    histogram[value] += 1


def _mean(histogram: list[int]) -> float | None:
    """The mean of the values a histogram (entry n: how often n) counts, or None when empty."""
    total = sum(histogram)
    return sum(n * c for n, c in enumerate(histogram)) / total if total else None


#: The batched engine's stats are the same class (one definition of τ); the name stays importable.
BatchStats = SpecDecodingStats
