"""Bad input, auth, overload, disconnects and shutdown: the server answers each with the
right JSON error and keeps serving correctly afterwards."""
import asyncio
import json
import re
import signal
import time

import httpx
import pytest

from .conftest import start_tiny

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
RAW = {**AUTH, "Content-Type": "application/json"}  # raw bodies (json= sets the type itself)
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def srv(tiny_dir):
    # one sequence slot: these tests queue requests behind a running one
    s = start_tiny(tiny_dir, "llama", "--api-key", KEY, "--max-queue", "2", "--max-body-mb", "1", "--parallel", "1")
    yield s
    assert s.stop() == 0, s.output()


def post(srv, path, body=None, headers=AUTH, **kw):
    return httpx.post(srv.url + path, json=body, headers=headers, timeout=60, **kw)


def healthy(srv):
    r = post(srv, "/v1/chat/completions", CHAT)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] is not None


def metric(srv, name: str, labels: str = "") -> float:
    text = httpx.get(srv.url + "/metrics", headers=AUTH).text
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_auth(srv):
    r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    r = httpx.post(srv.url + "/v1/messages", json=CHAT, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert r.json()["type"] == "error"  # Anthropic shape on Anthropic routes
    assert httpx.post(srv.url + "/v1/chat/completions", json=CHAT, headers={"x-api-key": KEY}).status_code == 200
    assert httpx.get(srv.url + "/health").status_code == 200  # health stays public
    assert httpx.get(srv.url + "/metrics").status_code == 401


@pytest.mark.parametrize("body", [
    b"{not json", b"", b"[]", b'"text"', b"\xff\xfe\x00garbage", b"[" * 5000 + b"]" * 5000,
    b'{"model": "tiny", "messages": "hello"}',
    b'{"model": "tiny", "messages": []}',
    b'{"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": 5}]}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1e400}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 99999999999999999999999}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 7}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_p": 1.5}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 50}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stop": ["a","b","c","d","e"]}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 50, "logprobs": true}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", '
    b'"json_schema": {"name": "x", "schema": {"type": "nope"}}}}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
    b'"function": {"name": "bad name <>"}}]}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}',
])
def test_bad_chat_requests_are_400(srv, body):
    r = httpx.post(srv.url + "/v1/chat/completions", content=body, headers=RAW, timeout=60)
    assert r.status_code == 400, (body[:80], r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert len(r.content) < 4000  # the error never echoes a huge input back


def test_context_error_has_the_numbers(srv):
    r = post(srv, "/v1/chat/completions", {**CHAT, "max_tokens": 100_000})
    msg = r.json()["error"]["message"]
    assert "100000" in msg and "512" in msg and r.json()["error"]["param"] == "max_tokens"


def test_other_endpoints_validate(srv):
    assert post(srv, "/v1/completions", {"model": "tiny", "prompt": [10**9]}).status_code == 400
    assert post(srv, "/v1/completions", {"model": "tiny", "prompt": "x", "suffix": "y"}).status_code == 400
    assert post(srv, "/v1/responses", {"model": "tiny", "input": 5}).status_code == 400
    assert post(srv, "/v1/responses", {"model": "tiny", "input": "x", "previous_response_id": "r"}).status_code == 404
    assert post(srv, "/v1/responses", {"model": "tiny", "input": "x", "conversation": "c"}).status_code == 400
    assert post(srv, "/detokenize", {"tokens": [-1]}).status_code == 400
    assert post(srv, "/tokenize", {"content": 5}).status_code == 400
    r = post(srv, "/v1/messages", {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                                   "thinking": {"type": "enabled", "budget_tokens": 10}})
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_unknown_fields_are_ignored(srv):
    r = post(srv, "/v1/chat/completions", {**CHAT, "frobnicate": {"x": [1, 2]}, "user": "u", "store": False,
                                           "metadata": {"a": "b"}, "service_tier": "auto"})
    assert r.status_code == 200


def test_routes_and_methods(srv):
    r = httpx.get(srv.url + "/v1/nope", headers=AUTH)
    assert r.status_code == 404 and "unknown route" in r.json()["error"]["message"]
    r = httpx.get(srv.url + "/v1/chat/completions", headers=AUTH)
    assert r.status_code == 405 and r.json()["error"]["message"]


def test_oversized_body_is_413(srv):
    big = b'{"model": "tiny", "prompt": "' + b"a" * (2 << 20) + b'"}'
    r = httpx.post(srv.url + "/v1/completions", content=big, headers=RAW)
    assert r.status_code == 413 and r.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(40):
            yield b"a" * (64 << 10)

    r = httpx.post(srv.url + "/v1/messages", content=chunks(), headers=RAW)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    healthy(srv)


def test_100_concurrent_requests_with_small_queue(srv):
    async def one(client, i):
        body = {**CHAT, "max_tokens": 8, "stream": i % 2 == 0}
        r = await client.post("/v1/chat/completions", json=body)
        return r.status_code, r.headers.get("retry-after"), r.text

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, headers=AUTH, timeout=120,
                                     limits=httpx.Limits(max_connections=100)) as client:
            return await asyncio.gather(*(one(client, i) for i in range(100)))

    results = asyncio.run(main())
    codes = [c for c, _, _ in results]
    assert set(codes) <= {200, 503}, codes
    assert codes.count(200) >= 3 and codes.count(503) >= 1
    for code, retry, text in results:
        if code == 503:
            assert retry is not None and int(retry) >= 1 and "queue" in text
        elif '"stream": true' not in text:
            assert "[DONE]" in text or '"choices"' in text
    assert metric(srv, "dflash_rejected_requests_total") >= codes.count(503)
    healthy(srv)


def _cancelled(srv) -> float:
    return metric(srv, "dflash_generations_total", '{finish_reason="cancelled"}')


def _wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_disconnect_mid_stream_cancels(srv):
    before = _cancelled(srv)
    body = {**CHAT, "max_tokens": 450, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, headers=AUTH) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    assert _wait_for(lambda: _cancelled(srv) > before)
    healthy(srv)


def test_disconnect_while_waiting_non_stream_cancels(srv):
    before = _cancelled(srv)
    # the client gives up while the 450 tokens are still being decoded: the tiny model writes them in
    # ~0.3 s on the 2-core VM (a 0.3 s read timeout failed 1 run in 3 on 2026-12-04), so 0.1 s
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 450, "ignore_eos": True},
                   headers=AUTH, timeout=httpx.Timeout(60, read=0.1))
    assert _wait_for(lambda: _cancelled(srv) > before)
    healthy(srv)


