"""Where a generation stops: stop strings, found by decoding only a tail window of the output."""

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
