"""The fast path's settings: an engine's (``FastPath``: its rows buckets, widest width, graphs and dynamic
shapes, shared by its caches), and a model's (whether its forwards compile, and the one-row engine it keeps).

The fast path itself is the round's: a static batch cache with per-row positions
(``batch_cache.BatchKVCache``) and forwards compiled at (rows, width) buckets, CUDA graphs on
CUDA (``batch_runner.BatchRunner``), after gpt-fast's ``generate.py``. A one-sequence
generation (``SpeculativeDecoder``) runs the same round with one row.

``ModelRunner`` holds what a generator keeps per model across decoders: the ``compile`` and
``graphs`` settings, and the latest one-row engine made with them, whose cache and compiled
buckets the next decoder with the same runner reuses (a bench running several methods
compiles once).

On CPU the fast path is off by default (``default_compile``): measured on a 2-core EPYC with
AVX512-BF16, torch 2.13, the Qwen2.5-Coder 1.5B in bf16, one token, 2048-position static
cache: eager 142 ms per forward, inductor-compiled 244 ms (35 s to compile each width).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from specdecode.engine.compat import RECOMPILE_LIMIT  # noqa: F401 (the fast path's limit, defined with the options)
from specdecode.errors import InvalidArgumentError

__all__ = ["DRAFT_BUCKETS", "GRAPHS", "FastPath", "ModelRunner", "check_compilable", "check_drafter_compilable",
           "check_dynamic_shapes", "check_graphs", "default_compile", "engine_fast_path", "resolve_compile"]

#: Widest draft-model forward the fast path pads to (the cascade's n-gram check feeds several
#: tokens); a one-row engine's cache leaves room for it.
DRAFT_BUCKETS = (1, 2, 4, 8)


@dataclass(frozen=True)
class FastPath:
    """The batched fast path's settings (``engine.batch_runner``), shared by the engine's caches. Two compare
    equal when their compiled buckets can serve each other's engines (``max_width`` and ``draft_steps`` aside).

    Attributes:
        rows: Rows buckets, ascending, the last one the cache's ``num_slots``.
        max_width: The widest width bucket of any runner: positions allocated past the capacity,
            where padding tokens land.
        graphs: True compiles each bucket (``torch.compile``; its CUDA graphs on CUDA); "captured"
            compiles each without them and, on CUDA, captures and replays one ``torch.cuda.CUDAGraph``
            per bucket itself (``batch_runner``; elsewhere as True); False runs the same static-shape
            forwards eagerly (tests, debugging).
        draft_steps: What a draft runner on these caches fuses (``BatchRunner.draft_steps``): (steps,
            with top probabilities) pairs; each engine on them adds its longest block less one, with top
            probabilities where its adaptive exit reads them with the round's sync, so engines that share
            a cache (one row at a time, ``SpeculativeDecoder``) each fuse their own full rounds.
        dynamic_shapes: Buckets share compiled functions traced with symbolic rows and widths above 1: at most
            four per runner (tree forwards up to four more), as vLLM compiles once for every batch size; CUDA
            graphs stay one per bucket. False compiles each (rows, width) bucket apart.
    """

    rows: tuple[int, ...]
    max_width: int = field(compare=False)
    graphs: bool | str = True
    dynamic_shapes: bool = False
    draft_steps: set[tuple[int, bool]] = field(default_factory=set, compare=False)

    def __post_init__(self) -> None:
        check_graphs(self.graphs)
        check_dynamic_shapes(self.dynamic_shapes, True, self.graphs)


def engine_fast_path(compile: bool, rows: tuple[int, ...], max_width: int, graphs: bool | str = True,
                     dynamic_shapes: bool = False) -> FastPath | None:
    """An engine's ``FastPath`` with ``compile``, else None (``InvalidArgumentError``: ``check_dynamic_shapes``'
    and ``FastPath``'s)."""
    check_dynamic_shapes(dynamic_shapes, compile, graphs)
    return FastPath(rows, max_width, graphs, dynamic_shapes) if compile else None


def check_dynamic_shapes(dynamic_shapes, compile: bool, graphs) -> None:
    """Refuse a ``dynamic_shapes`` that is not a bool, or True where nothing compiles (``compile`` off, or
    ``graphs=False``): it shapes compiled forwards only, so it is never silently ignored.

    Raises:
        InvalidArgumentError: Naming the value, ``compile`` and ``graphs``.
    """
    if dynamic_shapes is not False and (dynamic_shapes is not True or not compile or graphs is False):
        raise InvalidArgumentError(
            f"dynamic_shapes must be True or False, and True only where forwards compile (compile=True, --compile; "
            f"graphs True or 'captured'): got {dynamic_shapes!r} with compile={compile}, graphs={graphs!r}")


#: ``FastPath.graphs``' values.
GRAPHS = (True, False, "captured")


def check_graphs(graphs) -> bool | str:
    """``graphs`` if it is one of ``GRAPHS``.

    Raises:
        InvalidArgumentError: Any other value (named, with the allowed ones).
    """
    if not any(graphs is g or (isinstance(graphs, str) and graphs == g) for g in GRAPHS):
        raise InvalidArgumentError(f"graphs must be True, False or 'captured', got {graphs!r}")
    return graphs


