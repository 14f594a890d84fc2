"""Hostile review: ``--kv-cache-interval N`` exports a full snapshot (a copy of the whole
KV) every N tokens and queues it on the single background writer, with no bound: when the
disk (hash + write of the whole file) is slower than N decode steps, the queue, and the
copies it holds, grow with every token. Measured with the tiny model and a fast local disk,
interval 1: 45 snapshots queued at once; a real model's snapshot is ~23 KB per token
(SmolLM2-135M f16: 92 MB at 4000 tokens), so a long answer queues gigabytes. Here the slow disk
is simulated (a write takes 50 ms)."""
import time

import dflash_server.cache.disk as disk_mod
from dflash_server.cache.disk import DiskCache
from dflash_server.engine.generate import Engine, GenerationRequest
from helpers.build import pipeline


def test_checkpoints_do_not_pile_up_behind_a_slow_disk(tiny_dir, tmp_path, monkeypatch):
    real = disk_mod.write_snapshot

    def slow(*a, **kw):
        time.sleep(0.05)
        return real(*a, **kw)
    monkeypatch.setattr(disk_mod, "write_snapshot", slow)
    pipe = pipeline(tiny_dir("llama"))
    disk = DiskCache(tmp_path, "fp", 1 << 30, 10 ** 6)
    eng = Engine(pipe, prefix_slots=0, checkpoint_interval=1, disk_cache=disk)
    ids = tuple(pipe.tokenizer.encode("hello world " * 100))
    eng.submit(GenerationRequest(ids, max_tokens=120, ignore_eos=True))
    most_queued = 0
    while eng.has_work:
        eng.step()
        waiting = [f for f in disk._pending if not f.done()]
        most_queued = max(most_queued, len(waiting))
    one = sum(p.stat().st_size for p in list((tmp_path / "fp").glob("*.safetensors"))[:1])
    eng.close()
    # a handful of snapshots may wait for the disk; not one per generated token
    assert most_queued <= 8, f"{most_queued} snapshot copies (~{one >> 10} KiB each) queued at once"
