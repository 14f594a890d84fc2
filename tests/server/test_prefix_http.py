"""Prefix cache through the HTTP server: a multi-turn chat reports cached tokens on turns
2..5, and a restarted server (SIGTERM, same --kv-cache-dir) hits from disk on its first
request with output equal to the warm server's."""
from __future__ import annotations

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
