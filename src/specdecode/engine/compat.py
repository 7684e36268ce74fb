"""``torch.compile`` on the torch that users have: the oldest supported is 2.11.

The fast path compiles each runner's forward with two ``torch.compile`` options that only
newer torch offers (2.13 has both; 2.11, what the GPU machines run, has neither):

* ``isolate_recompiles=True``: each ``torch.compile`` call keeps its own cache entries and
  recompile budget. Every runner compiles the same ``forward`` function, and dynamo keeps
  its compiled entries (and counts recompilations) per *code object*; without isolation the
  target's and the draft's graphs would share one entry list and one budget, and each call
  would first try the guards of the other runners' entries.
* ``recompile_limit=RECOMPILE_LIMIT``: that budget, raised from dynamo's default of 8.

Where ``torch.compile`` lacks them (detected from its signature, not its version):

* for ``isolate_recompiles``, ``compile_function`` compiles a private copy of the function's
  code object (``CodeType.replace()``: same bytecode, name and closure, a new object), which
  gives the runner its own entry list and budget, as isolation does. The copy has the same
  code, so inductor's on-disk graph cache (keyed by the traced graph) is shared as before.
* for ``recompile_limit``, ``compile_function`` applies the same limit through
  ``torch._dynamo.config.recompile_limit``, inside ``torch._dynamo.config.patch`` and only
  for a call that hit the global limit (dynamo raises ``FailOnRecompileLimitHit`` under
  ``fullgraph=True`` before tracing anything; the call is then retried under the patch).
  Steady-state calls pay nothing, and the global config is never changed for good.

Each dropped option is logged once (INFO), naming the torch version and the replacement.

**No guards on the models' modules.** Each call of a compiled function first runs dynamo's guards,
which check that what the graph was traced from still holds; for a transformers model most of them
are on its modules (each parameter's tensor properties, each module's attributes and ``training``
flag). Their cost is paid per call, on the host, whatever the device: on a 2-core AMD EPYC (AVX2),
dynamo's cache lookup took a median 1.36 ms a call for a 28-layer Qwen2-shaped model (the packaged
1.5B target's depth), 0.32 ms with the guards on modules dropped (``docs/benchmarks/guard_cost.py``).
A draft round calls several compiled functions, so ``compile_kwargs`` passes
``torch.compiler.skip_guard_on_all_nn_modules_unsafe`` as ``options["guard_filter_fn"]`` where this
torch has it (looked up by name; torch 2.13 has it, and so did 2.9's API; without it every guard is
kept, logged once). The guards on the inputs (shapes, dtypes, devices), on the caches and on globals
stay, so a new shape still compiles anew. What this assumes (as ``graphs="captured"``, whose replays
check nothing, does anyway): an engine's models are not modified while it holds them (no parameter,
attribute or ``forward`` replaced, no hook added). specdecode's own module swaps (layer skip's draft
mode, a truncated draft head) happen around every call of the runner that traced them, warm-up
included, and each such runner compiles functions of its own (one per skip set, one per head).

Source followed: torch 2.11.0's ``torch/__init__.py`` (``compile``'s signature:
``model, *, fullgraph, dynamic, backend, mode, options, disable``),
``torch/_dynamo/convert_frame.py`` and ``torch/_dynamo/cache_size.py`` (the recompile
limit is checked per code object, before tracing, and raises under ``fullgraph=True``).
"""

from __future__ import annotations

import functools
import inspect
import logging
import types
from collections.abc import Callable

import torch

from specdecode.engine import compile_cache
from specdecode.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

#: Graph variants one compiled function (one runner's forward) may compile (widths x cache
#: sizes x draft modes) before ``torch.compile`` raises instead of recompiling again.
RECOMPILE_LIMIT = 32

#: ``torch.compile`` options newer than torch 2.11 that specdecode passes where they exist.
NEWER_COMPILE_OPTIONS = ("isolate_recompiles", "recompile_limit")

#: The ``torch.compiler`` guard filter passed as ``options["guard_filter_fn"]`` (module docstring).
MODULE_GUARD_FILTER = "skip_guard_on_all_nn_modules_unsafe"


