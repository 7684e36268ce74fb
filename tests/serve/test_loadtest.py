"""The soak driver: its arithmetic, its input checks, and one short soak of a real server on tiny models."""

from __future__ import annotations

import json
import re

import pytest

from serve_helpers import tiny_chat_folders
from specdecode.errors import InvalidArgumentError
from specdecode.serve.loadtest import (
    SoakSettings, _Record, parse_token_range, passed, percentile, rss_trend, run_soak, summarize,
)


@pytest.mark.parametrize(("text", "expected"), [("5", (5, 5)), ("16:64", (16, 64)), ("1:1", (1, 1))])
def test_token_ranges(text, expected):
    assert parse_token_range(text) == expected


@pytest.mark.parametrize("text", ["0:5", "5:2", "abc", "1:2:3", "", "-3"])
def test_bad_token_ranges_name_the_value(text):
    with pytest.raises(InvalidArgumentError, match=re.escape(repr(text))):
        parse_token_range(text)


def test_percentiles_interpolate():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)


def test_rss_trend_ignores_warmup_and_fits_a_slope():
    samples = [(0.0, 100.0), (10.0, 900.0)] + [(60.0 + t, 1000.0 + t / 60) for t in range(0, 600, 10)]
    trend = rss_trend(samples, warmup_s=60)
    assert trend["rss_after_warmup_mb"] == 1000.0 and trend["rss_max_mb"] == pytest.approx(1000.0 + 590 / 60)
    assert trend["rss_slope_mb_per_min"] == pytest.approx(1.0)
    assert trend["rss_growth_pct"] == pytest.approx(100 * (590 / 60) / 1000)


def test_summary_counts_errors_lost_and_tokens():
    ok = _Record(0.0, 8, ttft_s=1.0, gaps_s=[0.5, 0.5], end_s=3.0, completion_tokens=5, finish_reason="length",
                 speculative={"num_drafted_tokens": 10, "num_accepted_tokens": 5, "mean_accepted_tokens": 2.0})
    failed = [_Record(0.0, 8, end_s=1.0, error="APIError: boom") for _ in range(2)]
    lost = _Record(0.0, 8)
    s = summarize([ok, *failed, lost], [(0.0, 1.0)], wall_s=10.0, warmup_s=0)
    assert (s["requests_started"], s["requests_completed"], s["requests_errored"], s["requests_lost"]) == (4, 1, 2, 1)
    assert s["errors"] == [{"error": "APIError: boom", "count": 2}]
    assert s["total_tokens_per_s"] == 0.5 and s["acceptance_rate"] == 0.5 and s["ttft_s_p50"] == 1.0
    assert s["time_per_output_token_s_p50"] == pytest.approx(0.5)
    assert not passed({"summary": s, "shutdown": {"clean": True}})


def test_bad_settings_are_refused():
    with pytest.raises(InvalidArgumentError, match="clients"):
        SoakSettings(clients=0)
    with pytest.raises(InvalidArgumentError, match="--max-tokens"):
        SoakSettings(max_tokens=(4, 2))


def test_a_short_soak_of_a_real_server_passes(tmp_path):
    target, draft = tiny_chat_folders(tmp_path / "models")
    settings = SoakSettings(
        server_args=["--target", str(target), "--draft", str(draft), "--dtype", "float32", "--device", "cpu",
                     "--max-batch-size", "2", "--max-length", "256", "--shutdown-timeout", "2"],
        clients=4, duration_s=60, max_requests=10, max_tokens=(4, 24), warmup_s=0, rss_interval_s=0.5,
        out=str(tmp_path / "soak"), prompts=["w5 w9 w11", "w7 w8", "w20 w21 w22 w23"], startup_timeout_s=120,
    )
    result = run_soak(settings)
    s = result["summary"]
    assert passed(result), (s, result["shutdown"])
    assert s["requests_started"] == s["requests_completed"] == 10
    assert s["completion_tokens"] > 0 and s["ttft_s_p50"] > 0 and s["rss_end_mb"] > 0
    saved = json.loads((tmp_path / "soak" / "soak.json").read_text())
    assert saved["summary"]["requests_completed"] == 10
    assert "specdecode_requests_total" in (tmp_path / "soak" / "metrics.txt").read_text()
    assert "| total tok/s |" in (tmp_path / "soak" / "soak.md").read_text()
