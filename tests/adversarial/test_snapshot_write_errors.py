"""Hostile review (2026-11-27). A snapshot write that fails inside safetensors (disk full, folder removed by `cache clear`
under a running server) is a warning plus an error count, like any OSError: never silent,
never an exception out of flush()/close() (graceful shutdown, `generate`'s exit)."""
import json
import logging
import resource
import subprocess
import sys

import torch

from dflash_server.cache.disk import DiskCache
from dflash_server.cache.disk_layout import clear

IDS = tuple(range(1, 40))


def test_write_into_a_folder_that_became_a_file_is_a_warning(tmp_path, caplog):
    c = DiskCache(tmp_path, "fp", 1 << 30)
    c.save(IDS[:10], {"ls0.kv_k.0": torch.zeros(1, 2, 10, 4)}, force=True)
    c.flush()
    assert clear(tmp_path)[:2] == (1, 1)          # `dflash-server cache clear` while the server runs
    (tmp_path / "fp").write_text("not a folder")  # ... and something else took the folder's name
    caplog.set_level(logging.WARNING, logger="dflash_server.cache")
    c.save(IDS[:20], {"ls0.kv_k.0": torch.zeros(1, 2, 20, 4)}, force=True)
    c.close()                                     # (raised SafetensorError once)
    assert c.counters["errors"] == 1
    assert any("cannot write snapshot" in r.getMessage() for r in caplog.records)


def test_generate_with_a_full_disk_still_answers(tiny_dir, tmp_path):
    def small_files():                            # writes past 64 kB fail with EFBIG, as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
    r = subprocess.run([sys.executable, "-m", "dflash_server", "generate", "--model", str(tiny_dir("llama")),
                        "--kv-cache-dir", str(tmp_path / "c"), "--disk-prefix-cache", "full", "--system", "Be brief.",
                        "--chat", "hi", "--max-tokens", "2", "--json"],
                       capture_output=True, text=True, timeout=300, preexec_fn=small_files)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-1500:]
    assert json.loads(r.stdout)["completion_tokens"] == 2
    assert "cannot write snapshot" in r.stderr
