"""Hostile review 2 (lifecycle). Request bodies are read into memory before any admission: every connection
that has sent a body short of its last byte holds it, without limit on how many, so memory grows as
connections x --max-body-mb (--max-queue bounds only jobs in the scheduler). 100 such connections to a server
with --parallel 1 --max-queue 1 and 1 MiB bodies must not cost the server anywhere near 100 MiB."""
from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from dflash_server.server import state as state_mod
from dflash_server.server.config import ServerConfig
from dflash_server.server.errors import APIError

from server.conftest import start_tiny


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_held_request_bodies_do_not_grow_memory_per_connection(tiny_dir):
    srv = start_tiny(tiny_dir, "llama", "--parallel", "1", "--max-queue", "1", "--max-body-mb", "1")
    socks = []
    try:
        size = (1 << 20) - 1024
        body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "a" * (size - 64)}]}).encode()
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        before = _rss_mib(srv.proc.pid)
        for _ in range(100):   # each sends all but the last byte and waits
            s = socket.create_connection(("127.0.0.1", srv.port))
            s.settimeout(0.05)
            try:
                s.sendall(head + body[:-1])
            except (socket.timeout, OSError):
                pass           # the server stopped reading this one: what a bounded server may do
            socks.append(s)
        time.sleep(3)
        grown = _rss_mib(srv.proc.pid) - before
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
        assert grown < 40, f"server memory grew {grown:.0f} MiB for 100 held 1 MiB bodies"
    finally:
        for s in socks:
            s.close()
        assert srv.stop() == 0, srv.output()


def _request(receive, length: int):
    from starlette.requests import Request

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [
        (b"content-length", str(length).encode()), (b"content-type", b"application/json")]}
    return Request(scope, receive)


def test_a_body_that_stops_arriving_is_a_408(monkeypatch):
    monkeypatch.setattr(state_mod, "BODY_READ_TIMEOUT_S", 0.2)
    st = state_mod.ServerState(ServerConfig(model_name="x"))

    async def receive(sent=[]):  # noqa: B006 - one call's state
        if not sent:
            sent.append(1)
            return {"type": "http.request", "body": b"{", "more_body": True}
        await asyncio.sleep(3600)   # the client stops sending

    with pytest.raises(APIError) as e:
        asyncio.run(st.read_body(_request(receive, 100)))
    assert e.value.status == 408
    assert st._body_bytes == 0      # the reservation is returned


def test_bodies_in_flight_have_a_budget():
    st = state_mod.ServerState(ServerConfig(model_name="x", max_body_bytes=1024))
    gate = asyncio.Event

    async def main():
        held = gate()

        async def hold():
            await held.wait()
            return {"type": "http.request", "body": b"x" * 1024, "more_body": False}

        tasks = [asyncio.create_task(st.read_body(_request(hold, 1024))) for _ in range(state_mod.BODIES_BEYOND_CAPACITY)]
        await asyncio.sleep(0.05)
        with pytest.raises(APIError) as e:   # one more than the budget: refused unread
            await st.read_body(_request(hold, 1024))
        assert e.value.status == 503 and e.value.headers.get("Retry-After")
        held.set()
        assert all(len(b) == 1024 for b in await asyncio.gather(*tasks))
        assert st._body_bytes == 0

    asyncio.run(main())


# A request with 'Transfer-Encoding: chunked' is framed by its chunks (h11, RFC 9112 6.3: the
# Content-Length beside it is ignored): reserving its 'Content-Length: 1' let connections
# each holding back the end of a full-size body pin memory past the budget.
def _chunked_request(receive):
    from starlette.requests import Request

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [
        (b"content-length", b"1"), (b"transfer-encoding", b"chunked"), (b"content-type", b"application/json")]}
    return Request(scope, receive)


def test_chunked_body_with_a_small_content_length_does_not_bypass_the_budget():
    limit = 1024
    st = state_mod.ServerState(ServerConfig(model_name="x", max_body_bytes=limit))
    n = 4 * state_mod.BODIES_BEYOND_CAPACITY   # budget: BODIES_BEYOND_CAPACITY bodies (no scheduler)

    async def main():
        held = asyncio.Event()

        def receiver():
            sent = []

            async def receive():
                if not sent:
                    sent.append(1)   # most of a body (far more than the 1 byte declared) ...
                    return {"type": "http.request", "body": b"x" * (limit - 1), "more_body": True}
                await held.wait()    # ... and the last byte held back
                return {"type": "http.request", "body": b"x", "more_body": False}
            return receive

        tasks = [asyncio.create_task(st.read_body(_chunked_request(receiver()))) for _ in range(n)]
        await asyncio.sleep(0.1)
        refused = sum(1 for t in tasks if t.done() and isinstance(t.exception(), APIError))
        held.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        return refused

    refused = asyncio.run(main())
    # n bodies of `limit` bytes held at once, n - refused of them admitted: at most the budget's worth
    assert n - refused <= state_mod.BODIES_BEYOND_CAPACITY, \
        f"{n - refused} bodies of {limit} bytes held at once (budget: {state_mod.BODIES_BEYOND_CAPACITY})"
