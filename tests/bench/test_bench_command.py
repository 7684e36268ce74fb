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
