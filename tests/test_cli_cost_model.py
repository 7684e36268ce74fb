"""`specdecode generate --draft-length-schedule cost-model`: selectable for every method with a drafter, exact in
float32, and refused beside adaptive exit."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_tiny_model, make_tiny_tokenizer
from helpers import run_generate, save_tiny_folders
from specdecode import GenerationConfig, SpeculativeDecoder


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    target = make_tiny_model("llama", num_layers=3)
    draft = make_tiny_model("llama", num_layers=1, seed=5)
    return (*save_tiny_folders(tmp_path_factory.mktemp("models"), make_tiny_tokenizer(), target, draft), target)


@pytest.mark.parametrize("method", ["prompt-lookup", "draft", "token-recycling"])
def test_generate_with_the_cost_model_gives_target_only_tokens(tiny_folders, capsys, method):
    target_dir, draft_dir, target = tiny_folders
    code, out, err = run_generate(capsys, "--target", target_dir, "--draft", draft_dir, "--method", method,
                                  "--draft-length-schedule", "cost-model", "--prompt", "w5 w9 w11 w5 w9 w11 w5",
                                  "--max-new-tokens", 16, "--dtype", "float32", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["draft_control"]["length_schedule"] == "cost-model"
    assert result["draft_control"]["adaptive_exit"] is False  # "draft"'s default adaptive exit gives way
    expected = SpeculativeDecoder(target, eos_token_ids=[2]).generate(
        torch.tensor([[5, 9, 11, 5, 9, 11, 5]]), GenerationConfig(max_new_tokens=16))
    assert result["token_ids"] == expected.token_ids
    assert "mean_draft_size" in result["stats"] and "rounds_by_draft_cap" in result["stats"]


def test_the_cost_model_with_adaptive_exit_is_refused(tiny_folders, capsys):
    target_dir, draft_dir, _ = tiny_folders
    code, _, err = run_generate(capsys, "--target", target_dir, "--draft", draft_dir, "--method", "draft",
                                "--draft-length-schedule", "cost-model", "--adaptive-draft-exit", "--prompt", "w5",
                                "--max-new-tokens", 4, "--dtype", "float32")
    assert code != 0 and "cost-model" in err and "adaptive_exit" in err
