"""The HTTP surface as a web page or a careless client meets it: Host names (DNS
rebinding), Content-Type (cross-origin simple requests), HEAD, paths in public answers,
parameter names in errors, alias fields, and the sampling a request gets by default."""
import time

import httpx
import pytest

from dflash_server.server.middleware import ROUTES
from server.scripted import ScriptedEngine, ThreadServer, qwen35_tokenizer

POSTS = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
         "/tokenize", "/detokenize"]
BODIES = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
          "/v1/completions": {"prompt": "hi", "max_tokens": 3},
          "/v1/responses": {"input": "hi", "max_output_tokens": 3},
          "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
          "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "hi"}]},
          "/tokenize": {"content": "hi"}, "/detokenize": {"tokens": [1, 2]}}
GETS = ["/", "/health", "/props", "/metrics", "/v1/models", "/slots"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return qwen35_tokenizer(tmp_path_factory)


class Degraded(ScriptedEngine):
    def health(self):
        return {"status": "degraded", "error": "shard worker at ipc:///tmp/dflash-shard-1-abc/worker.sock exited"}


@pytest.fixture(scope="module")
def srv(tok):
    engine = ScriptedEngine(tok, {}, max_ctx=256)
    s = ThreadServer(engine, info={"model": {"path": "/srv/secret/models/m.gguf"}})
    s.engine = engine
    yield s
    s.stop()


def test_every_post_route_is_covered():
    assert set(POSTS) | set(GETS) | {"/v1/models/{id}"} >= set(ROUTES)


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8080", "127.0.0.1.nip.io", "localhost.evil.example"])
def test_foreign_host_names_are_refused(srv, host):
    for path in POSTS:
        r = httpx.post(srv.url + path, json=BODIES[path], headers={"Host": host})
        assert r.status_code == 403 and "--allowed-hosts" in r.json()["error"]["message"], (path, r.text)
    for path in GETS:
        assert httpx.get(srv.url + path, headers={"Host": host}).status_code == 403, path


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:1234", "127.0.0.1", "127.0.0.2:80", "[::1]:8080",
                                  "app.localhost"])
def test_loopback_host_names_are_served(srv, host):
    assert httpx.get(srv.url + "/health", headers={"Host": host}).status_code == 200
    r = httpx.post(srv.url + "/v1/chat/completions", json=BODIES["/v1/chat/completions"], headers={"Host": host})
    assert r.status_code == 200, r.text


def test_allowed_hosts_widen_the_list(tok):
    s = ThreadServer(ScriptedEngine(tok, {}), allowed_hosts=("box.lan", ".corp.example"))
    try:
        for host, code in (("box.lan", 200), ("BOX.LAN:8080", 200), ("a.corp.example", 200), ("corp.example", 200),
                           ("evil.example", 403), ("xcorp.example", 403), ("localhost", 200)):
            assert httpx.get(s.url + "/health", headers={"Host": host}).status_code == code, host
    finally:
        s.stop()
    s = ThreadServer(ScriptedEngine(tok, {}), host="0.0.0.0")  # bound beyond loopback: any name
    try:
        assert httpx.get(s.url + "/health", headers={"Host": "my-server.lan"}).status_code == 200
    finally:
        s.stop()


@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                   "application/jsonx", "text/json"])
def test_post_bodies_must_be_json(srv, ctype):
    """A page's form or text/plain fetch needs no CORS preflight: refused before anything runs."""
    before = len(srv.engine.requests)
    for path in POSTS:
        headers = {"Content-Type": ctype} if ctype else {}
        r = httpx.post(srv.url + path, content=b'{"prompt": "hi", "max_tokens": 3}', headers=headers)
        assert r.status_code == 415 and "application/json" in r.text, (path, ctype, r.text)
    assert len(srv.engine.requests) == before


