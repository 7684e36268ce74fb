"""Banned words: a finite-state matcher over the generated text, for rollback-and-mask decoding.

Token masking (OpenAI's ``logit_bias``, transformers' ``bad_words_ids``) works on
token ids, but one word has many tokenizations (" hamburger", " ham" + "burger",
"H" + "amb" + ...), so an id-level ban lets banned text through. Following the
blog post "Using Finite State Machine (FSM) and Rollback Mechanism to Restrict
LLM from Generating Banned Words" (code: ccs96307/llm-decode-filter-special-words),
the words are matched on the *text* as tokens are committed, with an Aho–Corasick
automaton (``pyahocorasick``). When a banned word completes, the decoder cuts the
output back to the token where the word began, forbids that token at that
position (a logit mask for that position only) and continues.

``BannedWords`` is the compiled list (reusable); ``BannedWordMatcher`` is the
per-generation state: the generated text, decoded incrementally (a few tokens of
context per new token, never the whole output), the character end of every token,
and how many tokens are *safe*, i.e. can no longer become part of a banned word.
A stream only releases safe tokens, so it never shows a banned word, not even
briefly: it holds back exactly the tail that is still a prefix of some banned word
(with whole-word matching, a complete word at the end too, until the next
character shows whether the word goes on).

Matching rules:

* ``ignore_case``: words and text are compared lower-cased (character by character,
  so offsets stay those of the text).
* ``whole_word``: a match counts only between word boundaries: the characters
  around it are not letters, digits or ``_`` (the start of the generated text and
  its end, once generation ends, are boundaries). A banned "ass" does not block "class".
* Matching covers the generated text only, not the prompt.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from pathlib import Path

from specdecode.config import check_banned_words
from specdecode.errors import InvalidArgumentError


def _fold(text: str, ignore_case: bool) -> str:
    """``text`` lower-cased character by character (same length), or unchanged."""
    if not ignore_case:
        return text
    low = text.lower()
    if len(low) == len(text):
        return low
    return "".join(c if len(c.lower()) != 1 else c.lower() for c in text)


def _is_word_char(c: str) -> bool:
    return c.isalnum() or c == "_"


class BannedWords:
    """A compiled list of banned words.

    Args:
        words: The words or phrases (at least one; none empty or only whitespace);
            duplicates are merged.
        ignore_case: Match regardless of case.
        whole_word: Match only whole words (see the module docstring).

    Attributes:
        words: The words as given, deduplicated, in order.
        max_len: Length of the longest word, in characters.

    Raises:
        InvalidArgumentError: If ``words`` is empty, or a word is empty, only whitespace,
            or not a string.
    """

    def __init__(self, words: Iterable[str], *, ignore_case: bool = False, whole_word: bool = False) -> None:
        import ahocorasick  # pyahocorasick; a dependency of specdecode

        self.words = words = check_banned_words(words)
        self.ignore_case = bool(ignore_case)
        self.whole_word = bool(whole_word)
        self.max_len = max(len(w) for w in words)
        self._automaton = ahocorasick.Automaton()
        for w in words:
            folded = _fold(w, self.ignore_case)
            self._automaton.add_word(folded, len(folded))
        self._automaton.make_automaton()

    def find(self, folded: str, start: int) -> list[tuple[int, int]]:
        """(start, end) character spans of every match in ``folded[start:]``, ``folded`` already case-folded."""
        if start >= len(folded):
            return []
        return [(end + 1 - length, end + 1) for end, length in self._automaton.iter(folded, start)]

    def is_prefix(self, folded: str) -> bool:
        """Whether ``folded`` is a prefix of some banned word (or a whole one)."""
        return self._automaton.match(folded)

    def matcher(self, tokenizer) -> BannedWordMatcher:
        """Fresh per-generation state; ``tokenizer`` decodes token ids (skipping special tokens)."""
        return BannedWordMatcher(self, tokenizer)


class BannedWordMatcher:
    """The generated text of one generation, matched against ``BannedWords`` as tokens arrive.

    The decoder calls ``extend`` with newly committed tokens, then ``violation`` to learn
    whether a banned word completed, ``truncate`` after a rollback, and ``num_safe`` to
    know how many tokens it may release to the caller.

    Attributes:
        token_ids: The tokens fed so far (the generated tokens, prompt excluded).
        text: Their text, as ``tokenizer.decode(token_ids, skip_special_tokens=True)``
            gives it for byte-level and word-level tokenizers.
    """

    CONTEXT_TOKENS = 4  # earlier tokens decoded with each new one, so spaces and merges come out right

    def __init__(self, banned: BannedWords, tokenizer) -> None:
        if tokenizer is None:
            raise InvalidArgumentError("banned_words need a tokenizer; pass tokenizer= to the decoder")
        self.banned = banned
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.text = ""
        self._folded = ""
        self._ends: list[int] = []  # character end of each token's text
        self._group: list[int] = []  # first token of the bytes that make each token's first character
        self._pending_from: int | None = None  # first token of a group whose bytes are not a whole character yet
        self._pending: list[int | None] = []  # ``_pending_from`` after each token, for ``truncate``
        self._checked = 0  # text length at the last ``violation`` call

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def extend(self, token_ids: Iterable[int]) -> None:
        """Append committed tokens and their text."""
        for token in token_ids:
            j = len(self.token_ids)
            self.token_ids.append(int(token))
            start = j if self._pending_from is None else self._pending_from
            ctx = max(0, start - self.CONTEXT_TOKENS)
            full = self._decode(self.token_ids[ctx : j + 1])
            self._group.append(start)
            if full.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the rest of its bytes
                self._pending_from = start
                self._pending.append(start)
                self._ends.append(len(self.text))
                continue
            base = self._decode(self.token_ids[ctx:start])
            if full.startswith(base):
                piece = full[len(base) :]
            else:  # the context decodes differently once extended: diff against the whole text
                piece = self._decode(self.token_ids)[len(self.text) :]
            self._pending_from = None
            self._pending.append(None)
            self.text += piece
            self._folded += _fold(piece, self.banned.ignore_case)
            self._ends.append(len(self.text))

    def truncate(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens (0 <= num_tokens <= len(token_ids))."""
        del self.token_ids[num_tokens:]
        del self._ends[num_tokens:]
        del self._group[num_tokens:]
        del self._pending[num_tokens:]
        end = self._ends[-1] if self._ends else 0
        self.text, self._folded = self.text[:end], self._folded[:end]
        # as it was after the last token kept: a character whose bytes that token left open is open again
        self._pending_from = self._pending[-1] if self._pending else None
        self._checked = min(self._checked, end)

    def _is_violation(self, start: int, end: int, final: bool) -> bool | None:
        """True, False, or None when it depends on text not generated yet (a whole word at the end)."""
        if not self.banned.whole_word:
            return True
        if start > 0 and _is_word_char(self.text[start - 1]):
            return False
        if end == len(self.text):
            return True if final else None
        return not _is_word_char(self.text[end])

    def violation(self, final: bool = False) -> int | None:
        """Index of the first token to cut if a banned word completed since the last call, else None.

        The cut is at the token whose text holds the word's first character (or, when that
        character's bytes span several tokens, the first of them).

        Args:
            final: Generation ends here: a whole word at the very end counts.
        """
        # A match not seen before ends after the last check; re-scanning max_len characters
        # before it also re-judges a whole word that was waiting for its next character.
        start = max(0, self._checked - self.banned.max_len)
        self._checked = len(self.text)
        first = None
        for s, e in self.banned.find(self._folded, start):
            if (first is None or s < first) and self._is_violation(s, e, final):
                first = s
        if first is None:
            return None
        return self._group[bisect.bisect_right(self._ends, first)]

    def num_safe(self) -> int:
        """How many leading tokens no later token can make part of a banned word.

        Holds back the longest tail of the text that is a prefix of a banned word
        (with whole-word matching, also a complete word at the very end), and any
        tokens whose bytes do not yet form a whole character.
        """
        n = len(self.text)
        hold = 0
        for d in range(min(self.banned.max_len, n), 0, -1):
            if self.banned.is_prefix(self._folded[n - d :]):
                hold = d
                break
        safe = bisect.bisect_right(self._ends, n - hold) if hold else len(self.token_ids)
        if self._pending_from is not None:
            safe = min(safe, self._pending_from)
        # Never split the tokens of one character: a cut inside it goes back to its first token.
        return self._group[safe] if safe < len(self.token_ids) else safe


def read_banned_words(path: str | Path) -> list[str]:
    """The banned words in a UTF-8 text file, one word or phrase per line.

    Surrounding whitespace is stripped and blank lines are skipped.

    Raises:
        InvalidArgumentError: If the file cannot be read, is not UTF-8, or holds no word.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InvalidArgumentError(f"banned-words file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgumentError(f"cannot read banned-words file {str(path)!r}: {e}") from None
    words = [line.strip() for line in text.splitlines() if line.strip()]
    if not words:
        raise InvalidArgumentError(f"banned-words file {str(path)!r} holds no word (one per line)")
    return words