def default_compile(device: torch.device | str) -> bool:
    """The fast path's default, for one row and for many: on for CUDA, off for CPU (where eager measured faster).

    One row: the module docstring. Many rows (``batch_runner.BatchRunner``), measured
    (``docs/benchmarks/batched_fast_path_cost.py``, 2026-11-25): Qwen2.5-Coder 1.5B, bf16, 2-core AMD EPYC with
    AVX512-BF16 (no AMX), torch 2.13, 2 threads, rows of 300 positions in a 2048-position cache, ms per forward
    eager / compiled: rows 1 width 1 240 / 549; rows 1 width 6 1562 / 1060; rows 4 width 1 1010 / 613; rows 4
    width 6 428 / 785; rows 8 width 1 314 / 1301; rows 8 width 6 721 / 2645 (45-62 s to compile each bucket).
    The machine was shared (load 3-7 on 2 cores), so single cells are noisy, but the compiled forwards attend
    over every allocated position and lost in 4 of 6 cells, by 2-4x at 8 rows. A quieter rerun (8 repeats,
    inductor's cache warm: 6-9 s a bucket): rows 1 width 1 280 / 335, width 6 255 / 279; rows 8 width 1
    326 / 1419, width 6 797 / 1294: eager in every cell.
    """
    return torch.device(device).type == "cuda"


def resolve_compile(compile: bool | None, device: torch.device | str) -> bool:
    """``compile`` itself, or ``default_compile(device)`` for None.

    Raises:
        InvalidArgumentError: If ``compile`` is neither a bool nor None.
    """
    if compile is None:
        return default_compile(device)
    if not isinstance(compile, bool):
        raise InvalidArgumentError(f"compile must be True, False or None (the device default), got {compile!r}")
    return compile


def check_compilable(model: torch.nn.Module, name: str) -> None:
    """Raise if the fast path cannot compile ``model`` (named ``name`` in the message): a layer holding
    oneDNN tensors (``models.prepacked_linear``, a float32 CPU model's default), which torch.compile
    cannot trace with ``fullgraph=True``.

    Raises:
        InvalidArgumentError: Naming the way out (``prepack_linears=False``, or ``compile=False``).
    """
    if any(buffer.is_mkldnn for buffer in model.buffers()):
        raise InvalidArgumentError(
            f"compile=True: the fast path cannot compile the {name}'s prepacked (oneDNN) linear layers; load "
            "it with prepack_linears=False (--no-prepack-linears) to compile, or run it eagerly (compile=False, "
            "the CPU default)")


def check_drafter_compilable(drafter, compile: bool) -> None:
    """``check_compilable`` for a drafter's own model (``drafter.model``, e.g. a draft model's; named by its
    ``who``) when ``compile`` (resolved) asks for the fast path: so a decoder refuses before its first round.

    Raises:
        InvalidArgumentError: As ``check_compilable``.
    """
    model = getattr(drafter, "model", None)
    if compile and isinstance(model, torch.nn.Module):
        check_compilable(model, getattr(drafter, "who", "draft model"))


class ModelRunner:
    """A model's fast-path settings, kept per generator across decoders (module docstring).

    Args:
        model: A transformers causal LM in eval mode.
        compile: True: the static batch cache and compiled forwards; False: eager forwards on
            the same cache; None: ``default_compile``.
        name: For messages ("target model").
        graphs: False keeps every forward eager even with ``compile`` (the fast path's cache
            logic without its compile time, for tests and debugging); "captured": specdecode's own
            CUDA graphs rather than torch.compile's (``FastPath``; CUDA only).
        dynamic_shapes: Compile each model's forwards once for every width above 1 (and, batched, every rows
            count above 1), with CUDA graphs still one per bucket (``FastPath``); True needs compiled
            forwards (``check_dynamic_shapes``).

    Attributes:
        model, name, compile, graphs, dynamic_shapes: As given (``compile`` resolved); ``dynamic_shapes`` may be
            changed between generations: a decoder's next generation then makes a new one-row engine.
        one_row_engine: The latest one-row ``BatchedSpeculativeDecoder`` made with these settings
            (set by ``SpeculativeDecoder``), or None.

    Raises:
        InvalidArgumentError: A bad ``compile``, ``graphs`` or ``dynamic_shapes``; compiling a model it cannot
            compile (``check_compilable``).
    """

    def __init__(self, model: PreTrainedModel, *, compile: bool | None = None, name: str = "model",
                 graphs: bool | str = True, dynamic_shapes: bool = False) -> None:
        check_graphs(graphs)
        self.model = model
        self.name = name
        self.compile = resolve_compile(compile, model.device)
        check_dynamic_shapes(dynamic_shapes, self.compile, graphs)
        self.dynamic_shapes = dynamic_shapes
        if self.compile and graphs:
            check_compilable(model, name)
        self.graphs = graphs
        self.one_row_engine = None
