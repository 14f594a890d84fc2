"""Hostile review: `dflash-server cache clear` on the folder of a running server removes the
server's fingerprint folder (it was emptied); from then on every snapshot write of that
server fails ("cannot write snapshot ... No such file or directory") until a restart, and
its index keeps the cleared files (stats, `contains`), so those prefixes are never written
again either."""
import torch

from dflash_server.cache.disk import DiskCache
from dflash_server.cache.disk_format import SUFFIX
from dflash_server.cache.disk_layout import clear


def test_a_cache_cleared_under_a_running_server_keeps_working(tmp_path):
    t = {"ls0.kv_k.0": torch.zeros(10)}
    d = DiskCache(tmp_path, "fp", 1 << 20, 0)
    d.save([1, 2, 3], t).result()
    assert clear(tmp_path)[0] == 1          # `dflash-server cache clear --kv-cache-dir tmp_path`
    fut = d.save([4, 5, 6], t)
    fut.result()
    fut = d.save([1, 2, 3], t)               # the cleared prefix is written again too
    if fut is not None:
        fut.result()
    files = sorted(p.name for p in (tmp_path / "fp").glob(f"*{SUFFIX}")) if (tmp_path / "fp").is_dir() else []
    st = d.stats()
    d.close()
    assert st["errors"] == 0, st
    assert len(files) == 2 and st["files"] == 2, (files, st)
