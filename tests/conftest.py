import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# two threads per process, shared by the xdist workers (the README's `-n 2`): the cores stay
# busy without workers fighting over them
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // _WORKERS))


@pytest.fixture(scope="session", autouse=True)
def _native_kernels_built():
    """Build (or load) the native kernels once, in this process, before any test: the CLI
    subprocesses the tests start then find them cached, whatever order the tests run in
    (a first-use build writes progress lines that single-line error checks would see)."""
    from dflash_server import kernels

    kernels.load()


def _thread_cpu_s(native_id: int) -> float | None:
    try:
        with open(f"/proc/self/task/{native_id}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture(scope="module", autouse=True)
def _no_thread_left_spinning():
    """After each test module (its own fixtures torn down first): no Python thread it
    started may still burn CPU. A fake engine that never ended its sequences once left a
    scheduler's daemon worker stepping for the rest of an xdist worker, whose GIL contention
    made later tests there ~400x slower (tests/server/test_queue_admission.py). Linux only
    (/proc); a thread busy for more than half of 0.3 s fails the module."""
    import threading
    import time

    yield
    if not os.path.isdir("/proc/self/task"):
        return
    threads = [t for t in threading.enumerate() if t is not threading.main_thread() and t.native_id]
    before = {t: _thread_cpu_s(t.native_id) for t in threads}
    time.sleep(0.3)
    busy = [f"{t.name} ({after - before[t]:.2f} s)" for t in threads
            if before[t] is not None and (after := _thread_cpu_s(t.native_id)) is not None
            and t.is_alive() and after - before[t] > 0.15]
    assert not busy, f"threads left spinning after this module: {busy}"


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """Cached tiny model directories: tiny_dir("llama") -> Path."""
    from helpers.tiny import make_tiny_model

    cache = {}

    def get(family: str, **overrides):
        key = (family, tuple(sorted(overrides.items())))
        if key not in cache:
            cache[key] = make_tiny_model(family, tmp_path_factory.mktemp(family), **overrides)
        return cache[key]

    return get
