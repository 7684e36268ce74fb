"""``specdecode serve`` with token trees: ``--prompt-lookup-branches`` and ``--draft-tree-depth`` reach the
engine's drafter, and a greedy completion over real HTTP (uvicorn on loopback, the ``openai`` client)
is the autoregressive server's, token for token (float32, tiny models)."""

from __future__ import annotations

import pytest

from serve_helpers import command_completion, tiny_chat_folders
from specdecode.cli import build_parser, main
from specdecode.drafters.cascade import CascadeDrafter
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.prompt_lookup import PromptLookupDrafter

PROMPT = "w7 w8 w9 w7 w8 w9 w10 w7 w8"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return tiny_chat_folders(tmp_path_factory.mktemp("tiny"))


def completion(folders, tmp_path, *flags: str) -> tuple[str, object]:
    """The greedy 24-token completion of ``PROMPT`` by a server built as the command builds it, and its drafter."""
    text, engine = command_completion(folders, tmp_path, PROMPT, *flags)
    return text, engine.decoder.drafter


@pytest.fixture(scope="module")
def reference(folders, tmp_path_factory):
    text, _ = completion(folders, tmp_path_factory.mktemp("cache"), "--method", "autoregressive")
    return text


@pytest.mark.parametrize("flags", [
    ("--method", "prompt-lookup", "--prompt-lookup-branches", "3", "-g", "6"),
    ("--method", "draft", "--draft-tree-depth", "2", "-g", "6"),
    ("--method", "draft", "--draft-tree-depth", "2", "--draft-tree-expand", "2", "-g", "6"),
    ("--method", "cascade", "--draft-tree-depth", "2", "-g", "6", "--draft-quantize", "none"),
    ("--method", "draft", "--draft-tree-depth", "2", "--draft-tree-shape", "previous-round", "-g", "6"),
])
def test_tree_flags_reach_the_drafter_and_keep_the_greedy_text(folders, tmp_path, reference, flags):
    text, drafter = completion(folders, tmp_path, *flags)
    assert text == reference
    if "--prompt-lookup-branches" in flags:
        assert isinstance(drafter, PromptLookupDrafter) and drafter.branches == 3
    else:
        assert isinstance(drafter, CascadeDrafter if "cascade" in flags else DraftModelDrafter)
        assert drafter.tree_depth == 2
        assert drafter.tree_expand == (2 if "--draft-tree-expand" in flags else None)
        shaped = "--draft-tree-shape" in flags
        assert drafter._tree_shape() == ("previous-round" if shaped else "per-round")  # a CPU's default


@pytest.mark.parametrize(("args", "needle"), [
    (["--prompt-lookup-branches", "0"], "--prompt-lookup-branches must be >= 1 (matches per round), got 0"),
    (["--method", "draft", "--prompt-lookup-branches", "2"], "not to 'draft'"),
    (["--method", "draft", "--draft-tree-depth", "0"], "--draft-tree-depth must be >= 1"),
    (["--method", "draft", "--draft-tree-depth", "65"], "--draft-tree-depth must be in 1..64, got 65"),
    (["--method", "draft", "--draft-tree-expand", "2"], "give --draft-tree-depth D too"),
    (["--method", "draft", "--draft-tree-shape", "per-round"], "--draft-tree-shape per-round shapes a draft tree: "
                                                               "give --draft-tree-depth D too"),
    (["--method", "prompt-lookup", "--draft-tree-depth", "3"], "not to 'prompt-lookup'"),
    (["--method", "cascade", "--draft-tree-depth", "3", "--draft-tree-expand", "2"], "not to 'cascade'"),
    (["--method", "draft", "--draft-tree-depth", "3", "--adaptive-draft-exit"], "drafts a linear chain, never a tree"),
    (["--method", "draft", "--prompt-lookup-datastore", "none"], "--prompt-lookup-datastore applies to the method "
                                                                 "'prompt-lookup', not to 'draft'"),
    (["--method", "prompt-lookup", "--prompt-lookup-datastore", "/no/such/corpus"], "neither 'python-stdlib', a "
                                                                                   "folder nor a file"),
    (["--method", "prompt-lookup", "--prompt-lookup-datastore", "python-stdlib", "--prompt-lookup-branches", "2"],
     "with --prompt-lookup-branches 2 use 'auto' or 'none'"),
])
def test_bad_tree_flags_exit_2_before_loading(args, needle, capsys):
    assert main(["serve", "--target", "/nonexistent/model", *args]) == 2
    assert needle in capsys.readouterr().err


def test_a_draft_tree_turns_the_default_adaptive_exit_off():
    import torch

    from specdecode.defaults import plan_command

    plain = plan_command(build_parser().parse_args(["serve", "--method", "draft"]), torch.device("cpu"))
    tree = plan_command(build_parser().parse_args(["serve", "--method", "draft", "--draft-tree-depth", "3"]),
                            torch.device("cpu"))
    assert plain.draft_control is not None and tree.draft_control is None
