"""Prompt-lookup drafting: hand-computed n-gram matches, validation, exactness."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from conftest import make_tiny_model
from selfspec_helpers import (  # noqa: F401  (one_thread is a fixture)
    autoregressive,
    exact_marginals,
    one_thread,
    sample_counts,
    violations,
)
from specdecode.engine.batch_cache import BatchKVCache
from specdecode import GenerationConfig, InvalidArgumentError, SpeculativeDecoder
from specdecode.drafters.prompt_lookup import (HostSequences, PromptLookupDrafter, continuation_tree, find_continuation,
                                                find_continuations, match_continuation)
from specdecode.engine.batched import BatchedSpeculativeDecoder

pytestmark = pytest.mark.usefixtures("one_thread")


def _find(seq, max_tokens=3, max_ngram=3, min_ngram=1):
    return find_continuation(torch.tensor(seq), max_tokens, max_ngram, min_ngram).tolist()


def test_most_recent_match_wins():
    #        0  1  2  3  4  5  6  7  8  9
    seq = [5, 6, 7, 8, 5, 6, 9, 4, 5, 6]
    # No earlier (4, 5, 6); (5, 6) occurs at 0 and 4 -> the latest, 4, is followed by 9, 4, 5.
    assert _find(seq) == [9, 4, 5]
    assert _find(seq, max_tokens=10) == [9, 4, 5, 6]  # up to the end of the sequence
    assert _find(seq, max_tokens=1) == [9]


def test_longer_ngram_is_tried_first():
    #        0  1  2  3  4  5  6  7  8  9  10
    seq = [1, 2, 3, 7, 9, 2, 3, 8, 1, 2, 3]
    assert _find(seq, max_tokens=2, max_ngram=3) == [7, 9]  # (1, 2, 3) at 0
    assert _find(seq, max_tokens=2, max_ngram=2) == [8, 1]  # (2, 3) latest at 5
    assert _find(seq, max_tokens=2, max_ngram=1, min_ngram=1) == [8, 1]  # (3,) latest at 6


def test_min_ngram_and_no_match():
    assert _find([4, 1, 2, 9, 3]) == []  # 3 never occurred before
    assert _find([4, 1, 2, 9, 2]) == [9, 2]  # (2,) at 2
    assert _find([4, 1, 2, 9, 2], min_ngram=2) == []  # (9, 2) never occurred before
    assert _find([7]) == []
    assert _find([7, 7, 7], max_tokens=5) == [7]  # (7, 7) at 0, followed by the last 7


def test_ngram_validation():
    for kwargs, message in [
        (dict(min_ngram=0), "min_ngram must be an integer >= 1, got 0"),
        (dict(max_ngram=0), "max_ngram must be an integer >= 1, got 0"),
        (dict(max_ngram=2, min_ngram=3), "min_ngram (3) must be <= max_ngram (2); allowed: 1 <= min_ngram <= max_ngram"),
        (dict(max_ngram=2.5), "max_ngram must be an integer >= 1, got 2.5"),
    ]:
        with pytest.raises(InvalidArgumentError) as e:
            PromptLookupDrafter(**kwargs)
        assert message in str(e.value)
    host = np.array([4, 1, 2, 9, 2], dtype=np.int64)
    for match in (lambda: find_continuation(torch.from_numpy(host), 3, 3, 0), lambda: find_continuation(host, 3, 3, 0),
                  lambda: match_continuation(host, 3, 3, 0), lambda: find_continuations(host, 3, 3, 0, 2)):
        with pytest.raises(InvalidArgumentError, match=r"min_ngram must be an integer >= 1, got 0"):
            match()  # the empty n-gram would match everywhere
    with pytest.raises(InvalidArgumentError, match=r"min_ngram must be an integer >= 1, got 1.5"):
        match_continuation(host, 3, 3, 1.5)


def test_drafter_proposes_without_a_model():
    drafter = PromptLookupDrafter(max_ngram=2)
    drafter.bind(BatchKVCache(make_tiny_model("llama", num_layers=1), 2, 16))
    seq = [5, 6, 7, 8, 5, 6]
    draft = drafter.propose([seq, [9, 9, 3]], [3, 3])  # row 1: no earlier match of (9, 3) or 3
    assert draft.tokens[0].tolist() == [7, 8, 5] and draft.num_tokens == [3, 0] and draft.probs is None
    seq[2] = 0  # the draft does not alias the caller's list
    assert draft.tokens[0].tolist() == [7, 8, 5] and draft.tokens.dtype == torch.long
    assert drafter.num_forwards == 0


def test_greedy_equals_autoregressive(arch):
    """A repetitive prompt gives matches; the output is still exactly the target's."""
    model = make_tiny_model(arch, num_layers=2)
    prompt = torch.tensor([[5, 9, 12, 7, 5, 9, 12, 7, 5, 9, 12, 7, 20, 21]])
    for gamma in (2, 6):
        config = GenerationConfig(max_new_tokens=30, num_speculative_tokens=gamma, stop_on_eos=False)
        result = SpeculativeDecoder(model, PromptLookupDrafter()).generate(prompt, config)
        assert result.token_ids == autoregressive(model, prompt, config), (arch, gamma)
        assert result.stats.num_drafted_tokens > 0 and result.stats.num_draft_forwards == 0


