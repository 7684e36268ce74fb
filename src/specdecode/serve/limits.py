"""How long the server's rows may be: ``specdecode serve``'s --max-length against the flags, before any
model loads.

A row of the batched engine holds --max-length cache positions: a request's prompt and new tokens, and
the longest draft block + 1 for the verification (``BatchedSpeculativeDecoder.max_block``). So
--max-length must leave one prompt token and one new token beside that block.
"""

from __future__ import annotations

from specdecode.engine.cost_model import MEASURED_WIDTHS
from specdecode.errors import InvalidArgumentError


def longest_draft_block(args, plan) -> int:
    """The longest draft block (tokens) a round of the server's engine drafts, its
    ``BatchedSpeculativeDecoder.max_block``, from the flags before any model loads: none for
    autoregressive; with an active draft policy (adaptive draft exit, a length schedule) its longest,
    adaptive exit's ``max_draft_tokens``; under a llama.cpp target without one, γ capped at the widest
    forward measured (``runner_target.measured_cost_policy``); else γ (a draft tree's nodes, token
    recycling's largest tree). A row keeps it + 1 cache positions past its tokens for the verification.
    """
    if args.method == "autoregressive":  # no drafter
        return 0
    gamma = plan.num_speculative_tokens
    control = plan.draft_control
    if control is not None:
        return control.controller(gamma).max_tokens if control.active else gamma
    if getattr(args, "backend", "torch") == "llama-cpp":
        return min(gamma, MEASURED_WIDTHS[-1] - 1)
    return gamma


def check_max_length(max_length: int, block: int, method: str, max_prompt_tokens: int | None = None) -> None:
    """Refuse a --max-length that leaves a row no room for a request: one prompt token and one new token
    beside ``block`` + 1 positions for a draft block (``longest_draft_block``), or for a prompt of
    --max-prompt-tokens tokens and one new token. Needs no model.

    Raises:
        InvalidArgumentError: Naming the flag, its value and the allowed range.
    """
    least = block + 3
    drafts = "drafts no token" if block == 0 else f"drafts up to {block} tokens a round"
    if max_length < least:
        raise InvalidArgumentError(
            f"--max-length {max_length} leaves no room for a request: a row keeps {block + 1} positions for a "
            f"draft block (--method {method} {drafts}, + 1), and a request needs at least one prompt token and one "
            f"new token; allowed: --max-length >= {least}")
    if max_prompt_tokens is not None and max_prompt_tokens + block + 2 > max_length:
        need = max_prompt_tokens + block + 2
        raise InvalidArgumentError(
            f"--max-prompt-tokens {max_prompt_tokens} does not fit --max-length {max_length}: a prompt of "
            f"{max_prompt_tokens} tokens, one new token and a draft block ({block + 1} positions) take {need}; "
            f"allowed: --max-prompt-tokens 1..{max_length - block - 2}, or --max-length >= {need}")


__all__ = ["check_max_length", "longest_draft_block"]
