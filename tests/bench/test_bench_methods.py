"""specdecode.bench.methods and settings: method names, variants, drafter options, requirements."""

from __future__ import annotations

import pytest

from bench_helpers import PROMPTS, SMALL, SMALL_GAMMA, generator, target_only  # noqa: F401
from specdecode import bench, pipeline
from specdecode.bench import BenchSettings, run_bench
from specdecode.errors import InvalidArgumentError
from specdecode.pipeline import SpeculativeGenerator


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


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(repeats=0), "repeats must be an integer >= 1, got 0"),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    (dict(temperature=-1.0), "temperature must be"),
    (dict(drafter_options={"bad key": 1}), "drafter option names"),
    # once accepted here and refused by torch after the models loaded
    (dict(seed=2**64), r"seed must be an integer in -9223372036854775808..18446744073709551615 .* got "
                       r"18446744073709551616"),
    (dict(seed=-(2**63) - 1), r"seed must be an integer in -9223372036854775808\.\..* got -9223372036854775809"),
    (dict(seed=False), r"seed must be an integer .* got False"),
])
def test_settings_validation(kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        BenchSettings(**kwargs)


def test_a_negative_bench_seed_is_accepted():
    assert BenchSettings(seed=-(2**63)).seed == -(2**63)


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
    ("autoregressive:compile=2", r"'autoregressive:compile=2': compile=2 is not allowed; use compile=0 or compile=1"),
    ("draft:compile=yes", r"compile='yes' is not allowed; use compile=0 or compile=1 \(or false/true\)"),
    ("autoregressive:compile=1,exit_layer=2", r"'autoregressive' takes no options or modifiers but compile=0\|1"),
    ("autoregressive:compile=1+adaptive", r"'autoregressive' takes no options or modifiers but compile=0\|1"),
    ("hf-generate:compile=1", r"'hf-generate' takes no options or modifiers .* use 'hf-generate-static'"),
    ("draft:draft_exit_mode=masked", r"draft_exit_mode applies to the adaptive draft exit; add \+adaptive"),
    ("draft:draft_exit_mode=lagged+adaptive", r"unknown draft exit mode 'lagged'; allowed: per-step, previous-round"),
])
def test_bad_method_variants(name, match):
    with pytest.raises(InvalidArgumentError, match=match):
        bench.check_method_names([name])


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


def test_draft_exit_mode_option_sets_the_control():
    spec = bench.MethodSpec.parse("draft:draft_exit_mode=masked+adaptive")
    assert spec.base == "draft" and not spec.options
    assert spec.draft_control.adaptive_exit and spec.draft_control.exit_mode == "masked"


@pytest.mark.parametrize("name, base, compile_, gamma", [
    ("autoregressive:compile=0", "autoregressive", False, None),
    ("autoregressive:compile=1", "autoregressive", True, None),
    ("autoregressive:compile=true", "autoregressive", True, None),
    ("draft:compile=False,num_speculative_tokens=2", "draft", False, 2),
    ("early-exit:exit_layer=2", "early-exit", None, None),
])
def test_compile_option_parses(name, base, compile_, gamma):
    spec = bench.MethodSpec.parse(name)
    assert (spec.base, spec.compile, spec.num_speculative_tokens) == (base, compile_, gamma)
    assert "compile" not in spec.options  # a setting of the decoder, not a drafter option


class _CompileRecordingGenerator(SpeculativeGenerator):
    """Records the ``compile`` each decoder is asked for, and builds it eager (the fast path is not under test)."""

    def __init__(self, target, draft=None) -> None:
        super().__init__(target, draft)
        self.asked: list[tuple[str, object]] = []

    def decoder(self, method: str = "draft", **options):
        self.asked.append((method, options.pop("compile", "unset")))
        return super().decoder(method, **options, compile=False)


@pytest.mark.parametrize("run_wide", [None, False, True])
def test_compile_reaches_the_decoder(generator, run_wide):
    """A method's compile=0|1 wins; otherwise the run-wide setting; unset stays unset (the device default)."""
    gen = _CompileRecordingGenerator(generator.target, generator.draft)
    methods = ["autoregressive", "autoregressive:compile=0", "autoregressive:compile=1", "draft:compile=0", "draft"]
    runners, _ = bench.resolve_methods(gen, methods, BenchSettings(**SMALL, compile=run_wide))
    default = "unset" if run_wide is None else run_wide
    assert gen.asked == [("autoregressive", default), ("autoregressive", False), ("autoregressive", True),
                         ("draft", False), ("draft", default)]
    described = {name: runner.describe() for name, runner in runners.items()}
    assert described["autoregressive:compile=1"]["compile"] is True
    assert described["autoregressive"]["compile"] is run_wide
    assert described["draft:compile=0"]["drafter_options"] == {}


def test_compile_setting_validation_and_identity(generator):
    with pytest.raises(InvalidArgumentError, match="compile must be True, False or None"):
        BenchSettings(compile=1)
    with pytest.raises(InvalidArgumentError, match="drafter option compile=1: .* NAME:compile=0|1"):
        BenchSettings(drafter_options={"compile": 1})
    # only a run that sets the fast path names it, so folders made before the setting still resume
    assert "compile" not in bench.run_identity(generator, BenchSettings(**SMALL))
    assert bench.run_identity(generator, BenchSettings(**SMALL, compile=False))["compile"] is False
    assert BenchSettings(**SMALL, compile=True).to_dict()["compile"] is True


def test_hf_generate_static_compiles_on_every_device(target_only):
    runners, _ = bench.resolve_methods(target_only, ["hf-generate-static"], BenchSettings(**SMALL), max_positions=40)
    described = runners["hf-generate-static"].describe()
    config = described["generation_config"]
    assert config["cache_implementation"] == "static" and config["max_cache_len"] == 40
    assert config["compile_config"]["compile_all_devices"] is True
    assert config["compile_config"]["backend"] == "inductor"
    hf_config = runners["hf-generate-static"].generation_config(6)
    assert hf_config.compile_config._compile_all_devices is True  # what makes generate compile on CPU
    assert runners["hf-generate-static"].supports_prompt_cache
