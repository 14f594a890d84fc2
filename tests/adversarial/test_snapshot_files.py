"""Hostile review (2026-11-27): snapshot files whose record has the wrong JSON types, and
what a write in progress leaves in the folder. A record of the wrong types (not an object,
ids outside int32 or not ints, a layout that is not a mapping) stopped every server start
with a traceback; now it is a miss plus one warning, removed, and ``cache ls`` lists it as
invalid. A write used safetensors' ``save_file``, which writes its own ``.tmpXXXXXX`` file
beside ours: a crash left it under a name neither the next start nor ``cache clear``
removes; now only the cache's own temporary name ever exists."""
import json
import logging
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_server.cache import disk_format
from dflash_server.cache.disk import DiskCache
from dflash_server.cache.disk_format import FORMAT, SUFFIX, VERSION
from dflash_server.cache.disk_layout import MARKER, TMP_RE, clear

from adversarial.test_cache_dir import cli, make_cache


def _record(**over):
    rec = {"format": FORMAT, "version": VERSION, "fingerprint": "fp", "token_ids": [1, 2, 3], "position": 3,
           "layout": {"x": ["float32", [2]]}}
    rec.update(over)
    return json.dumps(rec)


@pytest.mark.parametrize("meta", [
    "[1, 2]",                                  # not an object
    _record(token_ids=[2 ** 40], position=1),  # id outside int32
    _record(token_ids=["a"], position=1),      # not an int
    _record(token_ids=[-1], position=1),       # not a token id
    _record(layout=5),                         # layout not a mapping
    _record(layout={"x": "float32"}),          # an entry not [dtype, shape]
])
def test_a_record_of_wrong_types_is_a_warning_not_a_crash(tmp_path, caplog, meta):
    make_cache(tmp_path, "fp", n=1).close()
    bad = tmp_path / "fp" / ("0" * 32 + SUFFIX)
    save_file({"x": torch.zeros(2)}, str(bad), metadata={"dflash": meta})
    caplog.set_level(logging.WARNING, logger="dflash_server.cache")
    c = DiskCache(tmp_path, "fp", 1 << 30)
    assert len(c.index.entries) == 1                  # the good file is still there
    assert not bad.exists() and c.counters["errors"] == 1
    assert sum("ignoring" in r.getMessage() for r in caplog.records) == 1
    c.close()


def test_cache_ls_lists_a_record_of_wrong_types_as_invalid(tmp_path):
    make_cache(tmp_path, "fp", n=1).close()
    save_file({"x": torch.zeros(2)}, str(tmp_path / "fp" / ("0" * 32 + SUFFIX)), metadata={"dflash": "[1, 2]"})
    r = cli("ls", "--json", "--kv-cache-dir", str(tmp_path))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert sorted(row["valid"] for row in json.loads(r.stdout)) == [False, True]


def test_a_write_in_progress_leaves_only_the_caches_temporary_name(tmp_path, monkeypatch):
    seen = []
    real = os.replace

    def replace(src, dst):       # the moment before the rename: what would a crash leave?
        seen.extend(n for n in os.listdir(tmp_path / "fp") if n != MARKER)
        return real(src, dst)
    monkeypatch.setattr(disk_format.os, "replace", replace)
    c = DiskCache(tmp_path, "fp", 1 << 30, 0)
    tensors = {"ls0.kv_k.0": torch.randn(2, 3, 40, 8).bfloat16(), "ls0.ssm.0": torch.randn(3, 4),
               "pos": torch.arange(5), "flag": torch.tensor(True)}
    c.save(tuple(range(1, 41)), tensors, force=True)
    c.close()
    assert seen and all(TMP_RE.fullmatch(n) for n in seen), seen
    (f,) = (tmp_path / "fp").glob(f"*{SUFFIX}")
    got = load_file(str(f))                       # the streamed file is plain safetensors
    assert all(torch.equal(got[k], v) for k, v in tensors.items()) and set(got) == set(tensors)
    # a temporary left by a crash goes at the next start, and with `cache clear`
    (tmp_path / "fp" / seen[0]).write_bytes(b"half a snapshot")
    DiskCache(tmp_path, "fp", 1 << 30).close()
    assert not (tmp_path / "fp" / seen[0]).exists()
    (tmp_path / "fp" / seen[0]).write_bytes(b"half a snapshot")
    clear(tmp_path)
    assert not (tmp_path / "fp").exists()


def test_a_writer_killed_mid_write_leaves_nothing_behind(tmp_path):
    import signal
    import subprocess
    import sys
    import textwrap
    import time

    code = textwrap.dedent(f"""
        import torch
        from dflash_server.cache.disk import DiskCache
        c = DiskCache({str(tmp_path)!r}, "fp", 1 << 40)
        c.save(tuple(range(1, 100)), {{"ls0.kv_k.0": torch.ones(25_000_000)}}, force=True)   # 100 MB
        c.flush()
    """)
    p = subprocess.Popen([sys.executable, "-c", code])
    folder = tmp_path / "fp"
    try:
        deadline = time.time() + 120
        while time.time() < deadline and p.poll() is None:
            if folder.is_dir() and [n for n in os.listdir(folder) if n != MARKER]:
                break
            time.sleep(0.002)
        p.send_signal(signal.SIGKILL)          # the machine dies mid-write
    finally:
        p.wait()
    left = [n for n in os.listdir(folder) if n != MARKER]
    assert left and not [n for n in left if n.endswith(SUFFIX)], f"the writer was not caught mid-write: {left}"
    DiskCache(tmp_path, "fp", 1 << 30).close()  # a restart removes what the crash left
    assert [n for n in os.listdir(folder) if n != MARKER] == []


def test_servers_sharing_a_folder_share_its_budget(tmp_path):
    """Two servers on one --kv-cache-dir each evicted only the files they had written: the
    folder grew to ~N x the budget. Each write now sees the others' files (and forgets those
    they removed); a start with a smaller budget evicts down to it."""
    ids = tuple(range(1, 400))
    budget = 200_000
    a, b = DiskCache(tmp_path, "fp", budget), DiskCache(tmp_path, "fp", budget)
    for i in range(6):
        for c, base in ((a, 100), (b, 200)):
            c.save(ids[:base + i], {"ls0.kv_k.0": torch.ones(1, 2, 100 + i, 64)}, force=True)
            c.flush()
    a.close()
    b.close()
    on_disk = sum(p.stat().st_size for p in (tmp_path / "fp").glob(f"*{SUFFIX}"))
    assert 0 < on_disk <= budget, on_disk
    c = DiskCache(tmp_path, "fp", budget // 2)       # restarted with half the budget
    assert c.index.total_bytes <= budget // 2 and c.counters["evictions"] > 0
    assert sum(p.stat().st_size for p in (tmp_path / "fp").glob(f"*{SUFFIX}")) == c.index.total_bytes
    c.close()


def test_a_live_writers_temporary_is_left_alone(tmp_path):
    """A second server starting on the folder removed the temporary file the first was still
    writing; only those of processes that no longer run go."""
    DiskCache(tmp_path, "fp", 1 << 30).close()
    live = tmp_path / "fp" / f".{'a' * 32}{SUFFIX}.{os.getppid()}.tmp"   # our parent runs
    dead = tmp_path / "fp" / f".{'b' * 32}{SUFFIX}.{2 ** 22 + 12345}.tmp"
    live.write_bytes(b"being written")
    dead.write_bytes(b"crashed")
    DiskCache(tmp_path, "fp", 1 << 30).close()
    assert live.exists() and not dead.exists()
