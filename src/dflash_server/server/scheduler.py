"""Request scheduling: a FIFO queue in front of one engine worker thread.

The interface is what a continuous-batching scheduler would also offer, so one can
replace this without touching the protocol code:

- ``submit(req) -> Job`` (on the event loop thread; raises ``QueueFull`` / ``ShuttingDown``)
- ``await job.next()`` yields ``TokenEvent``s, then exactly one terminal item: the
  ``GenerationResult`` or the exception the engine raised
- ``job.cancel()`` (idempotent; a queued job is dropped, a running one stops within one
  decode step because the engine polls ``job.cancelled``)
- ``close(cancel_running)`` for shutdown

Events cross from the worker thread to the loop with ``call_soon_threadsafe``; a job's
memory is bounded by its own max_tokens and is dropped when the caller lets go of it.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import math
import threading
import time

from ..engine.generate import GenerationRequest, GenerationResult, TokenEvent
from ..errors import ShardError

log = logging.getLogger("dflash_server.scheduler")


class QueueFull(Exception):
    def __init__(self, retry_after_s: int):
        super().__init__("the request queue is full")
        self.retry_after_s = retry_after_s


class ShuttingDown(Exception):
    pass


class Job:
    def __init__(self, req: GenerationRequest, loop: asyncio.AbstractEventLoop, label: str = ""):
        self.req, self.label = req, label
        self._loop = loop
        self._items: asyncio.Queue = asyncio.Queue()
        self._cancel = threading.Event()
        self.t_submit = time.monotonic()
        self.t_start: float | None = None
        self.t_first: float | None = None
        self.t_last: float | None = None

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    async def next(self):
        return await self._items.get()

    async def next_batch(self) -> list:
        """Everything that has arrived (at least one item): bursts, e.g. the tokens one
        speculative step commits, go out to the client as one chunk."""
        items = [await self._items.get()]
        while not self._items.empty() and isinstance(items[-1], TokenEvent):
            items.append(self._items.get_nowait())
        return items

    def _put(self, item) -> None:  # worker thread
        try:
            self._loop.call_soon_threadsafe(self._items.put_nowait, item)
        except RuntimeError:  # the loop is gone: nobody is listening any more
            self._cancel.set()


class Scheduler:
    def __init__(self, engine, *, max_queue: int, hooks=None):
        self.engine, self.max_queue, self.hooks = engine, max_queue, hooks
        self._waiting: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._closing = False
        self.running: Job | None = None
        self._durations: collections.deque[float] = collections.deque(maxlen=16)
        self._thread = threading.Thread(target=self._work, name="dflash-engine", daemon=True)
        self._thread.start()

    # --- event loop side ------------------------------------------------------------
    def submit(self, req: GenerationRequest, label: str = "") -> Job:
        job = Job(req, asyncio.get_running_loop(), label)
        with self._cv:
            if self._closing:
                raise ShuttingDown("the server is shutting down")
            if len(self._waiting) >= self.max_queue and self.running is not None:
                if self.hooks:
                    self.hooks.rejected()
                raise QueueFull(self._retry_after_locked())
            self._waiting.append(job)
            self._cv.notify()
        if self.hooks:
            self.hooks.queue_changed(self.queue_depth, self.running is not None)
        return job

    @property
    def worker_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    def _retry_after_locked(self) -> int:
        per_job = sorted(self._durations)[len(self._durations) // 2] if self._durations else 1.0
        return max(1, min(60, math.ceil(per_job * (len(self._waiting) + 1))))

    def begin_shutdown(self, grace_s: float) -> None:
        """Refuse new work now; let queued and running jobs finish for ``grace_s`` seconds,
        then cancel whatever is left (its client gets a 503 / an error event)."""
        with self._cv:
            if self._closing:
                return
            self._closing = True
            self._cv.notify_all()

        def expire():
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and (self._waiting or self.running is not None):
                time.sleep(0.05)
            self.close(cancel_running=True, timeout=0)

        threading.Thread(target=expire, name="dflash-shutdown", daemon=True).start()

    def close(self, cancel_running: bool = True, timeout: float = 30.0) -> None:
        """Stop taking work, fail queued jobs, optionally cancel the running one, join.
        A cancelled running job is failed at once (its client gets its 503 now, not when
        the engine reaches its next check); what the engine still sends it is dropped."""
        with self._cv:
            self._closing = True
            dropped = list(self._waiting)
            self._waiting.clear()
            if cancel_running and self.running is not None:
                self.running.cancel()
                dropped.append(self.running)
            self._cv.notify_all()
        for job in dropped:
            job._put(ShuttingDown("the server is shutting down"))
        if self.hooks:
            self.hooks.queue_changed(0, self.running is not None)
        self._thread.join(timeout)

    # --- worker thread ----------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._closing:
                    self._cv.wait()
                if not self._waiting:
                    return  # closing and drained
                job = self._waiting.popleft()
                if job.cancelled:  # its client left while it waited: never run it
                    job._put(GenerationResult([], "", "cancelled", len(job.req.prompt_ids)))
                    if self.hooks:
                        self.hooks.skipped(job)
                        self.hooks.queue_changed(self.queue_depth, self.running is not None)
                    continue
                self.running = job
            if self.hooks:
                self.hooks.queue_changed(self.queue_depth, True)
            self._run(job)
            with self._cv:
                self.running = None
            if self.hooks:
                self.hooks.queue_changed(self.queue_depth, False)

    def _run(self, job: Job) -> None:
        job.t_start = time.monotonic()
        hooks = self.hooks

        def on_event(ev: TokenEvent) -> None:
            now = time.monotonic()
            if ev.token_id >= 0:
                if hooks:
                    hooks.token(job, now)
                if job.t_first is None:
                    job.t_first = now
                job.t_last = now
            job._put(ev)

        try:
            result = self.engine.generate(job.req, on_event=on_event, cancelled=job._cancel.is_set)
        except Exception as e:  # noqa: BLE001 - reported to the request, the worker lives on
            if isinstance(e, ShardError):  # expected and handled: the worker restarts
                log.warning("generation failed: %s", e)
            elif not isinstance(e, ValueError):
                log.exception("generation failed")
            if hooks:
                hooks.failed(job)
            job._put(e)
            return
        self._durations.append(time.monotonic() - job.t_start)
        if hooks:
            hooks.finished(job, result)
        job._put(result)
