"""PFlash against hostile input: the drafter flag pointed at the wrong things, prompts
past what the drafter reads, concurrent compressions, and garbage to a drafter worker."""
from __future__ import annotations

import concurrent.futures

import httpx
import pytest
import torch

from server.conftest import start_tiny
from unit.test_cli_errors import assert_clean_error, gen


def test_drafter_pointed_at_the_wrong_folder_or_file(tiny_dir, tmp_path):
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "holiday.jpg").write_bytes(b"\xff\xd8\xff" + b"\x00" * 100)
    assert_clean_error(gen(tiny_dir("llama"), "--prefill-drafter", str(folder)), "photos")
    bad = tmp_path / "drafter.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40)
    assert_clean_error(gen(tiny_dir("llama"), "--prefill-drafter", str(bad)), "gguf")
    assert (folder / "holiday.jpg").exists() and bad.exists()   # nothing touched


@pytest.fixture(scope="module")
def server(tiny_dir):
    srv = start_tiny(tiny_dir, "llama", "--prefill-drafter", "self:2", "--parallel", "2")
    yield srv
    assert srv.stop() == 0, srv.output()


def _chat(srv, content, **extra):
    return httpx.post(srv.url + "/v1/chat/completions", timeout=180, json={
        "model": "tiny", "max_tokens": 3, "temperature": 0, "messages": [{"role": "user", "content": content}],
        **extra})


def test_prompts_past_the_drafter_and_past_the_context(server):
    huge = "word " * 3000        # > 1024 tokens: past the tiny model's trained length, what self:N reads
    r = _chat(server, huge, prefill_compression="always")
    assert r.status_code == 400 and "prefill drafter reads at most" in r.json()["error"]["message"]
    r = _chat(server, "word " * 900, prefill_compression={"mode": "always", "keep_ratio": 1.0})
    assert r.status_code == 400 and "keep a smaller fraction" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_concurrent_compressions_equal_serial(server):
    texts = [" ".join(f"Item {i}-{k}: the lamp by the door is green." for i in range(40)) for k in range(4)]
    serial = [_chat(server, t, prefill_compression="always").json() for t in texts]
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        together = list(ex.map(lambda t: _chat(server, t, prefill_compression="always").json(), texts))
    for a, b in zip(serial, together):
        assert a["choices"][0]["message"] == b["choices"][0]["message"]
        da, db = a["usage"].pop("prompt_tokens_details"), b["usage"].pop("prompt_tokens_details")
        assert a["usage"] == b["usage"] and da["compressed_tokens"] == db["compressed_tokens"] > 0
        assert db["cached_tokens"] > 0     # the same compressed prompt again: a prefix-cache hit


def test_a_client_leaving_during_compression(server):
    text = " ".join(f"Row {i}: the kettle sings at dawn." for i in range(90))
    with pytest.raises(httpx.TimeoutException):
        _chat_timeout = httpx.post(server.url + "/v1/chat/completions", timeout=0.05, json={
            "model": "tiny", "max_tokens": 50, "messages": [{"role": "user", "content": text}],
            "prefill_compression": "always"})
        del _chat_timeout
    r = _chat(server, "hello", prefill_compression="always")
    assert r.status_code == 200


def test_garbage_to_a_drafter_worker(tiny_dir):
    from dflash_server.errors import ShardError
    from dflash_server.pflash.remote import RemoteScorer
    from dflash_server.runtime.worker_link import RemoteOptions

    remote = RemoteScorer(str(tiny_dir("qwen3")), device="cpu", dtype=torch.float32, max_ctx=256,
                          options=RemoteOptions(timeout_s=60), n_layers=1)
    try:
        for args, tensors, needle in [
            ({}, {}, "non-empty 1-D int64"),
            ({}, {"ids": torch.zeros(0, dtype=torch.int64)}, "non-empty"),
            ({}, {"ids": torch.ones(4, dtype=torch.float32)}, "int64"),
            ({}, {"ids": torch.tensor([-1], dtype=torch.int64)}, "token ids must be in"),
            ({}, {"ids": torch.zeros(5000, dtype=torch.int64)}, "reads at most"),
        ]:
            with pytest.raises(ValueError, match=needle):   # the worker's answer: it is fine
                remote.link.call("pflash_score", args, tensors)
        with pytest.raises(ShardError):
            remote.link.call("pflash_load", {"path": "/nonexistent", "device": "cpu", "dtype": "f32",
                                             "max_ctx": 64})
        assert remote.score([5, 6, 7, 8, 9, 10, 11, 12, 13]).shape == (9,)
    finally:
        remote.close()
