"""Hostile review 2 (lifecycle). A streaming client that leaves after its first token was generated but before
the streaming response started (the gap between ``start_stream``'s wait for the first event and Starlette's
``StreamingResponse``) must still cancel its generation. Starlette's disconnect listener then cancels the
response before its body iterator ever starts, so ``guarded()``'s ``finally`` (which cancels the runs) never
runs and the engine generates max_tokens for nobody, holding the sequence slot."""
from __future__ import annotations

import asyncio
import json
import time

from .scripted import ScriptedEngine, qwen35_tokenizer
from dflash_server.server.app import create_app
from dflash_server.server.config import ServerConfig
from dflash_server.server.state import ServerState


def test_client_gone_before_the_stream_starts_cancels_the_generation(tmp_path_factory):
    engine = ScriptedEngine(qwen35_tokenizer(tmp_path_factory), {"LONG": "word " * 400}, delay_s=0.01)
    state = ServerState(ServerConfig(model_name="scripted"))
    state.attach(engine, {"max_ctx": engine.pipeline.max_ctx})
    app = create_app(state)
    body = json.dumps({"messages": [{"role": "user", "content": "SCRIPT=LONG"}], "max_tokens": 1000,
                       "stream": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "query_string": b"", "root_path": "", "server": ("127.0.0.1", 8080), "client": ("127.0.0.1", 5000),
             "headers": [(b"host", b"127.0.0.1:8080"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    calls = {"n": 0}

    async def receive():
        calls["n"] += 1
        if calls["n"] == 1:
            return {"type": "http.request", "body": body, "more_body": False}
        if calls["n"] == 2:            # the wait for the first token: the client is still there
            await asyncio.Event().wait()
        return {"type": "http.disconnect"}   # it left once that token existed, before the response began

    async def send(message):
        await asyncio.sleep(0)

    def cancelled_count() -> int:
        return sum(1 for line in state.metrics.render().decode().splitlines()
                   if line.startswith('dflash_generations_total{finish_reason="cancelled"}'))

    async def run():
        await app(scope, receive, send)
        deadline = time.monotonic() + 1.5    # cancellation acts within one engine step (10 ms of 4 s here)
        while (engine.scheduler.running or not cancelled_count()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return len(engine.scheduler.running), cancelled_count()

    try:
        running, cancelled = asyncio.run(run())
        assert running == 0 and cancelled, "the generation of a client that left is still running"
    finally:
        state.close()
