"""Releasing a thread's OpenMP pool (``serve.openmp``) and the engine loop doing so before it starts."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time

import pytest
import torch

from specdecode.serve import engine_loop
from specdecode.serve.openmp import release_openmp_pool


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not sys.platform.startswith("linux") or "parallel backend: OpenMP" not in
                    torch.__config__.parallel_info(), reason="needs torch on OpenMP (libgomp) and /proc (Linux)")
def test_release_ends_the_calling_threads_openmp_workers_and_torch_still_works():
    outcome: dict = {}

    def in_fresh_thread() -> None:
        before_threads = torch.get_num_threads()
        torch.set_num_threads(2)  # a pool of one worker even on a 1-core machine
        try:
            x = torch.arange(1 << 20, dtype=torch.float32)
            first = x + 1  # parallel (over at::internal::GRAIN_SIZE elements): starts this thread's pool
            with_pool = _threads()
            outcome["released"] = release_openmp_pool()
            deadline = time.monotonic() + 10.0
            while _threads() >= with_pool and time.monotonic() < deadline:
                time.sleep(0.01)  # the worker exits on its own after the release
            outcome["threads"] = (with_pool, _threads())
            outcome["equal"] = torch.equal(x + 1, first)  # a new pool serves the next op
        finally:
            torch.set_num_threads(before_threads)

    worker = threading.Thread(target=in_fresh_thread)
    worker.start()
    worker.join()
    assert outcome["released"] is True
    with_pool, after = outcome["threads"]
    assert after < with_pool, f"the OpenMP worker did not exit: {with_pool} threads before the release, {after} after"
    assert outcome["equal"]


def test_the_engine_loop_releases_the_starting_threads_pool_before_its_thread_starts(monkeypatch):
    calls: list[tuple[str, bool]] = []

    def record() -> bool:
        calls.append((threading.current_thread().name, engine.alive))
        return True

    class Idle:
        max_batch_size = 1
        num_running = 0
        has_work = False

    monkeypatch.setattr(engine_loop, "release_openmp_pool", record)
    engine = engine_loop.EngineLoop(Idle(), max_queue=0)
    engine.start()
    asyncio.run(engine.stop(1.0))
    assert calls == [(threading.current_thread().name, False)]
