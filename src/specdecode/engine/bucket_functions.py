"""A ``batch_runner``'s buckets: its rows buckets, and the functions a bucket runs (a forward on the static path
with its greedy epilogue, and the fused draft steps), each compiled on a code object of its own
(``batch_runner``'s module docstring)."""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel

from specdecode.engine.batch_cache import BatchKVCache
from specdecode.engine.compat import compile_function
from specdecode.engine.sampling import finite_rows, greedy_tokens
from specdecode.engine.verification import greedy_epilogue
from specdecode.errors import InvalidArgumentError


def forward_function(model: PreTrainedModel, tag: str, graphs: bool, cuda: bool, cuda_graphs: bool,
                     dynamic: bool | None = False) -> Callable:
    """``forward(ids (R, W), cache) -> ((R, W, V) logits, (R, W, 2) greedy epilogue)`` on the static path
    (``BatchRunner.forward_greedy``: each position's argmax and finiteness, computed in the graph); compiled on a code
    object of its own when ``graphs`` (``batch_runner``'s module docstring), ``dynamic`` as ``compat.compile_kwargs``.

    Compiled, the argmax reads the logits as the graph computes them: where a pointwise step follows the LM head
    (a final-logit softcap, a scale), inductor may fuse it and take the argmax of values not yet rounded to the
    returned dtype, so on a bf16 near-tie it may differ from the returned logits' argmax (as a compiled graph
    may round the last bits differently from eager anyway). The packaged models (Qwen2.5-Coder; Gemma 3, whose
    ``final_logit_softcapping`` is None) end in a plain LM head. Not yet checked on a GPU."""

    def forward(ids: torch.Tensor, cache: BatchKVCache) -> tuple[torch.Tensor, torch.Tensor]:
        positions, mask = cache.static_inputs(model.dtype)
        logits = model(
            input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=cache, use_cache=True
        ).logits
        return logits, greedy_epilogue(logits)

    return own_compiled(forward, tag, graphs, cuda, cuda_graphs, dynamic)


def steps_function(model: PreTrainedModel, tag: str, num_steps: int, vocab: int, with_tops: bool, graphs: bool,
                   cuda: bool, cuda_graphs: bool) -> Callable:
    """[fused draft steps] ``steps(ids (R, 1), index (R, 1, 1, 1), head (K,) or None, cache) -> (tokens
    (R, S) long, finite (R,) bool, tops (R, S) float32 or None)``: S one-token forwards on the static path,
    each fed the previous one's greedy token (``head[argmax]`` of a truncated head's K logits, else the argmax of
    the first ``vocab``), ``index`` (the window's write positions) advanced by one in place after each; compiled
    on a code object of its own when ``graphs`` (``batch_runner``'s module docstring)."""

    def steps(ids: torch.Tensor, index: torch.Tensor, head: torch.Tensor | None,
              cache: BatchKVCache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        tokens, tops, finite = [], [], None
        for _ in range(num_steps):
            positions, mask = cache.static_inputs(model.dtype)  # from ``index``, the window's buffer
            logits = model(
                input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=cache, use_cache=True
            ).logits[:, -1]
            ok = finite_rows(logits)
            finite = ok if finite is None else finite & ok
            if with_tops:  # an adaptive exit's confidence
                tops.append(torch.softmax(logits.float(), -1).amax(-1))
            ids = (head[greedy_tokens(logits)] if head is not None else greedy_tokens(logits[:, :vocab])).view(-1, 1)
            tokens.append(ids)
            index.add_(1)
        return torch.cat(tokens, dim=1), finite, torch.stack(tops, dim=1) if with_tops else None

    return own_compiled(steps, tag, graphs, cuda, cuda_graphs)


def own_compiled(fn: types.FunctionType, tag: str, graphs: bool, cuda: bool, cuda_graphs: bool,
                 dynamic: bool | None = False) -> Callable:
    """``fn`` itself, or with ``graphs`` compiled on a code object of its own named by ``tag`` (``batch_runner``'s
    module docstring: one compiled function per bucket, or per size class with dynamic shapes), with
    torch.compile's CUDA graphs where ``cuda_graphs``."""
    if not graphs:
        return fn
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}", co_qualname=f"batch_{fn.__name__}_{tag}")
    own = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    # compat.compile_function: the options this torch has (CUDA graphs on CUDA), the compile cache
    # in specdecode's folder (a second process reuses the graphs).
    return compile_function(own, "cuda" if cuda else "cpu", cuda_graphs=cuda_graphs, dynamic=dynamic)


def row_buckets(max_rows: int) -> tuple[int, ...]:
    """Rows buckets for an engine of ``max_rows`` slots: 1, 2, 4, .. below it, and ``max_rows``."""
    out, r = [], 1
    while r < max_rows:
        out.append(r)
        r *= 2
    return (*out, max_rows)


def check_row_buckets(buckets: Sequence[int] | None, max_rows: int) -> tuple[int, ...]:
    """``buckets`` sorted, with ``max_rows`` added (every batch needs a bucket), or ``row_buckets(max_rows)`` for None.

    Raises:
        InvalidArgumentError: A bucket that is not an integer in 1 .. ``max_rows``.
    """
    if buckets is None:
        return row_buckets(max_rows)
    if isinstance(buckets, (str, bytes)) or not all(
        isinstance(r, int) and not isinstance(r, bool) and 1 <= r <= max_rows for r in buckets
    ):
        raise InvalidArgumentError(f"row_buckets must be integers in 1..{max_rows} (max_batch_size), got {buckets!r}")
    return tuple(sorted({*buckets, max_rows}))
