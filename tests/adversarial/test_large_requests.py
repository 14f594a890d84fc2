"""One huge request must not freeze or bloat the server: text that cannot fit in the
context is refused by its size before it is tokenized, parsing and tokenizing run off the
event loop, and /health answers within a second throughout."""
import json
import threading
import time

import httpx
import pytest

from server.conftest import start_tiny

JSON = {"content-type": "application/json"}
TEXT = "Hello world, plenty of words here. "  # 35 characters


@pytest.fixture(scope="module")
def srv(tiny_dir):
    s = start_tiny(tiny_dir, "llama", "--max-body-mb", "32")
    yield s
    assert s.stop() == 0, s.output()


def rss_mb(srv) -> float:
    with open(f"/proc/{srv.proc.pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1]) / 1024


def bodies(n_chars: int) -> dict[str, bytes]:
    text = (TEXT * (n_chars // len(TEXT) + 1))[:n_chars]
    user = [{"role": "user", "content": text}]
    return {
        "/v1/chat/completions": {"model": "tiny", "messages": user, "max_tokens": 4},
        "/v1/completions": {"model": "tiny", "prompt": text, "max_tokens": 4},
        "/v1/responses": {"model": "tiny", "input": text, "max_output_tokens": 4},
        "/v1/messages": {"model": "tiny", "messages": user, "max_tokens": 4},
        "/v1/messages/count_tokens": {"model": "tiny", "messages": user},
        "/tokenize": {"content": text},
        "/detokenize#huge": {"tokens": [42] * 3_000_000},
        # many small messages: refused on their total before the template renders them
        "/v1/chat/completions#many": {"model": "tiny", "messages": [{"role": "user", "content": "x" * 300}] * 99_000,
                                      "max_tokens": 4},
    }


def _send(srv, path, body, out):
    t = time.monotonic()
    r = httpx.post(srv.url + path.split("#")[0], content=json.dumps(body).encode(), headers=JSON, timeout=300)
    out.update(status=r.status_code, body=r.json(), seconds=time.monotonic() - t)


def test_30mb_requests_are_refused_by_size_and_health_stays_responsive(srv):
    start = rss_mb(srv)
    for path, body in bodies(30_000_000).items():
        out: dict = {}
        th = threading.Thread(target=_send, args=(srv, path, body, out))
        th.start()
        worst = 0.0
        while th.is_alive():
            t = time.monotonic()
            assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
            worst = max(worst, time.monotonic() - t)
            time.sleep(0.02)
        th.join()
        if path == "/detokenize#huge":  # no context limit applies: served, without blocking the loop
            assert out["status"] == 200 and len(out["body"]["content"]) > 1_000_000, (path, out["status"])
        else:
            assert out["status"] == 400, (path, out)
            err = out["body"]["error"]
            assert "characters" in err["message"] and "512 tokens" in err["message"], (path, err)
        assert out["seconds"] < 10, (path, out["seconds"])
        assert worst < 1.0, (path, worst)
    time.sleep(0.5)
    assert rss_mb(srv) - start < 200, (start, rss_mb(srv))
    r = httpx.post(srv.url + "/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "user", "content": "Hi"}]}, timeout=60)
    assert r.status_code == 200


def test_text_within_the_bound_is_tokenized_and_checked_exactly(srv):
    """Under the character bound the prompt is tokenized and refused (or served) by its
    real token count, with the numbers in the message."""
    r = httpx.post(srv.url + "/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "user", "content": TEXT * 100}]}, timeout=60)
    assert r.status_code == 400 and "tokens; the context size is 512" in r.json()["error"]["message"]
    r = httpx.post(srv.url + "/tokenize", json={"content": TEXT * 100}, timeout=60)
    assert r.status_code == 200 and r.json()["count"] > 512


def test_body_over_the_default_limit_is_413(tiny_dir):
    """The default limit is 8 MiB (a prompt that fits any context we serve is far smaller)."""
    s = start_tiny(tiny_dir, "llama")
    try:
        big = json.dumps({"model": "tiny", "prompt": "a" * (9 << 20)}).encode()
        r = httpx.post(s.url + "/v1/completions", content=big, headers=JSON, timeout=60)
        assert r.status_code == 413 and str(8 << 20) in r.json()["error"]["message"]
        assert httpx.get(s.url + "/props").json()["limits"]["max_body_bytes"] == 8 << 20
    finally:
        assert s.stop() == 0
