"""Prompt lookup's datastore (specdecode.drafters.datastore): lookups against a brute-force count, validation, the
on-disk cache, the drafter's order of sources, the options' checks, and exact greedy output through the engine."""

from __future__ import annotations

import collections
import logging

import numpy as np
import pytest
import torch

from conftest import make_tiny_model
from selfspec_helpers import autoregressive, one_thread  # noqa: F401  (one_thread is a fixture)
from specdecode import GenerationConfig, InvalidArgumentError, SpeculativeDecoder
from specdecode.drafters.datastore import (
    PYTHON_STDLIB,
    SEPARATOR,
    NgramDatastore,
    corpus_files,
    load_or_build,
    python_stdlib_files,
    tokenize_corpus,
)
from specdecode.drafters.prompt_lookup import PromptLookupDrafter
from specdecode.engine.batch_cache import BatchKVCache
from specdecode.engine.batched import BatchedSpeculativeDecoder
from specdecode.engine.cost_model import DepthAcceptance, ForwardCosts
from specdecode.engine.speculation_cost import SpeculationCostPolicy, match_key
from specdecode.method_registry import check_datastore_option, refused_option

pytestmark = pytest.mark.usefixtures("one_thread")


def _brute_force(tokens: list[int], context: list[int], max_tokens: int, max_ngram: int, min_ngram: int,
                 min_count: int, min_share: float) -> tuple[list[int], int]:
    """The datastore's rule, by counting every occurrence in a Python list."""
    for n in range(min(max_ngram, len(context)), min_ngram - 1, -1):
        query = context[len(context) - n:]
        starts = [i + n for i in range(len(tokens) - n + 1) if tokens[i:i + n] == query]
        if len(starts) < min_count:
            continue
        out = []
        for depth in range(max_tokens):
            nxt = [tokens[s + depth] if s + depth < len(tokens) else SEPARATOR for s in starts]
            counts = collections.Counter(nxt)
            top = max(counts.values())
            token = min(t for t, c in counts.items() if c == top)  # np.unique's order: the smallest of a tie
            if token == SEPARATOR or (depth == 0 and top < min_share * len(nxt)):
                break
            out.append(token)
            starts = [s for s, t in zip(starts, nxt) if t == token]
        return out, (n if out else 0)
    return [], 0


@pytest.mark.parametrize("seed", range(4))
def test_lookups_equal_a_brute_force_count(seed):
    rng = np.random.default_rng(seed)
    # A small vocabulary and repeated phrases, so n-grams recur with several continuations; documents split by -1.
    phrases = [rng.integers(0, 6, size=rng.integers(2, 7)).tolist() for _ in range(8)]
    tokens = []
    for _ in range(300):
        tokens += phrases[rng.integers(0, 8)] if rng.random() < 0.8 else [int(rng.integers(0, 6))]
        if rng.random() < 0.05:
            tokens.append(SEPARATOR)
    for max_ngram, min_ngram, min_count, min_share in ((4, 1, 1, 0.2), (3, 2, 3, 0.5), (6, 2, 2, 0.8)):
        store = NgramDatastore(np.asarray(tokens), max_ngram, min_ngram, min_count, min_share)
        drafted = 0
        for _ in range(60):
            context = rng.integers(0, 6, size=rng.integers(1, 9)).tolist()
            want = _brute_force(tokens, context, 7, max_ngram, min_ngram, min_count, min_share)
            assert store.lookup(np.asarray(context), 7) == want, (context, max_ngram, min_count, min_share)
            drafted += bool(want[0])
        assert drafted  # the comparison covered drafts, not only empty lookups


