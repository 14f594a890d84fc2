"""Request scheduling: the bridge between the event loop and the engine's step loop.

One worker thread drives the engine (``Engine.submit`` / ``Engine.step``: continuous
batching over the engine's sequence slots); the event loop sees:

- ``submit(req) -> Job`` (on the event loop thread; raises ``QueueFull`` / ``ShuttingDown``)
- ``await job.next()`` yields ``TokenEvent``s, then exactly one terminal item: the
  ``GenerationResult`` or the exception the engine raised
- ``job.cancel()`` (idempotent; a queued job is dropped, a running one stops within one
  engine step because the engine polls ``job.cancelled``)
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
        self.seq = None   # the engine's Sequence once handed over

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
        """``max_queue``: requests that may wait for a sequence slot (beyond those running)."""
        self.engine, self.max_queue, self.hooks = engine, max_queue, hooks
        self._incoming: collections.deque[Job] = collections.deque()  # not yet handed to the engine
        self._jobs: set[Job] = set()      # in the engine: waiting for a slot or running
        self._cv = threading.Condition()
        self._closing = False
        self._waiting = 0                 # in the engine without a slot (worker thread's count)
        self._running = 0
        self._lanes = max(1, engine.occupancy()[2])
        self._durations: collections.deque[float] = collections.deque(maxlen=16)
        self._thread = threading.Thread(target=self._work, name="dflash-engine", daemon=True)
        self._thread.start()

    @property
    def capacity(self) -> int:
        """Generations that can be in the server at once: running in the slots plus queued."""
        return self._lanes + self.max_queue

    # --- event loop side ------------------------------------------------------------
    def submit(self, req: GenerationRequest, label: str = "") -> Job:
        return self.submit_all([req], label)[0]

    def submit_all(self, reqs: list[GenerationRequest], label: str = "") -> list[Job]:
        """Queue the generations of one request together, or none of them (QueueFull) when
        they do not all fit in the free slots plus ``max_queue``."""
        loop = asyncio.get_running_loop()
        jobs = [Job(req, loop, label) for req in reqs]
        with self._cv:
            if self._closing:
                raise ShuttingDown("the server is shutting down")
            if self._in_server_locked() + len(jobs) > self.capacity:
                if self.hooks:
                    self.hooks.rejected()
                raise QueueFull(self._retry_after_locked())
            self._incoming.extend(jobs)
            self._cv.notify()
        if self.hooks:
            self.hooks.queue_changed(self.queue_depth, self._running)
        return jobs

    @property
    def worker_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a sequence slot (those a free slot is about to take aside)."""
        return max(0, self._in_server_locked() - self._lanes)

    @property
    def running(self) -> int:
        """Requests holding a sequence slot (prefilling or decoding)."""
        return self._running

    def _in_server_locked(self) -> int:
        return self._running + len(self._incoming) + self._waiting

    def _retry_after_locked(self) -> int:
        per_job = sorted(self._durations)[len(self._durations) // 2] if self._durations else 1.0
        return max(1, min(60, math.ceil(per_job * (self.queue_depth + 1) / self._lanes)))

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
            while time.monotonic() < deadline and (self._incoming or self._jobs):
                time.sleep(0.05)
            self.close(cancel_running=True, timeout=0)

        threading.Thread(target=expire, name="dflash-shutdown", daemon=True).start()

    def close(self, cancel_running: bool = True, timeout: float = 30.0) -> None:
        """Stop taking work, fail queued jobs, optionally cancel the running ones, join.
        A cancelled job is failed at once (its client gets its 503 now, not when the engine
        reaches its next step); what the engine still sends it is dropped."""
        with self._cv:
            self._closing = True
            dropped = list(self._incoming)
            self._incoming.clear()
            for job in list(self._jobs):
                if cancel_running or job.seq is None or job.seq.lane is None:
                    dropped.append(job)
            for job in dropped:
                job.cancel()
            self._cv.notify_all()
        for job in dropped:
            job._put(ShuttingDown("the server is shutting down"))
        if self.hooks:
            self.hooks.queue_changed(0, self._running)
        self._thread.join(timeout)

    # --- worker thread ----------------------------------------------------------------
    def _work(self) -> None:
        engine = self.engine
        while True:
            with self._cv:
                while not self._incoming and not engine.has_work and not self._closing:
                    self._cv.wait()
                if not self._incoming and not engine.has_work:
                    return  # closing and drained
                new = list(self._incoming)
                self._incoming.clear()
                self._waiting += len(new)   # counted until _count reads the engine's figures after the step
            for job in new:
                self._hand_over(job)
            if engine.has_work:
                try:
                    ended = engine.step()
                except Exception as e:  # noqa: BLE001 - an engine bug: fail what it holds, live on
                    log.exception("engine step failed")
                    ended = engine.abort(e)
                for seq in ended:
                    self._ended(seq)
            self._count()

    def _count(self) -> None:
        waiting, running, _ = self.engine.occupancy()
        with self._cv:
            self._waiting, self._running = waiting, running
        if self.hooks:
            self.hooks.queue_changed(self.queue_depth, self._running)

    def _hand_over(self, job: Job) -> None:
        hooks = self.hooks
        if job.cancelled:  # its client left while it waited: never run it
            job._put(GenerationResult([], "", "cancelled", len(job.req.prompt_ids)))
            if hooks:
                hooks.skipped(job)
            return

        def on_event(ev: TokenEvent) -> None:
            now = time.monotonic()
            if job.t_start is None and job.seq is not None:
                job.t_start = job.seq.t_start
            if ev.token_id >= 0:
                if hooks:
                    hooks.token(job, now)
                if job.t_first is None:
                    job.t_first = now
                job.t_last = now
            job._put(ev)

        try:
            job.seq = self.engine.submit(job.req, on_event=on_event, cancelled=job._cancel.is_set, tag=job)
        except Exception as e:  # noqa: BLE001 - a request the engine refuses
            self._failed(job, e)
            return
        self._jobs.add(job)

    def _ended(self, seq) -> None:
        job = seq.tag
        self._jobs.discard(job)
        job.t_start = job.t_start or seq.t_start
        if seq.error is not None:
            self._failed(job, seq.error)
            return
        result = seq.result
        if job.t_start is None:     # cancelled before it got a slot
            if self.hooks:
                self.hooks.skipped(job)
        else:
            self._durations.append(time.monotonic() - job.t_start)
            if self.hooks:
                self.hooks.finished(job, result)
        log_request(job, result)
        job._put(result)

    def _failed(self, job: Job, e: BaseException) -> None:
        if isinstance(e, ShardError):  # expected and handled: the worker restarts
            log.warning("generation failed: %s", e)
        elif not isinstance(e, ValueError):
            log.error("generation failed", exc_info=e)
        if self.hooks:
            self.hooks.failed(job)
        log_request(job, None, e)
        job._put(e)


request_log = logging.getLogger("dflash_server.requests")


def log_request(job: Job, result: GenerationResult | None, error: BaseException | None = None) -> None:
    """One info line per finished request (llama-server's and Flyweight's habit): endpoint,
    prompt tokens and the cached share, time to first token, output tokens and speed,
    DFlash acceptance length, finish reason; or the failure's reason."""
    if not request_log.isEnabledFor(logging.INFO):
        return
    what = job.label or "generate"
    if result is None:
        reason = f"{type(error).__name__}: {error}" if error is not None else "unknown"
        request_log.info("%s failed after %.2f s: %s", what, time.monotonic() - job.t_submit, reason[:300])
        return
    prompt, cached = result.prompt_tokens, result.cached_tokens
    ttft = f"{job.t_first - job.t_submit:.3f} s" if job.t_first is not None else "-"
    spec = result.extra.get("spec") if result.extra else None
    tau = f", acceptance {spec['acceptance_length']:.2f}" if spec and spec.get("steps") else ""
    request_log.info("%s: %d prompt tokens (%d cached, %.0f%%), ttft %s, %d tokens in %.2f s (%.1f tok/s)%s, "
                     "finish %s", what, prompt, cached, 100.0 * cached / prompt if prompt else 0.0, ttft,
                     len(result.token_ids), result.decode_s, result.decode_tokens_per_s, tau, result.finish_reason)
