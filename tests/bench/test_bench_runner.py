"""specdecode.bench.run_bench: a whole bench on tiny random models (seconds, no download)."""

from __future__ import annotations

import json
import math

import pytest

from bench_helpers import PROMPTS, SMALL, _lines, generator  # noqa: F401
from conftest import make_tiny_model, make_tiny_tokenizer
from specdecode import bench
from specdecode.bench import BenchSettings, run_bench
from specdecode.bench.datasets import Prompt
from specdecode.errors import InvalidArgumentError
from specdecode.models import LoadedModel
from specdecode.pipeline import SpeculativeGenerator


def test_bench_writes_reports_with_the_right_fields(generator, tmp_path):
    methods = ["hf-generate", "autoregressive", "draft"]
    out = tmp_path / "out"
    ticks = []
    results = run_bench(generator, PROMPTS, methods, BenchSettings(**SMALL), out,
                        progress=lambda done, total, what: ticks.append((done, total)))
    for name in ("results.json", "results.md", "speedup_by_category.png", "acceptance_by_position.png",
                 "records.jsonl", "settings.json"):
        assert (out / name).is_file(), name
    for png in ("speedup_by_category.png", "acceptance_by_position.png"):
        data = (out / png).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000
    assert ticks[0] == (0, 6) and ticks[-1] == (6, 6)

    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["summary"] == json.loads(json.dumps(results["summary"]))
    records = on_disk["records"]
    assert len(records) == 6 == len(_lines(out / "records.jsonl"))
    assert {(r["method"], r["prompt_id"]) for r in records} == {(m, p.id) for m in methods for p in PROMPTS}
    for r in records:
        assert 1 <= r["new_tokens"] == len(r["token_ids"]) <= 6
        assert r["seconds"] > 0 and r["tokens_per_s"] == pytest.approx(r["new_tokens"] / r["seconds"])
        assert r["peak_rss_mb"] > 10
        assert r["prompt_tokens"] == len(next(p for p in PROMPTS if p.id == r["prompt_id"]).text.split())

    # float32, same weights: every method gives autoregressive's tokens
    ar = {r["prompt_id"]: r["token_ids"] for r in records if r["method"] == "autoregressive"}
    for r in records:
        assert r["token_ids"] == ar[r["prompt_id"]]
        assert r["exact_match"] is (None if r["method"] == "autoregressive" else True)

    s = on_disk["summary"]
    assert set(s) == set(methods)
    for m in methods:
        assert set(s[m]) == {"code", "chat", "overall"}
        # overall tokens/s = total tokens / total seconds of that method
        rs = [r for r in records if r["method"] == m]
        assert s[m]["overall"]["tokens_per_s"] == pytest.approx(
            sum(r["new_tokens"] for r in rs) / math.fsum(r["seconds"] for r in rs))
        assert s[m]["overall"]["tokens_per_s_min"] == s[m]["overall"]["tokens_per_s"]  # one repeat
    for cat in ("code", "chat", "overall"):
        base = max(s["hf-generate"][cat]["tokens_per_s"], s["autoregressive"][cat]["tokens_per_s"])
        for m in methods:
            assert s[m][cat]["speedup"] == pytest.approx(s[m][cat]["tokens_per_s"] / base)
        assert on_disk["baselines_used"][cat] in ("hf-generate", "autoregressive")
    ov = {m: s[m]["overall"] for m in methods}
    assert ov["draft"]["acceptance_rate"] == 1.0  # identical draft
    assert ov["draft"]["mean_accepted_tokens"] > 1.0
    assert ov["draft"]["target_forwards_per_token"] < 1.0
    assert ov["draft"]["acceptance_by_position"][0] == 1.0
    assert ov["draft"]["exact_match_rate"] == 1.0 and ov["draft"]["compared"] == 2
    assert ov["hf-generate"]["exact_match_rate"] == 1.0
    for m in ("autoregressive", "hf-generate"):
        assert ov[m]["acceptance_rate"] is None
        assert ov[m]["mean_accepted_tokens"] == 1.0
        assert ov[m]["target_forwards_per_token"] == 1.0  # the forward hook counts hf's forwards
    assert ov["autoregressive"]["exact_match_rate"] is None  # the reference itself

    env = on_disk["environment"]
    assert env["torch_threads"] >= 1 and env["dtype"] == "float32" and env["transformers"]
    assert on_disk["identity"]["max_new_tokens"] == 6 and on_disk["identity"]["target"] == "tiny-target"
    assert on_disk["methods"]["hf-generate"]["generation_config"]["do_sample"] is False

    md = (out / "results.md").read_text()
    assert "| Method | code speedup | chat speedup |" in md
    for m in methods:
        assert f"| `{m}` |" in md
    draft_row = next(line for line in md.splitlines() if line.startswith("| `draft` |"))
    assert "100.0%" in draft_row


