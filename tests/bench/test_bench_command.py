"""specdecode bench on the command line (``specdecode.cli.main``), on tiny model folders."""

from __future__ import annotations

import json

import pytest

from bench_helpers import _write_jsonl
from conftest import make_tiny_model, make_tiny_tokenizer
from specdecode import cli


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
    assert cli.main(["bench", "--target", str(target), "--draft", "none", "--dataset", data,
                     "--draft-quantize-head", "int8", "--out", str(tmp_path / "o")]) == 2
    assert "--draft-quantize-head needs a draft model (--draft)" in capsys.readouterr().err
    # tree flags without the depth: refused, not a run whose draft-model methods are all skipped
    assert cli.main(["bench", "--target", str(target), "--dataset", data, "--draft-tree-shape", "previous-round",
                     "--out", str(tmp_path / "o")]) == 2
    assert "--draft-tree-shape previous-round shapes a draft tree: give --draft-tree-depth D too" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["bench", "--target", str(target), "--dataset", data, "--draft-tree-depth", "3",
                  "--draft-tree-shape", "eagle", "--out", str(tmp_path / "o")])
    assert "'eagle' is not one of per-round, previous-round" in capsys.readouterr().err


def test_cli_bench_compile_flag_and_variants(model_folders, tmp_path, capsys, monkeypatch):
    """--no-compile is the run-wide setting (in the run identity); a method's compile=1 overrides it.

    The decoders are built eager whatever was asked: this tests the plumbing, not the fast path.
    """
    from specdecode.pipeline import SpeculativeGenerator

    asked = []
    original = SpeculativeGenerator.decoder

    def decoder(self, method="draft", **options):
        asked.append((method, options.pop("compile", "missing")))
        return original(self, method, **options, compile=False)

    monkeypatch.setattr(SpeculativeGenerator, "decoder", decoder)
    monkeypatch.setenv("COLUMNS", "200")  # rich drops the table's columns on a narrow terminal
    target, _ = model_folders
    data = _write_jsonl(tmp_path / "q.jsonl", [{"prompt": "w5 w9 w12"}])
    out = tmp_path / "out"
    argv = ["bench", "--target", str(target), "--draft", "none", "--dataset", data, "--dtype", "float32",
            "--methods", "autoregressive,autoregressive:compile=1", "--no-compile", "--max-new-tokens", "4",
            "--warmup-tokens", "2", "--out", str(out)]
    assert cli.main(argv) == 0
    assert asked == [("autoregressive", False), ("autoregressive", True)]
    results = json.loads((out / "results.json").read_text())
    assert results["identity"]["compile"] is False
    assert results["methods"]["autoregressive:compile=1"]["compile"] is True
    assert all(results["methods"][m]["warmup_s"] > 0 for m in results["methods"])
    printed = capsys.readouterr().out
    assert "warm-up s" in printed and "autoregressive:compile=1" in printed
    # a folder made without the setting is not one made with it
    assert cli.main([*argv[:-1], str(out), "--compile"]) == 2
    assert "compile: False there, True now" in capsys.readouterr().err


