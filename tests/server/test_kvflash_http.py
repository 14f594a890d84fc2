"""The HTTP server with KV Flash: a context longer than the pool is served; /props and
/metrics show the pool and its paging; the split across a shard worker works too."""
from __future__ import annotations

import httpx

from .conftest import start_tiny


def test_kvflash_visible_in_props_and_metrics(tiny_dir):
    srv = start_tiny(tiny_dir, "qwen3_5", "--kvflash", "128", "--kvflash-chunk", "16", "--kvflash-policy", "score",
                     "--target-devices", "cpu,remote:cpu")
    try:
        long_text = "The river runs past the old mill and under the stone bridge. " * 20
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "model": "tiny", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": long_text}]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] > 128
        kv = httpx.get(srv.url + "/props").json()["kvflash"]
        assert kv["enabled"] and len(kv["stages"]) == 2
        for st in kv["stages"]:
            assert st["pool_tokens"] == 128 and st["chunk"] == 16 and st["policy"] == "score"
            assert st["page_outs"] > 0 and st["paged_chunks"] > 0 and st["host_bytes"] > 0
        metrics = httpx.get(srv.url + "/metrics").text
        line = next(m for m in metrics.splitlines() if m.startswith("dflash_kvflash_page_outs "))
        assert float(line.split()[1]) > 0
        assert "dflash_kvflash_pool_tokens 256.0" in metrics  # two stages of 128
    finally:
        assert srv.stop() == 0, srv.output()
