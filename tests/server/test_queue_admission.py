"""Hostile review (2026-11-28). Generations the scheduler's worker has taken out of its incoming queue
are counted nowhere until the engine step after their hand-over ends (``_waiting`` / ``_running`` are
refreshed by ``_count`` only): requests that arrive during that step see free room that is not there.
With --parallel 2 --max-queue 2 (capacity 4) a server admitted 6-8 of 10 staggered requests and /props
showed queue.waiting = 4; this test pins the step of the first request and submits four more."""
from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from dflash_server.engine.generate import GenerationRequest, GenerationResult
from dflash_server.server.scheduler import QueueFull, Scheduler


class BlockedEngine:
    """Two slots; ``step`` waits on ``release`` (a long prefill step), then ends the cancelled
    sequences as the real engine does (a fake that never ended them kept the scheduler's
    worker stepping after ``close``: a daemon thread spinning for the rest of the test
    process, whose GIL contention made later tests of the same xdist worker ~400x slower)."""

    def __init__(self, lanes: int = 2):
        self.lanes, self.seqs = lanes, []
        self.in_step = threading.Event()
        self.release = threading.Event()

    def occupancy(self):
        n = len(self.seqs)
        return max(0, n - self.lanes), min(n, self.lanes), self.lanes

    @property
    def has_work(self):
        return bool(self.seqs)

    def submit(self, req, on_event=None, cancelled=None, tag=None):
        seq = SimpleNamespace(tag=tag, lane=None, t_start=None, error=None, result=None, cancelled=cancelled,
                              prompt=len(req.prompt_ids))
        self.seqs.append(seq)
        return seq

    def step(self):
        self.in_step.set()
        self.release.wait(10)
        ended = [s for s in self.seqs if s.cancelled is not None and s.cancelled()]
        for s in ended:
            s.result = GenerationResult([], "", "cancelled", s.prompt)
        self.seqs = [s for s in self.seqs if s not in ended]
        return ended

    def abort(self, e):
        out, self.seqs = self.seqs, []
        return out


def _req():
    return GenerationRequest(prompt_ids=[1, 2, 3], max_tokens=4)


def test_jobs_being_handed_over_count_against_slots_plus_queue():
    engine = BlockedEngine(lanes=2)
    sched = Scheduler(engine, max_queue=2)            # capacity: 2 slots + 2 queued = 4

    async def scenario():
        sched.submit(_req())                          # the worker takes it and steps (held)
        deadline = time.monotonic() + 10
        while not engine.in_step.is_set():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        for _ in range(3):                            # 2, 3, 4 of 4: fit
            sched.submit(_req())
        assert sched.queue_depth + sched.running <= sched.capacity
        with pytest.raises(QueueFull):                # the fifth does not fit
            sched.submit(_req())

    try:
        asyncio.run(scenario())
    finally:
        engine.release.set()
        sched.close(cancel_running=True, timeout=5)
    assert not sched.worker_alive           # the worker ended: nothing left stepping
