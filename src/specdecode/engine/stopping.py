"""Where a generation stops: EOS, the length budget and stop strings (``emit``, the round's last
step, shared by both decoders), stop strings found by decoding only a tail window of the output."""

from __future__ import annotations

from specdecode.errors import InvalidArgumentError


class StopStrings:
    """Finds the first token whose text completes a stop string, decoding only a tail window."""

    def __init__(self, tokenizer, stop_strings: tuple[str, ...]) -> None:
        if stop_strings and tokenizer is None:
            raise InvalidArgumentError("stop_strings need a tokenizer; pass tokenizer= to the decoder")
        self.tokenizer = tokenizer
        self.stop_strings = stop_strings
        # Every non-special token decodes to at least one character, so this many
        # earlier tokens always cover a stop string that straddles a round.
        self.lookback = max((len(s) for s in stop_strings), default=0)

    def cut(self, generated: list[int], num_new: int) -> int | None:
        """Number of generated tokens to keep if the last ``num_new`` complete a stop string, else None."""
        if not self.stop_strings:
            return None
        start = max(len(generated) - num_new - self.lookback, 0)
        decode = self.tokenizer.decode
        if not any(s in decode(generated[start:]) for s in self.stop_strings):
            return None
        for end in range(len(generated) - num_new + 1, len(generated) + 1):
            text = decode(generated[start:end])
            if any(s in text for s in self.stop_strings):
                return end
        return len(generated)


def emit(
    output: list[int], new: list[int], eos: frozenset[int], max_new_tokens: int, stop: StopStrings
) -> str | None:
    """The round's emit step: append verified tokens to ``output``, cut at EOS, the budget, a stop string.

    Args:
        output: The row's generated tokens so far; extended in place.
        new: The tokens the round confirmed (accepted draft tokens and the bonus/replacement token).
        eos: Token ids that end the row (empty when EOS does not stop it).
        max_new_tokens: The row's budget: ``output`` never grows past it.
        stop: The row's stop strings.

    Returns:
        Why the row ends ("eos", "length" or "stop_string"), or None when it goes on. The
        tokens after the cut are not appended (a stop string's tokens are kept up to the one
        that completes it, as transformers' ``StopStringCriteria``).
    """
    reason = None
    for i, token in enumerate(new):
        if token in eos:
            new, reason = new[: i + 1], "eos"
            break
    room = max_new_tokens - len(output)
    if len(new) >= room:
        new = new[:room]
        reason = reason or "length"
    output.extend(new)
    keep = stop.cut(output, len(new))
    if keep is not None:
        del output[keep:]
        reason = "stop_string"
    return reason
