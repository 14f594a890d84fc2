"""The HTTP server with a local + remote (shard-worker) split: same answers as unsplit; a
killed worker fails the in-flight request with a 503, /health says degraded until the
worker is back, the next request is correct; shutdown leaves no process or segment."""
from __future__ import annotations

import os
import signal
import time

import httpx

from dflash_server.runtime.ipc_shm import shm_dir

from .conftest import start_tiny


def ask(url, text="Name a color.", status=200):
    r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "max_tokens": 8, "temperature": 0,
                                                     "messages": [{"role": "user", "content": text}]}, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def test_remote_split_server_survives_a_killed_worker(tiny_dir):
    shm_before = {f for f in os.listdir(shm_dir()) if f.startswith("dflash-shm-")}
    srv = start_tiny(tiny_dir, "qwen3_5")
    try:
        ref = ask(srv.url)["choices"][0]["message"]
    finally:
        assert srv.stop() == 0
    srv = start_tiny(tiny_dir, "qwen3_5", "--target-devices", "cpu,remote:cpu", "--shard-timeout", "10")
    try:
        assert ask(srv.url)["choices"][0]["message"] == ref
        props = httpx.get(srv.url + "/props").json()
        assert [p["remote"] for p in props["placement"]] == [False, True]
        (shard,) = props["shards"]
        assert shard["status"] == "ok" and shard["restarts"] == 0
        pid = shard["pid"]
        os.kill(pid, signal.SIGKILL)
        err = ask(srv.url, status=503)
        assert "shard worker" in err["error"]["message"] and "restarting" in err["error"]["message"]
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "degraded"
        deadline = time.monotonic() + 120
        while httpx.get(srv.url + "/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert ask(srv.url)["choices"][0]["message"] == ref
        shard = httpx.get(srv.url + "/props").json()["shards"][0]
        assert shard["restarts"] == 1 and shard["pid"] != pid
        new_pid = shard["pid"]
        # an expected, handled fault: one warning line, no traceback at ERROR
        assert "Traceback" not in srv.output() and "WARNING dflash_server.scheduler" in srv.output()
    finally:
        assert srv.stop() == 0, srv.output()
    try:
        os.kill(new_pid, 0)
        raise AssertionError("the shard worker outlived the server")
    except ProcessLookupError:
        pass
    assert {f for f in os.listdir(shm_dir()) if f.startswith("dflash-shm-")} <= shm_before  # nothing new
