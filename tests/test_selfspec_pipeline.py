"""The new methods through ``SpeculativeGenerator`` and ``specdecode generate``."""

from __future__ import annotations

import json

import pytest

from conftest import make_tiny_model, make_tiny_tokenizer
from selfspec_helpers import one_thread  # noqa: F401
from specdecode import GenerationConfig, InvalidArgumentError, SpeculativeGenerator
from specdecode.cli import main
from specdecode.drafters.control import DraftControl
from specdecode.drafters import CascadeDrafter, DraftModelDrafter
from specdecode.drafters.early_exit import EarlyExitDrafter
from specdecode.drafters.layer_skip import LayerSkipDrafter, SkipSet
from specdecode.models import LoadedModel
from specdecode.pipeline import METHODS
from specdecode.drafters.prompt_lookup import PromptLookupDrafter

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "w5 w9 w12 w7 w5 w9 w12 w7 w5"


@pytest.fixture(scope="module")
def generator():
    target = LoadedModel(make_tiny_model("qwen2", num_layers=4), make_tiny_tokenizer(), "tiny-qwen2")
    return SpeculativeGenerator(target)  # no draft model


def test_methods_listed():
    assert METHODS == ("autoregressive", "draft", "cascade", "layer-skip", "early-exit", "prompt-lookup",
                       "token-recycling")


def test_make_drafter_for_every_method(generator, tmp_path):
    assert generator.make_drafter("autoregressive") is None
    d = generator.make_drafter("layer-skip", skip_layers="attn=1,3;mlp=2")
    assert isinstance(d, LayerSkipDrafter) and d.skip_set == SkipSet(attn=(1, 3), mlp=(2,))
    cfg = tmp_path / "skip.json"
    cfg.write_text(json.dumps({"model": "tiny", "skip_set": {"attn": [0], "mlp": [3]}}))
    assert generator.make_drafter("layer-skip", skip_config=cfg).skip_set == SkipSet(attn=(0,), mlp=(3,))
    assert generator.make_drafter("layer-skip", skip_set=SkipSet(mlp=(1,))).skip_set == SkipSet(mlp=(1,))
    e = generator.make_drafter("early-exit", exit_layer=2)
    assert isinstance(e, EarlyExitDrafter) and e.exit_layer == 2
    p = generator.make_drafter("prompt-lookup", prompt_lookup_max_ngram=4, prompt_lookup_min_ngram=2)
    assert isinstance(p, PromptLookupDrafter) and (p.max_ngram, p.min_ngram) == (4, 2)
    with_draft = SpeculativeGenerator(generator.target, LoadedModel(make_tiny_model("qwen2", 2, seed=3),
                                                                   generator.tokenizer, "tiny-draft"))
    c = with_draft.make_drafter("cascade", prompt_lookup_max_ngram=4, prompt_lookup_min_ngram=2)
    assert isinstance(c, CascadeDrafter) and (c.max_ngram, c.min_ngram) == (4, 2)
    # options another method uses are ignored (one option set can serve a whole benchmark)
    assert isinstance(generator.make_drafter("prompt-lookup", exit_layer=2, skip_layers="attn=1"), PromptLookupDrafter)


@pytest.mark.parametrize(
    "method, kwargs, message",
    [
        ("layer-skip", {}, "method 'layer-skip' needs a skip set"),
        ("layer-skip", dict(skip_layers="attn=1", skip_set=SkipSet(attn=(2,))), "give the layer-skip skip set once"),
        ("layer-skip", dict(skip_layers="attn=4"), "allowed 0..3"),
        ("early-exit", {}, "method 'early-exit' needs exit_layer=N"),
        ("early-exit", dict(exit_layer=4), "exit layer 4 is out of range"),
        ("prompt-lookup", dict(prompt_lookup_min_ngram=3, prompt_lookup_max_ngram=2), "min_ngram (3) must be <="),
        ("draft", {}, "method 'draft' needs a draft model"),
        ("cascade", {}, "method 'cascade' needs a draft model"),
        ("medusa", {}, "unknown method 'medusa'; allowed: autoregressive, draft, cascade, layer-skip, early-exit, "
                       "prompt-lookup"),
    ],
)
def test_make_drafter_errors(generator, method, kwargs, message):
    with pytest.raises(InvalidArgumentError) as e:
        generator.make_drafter(method, **kwargs)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "method, options",
    [
        ("layer-skip", dict(skip_layers="attn=1,2;mlp=3")),
        ("early-exit", dict(exit_layer=2, draft_control=DraftControl(adaptive_exit=True))),
        ("prompt-lookup", dict(draft_control=DraftControl(length_schedule="heuristic"))),
    ],
)
def test_generate_with_new_methods_equals_autoregressive(generator, method, options):
    config = GenerationConfig(max_new_tokens=16, stop_on_eos=False)
    expected = generator.generate(PROMPT, config, method="autoregressive").token_ids
    result = generator.generate(PROMPT, config, method=method, **options)
    assert result.token_ids == expected
    assert result.stats.num_drafted_tokens > 0
    assert generator.decoder(method, **options).drafter is not None


