"""Hostile review (2026-11-27). A request with ``prefix_cache: {"scope": "memory"}`` must keep its snapshot out of the disk
cache (README "Prefix cache"); graceful shutdown writes every memory snapshot that is not on
disk yet, whatever scope its request asked for."""
from __future__ import annotations

import httpx

from .conftest import start_tiny


def test_memory_scope_snapshot_not_written_at_shutdown(tiny_dir, tmp_path):
    cache = tmp_path / "kv"
    srv = start_tiny(tiny_dir, "llama", "--kv-cache-dir", str(cache), "--disk-prefix-cache", "full")
    try:
        msgs = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "One"},
                {"role": "assistant", "content": "Two"}, {"role": "user", "content": "Three"}]
        body = {"model": "tiny", "messages": msgs, "max_tokens": 4, "temperature": 0,
                "prefix_cache": {"scope": "memory"}}
        for _ in range(2):
            r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0   # kept in memory
        assert list(cache.rglob("*.snap.safetensors")) == []
    finally:
        assert srv.stop() == 0, srv.output()
    assert list(cache.rglob("*.snap.safetensors")) == []   # fails: written by the shutdown flush
