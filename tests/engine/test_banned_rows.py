"""``BannedRow.check`` on its own: a block of tokens checked at once ends as the same tokens checked one at a
time (the target-only decoder's rounds), nested words and tokens released before a rollback included."""

from __future__ import annotations

import random

import pytest

from specdecode.engine.banned_rows import BannedRow
from specdecode.engine.banned_words import BannedWords


class CharTokenizer:
    """Each id is one piece of text; id 0 is a special token (skipped when decoding)."""

    PIECES = ["", "a", "b", "c", "d", " "]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.PIECES[i] for i in ids if not (skip_special_tokens and i == 0))


TOK = CharTokenizer()
PROMPT = 3  # positions of the prompt before the first generated token


def _row(words, whole_word: bool) -> BannedRow:
    return BannedRow(BannedWords(words, whole_word=whole_word).matcher(TOK), len(TOK.PIECES), PROMPT)


def _state(row: BannedRow, output: list[int]):
    return list(output), {p: list(t) for p, t in row.forbidden.items()}, row.released


def _one_at_a_time(row: BannedRow, output: list[int], tokens: list[int], finish: str | None):
    """Each token in a round of its own, the rounds stopping at the first rollback."""
    for i, token in enumerate(tokens):
        output.append(token)
        result = row.check(output, finish if i == len(tokens) - 1 else None)
        if result[1] is not None or result[0] is not None:
            return result
    return finish, None


@pytest.mark.parametrize("whole_word", [False, True])
@pytest.mark.parametrize("words", [("bc", "abcd"), ("a b",), ("ab", "cd"), ("a a", "b"), ("abc", "b")])
def test_a_block_checked_at_once_ends_as_its_tokens_one_at_a_time(words, whole_word):
    """1,000 random histories (each token checked as it came, rollbacks included), then a block of 1-5 tokens:
    checked at once, it leaves the same output, masks and released count, and returns the same finish reason
    and rewind, as the same tokens checked one at a time up to the first rollback. Nested words: with "bc" and
    "abcd", a, b, c, d roll back to b (where the first word to complete begins), not to a. A token released
    before a rollback inside the block stays released, so a word that began in it is cut after it."""
    rng = random.Random(f"{words}{whole_word}")
    spelled = [[TOK.PIECES.index(c) for c in w] for w in words]

    def tokens(most: int, least: int) -> list[int]:  # random pieces, often whole words or their starts
        out = []
        while len(out) < most:
            out += rng.choice(spelled) if rng.random() < 0.4 else [rng.randrange(len(TOK.PIECES))]
        return out[: rng.randrange(least, most + 1)]

    differences, rollbacks = [], 0
    for _ in range(1000):
        history, block = tokens(5, 0), tokens(5, 1)
        finish = rng.choice([None, None, "length"])
        rows, outputs = [_row(words, whole_word), _row(words, whole_word)], [[], []]
        for row, output in zip(rows, outputs):
            _one_at_a_time(row, output, history, None)
        outputs[0].extend(block)
        at_once = rows[0].check(outputs[0], finish)
        one_by_one = _one_at_a_time(rows[1], outputs[1], block, finish)
        rollbacks += at_once[1] is not None
        if (at_once, _state(rows[0], outputs[0])) != (one_by_one, _state(rows[1], outputs[1])):
            differences.append((history, block, finish, at_once, _state(rows[0], outputs[0]), one_by_one,
                                _state(rows[1], outputs[1])))
    assert rollbacks > 20, rollbacks
    assert not differences, differences[:3]


def test_nested_words_roll_back_to_the_first_word_to_complete():
    """a, b, c, d in one block with the words "bc" and "abcd": one at a time, "bc" completes first, at c."""
    row, output = _row(("bc", "abcd"), whole_word=False), [1, 2, 3, 4]
    assert row.check(output, None) == (None, PROMPT + 1)
    assert output == [1] and row.forbidden == {PROMPT + 1: [2]}


def test_a_whole_word_waiting_at_the_end_is_judged_when_the_generation_ends():
    """Whole-word matching holds a word at the end until the next character; a finish with no new token ends the
    text there, so the word counts: it rolls back."""
    row, output = _row(("ab",), whole_word=True), [1, 2]
    assert row.check(output, None) == (None, None) and row.released == 0
    assert row.check(output, "length") == (None, PROMPT)
    assert output == [] and row.forbidden == {PROMPT: [1]}


def test_requests_with_the_same_list_share_one_compiled_list():
    """``from_config`` with an engine's ``compiled`` lists: the same words, case and whole-word setting give the same
    ``BannedWords``; another setting another; the oldest is dropped past ``COMPILED_LISTS``."""
    from specdecode.config import GenerationConfig
    from specdecode.engine.banned_rows import COMPILED_LISTS, compiled_lists

    compiled = compiled_lists()

    def words_of(**options):
        row = BannedRow.from_config(GenerationConfig(**options), TOK, len(TOK.PIECES), PROMPT, compiled)
        return row.matcher.banned

    first = words_of(banned_words=("ab", "cd"))
    assert words_of(banned_words=("ab", "cd")) is first
    assert words_of(banned_words=("ab", "cd"), banned_words_ignore_case=True) is not first
    for i in range(COMPILED_LISTS):
        words_of(banned_words=(f"a{'b' * i}",))
    assert compiled.cache_info().currsize == COMPILED_LISTS and words_of(banned_words=("ab", "cd")) is not first
