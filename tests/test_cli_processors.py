"""`specdecode generate`'s processor and logprobs flags (issue 31) on tiny model folders."""

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


def test_generate_flags_reach_the_config_and_logprobs_are_printed(tiny_folders, capsys):
    target_dir, draft_dir, target = tiny_folders
    flags = ["--repetition-penalty", "1.5", "--frequency-penalty", "0.5", "--presence-penalty", "0.25",
             "--logit-bias", "9=5", "--logit-bias", "11=-100", "--logprobs", "--top-logprobs", "2"]
    code, out, err = run_generate(
        capsys, "--target", target_dir, "--draft", draft_dir, "--method", "draft", "--prompt", "w5 w9 w11",
        "--max-new-tokens", 12, "--dtype", "float32", "--device", "cpu", "-g", 3, "--json", *flags,
    )
    assert code == 0, err
    result = json.loads(out)
    config = GenerationConfig(max_new_tokens=12, repetition_penalty=1.5, frequency_penalty=0.5,
                              presence_penalty=0.25, logit_bias={9: 5.0, 11: -100.0}, logprobs=True, top_logprobs=2)
    expected = SpeculativeDecoder(target, eos_token_ids=[2]).generate(torch.tensor([[5, 9, 11]]), config)
    plain = SpeculativeDecoder(target, eos_token_ids=[2]).generate(torch.tensor([[5, 9, 11]]),
                                                                   GenerationConfig(max_new_tokens=12))
    assert result["token_ids"] == expected.token_ids != plain.token_ids
    assert [lp["token_id"] for lp in result["logprobs"]] == expected.token_ids
    assert [lp["logprob"] for lp in result["logprobs"]] == pytest.approx(
        [lp.logprob for lp in expected.logprobs], abs=1e-4)
    assert all(len(lp["top"]) == 2 for lp in result["logprobs"])


def test_stop_token_id_and_text_mode_logprobs(tiny_folders, capsys):
    target_dir, _, target = tiny_folders
    plain = SpeculativeDecoder(target, eos_token_ids=[2]).generate(torch.tensor([[5, 9]]),
                                                                   GenerationConfig(max_new_tokens=8)).token_ids
    code, out, err = run_generate(capsys, "--target", target_dir, "--method", "autoregressive", "--prompt", "w5 w9",
                                  "--max-new-tokens", 8, "--dtype", "float32", "--stop-token-id", plain[2],
                                  "--logprobs")
    assert code == 0, err
    assert len([line for line in out.splitlines() if line.strip().startswith(str(plain[0]))]) >= 1
    code, out, err = run_generate(capsys, "--target", target_dir, "--method", "autoregressive", "--prompt", "w5 w9",
                                  "--max-new-tokens", 8, "--dtype", "float32", "--stop-token-id", plain[2], "--json")
    assert json.loads(out)["token_ids"] == plain[: plain.index(plain[2]) + 1]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--repetition-penalty", "0"], "repetition_penalty must be a number in [0.01, 100] (1 = off), got 0.0"),
        (["--frequency-penalty", "3"], "frequency_penalty must be a number in [-2, 2] (0 = off), got 3.0"),
        (["--min-p", "-0.1"], "min_p must be a number in [0, 1] (0 = off), got -0.1"),
        (["--logit-bias", "9"], "--logit-bias takes ID=BIAS (an integer id, a number), got '9'"),
        (["--logit-bias", "9=500"], "logit_bias for token 9 must be a number in [-100, 100], got 500"),
        (["--top-logprobs", "3"], "top_logprobs=3 needs logprobs=True"),
    ],
)
def test_bad_processor_flags_exit_nonzero_with_message(capsys, args, message):
    code, out, err = run_generate(capsys, "--prompt", "w5", *args)
    assert code == 2
    assert message in err
    assert out == ""
