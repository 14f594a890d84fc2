"""Hostile DDTree arguments to a shard worker (``forward`` with ``tree``, ``rollback_tree``):
every malformed tree or path is a clear value error that leaves the sequence as it was, and
the worker verifies a real tree correctly after them."""
import pytest
import torch

from dflash_server.weights.loader import open_model
from helpers.worker import authed_worker
from helpers.worker import call as _call

SECRET = b"trees-secret-trees-secret"


@pytest.fixture(scope="module")
def worker(tiny_dir):
    w = authed_worker(SECRET)
    path = tiny_dir("qwen3_5")
    cfg = open_model(path).config
    assert _call(w, "load", {"model": str(path), "shards": [["cpu", 1, cfg.num_layers]], "dtype": "f32",
                             "max_ctx": 64, "quantize": ["dense", "dense"]})[0]["ok"]
    w.hidden = cfg.hidden_size
    return w


def _x(w, rows, seed=0):
    return {"x": torch.randn(1, rows, w.hidden, generator=torch.Generator().manual_seed(seed))}


@pytest.mark.parametrize("tree, why", [
    ([0, 0, 0], "parent"),                 # a row its own parent
    ([-1, 2, 0], "parent"),                # a parent after its child
    ([-1, 0], "one parent per row"),       # rows and parents disagree
    ([-1, -5, 0], "parent"),
    ("(-1, 0, 0)", "list of 1 to 64"),
    ([-1, True, 0], "list of 1 to 64"),
    ([-1, 0.0, 0], "list of 1 to 64"),
    ([-1] + list(range(64)), "list of 1 to 64"),
    ([], "list of 1 to 64"),
])
def test_bad_trees(worker, tree, why):
    assert _call(worker, "reset")[0]["ok"]
    assert _call(worker, "forward", {"start": 0}, _x(worker, 5))[0]["ok"]
    assert _call(worker, "checkpoint")[0]["ok"]
    h, _ = _call(worker, "forward", {"start": 5, "logits": "all", "tree": tree}, _x(worker, 3))
    assert not h["ok"] and h["error"]["kind"] == "value" and why in h["error"]["message"], h


def test_tree_needs_a_checkpoint(worker):
    assert _call(worker, "reset")[0]["ok"]
    h, _ = _call(worker, "forward", {"start": 0, "tree": [-1, 0]}, _x(worker, 2))
    assert not h["ok"] and "checkpoint" in h["error"]["message"], h


@pytest.mark.parametrize("path, why", [
    ([1, 2], "not a path"), ([0, 0], "not a path"), ([0, 9], "not a path"), ([0, 2, 1], "not a path"),
    ("0", "list of 1 to 64"), ([], "list of 1 to 64"), ([0, None], "list of 1 to 64"),
])
def test_bad_paths_then_a_good_one(worker, path, why):
    """A bad path changes nothing: the good path after it gives what a plain run gives."""
    assert _call(worker, "reset")[0]["ok"]
    assert _call(worker, "forward", {"start": 0}, _x(worker, 5))[0]["ok"]
    assert _call(worker, "checkpoint")[0]["ok"]
    x = _x(worker, 3, seed=1)
    assert _call(worker, "forward", {"start": 5, "logits": "all", "tree": [-1, 0, 0]}, x)[0]["ok"]
    h, _ = _call(worker, "rollback_tree", {"path": path})
    assert not h["ok"] and h["error"]["kind"] == "value" and why in h["error"]["message"], h
    h, _ = _call(worker, "rollback_tree", {"path": [0, 2]})
    assert h["ok"] and h["result"]["length"] == 7
    nxt = _x(worker, 1, seed=2)
    got = _call(worker, "forward", {"start": 7, "logits": "all"}, nxt)[1]["logits"]
    assert _call(worker, "reset")[0]["ok"]
    assert _call(worker, "forward", {"start": 0}, _x(worker, 5))[0]["ok"]
    assert _call(worker, "forward", {"start": 5}, {"x": x["x"][:, [0, 2]]})[0]["ok"]
    want = _call(worker, "forward", {"start": 7, "logits": "all"}, nxt)[1]["logits"]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_paths_must_follow_the_tree_and_trees_end_their_checkpoint(worker):
    """Rows in increasing order that are not parent and child, a tree forward away from its
    checkpoint, a plain rollback into a tree's rows, a commit of a tree: all refused."""
    assert _call(worker, "reset")[0]["ok"]
    assert _call(worker, "forward", {"start": 0}, _x(worker, 5))[0]["ok"]
    assert _call(worker, "checkpoint")[0]["ok"]
    h, _ = _call(worker, "forward", {"start": 4, "logits": "all", "tree": [-1, 0]}, _x(worker, 2))
    assert not h["ok"] and "checkpoint" in h["error"]["message"], h
    assert _call(worker, "forward", {"start": 5, "logits": "all", "tree": [-1, 0, 0]}, _x(worker, 3))[0]["ok"]
    for op, args in (("rollback_tree", {"path": [0, 1, 2]}), ("rollback", {"length": 7}), ("commit", {})):
        h, _ = _call(worker, op, args)
        assert not h["ok"] and h["error"]["kind"] == "value", (op, h)
    assert _call(worker, "rollback_tree", {"path": [0, 1]})[0]["result"]["length"] == 7
    h, _ = _call(worker, "rollback_tree", {"path": [0]})      # no tree since: nothing to keep
    assert not h["ok"], h


@pytest.mark.parametrize("observe", [0, 1, "false", None, [False]])
def test_observe_must_be_a_boolean(worker, observe):
    """``forward``'s ``observe`` (False: KV Flash's score policy sits out a prompt's body) is a
    boolean or absent; anything else is a value error before the forward writes anything."""
    assert _call(worker, "reset")[0]["ok"]
    assert _call(worker, "forward", {"start": 0}, _x(worker, 5))[0]["ok"]
    h, _ = _call(worker, "forward", {"start": 5, "observe": observe}, _x(worker, 2))
    assert not h["ok"] and h["error"]["kind"] == "value" and "observe" in h["error"]["message"], h
    h, _ = _call(worker, "forward", {"start": 5, "observe": False}, _x(worker, 2))
    assert h["ok"], h   # (the position right after the refused forward: nothing was written)