def test_json_with_parameters_is_accepted(srv):
    r = httpx.post(srv.url + "/v1/completions", content=b'{"prompt": "hi", "max_tokens": 3}',
                   headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200, r.text


def test_head_health(srv):
    r = httpx.head(srv.url + "/health")
    assert r.status_code == 200 and r.content == b""


def test_public_answers_carry_no_paths(srv, tok):
    props = httpx.get(srv.url + "/props").json()
    assert "/srv/secret" not in str(props) and props["model"]["path"].endswith("m.gguf")
    s = ThreadServer(Degraded(tok, {}))
    try:
        r = httpx.get(s.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "degraded"
        assert "/tmp" not in r.text and "dflash-shard" not in r.text and "shard worker" in r.text
        for path in ("/health", "/props"):
            assert "/tmp/" not in httpx.get(s.url + path).text
    finally:
        s.stop()
    keyed = ThreadServer(ScriptedEngine(tok, {}), info={"model": {"path": "/srv/secret/models/m.gguf"}},
                         api_key="k")
    try:  # with a key every /props reader was authenticated: the operator sees the path
        props = httpx.get(keyed.url + "/props", headers={"Authorization": "Bearer k"}).json()
        assert props["model"]["path"] == "/srv/secret/models/m.gguf"
    finally:
        keyed.stop()


def test_context_errors_name_the_field_the_prompt_came_from(srv):
    long = "word " * 400
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": long, "max_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": [5] * 300, "max_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": long}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_responses_token_limit_aliases(srv):
    for field in ("max_output_tokens", "max_tokens", "max_completion_tokens"):
        r = httpx.post(srv.url + "/v1/responses", json={"input": "hi", field: 2})
        assert r.status_code == 200 and srv.engine.requests[-1].max_tokens == 2, field
        assert r.json()["max_output_tokens"] == 2
    r = httpx.post(srv.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 2, "max_tokens": 5})
    assert r.status_code == 400


def test_queue_depth_returns_to_zero_after_skipped_requests(tok):
    engine = ScriptedEngine(tok, {"slow": "one two three four five six seven eight nine ten " * 3}, delay_s=0.02)
    s = ThreadServer(engine)
    try:
        import threading

        runner = threading.Thread(target=lambda: httpx.post(s.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "SCRIPT=slow"}]}, timeout=60))
        runner.start()
        deadline = time.monotonic() + 10
        while "dflash_requests_running 1.0" not in httpx.get(s.url + "/metrics").text:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for _ in range(3):  # queued behind it, then abandoned (slow too, should one start anyway)
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(s.url + "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "SCRIPT=slow"}]}, timeout=httpx.Timeout(30, read=0.1))
        runner.join()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            text = httpx.get(s.url + "/metrics").text
            if "dflash_queue_depth 0.0" in text and 'dflash_generations_total{finish_reason="cancelled"} 3.0' in text:
                break
            time.sleep(0.05)
        assert "dflash_queue_depth 0.0" in text and "dflash_requests_running 0.0" in text
    finally:
        s.stop()


def test_open_bind_without_key_warns_at_start(tiny_dir):
    from server.conftest import start_tiny

    s = start_tiny(tiny_dir, "llama", "--host", "0.0.0.0")
    try:
        r = httpx.get(s.url + "/health", headers={"Host": "some-name.lan"})  # any name when bound beyond loopback
        assert r.status_code == 200
    finally:
        assert s.stop() == 0
    assert "without --api-key" in s.output()
    s = start_tiny(tiny_dir, "llama")
    try:
        assert httpx.get(s.url + "/health", headers={"Host": "some-name.lan"}).status_code == 403
    finally:
        assert s.stop() == 0
    assert "without --api-key" not in s.output()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"])
def test_the_speculative_switch_takes_booleans_only(srv, path):
    """``"speculative"`` (per request: no DFlash draft when false) on every generation route:
    false reaches the engine as ``speculate=False``; true, null or absent leave the draft on;
    anything else is a 400 naming the field."""
    for value, want in ((False, False), (True, True), (None, True)):
        r = httpx.post(srv.url + path, json={**BODIES[path], "speculative": value})
        assert r.status_code == 200 and srv.engine.requests[-1].speculate is want, (value, r.text)
    r = httpx.post(srv.url + path, json=BODIES[path])
    assert r.status_code == 200 and srv.engine.requests[-1].speculate is True
    for bad in ("false", 0, 1, [], {"enabled": False}, "x" * 100_000):
        r = httpx.post(srv.url + path, json={**BODIES[path], "speculative": bad})
        assert r.status_code == 400 and "speculative" in r.text, (bad, r.text[:300])
