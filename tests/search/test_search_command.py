"""`specdecode search` (specdecode.search.command) on tiny random models: a search writes a
best.json that generate accepts, the CLI defaults, bad calibration files and options."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

optuna = pytest.importorskip("optuna")

from conftest import make_tiny_model  # noqa: E402
from specdecode import GenerationConfig, SpeculativeDecoder  # noqa: E402
from specdecode import search  # noqa: E402
from specdecode.cli import SEARCH_DEFAULTS, SEARCH_OBJECTIVES, SEARCH_SAMPLERS, main  # noqa: E402
from specdecode.drafters.layer_skip import SkipSet  # noqa: E402
from specdecode.search import SearchSettings, expected_speedup  # noqa: E402
from optuna.trial import TrialState  # noqa: E402

from search_helpers import NUM_LAYERS, _finished, _load_study, _search_args, folders  # noqa: E402,F401


# --- 1. a search writes a best.json that generate accepts -----------------------------------


def test_search_writes_best_json_that_generate_accepts(folders, tmp_path, capsys):
    out = tmp_path / "run" / "best.json"
    code = main(_search_args(folders, out, "--trials", 7, "--remeasure", 2, "--seed", 0))
    stdout, err = capsys.readouterr()
    assert code == 0, err
    best = json.loads(out.read_text())
    for key in ("attn", "mlp", "model", "dtype", "num_layers", "num_speculative_tokens", "objective",
                "modelled", "measured", "num_trials", "study_name", "storage", "selected_by"):
        assert key in best, key
    assert best["model"] == "llama4" and best["dtype"] == "float32" and best["num_layers"] == NUM_LAYERS
    assert best["objective"] == "modelled" and best["num_trials"] == 7
    skip = SkipSet.from_json(out)  # generate's own reader
    assert (list(skip.attn), list(skip.mlp)) == (best["attn"], best["mlp"])
    # The pick is the best MEASURED one among the re-measured (the two best modelled, distinct).
    assert len(best["remeasured"]) == 2
    assert best["measured"]["speedup"] == max(r["measured"]["speedup"] for r in best["remeasured"])
    modelled = [r["modelled"]["speedup"] for r in best["remeasured"]]
    assert modelled == sorted(modelled, reverse=True)
    assert 1 <= best["num_speculative_tokens"] <= 4
    m = best["modelled"]
    assert 0 <= m["alpha"] <= 1 and 0 <= m["cost_ratio"] < 1
    assert m["speedup"] == pytest.approx(
        expected_speedup(m["alpha"], m["cost_ratio"], m["best_gamma"],
                         best["calibration"]["verify_ratios"][m["best_gamma"]]))
    assert m["speedup_v1"] == pytest.approx(expected_speedup(m["alpha"], m["cost_ratio"], m["best_gamma_v1"]))
    # The default storage is a SQLite file beside best.json, named after the study.
    assert best["storage"] == f"sqlite:///{out.parent.resolve() / (best['study_name'] + '.db')}"
    study = _load_study(best["storage"], best["study_name"])
    assert len(_finished(study)) == 7
    # The first trials are the enqueued seed sets.
    seeds = [search.skip_set_params(s, NUM_LAYERS) for s in search.seed_skip_sets(NUM_LAYERS)]
    assert [t.params for t in study.trials[: len(seeds)]] == seeds
    for t in study.get_trials(states=(TrialState.COMPLETE,)):
        if "infeasible" not in t.user_attrs:
            assert {"alpha", "cost_ratio", "best_gamma", "speedup", "speedup_v1"} <= set(t.user_attrs)
    for name in (search.HISTORY_PNG, search.IMPORTANCES_PNG, search.HEATMAP_PNG):
        assert (out.parent / name).stat().st_size > 1000, name
    if optuna.visualization.is_available():
        assert (out.parent / search.HISTORY_HTML).is_file() and (out.parent / "plotly.min.js").is_file()
    assert "best.json selected by the best measured speedup" in stdout.replace("\n", " ")

    code = main(["generate", "--target", str(folders["model"]), "--method", "layer-skip", "--skip-config",
                 str(out), "--prompt", "w5 w9 w11", "--max-new-tokens", "10", "--dtype", "float32",
                 "--device", "cpu", "-g", str(best["num_speculative_tokens"]), "--json"])
    gen_out, err = capsys.readouterr()
    assert code == 0, err
    model = make_tiny_model("llama", num_layers=NUM_LAYERS)
    expected = SpeculativeDecoder(model, eos_token_ids=[2]).generate(
        torch.tensor([[5, 9, 11]]), GenerationConfig(max_new_tokens=10))
    assert json.loads(gen_out)["token_ids"] == expected.token_ids

    # Running the finished command again runs no trial and gives the same answer.
    assert main(_search_args(folders, out, "--trials", 7, "--remeasure", 2, "--no-plots")) == 0
    capsys.readouterr()
    again = json.loads(out.read_text())
    assert (again["attn"], again["mlp"], again["num_trials"]) == (best["attn"], best["mlp"], 7)
    assert again["measured"] == best["measured"]  # re-measurements are stored in the study, not redone


def test_cli_defaults_match_search_settings():
    d = SearchSettings()
    for key, value in vars(SEARCH_DEFAULTS).items():
        assert getattr(d, key) == value, key
    assert SEARCH_OBJECTIVES == search.OBJECTIVES and SEARCH_SAMPLERS == search.SAMPLERS


# --- 5. errors --------------------------------------------------------------------------------


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "content,message",
    [
        (None, "calibration file '{path}' does not exist"),
        ("a folder", "calibration file '{path}' is not a file"),  # once "does not exist"
        ('{"prompt": "w5 w6"}\nnot json\n', "{path}:2: not valid JSON"),
        ('{"text": "w5"}\n', "{path}:1: needs a non-empty 'prompt' string"),
        ("", "dataset file '{path}' holds no prompts"),
    ],
)
def test_bad_calibration_file_is_a_clear_error(folders, tmp_path, capsys, content, message):
    path = tmp_path / "calib.jsonl"
    if content == "a folder":
        path.mkdir()
    elif content is not None:
        _write(path, content)
    args = _search_args(folders, tmp_path / "best.json")
    args[args.index("--calibration") + 1] = str(path)
    code = main(args)
    _, err = capsys.readouterr()
    assert code == 2 and message.format(path=path) in err


def test_unknown_spec_bench_category_lists_the_allowed_ones(folders, tmp_path, capsys, monkeypatch):
    bench_file = _write(tmp_path / "question.jsonl",
                        '{"question_id": 1, "category": "coding", "turns": ["w5 w6"]}\n'
                        '{"question_id": 2, "category": "math_reasoning", "turns": ["w7 w8"]}\n')
    monkeypatch.setenv("SPECDECODE_SPEC_BENCH", str(bench_file))
    args = _search_args(folders, tmp_path / "best.json")
    args[args.index("--calibration") + 1] = "spec-bench:poetry"
    code = main(args)
    _, err = capsys.readouterr()
    assert code == 2 and "unknown category 'poetry'" in err and "allowed: coding, math_reasoning" in err
    assert [p.id for p in search.load_calibration_prompts("spec-bench:coding", 4)] == ["spec-bench/1"]


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--trials", "0"], "trials must be an integer >= 1, got 0"),
        (["--min-skip-fraction", "0.6", "--max-skip-fraction", "0.4"],
         "min_skip_fraction 0.6 is above max_skip_fraction 0.4"),
        (["--max-skip-fraction", "1.5"], "max_skip_fraction must be a number in [0, 1], got 1.5"),
        (["--max-skip-fraction", "0.1"], "no skip set fits the bounds [0.0, 0.1]: the model has 8 sublayers"),
        (["--prompt-offset", "5"], "has 5 prompts, none left after skipping 5"),
        (["--max-new-tokens", "1"], "max_new_tokens must be an integer >= 2, got 1"),
    ],
)
def test_bad_search_options_exit_2(folders, tmp_path, capsys, extra, message):
    code = main(_search_args(folders, tmp_path / "best.json", *extra))
    out, err = capsys.readouterr()
    assert code == 2 and message in err, err
    assert out == ""


def test_an_out_path_that_cannot_be_written_exits_2_before_loading(folders, tmp_path, capsys):
    """--out under a file ended in a traceback from mkdir (after the model load); with --storage it
    would have failed only when best.json was written, after the whole study."""
    (tmp_path / "a-file").write_text("x")
    code = main(_search_args(folders, tmp_path / "a-file" / "best.json"))
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert f"cannot create the folder of --out '{tmp_path / 'a-file' / 'best.json'}': File exists" in err, err


def test_an_out_path_that_is_a_folder_exits_2_before_the_study(folders, tmp_path, capsys):
    """--out names best.json (plots and the default storage go beside it); an existing folder there
    failed only when best.json was written, after the whole study had run."""
    out = tmp_path / "results"
    out.mkdir()
    code = main(_search_args(folders, out, "--trials", "2", "--no-plots"))
    stdout, err = capsys.readouterr()
    assert code == 2 and stdout == "", err
    assert (f"--out {str(out)!r} is a folder: --out names the best.json file to write (the plots and the "
            f"default storage go beside it); pass e.g. --out {str(out / 'best.json')!r}") in err, err
    assert list(tmp_path.glob("*.db")) == [], "the study ran before --out was checked"
    assert list(out.iterdir()) == []