@pytest.mark.parametrize("batched", [False, True], ids=["bench", "batched"])
def test_cli_bench_passes_the_draft_quantization_to_the_loader(model_folders, tmp_path, capsys, monkeypatch,
                                                               batched):
    """Both load sites (the per-prompt run and --batch-size) pass --draft-quantize, --draft-quantize-head and
    --quantize-group-size on."""
    from specdecode.errors import SpecDecodeError
    from specdecode.pipeline import SpeculativeGenerator

    asked = []

    def from_pretrained(target, draft, **kwargs):
        asked.append((draft, kwargs))
        raise SpecDecodeError("stopped before loading")

    monkeypatch.setattr(SpeculativeGenerator, "from_pretrained", from_pretrained)
    target, draft = model_folders
    data = _write_jsonl(tmp_path / "q.jsonl", [{"prompt": "w5 w9 w12"}])
    argv = ["bench", "--target", str(target), "--draft", str(draft), "--dataset", data, "--dtype", "float32",
            "--methods", "draft", "--out", str(tmp_path / "out"), *(["--batch-size", "1"] if batched else [])]
    for flags, expected in ((["--draft-quantize", "int4", "--draft-quantize-head", "int8"], ("int4", "int8", None)),
                            (["--quantize", "int4", "--draft-quantize-head", "int4"], (None, "int4", None)),
                            (["--draft-quantize", "int4", "--quantize-group-size", "64"], ("int4", None, 64)),
                            (["--quantize", "int4", "--quantize-group-size", "256"], (None, None, 256)),
                            ([], (None, None, None))):
        assert cli.main([*argv, *flags]) == 2
        assert "stopped before loading" in capsys.readouterr().err
        draft_spec, kwargs = asked.pop()
        assert draft_spec == str(draft)
        assert (kwargs["draft_quantize"], kwargs["draft_quantize_head"], kwargs["quantize_group_size"]) == expected


@pytest.mark.parametrize("flags, message", [
    (["--quantize", "int8", "--draft-quantize-head", "int4"],
     "--draft-quantize-head int4 needs an int4 draft (--draft-quantize int4); the draft here is int8 (as --quantize "
     "int8)"),
    (["--quantize", "int4", "--draft-quantize", "int8", "--draft-quantize-head", "int4"],
     "--draft-quantize-head int4 needs an int4 draft (--draft-quantize int4); the draft here is int8 "
     "(--draft-quantize int8)"),
    (["--draft-quantize-head", "int4"],
     "--draft-quantize-head int4 needs an int4 draft (--draft-quantize int4); the draft here is dense (none: as "
     "--quantize none; unlike generate, bench quantizes the draft only when told)"),
    (["--quantize", "int8", "--draft-quantize", "none", "--draft-quantize-head", "int8"],
     "--draft-quantize-head int8 applies to a quantized draft, but the draft here is dense (none: --draft-quantize "
     "none): it has no quantized LM head, so the flag would be ignored; leave it out or quantize the draft "
     "(--draft-quantize int8 or int4)"),
    (["--quantize-group-size", "64"],
     "--quantize-group-size 64 applies to int4 weights, but neither model is int4: the target is dense (--quantize "
     "none) and the draft dense (as --quantize none; unlike generate, bench quantizes the draft only when told); "
     "leave it out, or make one of them int4 (--quantize int4 or --draft-quantize int4)"),
    (["--quantize", "int8", "--draft-quantize", "none", "--quantize-group-size", "256"],
     "--quantize-group-size 256 applies to int4 weights, but neither model is int4: the target is int8 (--quantize "
     "int8) and the draft dense (--draft-quantize none); leave it out"),
    (["--draft", "none", "--quantize-group-size", "128"],
     "--quantize-group-size 128 applies to int4 weights, but neither model is int4: the target is dense (--quantize "
     "none) and there is no draft model (--draft none); leave it out"),
])
@pytest.mark.parametrize("batched", [False, True], ids=["bench", "batched"])
def test_cli_bench_refuses_quantize_flags_the_models_do_not_fit(model_folders, tmp_path, capsys, monkeypatch, flags,
                                                                message, batched):
    """Before loading, in the flags' words: --draft-quantize-head needs a draft quantized to fit it, and
    --quantize-group-size other than 32 an int4 target or draft."""
    from specdecode.errors import SpecDecodeError
    from specdecode.pipeline import SpeculativeGenerator

    def from_pretrained(*args, **kwargs):
        raise SpecDecodeError("loaded")

    monkeypatch.setattr(SpeculativeGenerator, "from_pretrained", from_pretrained)
    target, draft = model_folders
    data = _write_jsonl(tmp_path / "q.jsonl", [{"prompt": "w5 w9 w12"}])
    assert cli.main(["bench", "--target", str(target), "--draft", str(draft), "--dataset", data, "--methods", "draft",
                     "--out", str(tmp_path / "out"), *(["--batch-size", "1"] if batched else []), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "loaded" not in err
