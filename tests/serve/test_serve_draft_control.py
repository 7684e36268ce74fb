"""``specdecode serve``'s draft length control: generate's flags (``defaults.add_draft_control_flags``) reach
every row's control, a greedy completion over real HTTP (uvicorn on loopback, the ``openai`` client) is the
autoregressive server's, token for token (float32, tiny models), and bad values are refused before loading."""

from __future__ import annotations

import pytest

from serve_helpers import command_completion, tiny_chat_folders
from specdecode.cli import main
from specdecode.drafters.control import DraftControl

PROMPT = "w7 w8 w9 w7 w8 w9 w10 w7 w8"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return tiny_chat_folders(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def reference(folders, tmp_path_factory):
    text, _ = command_completion(folders, tmp_path_factory.mktemp("cache"), PROMPT, "--method", "autoregressive")
    return text


@pytest.mark.parametrize("flags, control", [
    (("--method", "draft", "--confidence-gate", "0.5"),  # the default exit stays on, under the constant schedule
     DraftControl(adaptive_exit=True, confidence_gate=0.5)),
    (("--method", "draft", "-g", "3", "--draft-length-schedule", "heuristic"),  # -g: no default exit
     DraftControl(length_schedule="heuristic")),
    (("--method", "cascade", "--adaptive-draft-exit", "--max-draft-tokens", "4", "--draft-exit-threshold", "0.3",
      "--draft-quantize", "none"),
     DraftControl(adaptive_exit=True, max_draft_tokens=4, exit_threshold=0.3)),
    (("--method", "draft", "--no-adaptive-draft-exit", "--draft-length-schedule", "cost-model"),
     DraftControl(length_schedule="cost-model")),
])
def test_draft_control_flags_reach_the_rows_and_keep_the_greedy_text(folders, tmp_path, reference, flags, control):
    text, engine = command_completion(folders, tmp_path, PROMPT, *flags)
    assert engine.decoder.draft_control == control
    assert engine.decoder.max_block == control.controller(3 if "-g" in flags else 5).max_tokens  # rows sized by it
    assert text == reference


@pytest.mark.parametrize("flags, message", [
    (("--confidence-gate", "1.5"), "confidence gate threshold must be a number in [0, 1], got 1.5"),
    (("--max-draft-tokens", "0"), "max_draft_tokens"),
    (("--draft-length-schedule", "cost-model", "--confidence-gate", "0.5"), "does not combine with "
                                                                             "confidence_gate=0.5"),
    (("--method", "prompt-lookup", "--adaptive-draft-exit"), "--adaptive-draft-exit needs a method whose drafts "
                                                             "carry probabilities; 'prompt-lookup' has none"),
])
def test_bad_draft_control_flags_are_refused_before_loading(folders, monkeypatch, capsys, flags, message):
    from specdecode.errors import SpecDecodeError
    from specdecode.pipeline import SpeculativeGenerator

    def from_pretrained(*args, **kwargs):
        raise SpecDecodeError("loaded")

    monkeypatch.setattr(SpeculativeGenerator, "from_pretrained", from_pretrained)
    target, draft = folders
    code = main(["serve", "--target", str(target), "--draft", str(draft), "--dtype", "float32", "--device", "cpu",
                 "--port", "0", "--log-level", "warning", *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert "loaded" not in err
