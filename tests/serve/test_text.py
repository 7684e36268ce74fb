"""Streamed text: stop sequences cut as OpenAI does, partial matches and split characters held back."""

from __future__ import annotations

import pytest

from specdecode.serve.text import TextAssembler


class PieceTokenizer:
    """Token i decodes to PIECES[i]; id 0 is special (skipped); ids 7 and 8 are the two UTF-8 halves of 'é'."""

    PIECES = {0: "<eos>", 1: "Hello", 2: " wor", 3: "ld", 4: "!", 5: " EN", 6: "D", 7: b"\xc3", 8: b"\xa9"}

    def decode(self, ids, skip_special_tokens=True):
        data = b""
        for i in ids:
            if i == 0 and skip_special_tokens:
                continue
            piece = self.PIECES[i]
            data += piece if isinstance(piece, bytes) else piece.encode()
        return data.decode("utf-8", errors="replace")


def stream(assembler: TextAssembler, deliveries: list[list[int]]) -> list[str]:
    return [assembler.push(ids, final=i == len(deliveries) - 1) for i, ids in enumerate(deliveries)]


def test_without_stop_strings_text_flows_as_decoded():
    a = TextAssembler(PieceTokenizer())
    assert stream(a, [[1], [2, 3], [4, 0]]) == ["Hello", " world", "!"]


def test_a_stop_string_is_cut_and_nothing_after_it_is_sent():
    a = TextAssembler(PieceTokenizer(), ("END",))
    parts = stream(a, [[1, 2], [3, 5], [6, 4]])
    assert "".join(parts) == "Hello world "
    assert a.stopped and "END" not in "".join(parts)


def test_a_possible_stop_prefix_is_held_back_then_released():
    a = TextAssembler(PieceTokenizer(), ("ENDX",))
    assert a.push([1, 5], final=False) == "Hello "  # " EN" could start "ENDX": "EN" waits
    assert a.push([6], final=False) == ""  # "END" still could
    assert a.push([4], final=True) == "END!"  # it did not: released at the end
    assert a.text == "Hello END!" and not a.stopped


def test_a_stop_string_spanning_deliveries_is_found():
    a = TextAssembler(PieceTokenizer(), ("lo w",))
    assert "".join(stream(a, [[1], [2], [3]])) == "Hel"


def test_a_split_utf8_character_waits_for_its_second_byte():
    a = TextAssembler(PieceTokenizer())
    assert a.push([1, 7], final=False) == "Hello"
    assert a.push([8], final=False) == "é"
    assert a.push([4], final=True) == "!"


class CleaningTokenizer(PieceTokenizer):
    """Decodes like a tokenizer with ``clean_up_tokenization_spaces``: " 't" becomes "'t", so the
    text of a longer prefix rewrites characters of a shorter one."""

    PIECES = {**PieceTokenizer.PIECES, 9: " '", 10: "t"}

    def decode(self, ids, skip_special_tokens=True):
        return super().decode(ids, skip_special_tokens).replace(" 't", "'t")


def test_a_decode_that_rewrites_earlier_text_does_not_stall_the_stream():
    a = TextAssembler(CleaningTokenizer())
    parts = stream(a, [[1], [9], [10], [2, 3], [4]])
    assert parts == ["Hello", " '", "t", " world", "!"]  # nothing sent is taken back, nothing is lost
    assert a.text == "Hello 't world!"


def test_each_push_decodes_only_the_new_window():
    calls = []

    class Counting(PieceTokenizer):
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return super().decode(ids, skip_special_tokens)

    a = TextAssembler(Counting())
    for _ in range(50):
        a.push([1, 2], final=False)
    assert a.text == "Hello wor" * 50
    assert max(calls) <= 4  # the previous delivery as context plus this one, never the whole output


def test_token_offsets_skip_special_tokens_and_count_a_split_character_once():
    """Completions' logprobs.text_offset: where each token starts in the text as sent, which is decoded
    without special tokens; both halves of 'é' start where 'é' does."""
    a = TextAssembler(PieceTokenizer(), offsets=True)
    parts = stream(a, [[1, 0], [2, 7], [8, 3, 4]])
    text = "".join(parts)
    assert text == a.text == "Hello woréld!"
    assert a.token_ids == [1, 0, 2, 7, 8, 3, 4]
    assert a.token_offsets == [0, 5, 5, 9, 9, 10, 12]
    assert TextAssembler(PieceTokenizer()).token_offsets is None  # only computed when asked


def test_token_offsets_follow_the_tokens_past_a_stop_string():
    a = TextAssembler(PieceTokenizer(), ("END",), offsets=True)
    assert "".join(stream(a, [[1, 0, 2], [3, 5, 6]])) == "Hello world "
    assert a.token_offsets == [0, 5, 5, 9, 11, 14]  # " EN" starts at 11; "D" past the cut text


def test_token_texts_are_what_each_token_adds_and_join_to_the_text():
    """logprobs' tokens: a special token adds "", the first half of 'é' adds "" and the second the whole 'é'
    (each half's own decode is U+FFFD)."""
    a = TextAssembler(PieceTokenizer(), offsets=True)
    assert "".join(stream(a, [[1, 0], [2, 7], [8, 3, 4]])) == a.text == "Hello woréld!"
    assert [t.text for t in a.tokens] == ["Hello", "", " wor", "", "é", "ld", "!"]
    assert [t.offset for t in a.tokens] == a.token_offsets
    assert all(a.text[t.offset:t.offset + len(t.text)] == t.text for t in a.tokens)


def test_token_texts_of_alternatives_are_decoded_in_the_same_place():
    a = TextAssembler(PieceTokenizer(), offsets=True)
    a.push([1, 7], final=False, alternatives=[[2], [3, 0]])
    a.push([8], final=True, alternatives=[[4, 8]])
    assert [dict(t.alternatives) for t in a.tokens] == [{2: " wor"}, {3: "ld", 0: ""}, {4: "\ufffd!", 8: "é"}]
    with pytest.raises(ValueError, match="one entry per token: 1 for 2 tokens"):
        a.push([3, 4], final=False, alternatives=[[1]])
