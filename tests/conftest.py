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
