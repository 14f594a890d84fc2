"""Hostile review (2026-11-27). A disk hit is inserted into the memory index; when the snapshot is larger than
--prefix-cache-bytes the index evicts it at once, and its slot must then be freed, else
every such hit keeps a whole snapshot in memory for the life of the process."""
from __future__ import annotations

from dflash_server.cli.common import load_engine
from dflash_server.engine.config import EngineConfig
from dflash_server.engine.generate import GenerationRequest


def test_disk_hits_over_the_memory_budget_do_not_leak_snapshots(tiny_dir, tmp_path):
    cfg = EngineConfig(model=str(tiny_dir("llama")), dtype="fp32", max_ctx=512, threads=1, parallel="1",
                       kv_cache_dir=str(tmp_path / "kv"), disk_prefix_cache="full", prefix_cache_bytes=1)
    _, pipe, engine = load_engine(cfg, progress=False)
    try:
        tok = pipe.tokenizer
        text = ("<|im_start|>system\n" + "Be terse. " * 20 + "<|im_end|>\n<|im_start|>user\nOne<|im_end|>\n"
                "<|im_start|>assistant\nTwo<|im_end|>\n<|im_start|>user\nThree<|im_end|>\n<|im_start|>assistant\n")
        ids = tuple(tok.encode(text))
        first = engine.generate(GenerationRequest(ids, max_tokens=4))
        engine.prefix_cache.disk.flush()
        held = []
        for _ in range(3):
            r = engine.generate(GenerationRequest(ids, max_tokens=4))
            assert r.extra["cache"] == "disk" and r.token_ids == first.token_ids
            held.append(sum(len(st._snapshots) for st in pipe.stages))
        assert held == [0, 0, 0], held          # fails: [1, 2, 3]
        assert engine.prefix_cache.extras == {}
    finally:
        engine.close()