def test_sampling_preserves_target_distribution():
    """Deterministic drafts (probs None, one-hot q) keep the target law of tokens 1-3."""
    vocab, n = 8, 600
    model = make_tiny_model("qwen2", num_layers=1, vocab_size=vocab, seed=2)
    prompt = [5, 3, 6, 5, 3, 4, 6, 5, 7]
    config = GenerationConfig(max_new_tokens=3, num_speculative_tokens=3, stop_on_eos=False, temperature=1.0)
    dec = SpeculativeDecoder(model, PromptLookupDrafter(max_ngram=2))
    freq = sample_counts(dec, prompt, config, n, vocab)
    assert violations(exact_marginals(model, prompt, config, vocab), freq, n) == []
    # The lookup drafted, and was accepted sometimes and rejected sometimes.
    runs = [dec.generate(prompt, dataclasses.replace(config, seed=s)).stats for s in range(30)]
    drafted = sum(r.num_drafted_tokens for r in runs)
    assert 0 < sum(r.num_accepted_tokens for r in runs) < drafted


def _brute_match(seq: list[int], max_tokens: int, max_ngram: int, min_ngram: int) -> tuple[list[int], int]:
    """The definition, window by window: n from the longest down, the latest start j < L - n whose n tokens
    equal the last n decides; its continuation and n, or ([], 0)."""
    length = len(seq)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        for j in range(length - n - 1, -1, -1):
            if seq[j : j + n] == seq[length - n :]:
                return seq[j + n : j + n + max_tokens], n
    return [], 0


def _brute_continuations(seq: list[int], max_tokens: int, max_ngram: int, min_ngram: int, branches: int):
    """``find_continuations``' definition, window by window: n from the longest down, the latest start first;
    a continuation that is a prefix of one found (itself included) adds nothing."""
    length, found = len(seq), []
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        for j in range(length - n - 1, -1, -1):
            cont = seq[j + n : j + n + max_tokens]
            if seq[j : j + n] == seq[length - n :] and cont and not any(f[: len(cont)] == cont for f in found):
                found.append(cont)
                if len(found) == branches:
                    return found
    return found


def test_host_matching_equals_tensor_matching_and_the_definition():
    """The decoder's host copy (a numpy array) gives the same continuation as the tensor, and both, with the
    n that decided, are the definition's (``_brute_match``), as are a tree's several continuations
    (``_brute_continuations``): short and long sequences, small alphabets (many overlapping matches) and larger
    ones, every (max_ngram, min_ngram) pair up to 4."""
    g = torch.Generator().manual_seed(3)
    pairs = [(hi, lo) for hi in range(1, 5) for lo in range(1, hi + 1)]
    sizes = {n: 0 for n in range(5)}
    for trial in range(300):
        length = int(torch.randint(1, 40 if trial < 200 else 300, (1,), generator=g))
        vocab = (2, 4, 30)[trial % 3]
        seq = torch.randint(0, vocab, (length,), generator=g)
        for max_ngram, min_ngram in pairs:
            want, want_n = _brute_match(seq.tolist(), 5, max_ngram, min_ngram)
            assert find_continuation(seq, 5, max_ngram, min_ngram).tolist() == want, (trial, seq.tolist(), max_ngram)
            host = seq.numpy().astype(np.int64)
            got = find_continuation(host, 5, max_ngram, min_ngram)
            assert isinstance(got, np.ndarray) and got.tolist() == want, (trial, seq.tolist(), max_ngram)
            got, n = match_continuation(host, 5, max_ngram, min_ngram)
            assert (got.tolist(), n) == (want, want_n), (trial, seq.tolist(), max_ngram, min_ngram)
            got[:] = -1  # a copy: the sequence is untouched
            assert host.tolist() == seq.tolist()
            for branches in (1, 3):  # [trees] several matches' continuations
                assert find_continuations(host, 3, max_ngram, min_ngram, branches) == \
                    _brute_continuations(seq.tolist(), 3, max_ngram, min_ngram, branches), (trial, branches)
            sizes[n] += 1
    assert all(sizes.values()), sizes  # every outcome, no match included, was checked


