"""Server fixtures: the real CLI on tiny models (fp32, small context) and on the default model."""
from __future__ import annotations

import pytest

from .serverproc import ServerProc

TINY_ARGS = ("--dtype", "fp32", "--max-ctx", "512", "--threads", "1", "--model-name", "tiny")


def start_tiny(tiny_dir, family: str, *extra: str) -> ServerProc:
    return ServerProc("--model", str(tiny_dir(family)), *TINY_ARGS, *extra)


@pytest.fixture(scope="package")
def llama_server(tiny_dir):
    """Tiny Llama (SmolLM2 tokenizer and chat template)."""
    srv = start_tiny(tiny_dir, "llama")
    yield srv
    assert srv.stop() == 0, srv.output()
