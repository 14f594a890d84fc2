"""Graceful shutdown writes what is still only in memory (README, disk cache): the snapshots
whose write was dropped while the writer was behind are written by ``Engine.close``, not
dropped a second time by the same MAX_QUEUED bound (close queues them all at once)."""
import threading

import dflash_server.cache.disk as disk_mod
from dflash_server.cache.disk import DiskCache
from dflash_server.cache.disk_format import SUFFIX
from dflash_server.engine.generate import Engine, GenerationRequest
from helpers.build import pipeline


def test_close_writes_every_memory_snapshot_behind_a_slow_disk(tiny_dir, tmp_path, monkeypatch):
    real = disk_mod.write_snapshot

    disk_free = threading.Event()   # a disk slower than the prefills: writes wait for it

    def slow(*a, **kw):
        disk_free.wait(30)
        return real(*a, **kw)
    monkeypatch.setattr(disk_mod, "write_snapshot", slow)
    pipe = pipeline(tiny_dir("llama"))
    disk = DiskCache(tmp_path, "fp", 1 << 30, 0)
    eng = Engine(pipe, prefix_slots=12, disk_cache=disk)
    for i in range(10):  # ten distinct prompts, each committing a snapshot
        ids = tuple(pipe.tokenizer.encode_chat([{"role": "system", "content": f"You are assistant {i}. " * 8},
                                                {"role": "user", "content": "hi"}]))
        eng.submit(GenerationRequest(ids, max_tokens=1, ignore_eos=True))
    while eng.has_work:   # the server's worker loop (generate() flushes the disk at its exit)
        eng.step()
    in_memory = len(eng.prefix_cache.index.entries)
    disk_free.set()
    eng.close()
    files = list((tmp_path / "fp").glob("*" + SUFFIX))
    assert len(files) >= in_memory, \
        f"{len(files)} snapshot files after a graceful shutdown; {in_memory} were in memory " \
        f"({disk.counters['dropped']} writes dropped)"
