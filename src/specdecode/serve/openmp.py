"""Hand the CPU's OpenMP threads to the engine thread: release the calling thread's OpenMP pool.

GNU OpenMP (libgomp, the runtime of torch's CPU wheels on Linux) keeps one pool of worker threads
per thread that starts parallel regions, and it spins only about 100 times (instead of 300,000,
a few milliseconds) before a waiting thread sleeps on a futex when the threads it manages, all
pools together, outnumber the CPUs (``gomp_throttled_spin_count_var``, libgomp's ``env.c`` and
``team.c``). The server loads and warms up the models in the main thread (one pool) and decodes
in its engine thread (a second pool): on a 2-core machine that made every parallel torch op of
the engine thread sleep and wake its worker, two context switches per op.

Measured (2-core AMD EPYC, avx2 avx512f avx512_bf16 avx512_vnni, no AMX, torch 2.13.0+cpu, 2
threads): 20,000 ``torch.add`` of 200,000 floats took 0.33-0.37 s in the main thread and
1.27-1.32 s in a second thread (37,500 voluntary context switches against 0-3); after
``release_openmp_pool()`` in the main thread, 0.36-0.37 s in the second thread. The batched
engine stepped in a worker thread (``docs/benchmarks/engine_thread_cost.py``): see
``docs/benchmarks/2026-11-25-serve-vs-generate.md``.

``omp_pause_resource_all`` is OpenMP 5.0 (section 3.2.44); libgomp implements it as freeing the
calling thread's pool (``gomp_pause_host``). The calling thread may run torch again afterwards
(libgomp then starts a new pool), which brings the throttling back while both pools exist.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

import torch

logger = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: omp_pause_soft (OpenMP 5.0, omp.h)
LIBGOMP = "libgomp.so.1"


def release_openmp_pool() -> bool:
    """End the OpenMP worker threads that the calling thread's parallel torch ops started.

    Call it in the thread that loaded the models, before another thread takes over all torch work
    (``EngineLoop.start``), so that only that thread's pool exists and libgomp keeps its
    workers spinning between ops instead of sleeping. Only libgomp already loaded in this process is
    used (``RTLD_NOLOAD``): nothing is loaded.

    Returns:
        True if libgomp released the pool; False where torch's parallel backend is not OpenMP,
        libgomp is not loaded (Intel or LLVM OpenMP, macOS, Windows) or refused (called inside a
        parallel region): logged, nothing changed.
    """
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        logger.debug("torch's parallel backend is not OpenMP: no OpenMP pool to release")
        return False
    nolib = getattr(os, "RTLD_NOLOAD", None)
    if nolib is None:
        logger.debug("dlopen has no RTLD_NOLOAD here: the OpenMP pool is left as it is")
        return False
    try:
        gomp = ctypes.CDLL(LIBGOMP, mode=nolib | os.RTLD_LAZY)
        pause = gomp.omp_pause_resource_all
    except (OSError, AttributeError) as exc:
        logger.info("%s with omp_pause_resource_all is not loaded (%s): the OpenMP pool is left as it is",
                    LIBGOMP, exc)
        return False
    pause.argtypes = [ctypes.c_int]
    pause.restype = ctypes.c_int
    status = pause(OMP_PAUSE_SOFT)
    if status != 0:
        logger.warning("omp_pause_resource_all(omp_pause_soft) returned %d: the OpenMP pool is left as it is",
                       status)
        return False
    logger.debug("released the OpenMP pool of thread %r", threading.current_thread().name)
    return True
