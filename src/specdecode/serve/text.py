"""Token ids -> the text a client sees, streamed without ever taking text back.

OpenAI's API returns the text *before* a stop sequence, without the stop sequence. The
engine ends a row at the token whose text completes a stop string
(``engine.stopping.StopStrings``); this module cuts the text there, and while streaming
holds back (a) a tail that could still become a stop string and (b) an incomplete UTF-8
character (the tokenizer decodes it as U+FFFD until its last byte arrives), as vLLM's
incremental detokenizer does.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class TextAssembler:
    """Incremental text of one request.

    Args:
        tokenizer: The target's tokenizer (``decode(ids, skip_special_tokens=True)``).
        stop: The request's stop strings (may be empty).

    Decoding is incremental, as vLLM's ``detokenize_incrementally``: each push decodes only the
    tokens since the last committed point, with the previous window as context
    (``decode(ids[prefix:])`` minus ``decode(ids[prefix:read])``), so a delivery costs
    O(tokens in the window), not O(output). The committed text only grows, so text once sent
    is never taken back, even for a tokenizer whose decode of a longer prefix rewrites earlier
    characters (``clean_up_tokenization_spaces``: then the new tokens are decoded on their
    own). A window whose text ends in an incomplete
    UTF-8 character (decoded as U+FFFD) is not committed until its last byte arrives.

    With ``offsets``, ``token_offsets`` keeps each token's ``text_offset`` (completions' logprobs):
    the characters the tokens before it decode to, decoded as the text is (special tokens skipped,
    so a special token adds none), so ``text[token_offsets[i]:token_offsets[i + 1]]`` is what token i
    added. A character whose UTF-8 bytes span tokens counts from the token that completes it (the
    tokens before then start where it starts). Offsets follow the decoded tokens: a token that
    completed a stop string may start past the end of ``text``, which is cut before the stop string.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), *, offsets: bool = False) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.token_ids: list[int] = []
        #: With ``offsets``: per token, where it starts in the decoded text (characters); else None.
        self.token_offsets: list[int] | None = [] if offsets else None
        self.text = ""  # the text sent so far
        self.stopped = False  # a stop string was found: nothing more is sent
        self._committed = ""  # text of token_ids[:self._read], final
        self._prefix = 0  # token_ids[self._prefix:self._read]: context for decoding what follows
        self._read = 0

    def push(self, token_ids: list[int], final: bool) -> str:
        """Add tokens; return the text to send now (possibly "").

        Args:
            token_ids: New token ids of this delivery.
            final: Whether the request ended with this delivery (everything held back
                that is not a stop string is released).
        """
        start = len(self.token_ids)
        self.token_ids.extend(token_ids)
        if self.token_offsets is not None:
            self.token_offsets += self._offsets(start)
        if self.stopped:
            return ""
        full = self._decode(final)
        cut = self._stop_index(full)
        if cut is not None:
            full, self.stopped = full[:cut], True
        elif not final:
            full = full[: len(full) - self._held_back(full)]
        if len(full) <= len(self.text):
            return ""  # held back further than before (a longer possible stop prefix): wait
        delta = full[len(self.text):]
        self.text = full
        return delta

    def _decode(self, final: bool) -> str:
        """The text of all tokens so far: the committed text plus the window after it."""
        decode = self.tokenizer.decode
        context = decode(self.token_ids[self._prefix:self._read], skip_special_tokens=True)
        window = decode(self.token_ids[self._prefix:], skip_special_tokens=True)
        if window.startswith(context):
            pending = window[len(context):]
        else:  # decoding with context rewrote the context's text: take the new tokens' own text
            pending = decode(self.token_ids[self._read:], skip_special_tokens=True)
        if pending and (final or not pending.endswith(REPLACEMENT)):
            self._committed += pending
            self._prefix, self._read = self._read, len(self.token_ids)
            return self._committed
        return self._committed + pending

    def _offsets(self, start: int) -> list[int]:
        """Where tokens ``start ..`` (not yet decoded) start in the text: the committed text, plus what the
        window's tokens before each add (decoded with the window's context, as ``_decode`` does; an
        incomplete character at its end not counted)."""

        def decode(ids: list[int]) -> str:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

        context = decode(self.token_ids[self._prefix:self._read])
        out = []
        for j in range(start, len(self.token_ids)):
            pending = ""
            if j > self._read:
                window = decode(self.token_ids[self._prefix:j])
                pending = window[len(context):] if window.startswith(context) else decode(self.token_ids[self._read:j])
            out.append(len(self._committed) + len(pending.rstrip(REPLACEMENT)))
        return out

    def _stop_index(self, full: str) -> int | None:
        """Where the first stop string starts in ``full`` (searching only text not yet sent,
        plus the overlap a stop string can span), or None."""
        best = None
        for s in self.stop:
            i = full.find(s, max(0, len(self.text) - len(s) + 1))
            if i != -1 and (best is None or i < best):
                best = i
        return best

    def _held_back(self, full: str) -> int:
        """Characters at the end of ``full`` not to send yet."""
        n = 0
        while n < len(full) and full[len(full) - 1 - n] == REPLACEMENT:
            n += 1
        tail = full[: len(full) - n]
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(tail)), longest, -1):
                if tail.endswith(s[:k]):
                    longest = k
                    break
        return n + longest
