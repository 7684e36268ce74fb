"""How long and how many the server's rows may be: ``specdecode serve``'s --max-length and
--max-batch-size against the flags and the models' files (before any model loads) and against the loaded
models (before the engine is built and its caches allocated).

A row of the batched engine holds --max-length cache positions: a request's prompt and new tokens, and
the longest draft block + 1 for the verification (``BatchedSpeculativeDecoder.max_block``). So
--max-length must leave one prompt token and one new token beside that block, and is of no use past the
context length of the target, or of a draft model (which sees every position of the row but the block),
plus the block. Every row's keys and values are allocated at the engine's first forward, for the target
and a draft model: --max-batch-size rows of them must fit in the memory left once the models loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdecode import method_registry
from specdecode.engine import kv_cache
from specdecode.engine.cost_model import MEASURED_WIDTHS
from specdecode.engine.fast_path import resolve_compile
from specdecode.engine.runner_target import is_runner_target
from specdecode.errors import InvalidArgumentError
from specdecode.models.context_length import stored_context_length

#: Cache positions per row when --max-length is not given, fewer where the target's context length and a
#: draft block take fewer (``fit_max_length``).
DEFAULT_MAX_LENGTH = 2048


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


@dataclass(frozen=True)
class ContextLimit:
    """The most positions one of the server's models handles.

    Attributes:
        role: "target" or "draft model".
        name: Its spec (--target, --draft).
        positions: Its context length.
        source: Where that was read, for messages ("max_position_embeddings", "the GGUF file's
            qwen2.context_length", "llama.cpp's n_ctx_train").
    """

    role: str
    name: str
    positions: int
    source: str


def stored_context_limits(target: str, draft: str | None, *, cache_dir=None, backend: str = "torch"
                          ) -> list[ContextLimit]:
    """The context lengths of the ``target`` and the ``draft`` model (None: the method has none) that their files
    state, read before loading them (``models.context_length.stored_context_length``: a model whose files do
    not say it before loading is left out, for ``loaded_context_limits`` to check)."""
    limits = []
    for role, spec, runs_in in (("target", target, backend), ("draft model", draft, "torch")):
        stored = stored_context_length(spec, cache_dir=cache_dir, backend=runs_in) if spec else None
        if stored is not None:
            limits.append(ContextLimit(role, spec, stored.positions, stored.source))
    return limits


def loaded_context_limits(gen, method: str, *, target_name: str | None = None,
                          draft_name: str | None = None) -> list[ContextLimit]:
    """The context lengths of the loaded target (``kv_cache.context_length``: a transformers model's
    max_position_embeddings, a llama.cpp target's training context) and, where ``method`` drafts with a draft
    model, of the draft model the engine will use: the torch draft's, or a llama.cpp draft's training context
    (``n_ctx_train``; the generator's ``llama_cpp_draft``, loaded here if it was not yet). A model that states
    none is left out. ``target_name``, ``draft_name``: the specs they were loaded from, for messages (None: the
    loaded models' names)."""
    target = gen.target.model
    limits = []
    context = kv_cache.context_length(target)
    if context is not None:
        source = "max_position_embeddings" if isinstance(target, torch.nn.Module) else "llama.cpp's n_ctx_train"
        limits.append(ContextLimit("target", target_name or gen.target.name, context, source))
    if not method_registry.REGISTRY[method].needs_draft_model:
        return limits
    if gen.default_draft_backend() == "llama-cpp":
        draft = gen.llama_cpp_draft()
        trained = getattr(draft, "n_ctx_train", None)
        if isinstance(trained, int) and trained > 0:
            limits.append(ContextLimit("draft model", draft_name or draft.name, trained, "llama.cpp's n_ctx_train"))
    elif gen.draft is not None:
        context = kv_cache.context_length(gen.draft.model)
        if context is not None:
            limits.append(ContextLimit("draft model", draft_name or gen.draft.name, context,
                                       "max_position_embeddings"))
    return limits


def fit_max_length(max_length: int | None, block: int, limits: Sequence[ContextLimit]) -> int:
    """The rows' cache positions: a row never uses more than the shortest context length among ``limits`` (the
    target's and a draft model's, ``stored_context_limits`` or ``loaded_context_limits``) plus ``block`` + 1
    for a draft block. ``max_length`` None: ``DEFAULT_MAX_LENGTH``, or that where it is less.

    Raises:
        InvalidArgumentError: A ``max_length`` above it, naming --max-length, the model that limits it (a
            draft model by name) and its context length, and the allowed range.
    """
    tightest = tightest_limit(limits)
    if tightest is None:
        return DEFAULT_MAX_LENGTH if max_length is None else max_length
    most = tightest.positions + block + 1
    if max_length is None:
        return min(DEFAULT_MAX_LENGTH, most)
    if max_length > most:
        raise InvalidArgumentError(
            f"--max-length {max_length} is more than a row can use: {describe_limit(tightest, limits)} and a row "
            f"keeps {block + 1} more for a draft block; allowed: --max-length {block + 3}..{most}")
    return max_length


def tightest_limit(limits: Sequence[ContextLimit]) -> ContextLimit | None:
    """The shortest context length among ``limits`` (the target's where a draft model's is as long), or None."""
    return min(limits, key=lambda limit: (limit.positions, limit.role != "target"), default=None)


def describe_limit(limit: ContextLimit, limits: Sequence[ContextLimit] = ()) -> str:
    """``limit`` in words: "the target's context length is 512 positions (max_position_embeddings)", or for a
    draft model "the draft model 'NAME' has a context length of 300 positions (...), fewer than the target's
    512" (the target's from ``limits``, where known)."""
    if limit.role == "target":
        return f"the target's context length is {limit.positions} positions ({limit.source})"
    target = next((t for t in limits if t.role == "target"), None)
    than = f", fewer than the target's {target.positions}" if target is not None else ""
    return (f"the {limit.role} {limit.name!r} has a context length of {limit.positions} positions "
            f"({limit.source}){than}")


def kv_bytes_per_position(model) -> int:
    """Bytes of keys and values one cache position of one row holds for ``model`` (a transformers model): every
    layer's key and value heads (``num_key_value_heads``, or ``num_attention_heads``) of ``head_dim`` (or
    hidden_size / num_attention_heads) elements, in the model's dtype, as ``BatchKVCache`` allocates them."""
    config = model.config
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        config = get_text(decoder=True)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * heads * head_dim * 2 * model.dtype.itemsize


def available_memory_bytes(device) -> int | None:
    """Bytes free on ``device``, None where unknown (neither CUDA nor the CPU).

    A CUDA device: its free memory (``torch.cuda.mem_get_info``) plus what torch's caching allocator holds
    reserved but unallocated (``memory_reserved - memory_allocated``), which the caches' tensors get first
    and ``mem_get_info`` counts as used. A CPU: the memory available to new processes (psutil)."""
    device = torch.device(device)
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + max(cached, 0)
    if device.type == "cpu":
        import psutil

        return psutil.virtual_memory().available
    return None


def check_cache_memory(gen, method: str, *, max_batch_size: int, max_length: int, block: int = 0,
                       compile: bool | None = False, available_bytes: int | None = None) -> None:
    """Refuse a --max-batch-size whose KV caches cannot fit: the batched engine allocates every row's keys and
    values (``max_length`` positions, and on the fast path its widest forward past them) at its first forward,
    for the target and a draft model (``kv_bytes_per_position``), so that a batch too large failed only at the
    warm-up or at the first requests. A target run outside torch (llama.cpp) holds its own memory and is not
    counted.

    Args:
        gen: The loaded ``SpeculativeGenerator``.
        method: The decoding method (a draft model's cache counts where it uses one).
        max_batch_size, max_length: The rows and their positions (the flags' values).
        block: The longest draft block (``longest_draft_block``): the fast path's widest forward is it + 1.
        compile: --compile (None: the device's default).
        available_bytes: Memory free for the caches (bytes); None: ``available_memory_bytes`` of the target's
            device (no check where that is unknown).

    Raises:
        InvalidArgumentError: Naming --max-batch-size, the bytes a row takes, and the rows that fit.
    """
    target = gen.target.model
    if is_runner_target(target):
        return
    models = {"target": target}
    draft = getattr(gen, "draft", None)
    if method_registry.REGISTRY[method].needs_draft_model and isinstance(getattr(draft, "model", None),
                                                                          torch.nn.Module):
        models["draft"] = draft.model
    positions = max_length + (max(block + 1, 2) if resolve_compile(compile, target.device) else 0)
    per_row = {name: kv_bytes_per_position(m) * positions for name, m in models.items()}
    row = sum(per_row.values())
    if available_bytes is None:
        available_bytes = available_memory_bytes(target.device)
        if available_bytes is None:
            return
    if max_batch_size * row <= available_bytes:
        return
    fits = available_bytes // row
    allowed = (f"allowed: --max-batch-size 1..{fits} at --max-length {max_length} (or a smaller --max-length)"
               if fits >= 1 else "not even one row fits: lower --max-length")
    parts = ", ".join(f"{name} {_size(b)}" for name, b in per_row.items())
    raise InvalidArgumentError(
        f"--max-batch-size {max_batch_size} does not fit in memory: at --max-length {max_length} a row's keys and "
        f"values take {_size(row)} ({parts}), {max_batch_size} rows {_size(max_batch_size * row)}, more than the "
        f"{_size(available_bytes)} available on {target.device}; {allowed}")


def _size(n: int) -> str:
    """Bytes in KiB, MiB or GiB, one decimal."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1024:.1f} KiB"


__all__ = [
    "DEFAULT_MAX_LENGTH",
    "ContextLimit",
    "available_memory_bytes",
    "check_cache_memory",
    "check_max_length",
    "describe_limit",
    "fit_max_length",
    "kv_bytes_per_position",
    "loaded_context_limits",
    "longest_draft_block",
    "stored_context_limits",
    "tightest_limit",
]