def test_hf_assisted_records_transformers_defaults(generator, tmp_path):
    results = run_bench(generator, PROMPTS[:1], ["autoregressive", "hf-assisted", "hf-prompt-lookup"],
                        BenchSettings(**SMALL), tmp_path)
    conf = results["methods"]["hf-assisted"]["assistant_generation_config"]
    assert conf == {"num_assistant_tokens": 20, "num_assistant_tokens_schedule": "constant",
                    "assistant_confidence_threshold": 0.4}
    assert results["methods"]["hf-prompt-lookup"]["generation_config"]["prompt_lookup_num_tokens"] == 10
    s = results["summary"]
    assert s["hf-assisted"]["overall"]["acceptance_rate"] == 1.0  # identical draft
    assert s["hf-assisted"]["overall"]["exact_match_rate"] == 1.0
    assert s["hf-prompt-lookup"]["overall"]["exact_match_rate"] == 1.0
    # the draft's generation config is restored afterwards
    assert generator.draft.model.generation_config.num_assistant_tokens is None


def test_sampling_uses_per_prompt_seeds(generator, tmp_path):
    settings = BenchSettings(max_new_tokens=6, warmup_tokens=2, temperature=1.0, seed=3)
    results = run_bench(generator, PROMPTS, ["hf-generate", "autoregressive"], settings, tmp_path)
    seeds = {(r["method"], r["prompt_id"]): r["seed"] for r in results["records"]}
    assert seeds[("hf-generate", "t/1")] == seeds[("autoregressive", "t/1")] == bench.prompt_seed(3, "t/1", 0)
    assert seeds[("autoregressive", "t/1")] != seeds[("autoregressive", "t/2")]
    assert results["methods"]["hf-generate"]["generation_config"]["top_k"] == 0


def test_no_prompts_and_duplicate_ids(generator, tmp_path):
    with pytest.raises(InvalidArgumentError, match="no prompts"):
        run_bench(generator, [], ["autoregressive"], BenchSettings(**SMALL), tmp_path)
    with pytest.raises(InvalidArgumentError, match="'t/1' appears 2 times"):
        run_bench(generator, [PROMPTS[0], PROMPTS[0]], ["autoregressive"], BenchSettings(**SMALL), tmp_path)


def test_prompt_cache_changes_no_token_and_is_recorded(generator, tmp_path):
    """Every method starts from a copy of one encoded prefix; float32 outputs equal the uncached run's."""
    methods = ["hf-generate", "autoregressive", "draft", "prompt-lookup"]
    cached = run_bench(generator, PROMPTS, methods, BenchSettings(**SMALL), tmp_path / "a")
    plain = run_bench(generator, PROMPTS, methods, BenchSettings(**SMALL, prompt_cache=False), tmp_path / "b")
    tokens = {(r["method"], r["prompt_id"]): r["token_ids"] for r in plain["records"]}
    for r in cached["records"]:
        assert r["token_ids"] == tokens[(r["method"], r["prompt_id"])], r["method"]
        assert r["prompt_cache_tokens"] == r["prompt_tokens"] - 1 and r["prompt_cache_s"] > 0
    for r in plain["records"]:
        assert r["prompt_cache_tokens"] == 0 and r["prompt_cache_s"] is None
    for results in (cached, plain):
        assert results["summary"]["hf-generate"]["overall"]["target_forwards_per_token"] == 1.0
        assert results["summary"]["draft"]["overall"]["acceptance_rate"] == 1.0
    assert cached["identity"]["prompt_cache"] is True and plain["identity"]["prompt_cache"] is False


def test_prompt_cache_is_off_with_transformers_assisted_methods(generator, tmp_path):
    """transformers' assisted step re-feeds the whole prompt on its first step, so those runs time whole prompts."""
    results = run_bench(generator, PROMPTS[:1], ["autoregressive", "hf-assisted"], BenchSettings(**SMALL), tmp_path)
    assert results["identity"]["prompt_cache"] is False
    assert all(r["prompt_cache_tokens"] == 0 for r in results["records"])
    assert results["summary"]["hf-assisted"]["overall"]["acceptance_rate"] == 1.0
    with pytest.raises(InvalidArgumentError, match=r"hf-prompt-lookup cannot start from a cached prompt"):
        run_bench(generator, PROMPTS[:1], ["autoregressive", "hf-prompt-lookup"],
                  BenchSettings(**SMALL, prompt_cache=True), tmp_path / "b")


