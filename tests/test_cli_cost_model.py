"""`specdecode generate --draft-length-schedule cost-model`: selectable for every method with a drafter, exact in
float32, refused beside a confidence gate, over the default adaptive exit where the target computes in float32
on a CPU."""

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


def test_the_cost_model_with_a_confidence_gate_is_refused(tiny_folders, capsys):
    target_dir, draft_dir, _ = tiny_folders
    code, _, err = run_generate(capsys, "--target", target_dir, "--draft", draft_dir, "--method", "draft",
                                "--draft-length-schedule", "cost-model", "--confidence-gate", "0.5", "--prompt", "w5",
                                "--max-new-tokens", 4, "--dtype", "float32")
    assert code != 0 and "cost-model" in err and "confidence_gate=0.5" in err


def test_the_cost_model_takes_an_explicit_adaptive_exit(tiny_folders, capsys):
    target_dir, draft_dir, _ = tiny_folders
    code, out, _ = run_generate(capsys, "--target", target_dir, "--draft", draft_dir, "--method", "draft", "--json",
                                "--draft-length-schedule", "cost-model", "--adaptive-draft-exit", "--prompt", "w5",
                                "--max-new-tokens", 4, "--dtype", "float32")
    assert code == 0
    control = json.loads(out)["draft_control"]
    assert control["length_schedule"] == "cost-model" and control["adaptive_exit"] is True


@pytest.mark.parametrize("flags, schedule, adaptive", [
    ([], "cost-model", True),  # float32 on a CPU: the cost model over the default exit
    (["--dtype", "bfloat16"], "constant", True),  # native-bf16 CPUs' default: the exit alone, as measured there
    (["--no-adaptive-draft-exit"], "constant", False),
    (["--adaptive-draft-exit"], "constant", True),  # an exit asked for is Draft & Verify's alone
    (["--draft-length-schedule", "constant"], "constant", True),
    (["--draft-length-schedule", "cost-model"], "cost-model", False),
    (["-g", "3"], "constant", False),  # an explicit gamma: fixed blocks
])
def test_the_default_schedule_follows_the_target_dtype_on_a_cpu(tiny_folders, capsys, flags, schedule, adaptive):
    target_dir, draft_dir, target = tiny_folders
    dtype = [] if "--dtype" in flags else ["--dtype", "float32"]
    code, out, err = run_generate(capsys, "--target", target_dir, "--draft", draft_dir, "--method", "draft", "--json",
                                  "--prompt", "w5 w9 w11 w5 w9 w11 w5", "--max-new-tokens", 12, "--device", "cpu",
                                  *dtype, *flags)
    assert code == 0, err
    result = json.loads(out)
    control = result["draft_control"] or {"length_schedule": "constant", "adaptive_exit": False}
    assert (control["length_schedule"], control["adaptive_exit"]) == (schedule, adaptive)
    if dtype:
        expected = SpeculativeDecoder(target, eos_token_ids=[2]).generate(
            torch.tensor([[5, 9, 11, 5, 9, 11, 5]]), GenerationConfig(max_new_tokens=12))
        assert result["token_ids"] == expected.token_ids
