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


def test_the_proposer_implements_the_protocol(tiny_dir):
    """DFlashProposer implements spec/proposer_protocol.py's Proposer (the engine's view of it)."""
    from dflash_server.spec.proposer import DFlashProposer
    from dflash_server.spec.proposer_protocol import Proposer
    from model.test_dflash import random_draft

    pipe = pipeline(tiny_dir("llama"))
    prop = DFlashProposer(random_draft(pipe, block_size=4), pipe, tree_budget=6, adaptive=True)
    assert isinstance(prop, Proposer)
    names = set(Proposer.__annotations__) | {n for n, v in vars(Proposer).items()
                                             if not n.startswith("_") and callable(v)}
    assert not [n for n in names if not hasattr(prop, n)]
    assert prop.uses_tree(pipe) and prop.sizer is not None and prop.vocab is None
    ids = pipe.tokenizer.encode("The quick brown fox")
    pipe.reset()
    prop.reset()
    prop.add_context(pipe.prefill(ids, capture=prop.taps).captures, 0)
    assert len(prop.propose(ids[-1], len(ids), 4)) == 3
    assert len(prop.propose_tree(ids[-1], len(ids), 4, 5).tokens) == 5


def test_lookup_alone_implements_the_protocol(tiny_dir):
    """LookupProposer (prompt lookup without a draft model) implements the same Proposer."""
    from dflash_server.spec.lookup import LookupProposer
    from dflash_server.spec.proposer_protocol import Proposer

    pipe = pipeline(tiny_dir("llama"))
    prop = LookupProposer(pipe, 5)
    assert isinstance(prop, Proposer)
    names = set(Proposer.__annotations__) | {n for n, v in vars(Proposer).items()
                                             if not n.startswith("_") and callable(v)}
    assert not [n for n in names if not hasattr(prop, n)]
    assert prop.taps == () and prop.propose(1, 2, 4) == [] and not prop.uses_tree(pipe)
    assert prop.method == "lookup" and prop.draft.health() == {"status": "ok"} and prop.snapshot() == {}
