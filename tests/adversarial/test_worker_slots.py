"""Hostile sequence-slot arguments to a shard worker (continuous batching): every bad slot
count, slot id or row list is a clear value error, and the worker serves correctly after."""
import os

import pytest
import torch

from dflash_server.runtime import ipc_codec as codec
from dflash_server.runtime.ipc_channel import proof
from dflash_server.runtime.shard_worker import ShardWorker
from dflash_server.weights.loader import open_model

SECRET = b"slots-secret-slots-secret"


def _call(worker, op, args=None, tensors=None):
    header, out = codec.decode(worker.handle(b"c", codec.encode({"op": op, "id": 1, "args": args or {}},
                                                                tensors or {})))
    return header, out


@pytest.fixture(scope="module")
def worker(tiny_dir):
    w = ShardWorker(SECRET)
    nonce = os.urandom(16)
    h, _ = _call(w, "hello", {"nonce": nonce})
    assert _call(w, "auth", {"proof": proof(SECRET, b"client", nonce, h["result"]["nonce"])})[0]["ok"]
    path = tiny_dir("llama")
    n = open_model(path).config.num_layers
    w.load_args = {"model": str(path), "shards": [["cpu", 1, n]], "dtype": "f32", "max_ctx": 64,
                   "quantize": ["dense", "dense"], "lanes": 2}
    for bad in (0, 1000, "2", True, 1.5, None):
        h, _ = _call(w, "load", {**w.load_args, "lanes": bad})
        assert not h["ok"] and h["error"]["kind"] == "value" and "lanes" in h["error"]["message"], bad
    assert _call(w, "load", w.load_args)[0]["ok"]
    w.hidden = open_model(path).config.hidden_size
    return w


def _x(w, rows):
    return {"x": torch.randn(1, rows, w.hidden)}


@pytest.mark.parametrize("lane", [2, -1, "0", True, 1.0, [0]])
def test_bad_lane_in_state_operations(worker, lane):
    for op, args, tensors in (("forward", {"start": 0}, _x(worker, 1)), ("reset", {}, None),
                              ("checkpoint", {}, None), ("rollback", {"length": 0}, None),
                              ("snapshot_save", {"slot": 0}, None)):
        h, _ = _call(worker, op, {**args, "lane": lane}, tensors)
        assert not h["ok"] and h["error"]["kind"] == "value", (op, lane, h)


@pytest.mark.parametrize("lanes, positions, rows, why", [
    ([0, 0], [0, 1], 2, "one row per lane"),
    ([0, 5], [0, 0], 2, "outside"),
    ([0, 1], [0], 2, "one position per row"),
    ([0], [3], 1, "does not extend"),          # a gap after the slot's length
    ([0], [64], 1, "does not extend"),         # past the context
    ("0", [0], 1, "lists of integers"),
    ([0], [True], 1, "lists of integers"),
    ([0, 1], [0, 0], 3, "one row per lane"),   # rows in x and in the lists disagree
])
def test_bad_rows(worker, lanes, positions, rows, why):
    h, _ = _call(worker, "forward_rows", {"lanes": lanes, "positions": positions}, _x(worker, rows))
    assert not h["ok"] and h["error"]["kind"] == "value" and why in h["error"]["message"], h


def test_serves_after_bad_input(worker):
    for lane in (0, 1):
        assert _call(worker, "reset", {"lane": lane})[0]["ok"]
    h, out = _call(worker, "forward_rows", {"lanes": [1, 0], "positions": [0, 0]}, _x(worker, 2))
    assert h["ok"] and h["result"]["lengths"] == [1, 1] and out["logits"].shape[0] == 2
    h, _ = _call(worker, "forward", {"start": 1, "lane": 1}, _x(worker, 3))
    assert h["ok"] and h["result"]["length"] == 4
    h, _ = _call(worker, "forward", {"start": 1, "lane": 0}, _x(worker, 1))
    assert h["ok"] and h["result"]["length"] == 2          # slot 0 kept its own length
