"""One stats class with one definition of τ, for one generation and for a batched engine."""

from __future__ import annotations

import pytest

from specdecode.config import GenerationConfig
from specdecode.drafters import DraftModelDrafter
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.engine.batched import BatchedSpeculativeDecoder
from specdecode.engine.decoder import SpeculativeDecoder
from specdecode.engine.stats import BatchStats, SpecDecodingStats
from conftest import make_tiny_model


def test_batch_stats_is_the_same_class():
    assert BatchStats is SpecDecodingStats


def test_tau_counts_the_bonus_token_per_row_forward():
    s = SpecDecodingStats()
    s.record_block(4, 4)
    s.record_block(4, 1)
    s.record_block(0, 0)  # a plain step (gated, or the budget left no room to draft)
    assert s.num_target_forwards == s.num_row_rounds == 3
    assert s.mean_accepted_tokens == pytest.approx((5 + 3) / 3)
    assert s.mean_accepted_draft_tokens == pytest.approx(5 / 2)
    assert s.acceptance_rate == pytest.approx(5 / 8)
    d = s.to_dict()
    assert d["mean_accepted_tokens"] == s.mean_accepted_tokens and d["mean_accepted_tokens_counts_bonus"] is True


def test_single_and_batched_report_the_same_tau():
    """The same prompts and draft give the same per-row counts, so the same τ, in both engines; the
    batched engine's lifetime stats are the sum of its rows'."""
    target, draft = make_tiny_model("llama", seed=0), make_tiny_model("llama", seed=1)
    config = GenerationConfig(max_new_tokens=17, num_speculative_tokens=3, stop_on_eos=False)
    prompts = [[1, 5, 9, 2], [7, 3, 3, 3, 8, 1]]
    single = [SpeculativeDecoder(target, DraftModelDrafter(draft)).generate(p, config) for p in prompts]
    engine = BatchedSpeculativeDecoder(
        target, DraftModelDrafter(draft), max_batch_size=2, max_length=64, num_speculative_tokens=3
    )
    batched = engine.generate(prompts, config)
    for one, row in zip(single, batched):
        assert row.token_ids == one.token_ids
        assert row.stats.mean_accepted_tokens == pytest.approx(one.stats.mean_accepted_tokens)
        assert row.stats.num_prefills == one.stats.num_prefills == 1
    life = engine.stats
    assert life.num_target_forwards == sum(r.stats.num_target_forwards for r in batched)
    assert life.num_accepted_tokens == sum(r.stats.num_accepted_tokens for r in batched)
    assert life.num_prompt_tokens == sum(len(p) for p in prompts)
    assert life.drafted_by_position == [sum(x) for x in zip(*(r.stats.drafted_by_position for r in batched))]
    assert life.num_rounds == max(r.stats.num_rounds for r in batched)
    assert life.max_rows == 2
