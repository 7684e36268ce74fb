"""Shared by the tests of ``specdecode bench`` (tests/bench): the prompts, small settings,
tiny target and draft (same weights, so greedy acceptance is exactly 1), and file readers."""

from __future__ import annotations

import json

import pytest

from conftest import make_tiny_model, make_tiny_tokenizer
from specdecode.bench import BenchSettings
from specdecode.bench.datasets import Prompt
from specdecode.models import LoadedModel
from specdecode.pipeline import SpeculativeGenerator

PROMPTS = [
    Prompt("t/1", "code", "w5 w9 w12 w7 w5 w9 w12"),
    Prompt("t/2", "chat", "w30 w31 w32 w30 w31 w8"),
]
SMALL = dict(max_new_tokens=6, warmup_tokens=2)
SMALL_GAMMA = BenchSettings().num_speculative_tokens


@pytest.fixture(scope="module")
def generator() -> SpeculativeGenerator:
    """Target and draft with the same weights: greedy acceptance must be exactly 1."""
    tok = make_tiny_tokenizer()
    target = LoadedModel(make_tiny_model("qwen2", 4, seed=0), tok, "tiny-target")
    draft = LoadedModel(make_tiny_model("qwen2", 4, seed=0), tok, "tiny-draft")
    return SpeculativeGenerator(target, draft)


@pytest.fixture(scope="module")
def target_only(generator) -> SpeculativeGenerator:
    return SpeculativeGenerator(generator.target)


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)
