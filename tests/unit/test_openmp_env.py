"""libgomp's spin-wait is set for remote splits, shard workers and the server
(runtime/openmp.py), before torch loads, without overriding the user's own setting."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_server.runtime.openmp import SPLIT_SPINCOUNT, tune_for_split
from dflash_server.runtime.worker_link import WorkerProcess

SRC = str(Path(__file__).resolve().parents[2] / "src")
PROBE = ("import os, sys, dflash_server.cli as c; c._tune_openmp(sys.argv[1:]); "
         "print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)")


def probe(argv, **env):
    base = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    base["PYTHONPATH"] = SRC
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], env=dict(base, **env), capture_output=True,
                         text=True, check=True)
    return out.stdout.split()


@pytest.mark.parametrize("argv, want", [
    (["serve", "--target-devices", "cpu,remote:cpu"], SPLIT_SPINCOUNT),
    (["shard-worker", "--bind", "tcp://127.0.0.1:5555"], SPLIT_SPINCOUNT),
    (["serve", "--target-devices", "cpu,cpu"], SPLIT_SPINCOUNT),  # the event loop shares the cores
    (["generate", "--prompt", "hi"], "None"),                     # one process, no server: the default
    (["generate", "--prompt", "hi", "--target-devices", "cpu,cpu"], "None"),
])
def test_cli_sets_spin_before_torch_for_splits_and_serve(argv, want):
    assert probe(argv) == [want, "False"]


def test_user_setting_wins():
    assert probe(["serve", "--target-devices", "cpu,remote:cpu"], GOMP_SPINCOUNT="123") == ["123", "False"]
    env = {"GOMP_SPINCOUNT": "7"}
    tune_for_split(env)
    assert env == {"GOMP_SPINCOUNT": "7"}
    env = {}
    tune_for_split(env)
    assert env == {"GOMP_SPINCOUNT": SPLIT_SPINCOUNT}


def test_spawned_worker_gets_the_spin(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    proc = WorkerProcess(None)
    proc.start(b"0" * 64)
    try:
        environ = b""
        for _ in range(50):  # the environment is readable as soon as the process exists
            environ = Path(f"/proc/{proc.proc.pid}/environ").read_bytes()
            if environ:
                break
            time.sleep(0.1)
        assert f"GOMP_SPINCOUNT={SPLIT_SPINCOUNT}".encode() in environ.split(b"\0")
    finally:
        proc.stop()
    assert not proc.alive()