@functools.lru_cache(maxsize=8)
def _parameters_of(compile_fn: Callable) -> frozenset[str]:
    return frozenset(inspect.signature(compile_fn).parameters)


def compile_parameters() -> frozenset[str]:
    """The keyword names the installed ``torch.compile`` accepts (its signature, cached per function)."""
    return _parameters_of(torch.compile)


@functools.lru_cache(maxsize=8)
def _log_dropped(dropped: tuple[str, ...], version: str) -> None:
    """Logs once per (dropped options, torch version)."""
    replacements = {
        "isolate_recompiles": "each compiled function gets a private copy of its code object (its own graph "
                              "entries and recompile budget)",
        "recompile_limit": f"each function's recompile limit (default {RECOMPILE_LIMIT}) is applied through "
                           "torch._dynamo.config.recompile_limit, patched for the calls that recompile past it",
    }
    logger.info("torch %s: torch.compile has no %s option; %s", version, " or ".join(dropped),
                "; ".join(replacements[name] for name in dropped))


def module_guard_filter() -> Callable | None:
    """This torch's ``torch.compiler.skip_guard_on_all_nn_modules_unsafe`` (torch 2.9 and later), or None."""
    return getattr(torch.compiler, MODULE_GUARD_FILTER, None)


@functools.lru_cache(maxsize=4)
def _log_module_guards_kept(version: str) -> None:
    logger.info("torch %s: torch.compiler has no %s; compiled calls keep dynamo's guards on the models' modules "
                "(more host time per call)", version, MODULE_GUARD_FILTER)


def compile_kwargs(device_type: str, *, recompile_limit: int = RECOMPILE_LIMIT, cuda_graphs: bool = True,
                   dynamic: bool | None = False, module_guards: bool = False) -> dict:
    """The keyword arguments of specdecode's ``torch.compile`` calls, for this torch.

    ``dynamic=False`` by default (one graph per shape: the fast path's fixed widths; None lets the
    dimensions the caller marks with ``torch._dynamo.mark_dynamic`` stay symbolic) and always
    ``fullgraph=True`` (a graph break or an exhausted recompile budget raises, never a silent
    eager fallback); CUDA graphs when ``device_type`` is ``"cuda"`` and ``cuda_graphs`` (False: the
    caller captures graphs itself): ``mode="reduce-overhead"``, or where the guard filter is passed
    (``options`` and ``mode`` exclude each other) that mode's options
    (``torch._inductor.list_mode_options``); ``options["guard_filter_fn"]``, the module guard filter
    (module docstring), unless ``module_guards`` or this torch lacks it; and
    ``isolate_recompiles=True`` and ``recompile_limit`` only where ``torch.compile``'s signature
    has them (torch 2.13 does, 2.11 does not; each one dropped is logged once). Use
    ``compile_function`` to compile: it also makes up for dropped options.

    Args:
        device_type: ``torch.device(...).type`` of the model, e.g. "cuda" or "cpu".
        recompile_limit: Graph variants the compiled function may build (>= 1).
        cuda_graphs: On CUDA, whether torch.compile makes CUDA graphs (its graph trees).
        dynamic: ``torch.compile``'s ``dynamic``: False, or None (marked dimensions symbolic).
        module_guards: Keep dynamo's guards on the models' modules (for measuring what dropping them saves).

    Returns:
        A new dict of keyword arguments for ``torch.compile`` (``options`` a new dict too: ``torch.compile``
        pops ``guard_filter_fn`` from it).

    Raises:
        InvalidArgumentError: If ``recompile_limit`` is not an integer >= 1, or ``dynamic`` is neither
            False nor None.
    """
    _check_limit(recompile_limit)
    if dynamic is not False and dynamic is not None:
        raise InvalidArgumentError(f"dynamic must be False or None, got {dynamic!r}")
    kwargs: dict = {"dynamic": dynamic, "fullgraph": True}
    cuda = device_type == "cuda" and cuda_graphs
    guard_filter = None if module_guards else module_guard_filter()
    if guard_filter is None and not module_guards:
        _log_module_guards_kept(torch.__version__)
    if guard_filter is not None:
        from torch._inductor import list_mode_options  # named in torch.compile's docstring

        kwargs["options"] = {**(list_mode_options("reduce-overhead", dynamic) if cuda else {}),
                             "guard_filter_fn": guard_filter}
    elif cuda:
        kwargs["mode"] = "reduce-overhead"
    wanted = {"isolate_recompiles": True, "recompile_limit": recompile_limit}
    supported = compile_parameters()
    kwargs.update({name: value for name, value in wanted.items() if name in supported})
    dropped = tuple(name for name in NEWER_COMPILE_OPTIONS if name not in supported)
    if dropped:
        _log_dropped(dropped, torch.__version__)
    return kwargs


