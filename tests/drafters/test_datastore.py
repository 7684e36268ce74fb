"""Prompt lookup's datastore (specdecode.drafters.datastore) and its other sources: lookups against a brute-force
count, validation, the on-disk cache, the history of earlier outputs, and exact greedy output through the engine."""

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
)
from specdecode.drafters.prompt_lookup import PromptLookupDrafter
from specdecode.engine.batch_cache import BatchKVCache
from specdecode.engine.batched import BatchedSpeculativeDecoder
from specdecode.engine.cost_model import DepthAcceptance, ForwardCosts
from specdecode.engine.speculation_cost import SpeculationCostPolicy, match_key

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
    # Another tokenizer, or a changed file, is another key; a damaged file is rebuilt, with a warning.
    monkeypatch.undo()
    assert len(list((cache / "datastore").iterdir())) == 1
    load_or_build(corpus, _encode, "other", cache)
    assert len(list((cache / "datastore").iterdir())) == 2
    for path in (cache / "datastore").iterdir():
        path.write_bytes(b"not an npz")
    with caplog.at_level(logging.WARNING, logger="specdecode.drafters.datastore"):
        rebuilt = load_or_build(corpus, _encode, "chars", cache)
    assert "unreadable" in caplog.text and np.array_equal(rebuilt.tokens, built.tokens)


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


def test_the_sequence_first_then_the_history_then_the_datastore():
    store = NgramDatastore(np.asarray([40, 41, 42, 43, SEPARATOR] * 3), max_ngram=2, min_count=2)
    drafter = _bound(PromptLookupDrafter(history_tokens=64, datastore=store))
    drafter.join(0, torch.tensor([[1, 2]]), None)
    drafter.propose([[1, 2, 30, 31, 32, 33, 34]], [3])  # the row's output so far: 30 .. 34
    drafter.join(0, torch.tensor([[5]]), None)  # another row takes the slot: 30 .. 34 joins the history
    draft = drafter.propose([[7, 8, 9, 7, 8, 5, 6, 30, 31, 32], [41, 42], [5, 6, 7]], [3, 3, 3])
    # Row 0: "30 31 32" from the history (the sequence has only "32"... no earlier match of 2 tokens or more).
    # Row 1: the datastore's "41 42" -> 43. Row 2: nothing anywhere.
    assert draft.num_tokens == [2, 1, 0] and draft.tokens[0, :2].tolist() == [33, 34] and draft.tokens[1, 0] == 43
    assert draft.match_sources == ["history", "datastore", "sequence"] and draft.ngram_sizes == [3, 2, 0]
    draft = drafter.propose([[7, 8, 9, 7, 8]], [3])  # the sequence's own "7 8" comes first
    assert draft.match_sources == ["sequence"] and draft.ngram_sizes == [2] and draft.tokens[0].tolist() == [9, 7, 8]
    plain = _bound(PromptLookupDrafter())
    assert plain.propose([[41, 42]], [3]).num_tokens == [0]


def test_bad_history_and_datastore_options_are_refused():
    with pytest.raises(InvalidArgumentError, match="history_tokens must be an integer >= 0, got -1"):
        PromptLookupDrafter(history_tokens=-1)
    with pytest.raises(InvalidArgumentError, match="datastore must be an NgramDatastore or None, got 'x'"):
        PromptLookupDrafter(datastore="x")
    with pytest.raises(InvalidArgumentError, match="branches=2 drafts trees .* needs branches=1"):
        PromptLookupDrafter(branches=2, history_tokens=8)


def test_greedy_output_is_exact_while_drafting_from_the_history_and_the_datastore():
    target = make_tiny_model("llama", seed=5)
    config = GenerationConfig(max_new_tokens=30, num_speculative_tokens=4, stop_on_eos=False)
    prompts = [[3, 17, 29, 41], [8, 17, 29, 41], [40, 2, 33]]
    expected = [autoregressive(target, torch.tensor([p]), config) for p in prompts]
    # A datastore of the third prompt's output, and a history of the outputs before (the second's and the third's
    # share "12 17 15"); the sequence's own matches are of one token (max_ngram=1), so both sources are asked every
    # round: each drafts, and what is verified is the target's own output.
    store = NgramDatastore(np.asarray(expected[2] + [SEPARATOR]), max_ngram=3, min_count=1, min_share=0.5)
    drafter = PromptLookupDrafter(max_ngram=1, history_tokens=256, datastore=store)
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
    assert {"datastore", "history"} <= set(sources), collections.Counter(sources)
    # Several rows at once, rows joining mid-flight: as exact.
    batched = BatchedSpeculativeDecoder(target, PromptLookupDrafter(1, history_tokens=256, datastore=store),
                                        max_batch_size=2, max_length=64, num_speculative_tokens=4)
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
    controller.trim(5, 3, "history")  # a source not seen yet starts at the prior
    assert policy.acceptance(("history", 3)).alpha(1) == pytest.approx(0.56)
