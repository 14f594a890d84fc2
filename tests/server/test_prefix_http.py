"""Prefix cache through the HTTP server: a multi-turn chat reports cached tokens on turns
2..5, and a restarted server (SIGTERM, same --kv-cache-dir) hits from disk on its first
request with output equal to the warm server's."""
from __future__ import annotations

import time

import httpx

from .conftest import start_tiny

QUESTIONS = ["Describe the sea.", "Why salty?", "And rivers?", "Name a fish.", "Thanks."]


def chat(url, messages):
    r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 6,
                                                     "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_multi_turn_cached_tokens_and_restart_from_disk(tiny_dir, tmp_path):
    cache = str(tmp_path / "kv")
    args = ("--kv-cache-dir", cache, "--disk-prefix-cache", "full")
    messages = [{"role": "system", "content": "You are a terse assistant. " * 6}]
    warm_answers = []
    srv = start_tiny(tiny_dir, "llama", *args)
    try:
        for turn, q in enumerate(QUESTIONS):
            messages.append({"role": "user", "content": q})
            out = chat(srv.url, messages)
            usage = out["usage"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            if turn == 0:
                assert cached == 0
            else:
                # everything before this user turn came from the cache
                assert 0 < cached < usage["prompt_tokens"], usage
            text = out["choices"][0]["message"]["content"]
            warm_answers.append(text)
            messages.append({"role": "assistant", "content": text})
        last_prompt = messages[:-1]
    finally:
        assert srv.stop() == 0, srv.output()
    srv2 = start_tiny(tiny_dir, "llama", *args)
    try:
        out = chat(srv2.url, last_prompt)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert out["choices"][0]["message"]["content"] == warm_answers[-1]
        disk = httpx.get(srv2.url + "/props", timeout=30).json()["cache"]["disk"]
        assert disk["enabled"] and disk["files"] >= 4 and disk["hits"] >= 1 and disk["reads"] >= 1
    finally:
        assert srv2.stop() == 0, srv2.output()


def test_per_request_scope_and_metrics(tiny_dir, tmp_path):
    """``prefix_cache: {scope}``: off = no hit and no snapshot, memory = never written to
    disk, full = written whatever its length; a bad scope is a 400 in every API; /metrics
    counts memory and disk activity."""
    import anthropic

    cache = tmp_path / "kv"
    srv = start_tiny(tiny_dir, "llama", "--kv-cache-dir", str(cache), "--disk-prefix-cache", "auto",
                     "--kv-cache-min-tokens", "100000")  # auto would never write these short prompts
    try:
        def ask(messages, scope=None, status=200):
            body = {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0}
            if scope:
                body["prefix_cache"] = {"scope": scope}
            r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == status, r.text
            return r.json()

        def files():
            return list(cache.rglob("*.snap.safetensors"))

        msgs = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "One"},
                {"role": "assistant", "content": "Two"}, {"role": "user", "content": "Three"}]
        assert ask(msgs, "off")["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert ask(msgs, "off")["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # nothing was kept
        ask(msgs, "memory")
        assert ask(msgs, "memory")["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert files() == []  # memory scope and auto below the minimum: nothing on disk
        ask(msgs[:2] + [{"role": "assistant", "content": "Four"}, {"role": "user", "content": "Five"}], "full")
        deadline = time.monotonic() + 30
        while not files():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        err = ask(msgs, "everything", status=400)
        assert "prefix_cache" in err["error"]["message"]
        client = anthropic.Anthropic(base_url=srv.url, api_key="x")
        try:
            client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                                   extra_body={"prefix_cache": {"scope": 3}})
            raise AssertionError("expected a 400")
        except anthropic.BadRequestError as e:
            assert "prefix_cache" in str(e)
        def values():
            metrics = httpx.get(srv.url + "/metrics").text
            return {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
                    if line.startswith("dflash_prefix_cache_")}
        # the writer thread renames the file into place before it counts the write: poll
        deadline = time.monotonic() + 30
        while (v := values())["dflash_prefix_cache_disk_writes_total"] < 1 or v["dflash_prefix_cache_disk_files"] < 1:
            assert time.monotonic() < deadline, v
            time.sleep(0.1)
        assert v["dflash_prefix_cache_memory_hits_total"] >= 1
    finally:
        assert srv.stop() == 0, srv.output()