def compile_function(fn: Callable, device_type: str, *, recompile_limit: int = RECOMPILE_LIMIT,
                     cuda_graphs: bool = True, dynamic: bool | None = False, module_guards: bool = False) -> Callable:
    """``torch.compile(fn, **compile_kwargs(device_type, cuda_graphs=..., dynamic=...))``, the same on older torch.

    Before compiling, torch's compile caches are pointed at specdecode's cache folder
    (``compile_cache.use_compile_cache``), so a later process reuses the compiled graphs.
    Where ``torch.compile`` lacks ``isolate_recompiles``, ``fn`` is compiled from a private
    copy of its code object; where it lacks ``recompile_limit``, a call that dynamo refuses
    at the global ``torch._dynamo.config.recompile_limit`` is retried with that config
    patched to ``recompile_limit`` for the call (see the module docstring).

    Args:
        fn: A plain Python function (not a bound method or module), e.g. a closure over a model.
        device_type: ``torch.device(...).type`` of the model, e.g. "cuda" or "cpu".
        recompile_limit: Graph variants ``fn`` may build before a call raises (>= 1).
        cuda_graphs, dynamic, module_guards: As ``compile_kwargs``.

    Returns:
        The compiled callable, with ``fn``'s signature.

    Raises:
        InvalidArgumentError: If ``fn`` is not a Python function or ``recompile_limit`` is not
            an integer >= 1.
        torch._dynamo.exc.FailOnRecompileLimitHit: From a call, when ``fn`` would build more
            than ``recompile_limit`` variants.
    """
    if not isinstance(fn, types.FunctionType):
        raise InvalidArgumentError(f"compile_function needs a Python function, got {type(fn).__name__}")
    kwargs = compile_kwargs(device_type, recompile_limit=recompile_limit, cuda_graphs=cuda_graphs, dynamic=dynamic,
                            module_guards=module_guards)
    compile_cache.use_compile_cache()
    if "isolate_recompiles" not in kwargs:
        fn = _private_copy(fn)
    compiled = torch.compile(fn, **kwargs)
    if "recompile_limit" in kwargs:
        return compiled
    return _with_recompile_limit(compiled, recompile_limit)


def _private_copy(fn: types.FunctionType) -> types.FunctionType:
    """``fn`` on a new, identical code object: dynamo's entries and budget are per code object."""
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    return copy


def _with_recompile_limit(compiled: Callable, limit: int) -> Callable:
    """``compiled``, whose calls may recompile up to ``limit`` variants (older torch)."""

    @functools.wraps(compiled)
    def call(*args, **kwargs):
        try:
            return compiled(*args, **kwargs)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            # Raised before tracing (nothing ran): retry with the limit this function was given.
            if torch._dynamo.config.recompile_limit >= limit:
                raise
            logger.debug("recompiling past torch._dynamo.config.recompile_limit=%d (this function's limit: %d)",
                         torch._dynamo.config.recompile_limit, limit)
            with torch._dynamo.config.patch(recompile_limit=limit):
                return compiled(*args, **kwargs)

    return call


def _check_limit(limit: int) -> None:
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InvalidArgumentError(f"recompile_limit must be an integer >= 1, got {limit!r}")
