"""Hostile review (2026-11-27). ``n`` generations of one request on an idle server with --parallel 1 --max-queue 0: never a
retryable 503 (it could never succeed), and a refused request is not a cancelled generation."""
from __future__ import annotations

import httpx

from .conftest import start_tiny


def test_n_beyond_slots_plus_queue_on_an_idle_server(tiny_dir):
    srv = start_tiny(tiny_dir, "llama", "--parallel", "1", "--max-queue", "0")
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2,
                "temperature": 0}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
        assert 'dflash_generations_total{finish_reason="cancelled"}' not in metrics, metrics
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", (r.status_code, r.text)
        body["n"] = 1
        assert httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120).status_code == 200
    finally:
        assert srv.stop() == 0, srv.output()
