"""Hostile review 2 (lifecycle). ``n`` generations that fit the server's capacity (slots + --max-queue) are
admitted on an idle server: with --parallel 1 --max-queue 1 the server runs one and queues one, so n=2 must
succeed. The scheduler counts jobs it has not handed to the engine yet as queued even when a slot is free, so
the second of the n jobs submitted back to back is refused: a retryable 503 that every retry gets again."""
from __future__ import annotations

import httpx

from .conftest import start_tiny


def test_n_within_slots_plus_queue_is_admitted_on_an_idle_server(tiny_dir):
    srv = start_tiny(tiny_dir, "llama", "--parallel", "1", "--max-queue", "1")
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2,
                "temperature": 0}
        for _ in range(3):   # not a transient: an idle server, every try
            r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, (r.status_code, r.headers.get("retry-after"), r.text)
            assert len(r.json()["choices"]) == 2
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
        assert "dflash_rejected_requests_total 0.0" in metrics, metrics
        assert 'dflash_generations_total{finish_reason="cancelled"}' not in metrics, metrics
    finally:
        assert srv.stop() == 0, srv.output()
