"""Warm-up paid once per machine: torch's compile caches in specdecode's cache folder.

A compiled forward costs seconds to minutes on first use (dynamo traces the model, AOTAutograd
and inductor lower it, C++ or Triton kernels are compiled). Inductor keeps the expensive part
on disk, keyed by the traced graph, the torch version, the device and the config:

* the FX graph cache (``torch._inductor.config.fx_graph_cache``, on by default): the compiled
  module of each graph, with its C++ (CPU) or Triton (CUDA, bundled) kernels;
* the AOTAutograd cache (``torch._functorch.config.enable_autograd_cache``, on by default);
* Triton's own kernel cache, which inductor places under its cache folder
  (``<folder>/triton/<device>``) unless ``TRITON_CACHE_DIR`` is set.

By default that folder is ``/tmp/torchinductor_<user>``, which a reboot or a fresh container
empties. ``use_compile_cache`` points it at ``<specdecode cache>/compile`` through
``TORCHINDUCTOR_CACHE_DIR``, the variable torch reads (torch 2.11 and later), unless the user
has set it to another folder. A second
process with the same models, dtype, device and widths then loads its graphs from disk and
only re-runs dynamo's tracing. Measured in docs/benchmarks/2026-11-25-compile-cache.md.

torch's "mega-cache" (``torch.compiler.save_cache_artifacts`` / ``load_cache_artifacts``)
packs these same caches into bytes to carry them to another machine; on one machine the
on-disk caches already hold them, so it is not used.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

#: The environment variable inductor reads for its cache folder (FX graphs, AOTAutograd, Triton).
CACHE_DIR_ENV = "TORCHINDUCTOR_CACHE_DIR"


def compile_cache_dir() -> Path:
    """``<specdecode cache>/compile``: the compile caches' folder specdecode chooses.

    The specdecode cache is ``$SPECDECODE_CACHE``, else ``$XDG_CACHE_HOME/specdecode``, else
    ``~/.cache/specdecode``: the same root as ``specdecode.models.default_cache_dir`` (which
    the engine may not import; a test keeps the two equal).
    """
    if os.environ.get("SPECDECODE_CACHE"):
        return Path(os.environ["SPECDECODE_CACHE"]) / "compile"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specdecode" / "compile"


def use_compile_cache() -> Path:
    """Point torch's compile caches at ``compile_cache_dir()``, unless the user chose a folder.

    The user's choice is ``TORCHINDUCTOR_CACHE_DIR`` set to any folder but torch's default:
    importing ``torch._dynamo`` (transformers does) already sets the variable to that default
    (``/tmp/torchinductor_<user>``), so the default cannot be told from a user's setting and
    is replaced. Call before the first compilation of the process (``compat.compile_function``
    does, at each runner's first compile; later calls find the folder set and change nothing).
    The setting is the process's environment, the mechanism torch reads; nothing else is kept.
    Logs the folder (INFO) when it sets it, and (INFO) when the FX graph cache or the
    AOTAutograd cache is switched off, as a second process then compiles again.

    Returns:
        The folder torch's compile caches use from now on.
    """
    current = os.environ.get(CACHE_DIR_ENV)
    folder = compile_cache_dir()
    if current and Path(current).absolute() == folder.absolute():
        return folder
    torch_default = _torch_default_cache_dir()
    if current and (torch_default is None or Path(current).absolute() != torch_default.absolute()):
        logger.info("torch's compile caches stay in %s (%s is set)", current, CACHE_DIR_ENV)
        return Path(current)
    os.environ[CACHE_DIR_ENV] = str(folder)
    logger.info("torch's compile caches (inductor's FX graphs, AOTAutograd, Triton kernels) are in %s; "
                "set %s to place them elsewhere", folder, CACHE_DIR_ENV)
    _log_disabled_caches()
    return folder


def _torch_default_cache_dir() -> Path | None:
    """Inductor's own default folder (torch 2.11 to 2.13 at least), or None where torch moved it."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        logger.info("this torch has no torch._inductor.runtime.cache_dir_utils.default_cache_dir: any %s "
                    "already set is kept as the user's choice", CACHE_DIR_ENV)
        return None
    return Path(default_cache_dir())


def _log_disabled_caches() -> None:
    import torch._functorch.config
    import torch._inductor.config

    if not torch._inductor.config.fx_graph_cache:
        logger.info("inductor's FX graph cache is off (torch._inductor.config.fx_graph_cache, "
                    "TORCHINDUCTOR_FX_GRAPH_CACHE): every process compiles its graphs again")
    if not torch._functorch.config.enable_autograd_cache:
        logger.info("the AOTAutograd cache is off (torch._functorch.config.enable_autograd_cache, "
                    "TORCHINDUCTOR_AUTOGRAD_CACHE): every process lowers its graphs again")
