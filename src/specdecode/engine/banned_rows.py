"""Banned words with rollback for one sequence: the state and decisions both decoders share.

``engine.banned_words`` matches banned words on the generated text; this module is what a
decoder does with the matches, written once and used by the batched engine's round
(``engine.batched``, one per row that asks for banned words; ``engine.decoder`` runs it with one
row). Following the rollback-and-mask
method of "Using Finite State Machine (FSM) and Rollback Mechanism to Restrict LLM from
Generating Banned Words" (code: ccs96307/llm-decode-filter-special-words), a ``BannedRow``
keeps:

* the **masks**: position in the sequence (prompt included) -> token ids the target may not
  produce there, applied to a verification's logits before the token choice
  (``mask_batch``);
* the **check after emit** (``check``): the newly emitted tokens are matched one at a time; on a
  banned word the output is cut back to the token where the word began, that token is forbidden
  there, and the decoder rewinds its caches to that length. Tokens already released to the caller
  (``released``) are never taken back.

A row verifies its whole draft block, banned words or not: the check judges each token as if it
had come alone, so a block ends as its tokens would one round each, and the output (greedy) or its
law (sampling) is that of the target-only decoder. There is no draft cut before a word the draft would
spell: under sampling it biased the law (a cut chosen by draft tokens past the ones kept), and under
greedy decoding it gave the same output in as many target forwards (5 Spec-Bench prompts, 1,000 words,
174 against 173 for ``draft``) at a matcher pass per row and round, with 17-22% less verification input (the
block's tokens from a word on, which the target now verifies) (``docs/benchmarks/2026-11-29-banned-words-no-cut.md``).

Semantics (as ``decoder.GenerationStream`` documents them): under greedy decoding the output is
the target's greedy output with the (position, token) masks applied, a deterministic function
of the prompt and the banned words; a mask holds for the prefix it was made for, so rolling
back drops the masks after the cut. Under sampling, rollback and masking is not exact
conditioning on "contains no banned word" (see ``GenerationStream``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from specdecode.config import GenerationConfig
from specdecode.engine.banned_words import BannedWordMatcher, BannedWords
from specdecode.engine.batch_cache import to_device

#: ``finish_reason`` of a generation that could not avoid a banned word without taking back
#: tokens already released.
BANNED_WORD = "banned_word"
#: How many compiled banned-word lists an engine keeps for reuse (``BannedRow.from_config``).
COMPILED_LISTS = 16


def _compile(words: tuple[str, ...], ignore_case: bool, whole_word: bool) -> BannedWords:
    return BannedWords(words, ignore_case=ignore_case, whole_word=whole_word)


def compiled_lists() -> Callable[[tuple[str, ...], bool, bool], BannedWords]:
    """An engine's compiled banned-word lists: (words, ignore case, whole word) -> ``BannedWords``, the last
    ``COMPILED_LISTS`` kept (``functools.lru_cache``; ``cache_info`` counts them)."""
    return functools.lru_cache(maxsize=COMPILED_LISTS)(_compile)


class BannedRow:
    """One sequence's banned-word state: matcher, masks, and the tokens released so far.

    Args:
        matcher: The sequence's ``BannedWordMatcher`` (fed the generated tokens only).
        vocab_size: The target's logits width V: when every one of the V tokens is forbidden
            at a position, the rollback backs off one more token.
        num_prompt_tokens: n; positions count from the start of the prompt, so the first
            generated token is at position n.

    Attributes:
        forbidden: position (prompt included) -> token ids masked there, in the order forbidden.
        released: How many generated tokens the caller was given; they can never be taken back.
    """

    def __init__(self, matcher: BannedWordMatcher, vocab_size: int, num_prompt_tokens: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.num_prompt_tokens = num_prompt_tokens
        self.forbidden: dict[int, list[int]] = {}
        self.released = 0

    @classmethod
    def from_config(
        cls, config: GenerationConfig, tokenizer, vocab_size: int, num_prompt_tokens: int,
        compiled: Callable[[tuple[str, ...], bool, bool], BannedWords] | None = None,
    ) -> BannedRow | None:
        """The state for ``config.banned_words``, or None when it has none.

        ``compiled``: an engine's ``compiled_lists``, so that the choices of one request, or requests with the same
        list, share one automaton (a ``BannedWords`` is reusable); None compiles the list for this row alone.

        Raises:
            InvalidArgumentError: If banned words are asked for without a tokenizer.
        """
        if not config.banned_words:
            return None
        words = (compiled or _compile)(config.banned_words, config.banned_words_ignore_case,
                                       config.banned_words_whole_word)
        return cls(words.matcher(tokenizer), vocab_size, num_prompt_tokens)

    @property
    def forbidden_tokens(self) -> dict[int, list[int]]:
        """The masks by generated position (0 = the first new token) -> masked token ids, in position order."""
        n = self.num_prompt_tokens
        return {p - n: list(tokens) for p, tokens in sorted(self.forbidden.items())}

    # -- masks ------------------------------------------------------------------------------------

    def forbid(self, position: int, token: int) -> bool:
        """Mask ``token`` at sequence ``position`` from now on; True when no token is left there."""
        tokens = self.forbidden.setdefault(position, [])
        if token not in tokens:
            tokens.append(token)
        return len(tokens) >= self.vocab_size

    def forget_masks_after(self, position: int) -> None:
        """Drop the masks of positions after ``position`` (their prefix is being rolled back)."""
        for later in [p for p in self.forbidden if p > position]:
            del self.forbidden[later]

    def masks(self, first_position: int, width: int) -> list[tuple[int, int]]:
        """(i, token) for every mask on positions ``first_position .. first_position + width - 1``."""
        if not self.forbidden:
            return []
        return [(i, t) for i in range(width) for t in self.forbidden.get(first_position + i, ())]

    # -- after emit -------------------------------------------------------------------------------

    def check(self, output: list[int], finish_reason: str | None, *stats) -> tuple[str | None, int | None]:
        """Match the new tokens of ``output``; on a banned word, roll back and mask.

        The output is cut back to the token where the word begins, that token is forbidden
        at that position, and the caller rewinds its caches there. Masks after the cut are
        dropped: they were made for a prefix that no longer exists. Released tokens cannot
        change, so a word that began in them is cut at the first unreleased token instead
        (that token is what completed or continued it). If the whole vocabulary is then
        forbidden at a position, the cut backs off one more token (never into the prompt,
        nor into released tokens); when nothing is left to change, generation ends with
        finish reason "banned_word". Every rollback adds a mask at the cut and drops only
        masks after it, so the masks grow in position order and decoding ends.

        Afterwards ``released`` is how many tokens of ``output`` the caller may have: those
        that can no longer become part of a banned word (all of them once generation ends).

        The new tokens are matched one at a time, each judged as if it had come alone: the first
        word to complete decides the cut (not the longest, which may begin earlier: with the words
        "bc" and "abcd", the tokens a, b, c, d roll back to b), and the tokens before it count as
        released as they would have been. So a block of tokens ends as the same tokens one round
        each would, for greedy and sampling rows alike.

        Args:
            output: The generated tokens (prompt excluded), the new ones emitted already
                (cut at EOS, stop strings and the budget); truncated in place on a rollback.
            finish_reason: Why generation would end now, or None.
            *stats: ``SpecDecodingStats`` objects that count the rollback and the tokens it discards.

        Returns:
            (finish reason, None when there is nothing to rewind, else the sequence length,
            prompt included, to go back to: its last token becomes the pending token again).
        """
        matcher, released = self.matcher, self.released
        new = output[len(matcher.token_ids) :]
        cut = None if new else matcher.violation(final=finish_reason is not None)  # a word waiting at the end
        for i, token in enumerate(new):  # one at a time, as when each came in a round of its own
            matcher.extend((token,))
            last = i == len(new) - 1
            cut = matcher.violation(final=last and finish_reason is not None)
            if cut is not None:
                break
            if not last:
                released = max(released, matcher.num_safe())
        if cut is None:
            safe = len(output) if finish_reason is not None else matcher.num_safe()
            self.released = max(released, safe)
            return finish_reason, None
        cut = max(cut, released)
        n = self.num_prompt_tokens
        finish_reason = None
        while released <= cut < len(output):
            self.forget_masks_after(n + cut)
            if not self.forbid(n + cut, output[cut]):
                break
            cut -= 1  # every token is forbidden at n + cut: back off
        else:
            cut, finish_reason = released, BANNED_WORD
        for s in stats:
            s.num_banned_word_rollbacks += 1
            s.num_banned_word_discarded_tokens += len(output) - cut
        del output[cut:]
        matcher.truncate(cut)
        if finish_reason is not None:
            self.released = len(output)
            return finish_reason, None
        self.released = max(released, matcher.num_safe())
        return None, n + cut


def mask_batch(logits: torch.Tensor, rows: Sequence[BannedRow | None], first_positions: Sequence[int]) -> None:
    """Apply each row's masks to (n, W, V) ``logits``, whose [b, i] predicts ``first_positions[b] + i``.

    One ``index_put_`` on the logits' device (the indices go there without a host sync);
    nothing when no row has a mask in its window.
    """
    width = logits.shape[1]
    index = [
        (b, i, t)
        for b, (row, first) in enumerate(zip(rows, first_positions))
        if row is not None
        for i, t in row.masks(first, width)
    ]
    if index:
        where = to_device(index, logits.device).t()
        logits.index_put_(tuple(where), logits.new_full((), float("-inf")))
