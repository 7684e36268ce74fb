"""specdecode.bench.report: the arithmetic of the tables, with hand numbers."""

from __future__ import annotations

import pytest

from specdecode import bench
from specdecode.bench import first_divergence, speedups, tokens_per_second


def test_tokens_per_second_is_total_tokens_over_total_seconds():
    # 100 tokens in 10 s and 50 in 2 s: 150 / 12 = 12.5 tok/s, not the mean of 10 and 25.
    assert tokens_per_second([100, 50], [10.0, 2.0]) == pytest.approx(12.5)
    assert tokens_per_second([3], [0.0]) is None
    assert tokens_per_second([], []) is None


def test_speedup_is_against_the_faster_baseline():
    sp, base = speedups({"hf-generate": 10.0, "autoregressive": 12.5, "draft": 25.0, "x": None})
    assert base == "autoregressive"
    assert sp == {"hf-generate": pytest.approx(0.8), "autoregressive": 1.0, "draft": pytest.approx(2.0), "x": None}
    # a faster hf-generate becomes the baseline: our loop cannot be flattered by a slow one
    sp, base = speedups({"hf-generate": 20.0, "autoregressive": 12.5, "draft": 25.0})
    assert base == "hf-generate"
    assert sp["draft"] == pytest.approx(1.25) and sp["autoregressive"] == pytest.approx(0.625)
    # only one baseline measured
    sp, base = speedups({"autoregressive": 4.0, "draft": 6.0})
    assert (base, sp["draft"]) == ("autoregressive", pytest.approx(1.5))
    # none measured
    assert speedups({"draft": 6.0}) == ({"draft": None}, None)


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 4], [1, 2, 3]) == 2
    assert first_divergence([9, 2, 3], [1, 2, 3]) == 0
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # a prefix diverges where it ends
    assert first_divergence([1, 2, 3, 4], [1, 2, 3]) == 3


def test_every_target_only_method_is_a_baseline():
    """hf-generate-static and autoregressive's compile variants count; speculative methods and llama.cpp do not."""
    assert bench.is_baseline("hf-generate-static") and bench.is_baseline("autoregressive:compile=1")
    assert not bench.is_baseline("draft") and not bench.is_baseline("draft:compile=1")
    assert not bench.is_baseline("llama-cpp")
    sp, base = speedups({"hf-generate": 10.0, "hf-generate-static": 20.0, "autoregressive:compile=0": 8.0,
                         "autoregressive:compile=1": 25.0, "draft": 50.0, "llama-cpp": 60.0})
    assert base == "autoregressive:compile=1" and sp["draft"] == pytest.approx(2.0)
    sp, base = speedups({"hf-generate": 10.0, "hf-generate-static": 20.0, "autoregressive": 12.5, "draft": 30.0})
    assert base == "hf-generate-static" and sp["draft"] == pytest.approx(1.5)


def test_the_quantization_line_names_an_int4_lm_head():
    from specdecode.bench.report import _quantized

    assert _quantized({}) == ""
    assert _quantized({"quantize": "none", "draft_quantize": "int4"}) == " (draft: int4 weights)"  # int8 head
    assert _quantized({"quantize": "none", "draft_quantize": "int4", "draft_quantize_head": "int4"}) == (
        " (draft: int4 weights and LM head)")
    assert _quantized({"quantize": "int4", "draft_quantize": "int4", "draft_quantize_head": "int4"}) == (
        " with int4 weight-only quantized linear layers (draft: int4 weights and LM head)")
