"""Where a forward's and a generation's time goes: ``torch.profiler`` and ``cProfile`` summaries for
``gpu_engine.py``'s ``profile`` section (issue 28's open questions, measured on the GPU machine).

Two figures of the H200 run (``2026-11-27-gpu-h200.md``) have no explanation yet: a 1.5B target forward of
one token took 2.60 ms where its weights need about 0.65 ms of memory bandwidth, and ``autoregressive``
spent about 95 ms a prompt outside its rounds. This module turns a profiled block into the figures that
tell why, per call (a forward, a round):

- **device busy, ms**: the union of the device's kernel and copy intervals (CUPTI; kernels inside CUDA
  graphs are reported one by one; ``record_function`` ranges such as torch.compile's, which CUPTI also
  reports on the device, left out as torch's own tables leave them). Wall time well above it means the
  device waited on the host.
- **kernels**: device activities (kernels, memcpy, memset).
- **graph launches / kernel launches**: the host's ``cudaGraphLaunch`` and ``cudaLaunchKernel`` (or
  ``cuLaunchKernel``) calls: one graph a compiled call on the fast path; eager kernels otherwise.
- **syncs**: the host's ``cudaStreamSynchronize`` / ``cudaDeviceSynchronize`` / ``cudaEventSynchronize``
  calls and device-to-host copies.

On a CPU (no CUDA activity) the device columns are empty and the CPU operator table is what there is.
Only torch's public profiler API is used (``torch.profiler.profile``, ``events()``, ``key_averages()``),
with the device-time attribute names feature-detected (``self_device_time_total`` on torch >= 2.4,
``self_cuda_time_total`` before).
"""

from __future__ import annotations

import contextlib
import cProfile
import gc
import gzip
import time
import io
import os
import pstats
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

GRAPH_LAUNCHES = ("cudaGraphLaunch",)
KERNEL_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def old_cuda(version: str) -> bool:
    """Whether a CUDA version string ("12.4", "13.0") is older than 12.6, where profiling with CUDA graphs alive
    has crashed unless CUPTI is left initialized (pytorch PRs 112507, 151124)."""
    try:
        return tuple(int(p) for p in version.split(".")[:2]) < (12, 6)
    except ValueError:
        return False


def activities(device: torch.device) -> list:
    """The profiler activities for ``device``: CPU, and CUDA on a CUDA device."""
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


@contextlib.contextmanager
def profiled(device: torch.device):
    """``with profiled(device) as prof:`` a ``torch.profiler.profile`` of the block (CPU, and CUDA on CUDA)."""
    with profile(activities=activities(device)) as prof:
        yield prof


def summary(prof, calls: int) -> dict:
    """Per call (``calls`` >= 1 profiled calls): device busy ms, device activities, graph and kernel launches,
    host syncs (CUDA API synchronizations) and device-to-host copies. Device figures are None without CUDA
    activity (a CPU run)."""
    spans, names = [], Counter()
    d2h = 0
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            if getattr(e, "is_user_annotation", False):  # a record_function range (torch.compile's), not work
                continue
            spans.append((e.time_range.start, e.time_range.end))
            d2h += "DtoH" in e.name or "Device -> Host" in e.name
        else:
            names[e.name] += 1
    kernels, busy_us = len(spans), busy(spans)
    calls = max(1, calls)
    device = kernels > 0
    return {"device_ms": busy_us / 1000 / calls if device else None,
            "kernels": kernels / calls if device else None,
            "graph_launches": sum(names[n] for n in GRAPH_LAUNCHES) / calls,
            "kernel_launches": sum(names[n] for n in KERNEL_LAUNCHES) / calls,
            "syncs": sum(names[n] for n in SYNCS) / calls,
            "d2h_copies": d2h / calls if device else None}


def busy(spans: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals (µs): time the device was busy, overlapping kernels
    of several streams counted once."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def top_table(prof, device: bool, rows: int = 15) -> str:
    """``key_averages()`` as torch prints it: the ``rows`` costliest operators and kernels by self device
    time (``device``) or self CPU time."""
    averages = prof.key_averages()
    key = "self_cpu_time_total"
    if device:
        key = next((k for k in ("self_device_time_total", "self_cuda_time_total")
                    if all(hasattr(a, k) for a in averages[:1])), "self_cpu_time_total")
    return averages.table(sort_by=key, row_limit=rows, max_name_column_width=70)


def save_trace(prof, folder: str | os.PathLike | None, name: str) -> Path | None:
    """Write the profile's Chrome trace to ``folder/name.json.gz`` (atomically: a temporary file, gzipped,
    then renamed), or nothing when ``folder`` is None. Returns the path written."""
    if folder is None:
        return None
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    target = out / f"{name}.json.gz"
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        packed = Path(tmp) / "trace.json.gz"
        with open(raw, "rb") as src, gzip.open(packed, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(packed, target)
    return target


@contextlib.contextmanager
def gc_pauses():
    """``with gc_pauses() as pauses:`` collects (generation, seconds) of every garbage collection that runs in the
    block (``gc.callbacks``): Python's cyclic collector pauses the host, and a full collection walks every tracked
    object (about 0.4 million, 160 ms, on this project's 2-core CPU with the 1.5B and 0.5B models loaded)."""
    pauses: list[tuple[int, float]] = []
    started: list[float] = []

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append((info["generation"], time.perf_counter() - started.pop()))

    gc.callbacks.append(callback)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(callback)


def host_profile(fn, rows: int = 25) -> str:
    """Run ``fn()`` under ``cProfile`` and return the ``rows`` functions with the most cumulative time, as
    ``pstats`` prints them (the host's Python, where the time outside the forwards goes)."""
    prof = cProfile.Profile()
    prof.enable()
    try:
        fn()
    finally:
        prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).strip_dirs().sort_stats("cumulative").print_stats(rows)
    lines = text.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
    return "\n".join(line for line in lines[max(0, start - 2):] if line.strip())
