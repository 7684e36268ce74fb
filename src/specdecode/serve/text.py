"""Token ids -> the text a client sees, streamed without ever taking text back.

OpenAI's API returns the text *before* a stop sequence, without the stop sequence. The
engine ends a row at the token whose text completes a stop string
(``engine.stopping.StopStrings``); this module cuts the text there, and while streaming
holds back (a) a tail that could still become a stop string and (b) an incomplete UTF-8
character (the tokenizer decodes it as U+FFFD until its last byte arrives), as vLLM's
incremental detokenizer does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class TokenText:
    """What one token adds to the decoded text (``TextAssembler`` with ``offsets``; logprobs' tokens).

    Attributes:
        token_id: The token.
        offset: Where it starts in the decoded text, in characters (completions' ``text_offset``).
        text: The characters it adds there, decoded in the context of the tokens before it (its
            contribution, not its own decode): "" for a special token (the text is decoded without
            them) and for a token that starts a UTF-8 character it does not complete (the token that
            completes it adds the whole character). The ``text`` of a generation's tokens, joined, is
            its decoded text (before a stop string cuts it).
        alternatives: Other token ids -> what each would have added at this position instead,
            decoded the same way (logprobs' ``top_logprobs``).
    """

    token_id: int
    offset: int
    text: str
    alternatives: Mapping[int, str] = field(default_factory=dict)


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

    With ``offsets``, ``tokens`` keeps a ``TokenText`` per token (logprobs): where it starts in the
    decoded text (``text_offset``, characters; ``token_offsets``) and what it adds there, decoded as
    the text is (with the tokens before it as context, special tokens skipped, so a special token
    adds nothing), so ``text[t.offset:t.offset + len(t.text)] == t.text``. A character whose UTF-8
    bytes span tokens counts from the token that completes it (the tokens before then add "" and
    start where it starts). Offsets follow the decoded tokens: a token that completed a stop string
    may start past the end of ``text``, which is cut before the stop string.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), *, offsets: bool = False) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.token_ids: list[int] = []
        #: With ``offsets``: per token, what it adds to the decoded text and where; else None.
        self.tokens: list[TokenText] | None = [] if offsets else None
        self.text = ""  # the text sent so far
        self.stopped = False  # a stop string was found: nothing more is sent
        self._committed = ""  # text of token_ids[:self._read], final
        self._prefix = 0  # token_ids[self._prefix:self._read]: context for decoding what follows
        self._read = 0

    @property
    def token_offsets(self) -> list[int] | None:
        """With ``offsets``: per token, where it starts in the decoded text (characters); else None."""
        return None if self.tokens is None else [t.offset for t in self.tokens]

    def push(self, token_ids: list[int], final: bool,
             alternatives: Sequence[Sequence[int]] | None = None) -> str:
        """Add tokens; return the text to send now (possibly "").

        Args:
            token_ids: New token ids of this delivery.
            final: Whether the request ended with this delivery (everything held back
                that is not a stop string is released).
            alternatives: With ``offsets``, per new token, other token ids whose text at its position
                its ``TokenText.alternatives`` keeps (logprobs' top tokens); None: none.

        Raises:
            ValueError: ``alternatives`` without ``offsets``, or not one entry per new token.
        """
        if alternatives is not None and (self.tokens is None or len(alternatives) != len(token_ids)):
            raise ValueError(f"alternatives need offsets=True and one entry per token: {len(alternatives)} for "
                             f"{len(token_ids)} tokens (offsets={self.tokens is not None})")
        start = len(self.token_ids)
        self.token_ids.extend(token_ids)
        if self.tokens is not None:
            self.tokens += self._token_texts(start, final, alternatives)
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

    def _token_texts(self, start: int, final: bool, alternatives: Sequence[Sequence[int]] | None) -> list[TokenText]:
        """``TokenText``s of tokens ``start ..`` (not yet decoded): the committed text, plus what the window's
        tokens up to each add (decoded with the window's context, as ``_decode`` does; an incomplete character
        at the end not counted, unless ``final`` releases it with the last token)."""
        decode = self.tokenizer.decode
        ids = self.token_ids
        context = decode(ids[self._prefix:self._read], skip_special_tokens=True)

        def through(tail: list[int], last: bool) -> str:
            """The text of the committed tokens and ``tail`` (tokens after ``_read``)."""
            if not tail:
                return self._committed
            window = decode(ids[self._prefix:self._read] + tail, skip_special_tokens=True)
            pending = window[len(context):] if window.startswith(context) else decode(tail, skip_special_tokens=True)
            return self._committed + (pending if last else pending.rstrip(REPLACEMENT))

        out = []
        before = through(ids[self._read:start], False)
        for j in range(start, len(ids)):
            last = final and j == len(ids) - 1
            tail = ids[self._read:j]
            after = through(tail + [ids[j]], last)
            others = {}
            for other in (alternatives[j - start] if alternatives is not None else ()):
                text = after if other == ids[j] else through(tail + [other], last)
                others[other] = text[len(before):]
            out.append(TokenText(ids[j], len(before), after[len(before):], others))
            before = after
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
