"""The banned-word matcher on its own: incremental text, violations, the safe prefix, bad input."""

from __future__ import annotations

import pytest

from specdecode import InvalidArgumentError
from specdecode.engine.banned_words import BannedWords


class ByteTokenizer:
    """Each id is a byte string, like a byte-level BPE vocabulary; id 0 is a special token."""

    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        data = b"".join(self.pieces[i] for i in ids if not (skip_special_tokens and i == 0))
        return data.decode("utf-8", errors="replace")


PIECES = [b"", b" ham", b"burger", b"h", b"amb", b"urger", b" ", b"bad", b"ger", b"class", b"ass", b"!",
          "é".encode()[:1], "é".encode()[1:], b"x", b"Bad", b"B", b"AD"]
TOK = ByteTokenizer(PIECES)
ID = {p: i for i, p in enumerate(PIECES)}


def ids(*pieces) -> list[int]:
    return [ID[p.encode() if isinstance(p, str) else p] for p in pieces]


def feed_one_by_one(banned: BannedWords, tokens: list[int], final_at_end: bool = True):
    """Feed tokens one at a time as the decoder would; returns (cut index or None, safe counts)."""
    m = banned.matcher(TOK)
    safe = []
    for i, t in enumerate(tokens):
        m.extend([t])
        cut = m.violation(final=final_at_end and i == len(tokens) - 1)
        if cut is not None:
            return cut, safe, m
        safe.append(m.num_safe())
    return None, safe, m


@pytest.mark.parametrize(
    "tokens,cut",
    [
        (ids(" ", "x", " ham", "burger"), 2),  # two tokens
        (ids("x", " ", "h", "amb", "urger"), 2),  # three tokens
        (ids("x", " ham", "burger", "!"), 1),
    ],
)
def test_a_word_split_over_tokens_is_found_and_cut_at_its_first_token(tokens, cut):
    found, safe, m = feed_one_by_one(BannedWords(["hamburger"]), tokens)
    assert found == cut
    assert "hamburger" in m.text
    # Nothing at or after the cut was ever safe to release.
    assert all(s <= cut for s in safe)


def test_text_matches_a_whole_decode_and_the_safe_prefix_holds_back_partial_words():
    banned = BannedWords(["hamburger"])
    m = banned.matcher(TOK)
    m.extend(ids("x", " ", "h", "amb"))
    assert m.text == TOK.decode(m.token_ids) == "x hamb"
    assert m.violation() is None
    assert m.num_safe() == 2  # "x", " " are out; "h"+"amb" could still become "hamburger"
    m.extend(ids("!"))
    assert m.violation() is None and m.num_safe() == 5


def test_overlapping_and_nested_words_cut_at_the_earliest_start():
    found, _, m = feed_one_by_one(BannedWords(["badger", "bad"]), ids("x", "bad"))
    assert found == 1
    found, _, _ = feed_one_by_one(BannedWords(["ger", "badger"]), ids("x", "bad", "ger"))
    assert found == 1  # "badger" starts before "ger"


def test_case_insensitive_matching():
    assert feed_one_by_one(BannedWords(["bad"]), ids("x", "Bad"))[0] is None
    assert feed_one_by_one(BannedWords(["bad"], ignore_case=True), ids("x", "Bad"))[0] == 1
    assert feed_one_by_one(BannedWords(["BAD"], ignore_case=True), ids("x", "B", "AD"))[0] == 1


def test_whole_word_matching_waits_for_the_next_character():
    banned = BannedWords(["ass"], whole_word=True)
    assert feed_one_by_one(banned, ids("class", "!"))[0] is None  # inside a word: allowed
    m = banned.matcher(TOK)
    m.extend(ids(" ", "ass"))
    assert m.violation() is None  # "assess" would be fine: wait
    assert m.num_safe() == 1  # but never release it before knowing
    m.extend(ids("!"))
    assert m.violation() == 1
    m = banned.matcher(TOK)
    m.extend(ids(" ", "ass"))
    assert m.violation(final=True) == 1  # the end of the text is a boundary
    m = banned.matcher(TOK)
    m.extend(ids(" ", "ass", "x"))
    assert m.violation(final=True) is None  # "assx" is another word


def test_a_character_split_over_tokens_is_never_split_by_a_cut_or_a_release():
    banned = BannedWords(["é!"])
    m = banned.matcher(TOK)
    m.extend([ID["é".encode()[:1]]])
    assert m.text == "" and m.num_safe() == 0  # half a character: held back
    m.extend([ID["é".encode()[1:]]])
    assert m.text == "é" and m.num_safe() == 0  # a prefix of "é!"
    m.extend(ids("!"))
    assert m.violation() == 0  # cut at the first byte's token, not the second


def test_truncate_forgets_the_tail_and_matching_resumes():
    banned = BannedWords(["hamburger"])
    m = banned.matcher(TOK)
    m.extend(ids("x", " ham", "burger"))
    assert m.violation() == 1
    m.truncate(1)
    assert m.text == "x" and m.token_ids == ids("x")
    m.extend(ids(" ", "h", "amb", "urger"))
    assert m.violation() == 2


def test_truncate_back_into_half_a_character_keeps_it_open():
    """A rollback truncates the matcher, possibly into half a character (a cut that backs off, or that stops at
    released tokens). The next token still completes that character: a word beginning with it is cut at its
    first byte's token, and that token is not released."""
    banned = BannedWords(["é!"])
    first, second = ID["é".encode()[:1]], ID["é".encode()[1:]]
    m = banned.matcher(TOK)
    m.extend([ID[b"x"], first])
    assert m.num_safe() == 1
    m.extend([second, ID[b"!"]])  # the next tokens complete the character ...
    m.truncate(2)  # ... and a rollback truncates back into it
    assert m.text == "x" and m.num_safe() == 1
    m.extend([second])
    assert m.text == "xé" and m.num_safe() == 1
    m.extend(ids("!"))
    assert m.violation() == 1  # the first byte's token, not the second


@pytest.mark.parametrize("words", [[], [""], ["   "], ["ok", "\n\t"], [None]])
def test_bad_words_are_refused_with_the_value(words):
    with pytest.raises(InvalidArgumentError, match="banned"):
        BannedWords(words)


def test_a_matcher_needs_a_tokenizer():
    with pytest.raises(InvalidArgumentError, match="tokenizer"):
        BannedWords(["x"]).matcher(None)
