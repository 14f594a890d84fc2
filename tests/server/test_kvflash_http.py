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


def test_score_policy_pools_under_concurrent_requests_equal_each_alone(tiny_dir):
    """``--parallel 3`` with KV Flash pools under the score policy, split across a shard
    worker: requests streamed at once (each prompt longer than its 64-token pool, re-selecting
    every 8 tokens) get exactly what each gets alone, their rows in shared steps (bf16 + int8:
    the native kernels, whose masses per slot equal its own forward's)."""
    import re
    import threading

    srv = start_tiny(tiny_dir, "llama", "--dtype", "bf16", "--quantize", "int8", "--parallel", "3",
                     "--kvflash", "64", "--kvflash-chunk", "8", "--kvflash-policy", "score", "--kvflash-tau", "8",
                     "--target-devices", "cpu,remote:cpu", "--no-draft")
    try:
        texts = [f"Item {i}: the {w} river runs past the old mill and under the stone bridge. " * 6
                 for i, w in enumerate(("slow", "wide", "cold"))]

        def ask(text):
            r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
                "model": "tiny", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": text}]})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] > 64
            return r.json()["choices"][0]["message"]["content"]

        def metric(name):
            m = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(srv.url + "/metrics").text, re.M)
            return float(m.group(1)) if m else 0.0

        alone = [ask(t) for t in texts]
        seen = []
        for _ in range(4):
            got, gate = [None] * 3, threading.Barrier(3)

            def run(i):
                gate.wait(30)
                got[i] = ask(texts[i])
            rows0, steps0 = metric("dflash_engine_decode_rows_total"), metric("dflash_engine_steps_total")
            threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert got == alone
            rows = metric("dflash_engine_decode_rows_total") - rows0
            steps = metric("dflash_engine_steps_total") - steps0
            seen.append((rows, steps))
            if rows > steps * 1.5:
                break
        else:
            raise AssertionError(f"no round shared its steps (decode rows, steps per round): {seen}")
        for st in httpx.get(srv.url + "/props").json()["kvflash"]["stages"]:
            assert st["policy"] == "score" and st["page_outs"] > 0
    finally:
        assert srv.stop() == 0, srv.output()
