"""Both kinds of pipeline stage implement the whole Stage protocol (runtime/stage_protocol.py),
so the pipeline, /props and the CLI use them without probing for members."""
from __future__ import annotations

import torch

from dflash_server.runtime.stage_protocol import Stage
from helpers.build import pipeline


def _members() -> list[str]:
    names = set(Stage.__annotations__)
    names |= {n for n, v in vars(Stage).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return sorted(names)


def test_local_and_remote_stages_implement_the_protocol(tiny_dir):
    pipe = pipeline(tiny_dir("llama"), devices=["cpu", "remote:cpu"])
    try:
        local, remote = pipe.stages
        for st in (local, remote):
            assert isinstance(st, Stage), type(st).__name__
            missing = [n for n in _members() if not hasattr(st, n)]
            assert not missing, (type(st).__name__, missing)
        assert (local.is_remote, remote.is_remote) == (False, True)
        assert local.label == "cpu" and remote.label == "remote:cpu"
        assert local.health() == {"status": "ok"} and remote.health()["status"] == "ok"
        assert local.epoch == 0 and local.kv_bytes() > 0 and remote.kv_bytes() == 0
        assert not local.scoring and not remote.scoring and local.pager is None and remote.pager is None
        assert pipe.max_spec_rows == min(local.max_spec_rows, remote.max_spec_rows)
        out = pipe.forward(torch.tensor([[1, 2, 3]]), 0, logits="all")
        assert out.logits.shape[0] == 3
    finally:
        pipe.close()
