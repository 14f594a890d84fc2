"""Hostile review: ``--kvflash auto`` on a GPU sizes each stage's pool from the free device
memory, divided by the sequence slots (``Stage._kv_budget_tokens``), but the disk-cache
fingerprint records ``kvflash.pool_tokens(max_ctx)`` (half the context, the CPU default).
Two starts whose pools differ (another --parallel, or less free memory) share one
fingerprint folder: the second restores nothing and deletes every snapshot the first wrote
("does not fit this model"). The CUDA query is faked as in test_kvflash's
test_auto_pool_budget_from_free_device_memory (no GPU in CI)."""

from dflash_server.cache.disk_format import SUFFIX
from dflash_server.engine.generate import GenerationRequest
from dflash_server.runtime.stage import LocalStage as Stage


def _fake_gpu_budget(monkeypatch, free_tokens: int):
    """What _kv_budget_tokens returns on a GPU with room for ``free_tokens`` of KV."""
    def budget(self, kvflash, lanes=1):
        return None if kvflash.pool != "auto" else free_tokens // lanes
    monkeypatch.setattr(Stage, "_kv_budget_tokens", budget)


def _engine(path, tmp_path, parallel: str):
    from dflash_server.cli.common import load_engine
    from dflash_server.engine.config import EngineConfig

    cfg = EngineConfig(model=str(path), device="cpu", dtype="fp32", max_ctx=1024, kv_dtype="f32",
                       kvflash="auto", kvflash_chunk=16, parallel=parallel, kv_cache_dir=str(tmp_path / "kv"),
                       disk_prefix_cache="full")
    return load_engine(cfg, progress=False)


def test_auto_pools_of_other_sizes_do_not_share_a_fingerprint(tiny_dir, tmp_path, monkeypatch):
    _fake_gpu_budget(monkeypatch, 1024)
    path = tiny_dir("llama")
    _, pipe_a, a = _engine(path, tmp_path, "1")
    _, pipe_b, b = _engine(path, tmp_path, "2")
    pool_a, pool_b = pipe_a.stages[0].pager.pool_tokens, pipe_b.stages[0].pager.pool_tokens
    a.close()
    b.close()
    assert pool_a != pool_b    # 1024 vs 512 tokens per slot
    assert a.fingerprint != b.fingerprint


def test_a_restart_with_another_auto_pool_keeps_the_snapshots(tiny_dir, tmp_path, monkeypatch):
    path = tiny_dir("llama")
    _fake_gpu_budget(monkeypatch, 1024)
    _, _, a = _engine(path, tmp_path, "1")
    m = [{"role": "system", "content": "You are terse. " * 4}, {"role": "user", "content": "Hi"}]
    ids = tuple(a.tokenizer.encode_chat(m))
    a.generate(GenerationRequest(ids, max_tokens=4, ignore_eos=True))
    a.close()
    files = sorted((tmp_path / "kv").rglob(f"*{SUFFIX}"))
    assert files
    _fake_gpu_budget(monkeypatch, 512)     # less free memory at the next start
    _, _, b = _engine(path, tmp_path, "1")
    m += [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Again"}]
    b.generate(GenerationRequest(tuple(b.tokenizer.encode_chat(m)), max_tokens=2, ignore_eos=True))
    disk = b.prefix_cache.disk
    b.close()
    # either a folder of its own (a miss) or a hit: never the other pool's files deleted
    assert disk.counters["errors"] == 0, disk.counters
    assert all(f.exists() for f in files)