def test_hf_generate_static_gives_hf_generate_tokens_and_compiles_in_the_warmup(generator, tmp_path):
    """transformers' static cache + compiled forward (compiled on CPU too), from the prompt cache and
    from whole prompts: float32 greedy tokens equal hf-generate's; the compile time shows in warmup_s."""
    from torch._dynamo.utils import counters

    methods = ["hf-generate", "hf-generate-static", "autoregressive"]
    graphs_after_warmup = []

    def progress(done, total, what):
        if done == 1:  # the warm-ups are over
            graphs_after_warmup.append(counters["stats"]["unique_graphs"])

    eager = dict(SMALL, compile=False)  # our own loop eager: only transformers compiles here
    cached = run_bench(generator, PROMPTS, methods, BenchSettings(**eager), tmp_path / "a", progress=progress)
    assert counters["stats"]["unique_graphs"] == graphs_after_warmup[0]  # no prompt compiled anything
    plain = run_bench(generator, PROMPTS, methods, BenchSettings(**eager, prompt_cache=False), tmp_path / "b")
    assert cached["identity"]["prompt_cache"] is True and plain["identity"]["prompt_cache"] is False
    for results in (cached, plain):
        tokens = {(r["method"], r["prompt_id"]): r["token_ids"] for r in results["records"]}
        for p in PROMPTS:
            assert tokens[("hf-generate-static", p.id)] == tokens[("hf-generate", p.id)], p.id
        static = results["methods"]["hf-generate-static"]
        assert static["forward_compiled"] is True
        assert static["generation_config"]["cache_implementation"] == "static"
        longest = max(len(p.text.split()) for p in PROMPTS)
        assert static["generation_config"]["max_cache_len"] == longest + SMALL["max_new_tokens"]
        assert results["summary"]["hf-generate-static"]["overall"]["target_forwards_per_token"] == 1.0
        assert results["baselines_used"]["overall"] in methods
        for m in methods:
            assert results["methods"][m]["warmup_s"] > 0
    # the first run compiled in its warm-up, so its warm-up took longer than any of its timed generations
    static_records = [r for r in cached["records"] if r["method"] == "hf-generate-static"]
    assert cached["methods"]["hf-generate-static"]["warmup_s"] > max(r["seconds"] for r in static_records)
    md = (tmp_path / "a" / "results.md").read_text()
    assert "| Peak RSS MB | Warm-up s |" in md
    row = next(line for line in md.splitlines() if line.startswith("| `hf-generate-static` |"))
    assert row.rstrip(" |").split("| ")[-1] == f"{cached['methods']['hf-generate-static']['warmup_s']:.1f}"


def test_warmup_s_is_none_for_a_method_with_nothing_left_to_run(generator, tmp_path):
    settings = BenchSettings(**SMALL)
    first = run_bench(generator, PROMPTS[:1], ["autoregressive"], settings, tmp_path)
    assert first["methods"]["autoregressive"]["warmup_s"] > 0
    again = run_bench(generator, PROMPTS[:1], ["autoregressive", "prompt-lookup"], settings, tmp_path)
    assert again["methods"]["autoregressive"]["warmup_s"] is None  # resumed: all its records were done
    assert again["methods"]["prompt-lookup"]["warmup_s"] > 0


def test_a_prompt_past_the_context_length_is_refused_before_anything_runs(tmp_path):
    """max_position_embeddings 16: 7 prompt tokens + 10 new ones = 17 positions, one too many."""
    tok = make_tiny_tokenizer()
    short = SpeculativeGenerator(LoadedModel(make_tiny_model("qwen2", 2, max_position_embeddings=16), tok, "short"))
    prompts = [Prompt("fits", "a", "w5 w9 w12"), Prompt("long", "a", "w5 w9 w12 w7 w5 w9 w12")]
    with pytest.raises(InvalidArgumentError, match=r"prompt 'long': the prompt has 7 tokens and max_new_tokens is "
                                                   r"10: 17 positions, past the model's context length of 16"):
        run_bench(short, prompts, ["hf-generate", "autoregressive"], BenchSettings(max_new_tokens=10),
                  tmp_path / "o")
    assert not (tmp_path / "o").exists()  # nothing written, nothing run
    results = run_bench(short, prompts, ["hf-generate", "autoregressive"],
                        BenchSettings(max_new_tokens=9, warmup_tokens=2), tmp_path / "ok")  # 16: exactly fits
    assert len(results["records"]) == 4
