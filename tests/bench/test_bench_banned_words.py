"""``specdecode bench`` with a banned-word list: specdecode's methods only, rollbacks recorded."""

from __future__ import annotations

import json

import pytest

from bench_helpers import PROMPTS, SMALL, generator  # noqa: F401
from specdecode.bench import BenchSettings, run_bench
from specdecode.bench.methods import resolve_methods
from specdecode.cli import main
from specdecode.errors import InvalidArgumentError


def _words_of(generator, methods, tmp_path) -> list[str]:
    """Words the plain run produces, to ban in the second run."""
    results = run_bench(generator, PROMPTS, methods, BenchSettings(max_new_tokens=12, warmup_tokens=2),
                        tmp_path / "plain")
    text = " ".join(generator.tokenizer.decode(r["token_ids"], skip_special_tokens=True) for r in results["records"])
    return sorted(set(text.split()))[:3]


def test_banned_words_reach_every_specdecode_method_and_are_counted(generator, tmp_path):
    methods = ["autoregressive", "draft", "cascade"]
    banned = _words_of(generator, methods, tmp_path)
    settings = BenchSettings(max_new_tokens=12, warmup_tokens=2, banned_words=tuple(banned))
    out = tmp_path / "banned"
    results = run_bench(generator, PROMPTS, methods, settings, out)
    for r in results["records"]:
        words = generator.tokenizer.decode(r["token_ids"], skip_special_tokens=True).split()
        assert not set(words) & set(banned), (r["method"], words)
    assert sum(r["banned_word_rollbacks"] for r in results["records"]) > 0
    overall = results["summary"]["draft"]["overall"]
    assert overall["banned_word_rollbacks"] == sum(
        r["banned_word_rollbacks"] for r in results["records"] if r["method"] == "draft")
    stored = json.loads((out / "settings.json").read_text())["identity"]
    assert stored["banned_words"] == banned
    # Same tokens for every method: the bans act on the target's output, not on the drafter.
    by_prompt = {}
    for r in results["records"]:
        by_prompt.setdefault(r["prompt_id"], set()).add(tuple(r["token_ids"]))
    assert all(len(v) == 1 for v in by_prompt.values())


def test_transformers_methods_cannot_ban_words(generator):
    settings = BenchSettings(**SMALL, banned_words=("w5",))
    with pytest.raises(InvalidArgumentError, match="'hf-generate' cannot ban words"):
        resolve_methods(generator, ["hf-generate", "autoregressive"], settings)
    runners, skipped = resolve_methods(generator, None, settings)
    assert "hf-generate" in skipped and "hf-assisted" in skipped and "autoregressive" in runners


def test_a_missing_banned_words_file_is_refused_before_loading(tmp_path, capsys):
    code = main(["bench", "--banned-words-file", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "o")])
    assert code == 2
    assert f"banned-words file {str(tmp_path / 'nope.txt')!r} does not exist" in capsys.readouterr().err
