"""Shared by the tests of ``specdecode search`` (tests/search): the tiny model folders and
calibration file, the CLI arguments of a quick search, and reading a study back."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from conftest import make_tiny_model, make_tiny_tokenizer
from specdecode import search

NUM_LAYERS = 4


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A 4-layer and a 3-layer tiny llama saved as model folders, and a calibration JSONL."""
    root = tmp_path_factory.mktemp("search")
    tok = make_tiny_tokenizer()
    for name, layers in (("llama4", NUM_LAYERS), ("llama3", 3)):
        model = make_tiny_model("llama", num_layers=layers)
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    calib = root / "calib.jsonl"
    with open(calib, "w", encoding="utf-8") as f:
        for i in range(5):
            words = " ".join(f"w{3 + (7 * i + 5 * j) % 45}" for j in range(10))
            f.write(json.dumps({"id": i, "prompt": words}) + "\n")
    return {"model": root / "llama4", "model3": root / "llama3", "calib": calib, "root": root}


def _search_args(folders, out: Path, *extra) -> list[str]:
    return [
        "search", "--target", str(folders["model"]), "--calibration", str(folders["calib"]),
        "--dtype", "float32", "--device", "cpu", "--out", str(out), "--max-new-tokens", "12",
        "--num-prompts", "3", "--max-gamma", "4", "--timing-repeats", "2", *map(str, extra),
    ]


def _load_study(url: str, name: str) -> optuna.Study:
    # open_storage: retries while a worker is creating the tables of a new database.
    return optuna.load_study(study_name=name, storage=search.open_storage(url))


def _finished(study) -> list:
    return study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