def _run_cli(monkeypatch, capsys, generator, *argv):
    seen = {}

    def fake_from_pretrained(target, draft=None, **kw):
        seen["draft"] = draft
        return generator

    monkeypatch.setattr(SpeculativeGenerator, "from_pretrained", staticmethod(fake_from_pretrained))
    code = main(["generate", "--target", "tiny", "--prompt", PROMPT, "--max-new-tokens", "12", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err, seen


def test_cli_layer_skip_json(monkeypatch, capsys, generator):
    code, out, err, seen = _run_cli(
        monkeypatch, capsys, generator, "--method", "layer-skip", "--skip-layers", "attn=1,2;mlp=3",
        "--adaptive-draft-exit", "--confidence-gate", "0.05", "--json",
    )
    assert code == 0, err
    assert seen["draft"] is None  # no draft model is loaded for a self-speculative method
    data = json.loads(out)
    assert data["method"] == "layer-skip" and data["skip_layers"] == "attn=1,2;mlp=3"
    assert data["draft_control"]["adaptive_exit"] is True and data["draft_control"]["confidence_gate"] == 0.05
    stats = data["stats"]
    assert isinstance(stats["final_draft_threshold"], float) and isinstance(stats["num_gated_steps"], int)
    assert len(data["token_ids"]) == 12


def test_cli_prints_threshold_and_gated_steps(monkeypatch, capsys, generator, tmp_path):
    cfg = tmp_path / "skip.json"
    cfg.write_text('{"attn": [2], "mlp": [1]}')
    code, out, err, _ = _run_cli(
        monkeypatch, capsys, generator, "--method", "layer-skip", "--skip-config", str(cfg),
        "--adaptive-draft-exit", "--draft-length-schedule", "heuristic", "--confidence-gate", "0.05",
    )
    assert code == 0, err
    assert "final adaptive draft-exit threshold" in out and "gated steps" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--method", "layer-skip"], "--method layer-skip needs a skip set"),
        (["--method", "layer-skip", "--skip-layers", "attn=1;ffn=2"], "part 'ffn=2' must be"),
        (["--method", "layer-skip", "--skip-layers", "attn=9"], "allowed 0..3"),
        (["--method", "early-exit"], "--method early-exit needs --exit-layer N"),
        (["--method", "early-exit", "--exit-layer", "4"], "exit layer 4 is out of range"),
        (["--method", "prompt-lookup", "--prompt-lookup-min-ngram", "0"], "min_ngram must be an integer >= 1"),
        (["--method", "prompt-lookup", "--adaptive-draft-exit"],
         "--adaptive-draft-exit needs a method whose drafts carry probabilities; 'prompt-lookup' has none"),
        (["--method", "early-exit", "--exit-layer", "1", "--confidence-gate", "1.5"],
         "confidence gate threshold must be a number in [0, 1], got 1.5"),
    ],
)
def test_cli_errors(monkeypatch, capsys, generator, argv, message):
    code, out, err, _ = _run_cli(monkeypatch, capsys, generator, *argv)
    assert code == 2
    assert message in err and out == ""


def test_draft_method_still_uses_the_draft_model():
    target = LoadedModel(make_tiny_model("llama", num_layers=2), make_tiny_tokenizer(), "t")
    draft = LoadedModel(make_tiny_model("llama", num_layers=1, seed=3), make_tiny_tokenizer(), "d")
    assert isinstance(SpeculativeGenerator(target, draft).make_drafter("draft"), DraftModelDrafter)