def test_several_matches_make_a_trie():
    seq = np.array([1, 2, 3, 4, 1, 2, 3, 9, 8, 1, 2, 5, 1, 2], dtype=np.int64)
    # (1, 2) occurred at 9, 4 and 0: continuations 5.., 3 9.., 3 4.. (most recent first).
    found = find_continuations(seq, 3, max_ngram=2, min_ngram=2, max_branches=3)
    assert found == [[5, 1, 2], [3, 9, 8], [3, 4, 1]]
    tokens, parents = continuation_tree(found, 8)
    assert tokens == [5, 1, 2, 3, 9, 8, 4, 1] and parents == [0, 1, 2, 0, 4, 5, 4, 7]  # "3" once, shared
    tokens, parents = continuation_tree(found, 3)  # one node kept for the other first token (3)
    assert tokens == [5, 1, 3] and parents == [0, 1, 0]
    assert find_continuations(seq, 3, 2, 2, max_branches=1) == [find_continuation(seq, 3, 2, 2).tolist()]
    with pytest.raises(InvalidArgumentError, match="branches must be an integer >= 1, got 0"):
        PromptLookupDrafter(branches=0)


@pytest.mark.parametrize("rows", [1, 2])
def test_multi_match_trees_give_target_only_tokens(arch, rows):
    model = make_tiny_model(arch, num_layers=2)
    prompts = [[5, 9, 12, 7, 5, 9, 13, 7, 5, 9, 12, 8, 5, 9], [4, 6, 4, 7, 4, 6, 8, 4]]
    config = GenerationConfig(max_new_tokens=30, stop_on_eos=False)
    expected = [autoregressive(model, torch.tensor([p]), config) for p in prompts]
    dec = BatchedSpeculativeDecoder(model, PromptLookupDrafter(branches=3), max_batch_size=rows, max_length=64,
                                    num_speculative_tokens=6)
    results = dec.generate(prompts, config)
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.num_drafted_tokens for r in results) > 0


def test_host_sequences_copy_only_what_is_new_and_follow_rollbacks_joins_and_moves():
    """``HostSequences``: each ``arrays`` equals the rows' lists; what a ``rollback`` drops is taken anew
    even where the row grew back past it with other tokens; a list cut from its end needs no rollback;
    ``join`` forgets a slot; ``move`` carries a row's tokens to its new slot; buffers grow."""
    host = HostSequences()

    def check(sequences):
        out = host.arrays(sequences)
        assert [a.tolist() for a in out] == sequences
        return out

    a, b = list(range(10)), list(range(100, 105))
    check([a, b])
    a += [10, 11]
    check([a, b])
    a[0] = -100  # changed with no rollback (the engine never does): not read again, only tokens 12.. are
    assert host.arrays([a + [12], b])[0].tolist() == list(range(13))
    a[0] = 0
    a += [12]
    host.rollback([8, 5])  # a rewind: tokens 8.. of row 0 are replaced, and it grows past 12 again
    a = a[:8] + [-1, -2, -3, -4, -5]
    check([a, b])
    b = b[:3]  # cut from its end, no rollback
    check([a, b])
    b += [7, 7]
    check([a, b])
    host.join(1)  # a new row in slot 1, as long as the old one
    b = [-9, -8, -7, -6, -5]
    check([a, b])
    c = list(range(300))  # slot 2 grows past its first buffer
    check([a, b, c])
    c += list(range(300, 700))
    check([a, b, c])
    host.move(2, 0, 700)  # row 2 moves into slot 0; slot 2 is free
    host.join(1)
    b = [1, 2, 3]
    out = check([c, b])
    assert out[0].dtype == np.int64 and len(out[0]) == 700
    host.join(2)
    check([c, b, list(range(40))])
    host.move(0, 2, 650)  # fewer confirmed tokens than held: what follows them is taken anew
    c = c[:650] + [-1]
    check([[5], b, c])  # and slot 0 holds nothing (it is not joined)