def test_disconnect_while_queued_never_runs(srv):
    import threading

    before, tokens = _cancelled(srv), metric(srv, "dflash_generated_tokens_total")
    long, started = {}, threading.Event()

    def run_long():
        body = {**CHAT, "max_tokens": 450, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    started.set()
                    long["finish"] = json.loads(line[6:])["choices"][0].get("finish_reason") or long.get("finish")

    t = threading.Thread(target=run_long)
    t.start()
    assert started.wait(30)  # the long request holds the engine; the next one waits in the queue
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/chat/completions", json={**CHAT, "stream": True}, headers=AUTH,
                   timeout=httpx.Timeout(60, read=0.1))
    t.join()
    assert long["finish"] == "length"
    assert _wait_for(lambda: _cancelled(srv) > before)
    assert metric(srv, "dflash_generated_tokens_total") - tokens == 450  # the abandoned one never ran


def test_sigterm_finishes_or_cancels_and_exits_0(tiny_dir):
    s = start_tiny(tiny_dir, "llama", "--shutdown-grace", "0.5")
    body = {**CHAT, "max_tokens": 480, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        s.proc.send_signal(signal.SIGTERM)
        rest = list(lines)
    tail = [x for x in rest if x.startswith("data:")][-1]
    assert tail == "data: [DONE]" or '"error"' in tail  # complete, or told it was cancelled
    assert s.proc.wait(30) == 0, s.output()