def test_the_longest_frequent_ngram_decides_and_a_split_continuation_drafts_nothing():
    doc = [1, 2, 3, 4, 5]
    store = NgramDatastore(np.asarray((doc + [SEPARATOR]) * 5 + [9, 2, 3, 7, SEPARATOR]), max_ngram=3, min_ngram=1,
                           min_count=2, min_share=0.8)
    assert store.lookup(np.asarray([1, 2, 3]), 4) == ([4, 5], 3)  # stops at the document's end
    assert store.lookup(np.asarray([8, 2, 3]), 1) == ([4], 2)  # "2 3": 4 five times, 7 once (5/6 >= 0.8)
    split = NgramDatastore(np.asarray([1, 2, 4, SEPARATOR, 1, 2, 5, SEPARATOR]), max_ngram=2, min_count=2)
    assert split.lookup(np.asarray([1, 2]), 3) == ([], 0)  # 4 and 5 half each: under min_share
    assert store.lookup(np.asarray([6, 6]), 3) == ([], 0) and store.lookup(np.asarray([1, 2]), 0) == ([], 0)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_ngram": 0}, r"max_ngram must be an integer in 1\.\.16, got 0"),
    ({"max_ngram": 3, "min_ngram": 4}, r"min_ngram must be an integer in 1\.\.3, got 4"),
    ({"min_count": 0}, r"min_count must be an integer in 1\.\.inf, got 0"),
    ({"min_share": 0.0}, r"min_share must be in \(0, 1\], got 0\.0"),
    ({"min_share": 1.5}, r"min_share must be in \(0, 1\], got 1\.5"),
    ({"suffix_array": np.arange(3)}, r"suffix_array must have shape \(5,\), got \(3,\)"),
])
def test_bad_options_are_refused_by_name(kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        NgramDatastore(np.arange(5), **kwargs)
    with pytest.raises(InvalidArgumentError, match="non-empty 1-D"):
        NgramDatastore(np.zeros(0))


def _encode(text: str) -> list[int]:
    return [ord(c) % 97 for c in text]


def test_a_corpus_is_tokenized_once_and_read_back_from_the_cache(tmp_path, monkeypatch, caplog):
    corpus = tmp_path / "corpus"
    (corpus / "pkg").mkdir(parents=True)
    (corpus / "a.py").write_text("for i in range(10):\n    print(i)\n" * 3)
    (corpus / "pkg" / "b.md").write_text("for i in range(3): pass\n")
    (corpus / "image.png").write_bytes(b"\x89PNG")  # not a text suffix: left out
    (corpus / ".hidden.py").write_text("zzzz")  # hidden: left out
    assert [p.name for p in corpus_files(corpus)] == ["a.py", "b.md"]
    cache = tmp_path / "cache"
    built = load_or_build(corpus, _encode, "chars", cache, min_count=2)
    assert len(built) == len(_encode((corpus / "a.py").read_text())) + len(_encode("for i in range(3): pass\n")) + 2
    calls = []
    monkeypatch.setattr("specdecode.drafters.datastore.tokenize_corpus", lambda *a: calls.append(a))
    again = load_or_build(corpus, _encode, "chars", cache, min_count=2)
    assert calls == [] and np.array_equal(again.tokens, built.tokens)
    assert np.array_equal(again.suffix_array, built.suffix_array)
    context = np.asarray(_encode("for i in ra"))
    assert again.lookup(context, 4) == built.lookup(context, 4) and built.lookup(context, 4)[0]
    # Another tokenizer is another file; a changed corpus replaces its own.
    monkeypatch.undo()
    assert len(list((cache / "datastore").iterdir())) == 1
    load_or_build(corpus, _encode, "other", cache, min_count=2)
    assert len(list((cache / "datastore").iterdir())) == 2
    (corpus / "c.txt").write_text("while True:\n    break\n")
    load_or_build(corpus, _encode, "chars", cache, min_count=2)
    assert len(list((cache / "datastore").iterdir())) == 2


@pytest.mark.parametrize("damage", ["garbage", "empty", "truncated", "unsorted"])
def test_a_damaged_cache_file_is_rebuilt_with_a_warning(tmp_path, caplog, damage):
    corpus = tmp_path / "a.py"
    corpus.write_text("for i in range(10):\n    print(i)\n" * 3)
    built = load_or_build(corpus, _encode, "chars", tmp_path, min_count=2)
    (path,) = (tmp_path / "datastore").iterdir()
    if damage == "unsorted":  # a file of the right shapes whose suffix array is not in order
        with np.load(path) as saved:
            tokens, order = saved["tokens"], saved["suffix_array"]
        with open(path, "wb") as f:
            np.savez(f, tokens=tokens, suffix_array=order[::-1].copy())
    else:
        data = path.read_bytes()
        path.write_bytes({"garbage": b"not an npz", "empty": b"", "truncated": data[: len(data) // 2]}[damage])
    with caplog.at_level(logging.WARNING, logger="specdecode.drafters.datastore"):
        rebuilt = load_or_build(corpus, _encode, "chars", tmp_path, min_count=2)
    assert "unreadable" in caplog.text and np.array_equal(rebuilt.suffix_array, built.suffix_array)
    context = np.asarray(_encode("for i in ra"))
    assert rebuilt.lookup(context, 3) == built.lookup(context, 3) != ([], 0)


def test_a_cache_that_cannot_be_written_is_warned_about_and_the_datastore_still_works(tmp_path, caplog):
    corpus = tmp_path / "a.py"
    corpus.write_text("x = 1\n" * 20)
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache folder would be")
    with caplog.at_level(logging.WARNING, logger="specdecode.drafters.datastore"):
        store = load_or_build(corpus, _encode, "chars", blocked, min_count=2)
    assert "not written" in caplog.text and store.lookup(np.asarray(_encode("x = ")), 2)[0]


def test_files_that_are_not_text_are_counted_in_a_warning_and_a_corpus_of_none_is_refused(tmp_path, caplog):
    (tmp_path / "good.py").write_text("x = 1\n")
    (tmp_path / "latin1.py").write_bytes("caf\xe9 = 1\n".encode("latin-1"))
    with caplog.at_level(logging.WARNING, logger="specdecode.drafters.datastore"):
        tokenize_corpus(corpus_files(tmp_path), _encode)
    assert "1 of 2 files are not UTF-8 text" in caplog.text
    with pytest.raises(InvalidArgumentError, match="none of the 1 files holds UTF-8 text"):
        tokenize_corpus([tmp_path / "latin1.py"], _encode)


def test_bad_corpora_are_refused_by_name(tmp_path):
    with pytest.raises(InvalidArgumentError, match="neither 'python-stdlib', a folder nor a file"):
        corpus_files(tmp_path / "missing")
    (tmp_path / "x.bin").write_bytes(b"\0")
    with pytest.raises(InvalidArgumentError, match="has no text files"):
        corpus_files(tmp_path)


def test_the_standard_library_corpus_leaves_out_tests_and_packages():
    files = python_stdlib_files()
    assert files == corpus_files(PYTHON_STDLIB) and any(p.name == "collections" or p.parent.name == "collections"
                                                        for p in files)
    assert not [p for p in files if {"test", "tests", "site-packages"} & set(p.parts)]


def _bound(drafter: PromptLookupDrafter) -> PromptLookupDrafter:
    drafter.bind(BatchKVCache(make_tiny_model("llama", num_layers=1), 2, 64))
    return drafter


def test_the_sequence_first_then_the_datastore():
    store = NgramDatastore(np.asarray([40, 41, 42, 43, SEPARATOR] * 3), max_ngram=2, min_count=2)
    drafter = _bound(PromptLookupDrafter(datastore=store))
    draft = drafter.propose([[41, 42], [5, 6, 7], [7, 8, 9, 7, 8], [3, 42, 5, 42]], [3, 3, 3, 3])
    # Row 0: the datastore's "41 42" -> 43. Row 1: nothing anywhere. Row 2: the sequence's own "7 8" comes
    # first. Row 3: the sequence's one-token match "42", as the datastore has no "5 42".
    assert draft.num_tokens == [1, 0, 3, 2] and draft.tokens[0, 0] == 43 and draft.tokens[2].tolist() == [9, 7, 8]
    assert draft.match_sources == ["datastore", "sequence", "sequence", "sequence"]
    assert draft.ngram_sizes == [2, 0, 2, 1] and draft.tokens[3, :2].tolist() == [5, 42]
    plain = _bound(PromptLookupDrafter())
    assert plain.propose([[41, 42]], [3]).num_tokens == [0]


def test_bad_datastore_options_are_refused():
    with pytest.raises(InvalidArgumentError, match="datastore must be an NgramDatastore or None, got 'x'"):
        PromptLookupDrafter(datastore="x")
    store = NgramDatastore(np.arange(5))
    with pytest.raises(InvalidArgumentError, match="branches=2 drafts trees .* needs branches=1"):
        PromptLookupDrafter(branches=2, datastore=store)
    check_datastore_option("auto", 3)  # the default and "none" pass whatever the branches
    check_datastore_option("none", 3)
    with pytest.raises(InvalidArgumentError, match="with --prompt-lookup-branches 2 use 'auto' or 'none'"):
        check_datastore_option(PYTHON_STDLIB, 2)
    with pytest.raises(InvalidArgumentError, match="neither 'python-stdlib', a folder nor a file"):
        check_datastore_option("/no/such/folder", 1)
    assert refused_option("draft", {"prompt_lookup_datastore": "none"}) == ("prompt_lookup_datastore", "none")
    assert refused_option("draft", {"prompt_lookup_datastore": "auto"}) is None


def test_greedy_output_is_exact_while_drafting_from_the_datastore():
    target = make_tiny_model("llama", seed=5)
    config = GenerationConfig(max_new_tokens=30, num_speculative_tokens=4, stop_on_eos=False)
    prompts = [[3, 17, 29, 41], [8, 17, 29, 41], [40, 2, 33]]
    expected = [autoregressive(target, torch.tensor([p]), config) for p in prompts]
    # A datastore of the third prompt's output (its drafts are right there) and of a shuffled copy of the
    # second's (wrong there); the sequence's own matches are of one token (max_ngram=1), so the datastore is
    # asked every round: it drafts, and what is verified is the target's own output.
    wrong = list(np.random.default_rng(0).permutation(expected[1]))
    store = NgramDatastore(np.asarray(expected[2] + [SEPARATOR] + wrong + [SEPARATOR]), max_ngram=3, min_count=1,
                           min_share=0.5)
    drafter = PromptLookupDrafter(max_ngram=1, datastore=store)
    sources = []
    propose = drafter.propose

    def logged(*args, **kwargs):
        draft = propose(*args, **kwargs)
        sources.extend(s for s, k in zip(draft.match_sources, draft.num_tokens) if k)
        return draft

    drafter.propose = logged
    decoder = SpeculativeDecoder(target, drafter)
    results = [decoder.generate(p, config) for p in prompts]
    assert [r.token_ids for r in results] == expected
    assert "datastore" in sources and results[2].stats.num_accepted_tokens > 0
    assert sum(r.stats.num_drafted_tokens - r.stats.num_accepted_tokens for r in results) > 0  # some were wrong
    # Several rows at once, rows joining mid-flight: as exact.
    batched = BatchedSpeculativeDecoder(target, PromptLookupDrafter(1, datastore=store), max_batch_size=2,
                                        max_length=64, num_speculative_tokens=4)
    assert [r.token_ids for r in batched.generate(prompts, config)] == expected


def test_each_source_has_its_own_acceptance():
    policy = SpeculationCostPolicy(ForwardCosts({1: 0.0693, 2: 0.1045, 4: 0.1115, 8: 0.1967}), draft_node_s=0.0,
                                   prior=0.56, max_size=7)
    policy.prime(PromptLookupDrafter())
    assert match_key(3) == 3 and match_key(3, "datastore") == ("datastore", 3)
    policy.match_depths[3] = DepthAcceptance(0.95, prior_weight=100.0)
    policy.match_depths[("datastore", 3)] = DepthAcceptance(0.1, prior_weight=100.0)
    controller = policy.controller(7)
    controller.round_cap()
    assert controller.trim(5, 3) >= 3 and controller.trim(5, 3, "datastore") == 0
    controller.trim(5, 2, "datastore")  # an n-gram size not seen yet starts at the prior
    assert policy.acceptance(("datastore", 2)).alpha(1) == pytest.approx(0.56)
