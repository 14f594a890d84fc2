"""SSE framing, streaming responses, and what happens when a client goes away.

A stream is committed (status 200 and headers sent) only after the engine produced its
first event, so a request that fails before generating anything gets a proper 4xx/5xx.
When the client disconnects, the response ends and cancels the engine jobs (``_RunsStream``),
which stop within one decode step. Non-streaming requests watch
for the disconnect themselves (``collect``).
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import StreamingResponse

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"}


def dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def data(obj) -> bytes:
    return f"data: {obj if isinstance(obj, str) else dumps(obj)}\n\n".encode()


def event(name: str, obj) -> bytes:
    return f"event: {name}\ndata: {dumps(obj)}\n\n".encode()


class ClientGone(Exception):
    """The client disconnected before a non-streaming response was ready."""


async def _until_disconnect(request: Request, awaitable):
    """Await ``awaitable`` unless the client goes away first (then ClientGone)."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        work.cancel()
        watch.cancel()
        raise
    if work in done:
        watch.cancel()
        return work.result()
    work.cancel()
    raise ClientGone()


async def start_stream(request: Request, runs, body: AsyncIterator[bytes]) -> StreamingResponse:
    """Wait until the first run produced output (errors raise here, before any byte is
    sent; a client that leaves while queued cancels its job), then hand ``body`` to a
    streaming response that cancels ``runs`` when it ends for any reason."""
    try:
        await _until_disconnect(request, runs[0].start())
    except BaseException:
        for r in runs:
            r.cancel()
        raise

    return _RunsStream(runs, body, media_type="text/event-stream", headers=SSE_HEADERS)


class _RunsStream(StreamingResponse):
    """A streaming response that cancels its runs when it ends, whatever its body did: a
    client already gone when the response starts never starts the body iterator, so a
    ``finally`` inside it would never run (the engine would generate for nobody)."""

    def __init__(self, runs, body: AsyncIterator[bytes], **kw):
        super().__init__(body, **kw)
        self.runs = runs

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for r in self.runs:
                r.cancel()   # (a finished run: nothing to do)


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(request: Request, runs) -> list[list]:
    """Run every job to the end (non-streaming); cancels them all if the client leaves.
    Returns each run's logprob events."""
    async def all_runs():
        return [await r.collect() for r in runs]

    try:
        return await _until_disconnect(request, all_runs())
    except BaseException:
        for r in runs:
            r.cancel()
        raise
