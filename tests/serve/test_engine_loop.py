"""The engine loop on a stand-in decoder whose failures are chosen: no request is ever left waiting."""

from __future__ import annotations

import asyncio

import pytest

from specdecode.config import GenerationConfig
from specdecode.engine.stats import BatchStats
from specdecode.serve.engine_loop import EngineLoop, EngineStoppedError


class BrokenDecoder:
    """Takes requests; its step raises (``fail_step``) and so does cancelling a row afterwards
    (``fail_cancel``), as a batched engine whose device state broke would."""

    max_batch_size = 2

    def __init__(self, fail_step: bool = True, fail_cancel: bool = True) -> None:
        self.rows: list[int] = []
        self.fail_step, self.fail_cancel = fail_step, fail_cancel
        self.stats = BatchStats()
        self.steps = 0

    @property
    def num_running(self) -> int:
        return len(self.rows)

    @property
    def has_work(self) -> bool:
        return len(self.rows) >= self.max_batch_size  # the first step runs once both requests joined

    def add(self, prompt_ids, config) -> int:
        self.rows.append(len(self.rows))
        return self.rows[-1]

    def cancel(self, request_id: int) -> None:
        if self.fail_cancel:
            raise RuntimeError("device-side assert triggered")
        self.rows.remove(request_id)

    def step(self):
        self.steps += 1
        if self.fail_step:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return []


def test_a_failed_step_whose_rows_cannot_be_cancelled_still_answers_every_request():
    async def scenario():
        engine = EngineLoop(BrokenDecoder(), max_queue=0)
        engine.start()
        handles = [await asyncio.wait_for(engine.submit([1, 2], GenerationConfig(max_new_tokens=4)), 10)
                   for _ in range(2)]
        finals = [await asyncio.wait_for(h.deliveries.get(), 10) for h in handles]
        await engine.stop(1.0)
        return engine, finals

    engine, finals = asyncio.run(scenario())
    assert [d.finish_reason for d in finals] == ["error", "error"]
    assert all("illegal memory access" in d.error for d in finals)
    assert engine.outstanding == 0


def test_requests_submitted_after_the_engine_stopped_are_refused_not_left_waiting():
    async def scenario():
        engine = EngineLoop(BrokenDecoder(fail_step=False, fail_cancel=False), max_queue=4)
        engine.start()
        await engine.stop(0.0)
        with pytest.raises(EngineStoppedError):
            await asyncio.wait_for(engine.submit([1], GenerationConfig(max_new_tokens=2)), 5)
        return engine

    assert asyncio.run(scenario()).outstanding == 0
