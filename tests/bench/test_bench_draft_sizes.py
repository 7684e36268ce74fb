"""The bench reports each method's draft size per round (mean, the cost model's cap, a histogram in the plots) and
its acceptance by depth, in the records, results.json and the table: tiny models, and hand numbers."""

from __future__ import annotations

import json

import pytest

from bench_helpers import PROMPTS, SMALL, generator  # noqa: F401
from specdecode.bench import DRAFT_SIZES_PNG, BenchSettings, run_bench
from specdecode.bench.methods import MethodSpec
from specdecode.bench.report import markdown_report, summarize


def _record(method, sizes, caps, drafted_pos, accepted_pos, **kw):
    return {"method": method, "category": "code", "prompt_id": kw.get("prompt_id", "p"), "repeat": 0,
            "new_tokens": 10, "seconds": 1.0, "drafted": sum(n * c for n, c in enumerate(sizes)), "accepted": 0,
            "verify_tokens": sum(sizes), "verify_forwards": sum(sizes), "target_forwards": sum(sizes) + 1,
            "token_ids": [1] * 10, "exact_match": None, "first_divergence": None,
            "rounds_by_draft_size": sizes, "rounds_by_draft_cap": caps,
            "drafted_by_position": drafted_pos, "accepted_by_position": accepted_pos}


def test_mean_draft_size_and_acceptance_by_depth_by_hand():
    # Two generations: sizes {0: 2, 2: 1, 3: 1} and {1: 2, 3: 2}: (2 + 3 + 2 + 6) / 8 = 1.625 per verification.
    # Caps: {3: 4} and {3: 4}: 3. Depth 1: 5 of 6 accepted; depth 2: 2 of 4; depth 3: 1 of 3.
    records = [_record("m", [2, 0, 1, 1], [0, 0, 0, 4], [2, 2, 1], [2, 1, 0], prompt_id="a"),
               _record("m", [0, 2, 0, 2], [0, 0, 0, 4], [4, 2, 2], [3, 1, 1], prompt_id="b")]
    overall = summarize(records)["methods"]["m"]["overall"]
    assert overall["draft_size_histogram"] == [2, 2, 1, 3]
    assert overall["mean_draft_size"] == pytest.approx(13 / 8)
    assert overall["mean_draft_cap"] == pytest.approx(3.0)
    assert overall["acceptance_by_position"] == pytest.approx([5 / 6, 2 / 4, 1 / 3])
    md = markdown_report({"summary": summarize(records)["methods"], "categories": ["code"]})
    row = next(line for line in md.splitlines() if line.startswith("| `m` |"))
    assert "| 0.83/0.50/0.33 |" in row and "| 1.62 (3.00) |" in row
    assert "α by depth 1/2/3/4" in md and "Draft size (cap)" in md
    # Records without the fields (transformers' and llama.cpp's methods) give None, not an error.
    bare = {k: v for k, v in records[0].items() if k not in ("rounds_by_draft_size", "rounds_by_draft_cap")}
    assert summarize([bare])["methods"]["m"]["overall"]["mean_draft_size"] is None


def test_the_cost_model_modifier_parses():
    spec = MethodSpec.parse("prompt-lookup+cost-model")
    assert spec.base == "prompt-lookup" and spec.draft_control.length_schedule == "cost-model"
    assert spec.draft_control.cost_policy is not None


def test_the_bench_records_draft_sizes_and_plots_them(generator, tmp_path):  # noqa: F811
    methods = ["autoregressive", "draft", "prompt-lookup+cost-model", "token-recycling"]
    out = tmp_path / "out"
    run_bench(generator, PROMPTS, methods, BenchSettings(**SMALL), out)
    data = (out / DRAFT_SIZES_PNG).read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000
    on_disk = json.loads((out / "results.json").read_text())
    for r in on_disk["records"]:
        sizes, caps = r["rounds_by_draft_size"], r["rounds_by_draft_cap"]
        assert sum(sizes) == sum(caps) == r["verify_forwards"]  # one entry per verification
        assert sum(n * c for n, c in enumerate(sizes)) == r["drafted"]
        if r["method"] == "autoregressive":
            assert sizes == [r["verify_forwards"]] and caps == [r["verify_forwards"]]  # plain steps only
    s = {m: on_disk["summary"][m]["overall"] for m in methods}
    assert s["autoregressive"]["mean_draft_size"] == 0.0
    # The draft is the target (acceptance 1): depth 1 always accepted; a chain drafts γ but near the end.
    assert s["draft"]["acceptance_by_position"][0] == 1.0 and s["draft"]["mean_draft_size"] > 1.0
    assert s["draft"]["mean_draft_cap"] >= s["draft"]["mean_draft_size"]
    assert s["token-recycling"]["mean_draft_size"] > 0
    md = (out / "results.md").read_text()
    draft_row = next(line for line in md.splitlines() if line.startswith("| `draft` |"))
    assert "| 1.00/" in draft_row
