"""The HTTP server with a DFlash draft (adaptive block size, the default): output equals the
server without a draft; per-request stats in the response timings, the sizer's state in
/props, counters in /metrics."""
from __future__ import annotations

import json

import httpx
import torch
from safetensors.torch import save_file

from dflash_server.spec.config import DraftConfig
from dflash_server.spec.draft import DFlashDraft

from .conftest import start_tiny


def test_draft_server_equals_plain_and_reports_stats(tiny_dir, llama_server, tmp_path):
    cfg = DraftConfig(hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2,
                      head_dim=16, block_size=4, mask_token_id=5, target_layer_ids=(1, 2), num_target_layers=4)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    # with a draft vocabulary (every third token id)
    save_file({**DFlashDraft.random_tensors(cfg, 0, 0.05), "vocab_ids": torch.arange(0, 49152, 3)},
              str(tmp_path / "model.safetensors"))
    srv = start_tiny(tiny_dir, "llama", "--draft", str(tmp_path), "--batch-spec", "on")
    try:
        body = {"model": "tiny", "max_tokens": 40, "temperature": 0,
                "messages": [{"role": "user", "content": "Count from one to twenty in words."}]}
        got = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json=body).json()
        want = httpx.post(llama_server.url + "/v1/chat/completions", timeout=120, json=body).json()
        assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
        spec = got["timings"]["spec"]
        assert spec["block_size"] == 4 and spec["steps"] + spec["plain_steps"] > 0
        assert {"acceptance_length", "accept_rate", "mean_block_size"} <= set(spec)
        props = httpx.get(srv.url + "/props").json()["speculative"]
        assert props["enabled"] and props["adaptive_block_size"] and props["block_size"] == 4
        assert props["draft_vocab_size"] == 16384
        assert props["block_sizer"]["candidates"] == [1, 2, 3, 4] and props["block_sizer"]["cost_ms"]
        assert props["batch_verify"] is True and "cost_ms" in props["batch_sizer"]   # llama: attention-only
        metrics = httpx.get(srv.url + "/metrics").text
        assert "dflash_spec_plain_steps_total" in metrics and "dflash_spec_verify_steps_total" in metrics
        # a request may turn the draft off: plain steps only, the same answer; on every endpoint
        off = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={**body, "speculative": False}).json()
        assert off["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
        assert off["timings"]["spec"]["steps"] == 0 and off["timings"]["spec"]["plain_steps"] > 0
        for path, extra in (("/v1/completions", {"prompt": "Count"}), ("/v1/messages", {"messages": body["messages"]}),
                            ("/v1/responses", {"input": "Count"})):
            r = httpx.post(srv.url + path, timeout=120, json={"model": "tiny", "max_tokens": 4, "max_output_tokens": 4,
                                                              "speculative": False, **extra})
            assert r.status_code == 200, (path, r.text)
        for bad in ("no", 0, [], {"on": True}):
            r = httpx.post(srv.url + "/v1/chat/completions", timeout=30, json={**body, "speculative": bad})
            assert r.status_code == 400 and "speculative" in r.text, (bad, r.text)
    finally:
        assert srv.stop() == 0, srv.output()


def test_ddtree_server_with_slots_equals_plain(tiny_dir, llama_server, tmp_path):
    """--ddtree --parallel 3: concurrent requests verify their trees together in one forward
    (``speculative.batch_verify`` in /props) and each answer equals the server without a
    draft, streamed or not."""
    from concurrent.futures import ThreadPoolExecutor

    cfg = DraftConfig(hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2,
                      head_dim=16, block_size=4, mask_token_id=5, target_layer_ids=(1, 2), num_target_layers=4)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    save_file(DFlashDraft.random_tensors(cfg, 1, 0.05), str(tmp_path / "model.safetensors"))
    srv = start_tiny(tiny_dir, "llama", "--draft", str(tmp_path), "--ddtree-budget", "6", "--parallel", "3",
                     "--batch-spec", "on")
    try:
        props = httpx.get(srv.url + "/props").json()["speculative"]
        assert props["ddtree"] == {"budget": 6, "active": True} and props["batch_verify"] is True
        bodies = [{"model": "tiny", "max_tokens": 30, "temperature": 0,
                   "messages": [{"role": "user", "content": f"Say something about the number {i}."}]}
                  for i in range(4)]

        def ask(url, body, stream=False):
            if not stream:
                return httpx.post(url + "/v1/chat/completions", timeout=120, json=body).json()[
                    "choices"][0]["message"]["content"]
            text = ""
            with httpx.stream("POST", url + "/v1/chat/completions", timeout=120, json={**body, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        for ch in json.loads(line[6:])["choices"]:
                            text += ch["delta"].get("content") or ""
            return text
        want = [ask(llama_server.url, b) for b in bodies]
        with ThreadPoolExecutor(4) as ex:
            got = list(ex.map(lambda a: ask(srv.url, *a), [(b, i % 2 == 1) for i, b in enumerate(bodies)]))
        assert got == want
        metrics = httpx.get(srv.url + "/metrics").text
        tree_steps = next(float(line.split()[-1]) for line in metrics.splitlines()
                          if line.startswith("dflash_spec_tree_steps_total"))
        assert tree_steps > 0
        rows = {line.split()[0]: float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("dflash_engine_batch_size_")}
        assert rows["dflash_engine_batch_size_sum"] > rows["dflash_engine_batch_size_count"]   # steps of several rows
    finally:
        assert srv.stop() == 0, srv.output()


def test_on_a_cpu_sequences_decoding_together_take_plain_rows(tiny_dir, llama_server, tmp_path):
    """--batch-spec auto (the default) on a CPU target: several running sequences decode plain
    rows in one forward (no batched verify: /props says so), each feeding its draft context,
    and a request running alone still speculates; every answer equals the plain server's."""
    from concurrent.futures import ThreadPoolExecutor

    cfg = DraftConfig(hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2,
                      head_dim=16, block_size=4, mask_token_id=5, target_layer_ids=(1, 2), num_target_layers=4)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    save_file(DFlashDraft.random_tensors(cfg, 2, 0.05), str(tmp_path / "model.safetensors"))
    srv = start_tiny(tiny_dir, "llama", "--draft", str(tmp_path), "--parallel", "3")
    try:
        props = httpx.get(srv.url + "/props").json()["speculative"]
        assert props["enabled"] and props["batch_verify"] is False
        bodies = [{"model": "tiny", "max_tokens": 24, "temperature": 0,
                   "messages": [{"role": "user", "content": f"Tell me about the number {i}."}]} for i in range(4)]

        def ask(url, body):
            return httpx.post(url + "/v1/chat/completions", timeout=120, json=body).json()

        want = [ask(llama_server.url, b)["choices"][0]["message"]["content"] for b in bodies]
        alone = ask(srv.url, bodies[0])
        assert alone["choices"][0]["message"]["content"] == want[0] and alone["timings"]["spec"]["steps"] > 0
        with ThreadPoolExecutor(4) as ex:
            got = list(ex.map(lambda b: ask(srv.url, b)["choices"][0]["message"]["content"], bodies))
        assert got == want
        metrics = httpx.get(srv.url + "/metrics").text
        rows = {line.split()[0]: float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("dflash_engine_batch_size_")}
        assert rows["dflash_engine_batch_size_sum"] > rows["dflash_engine_batch_size_count"]   # steps of several rows
    finally:
        assert srv.stop() == 0, srv.output()
