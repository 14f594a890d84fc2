"""A shard worker driven in this process through its message handler (no sockets): the
authenticated worker and one call, for the hostile-argument tests."""
from __future__ import annotations

import os

from dflash_server.runtime import ipc_codec as codec
from dflash_server.runtime.ipc_channel import proof
from dflash_server.runtime.shard_worker import ShardWorker


def call(worker, op, args=None, tensors=None):
    """(reply header, reply tensors) of one operation."""
    return codec.decode(worker.handle(b"c", codec.encode({"op": op, "id": 1, "args": args or {}}, tensors or {})))


def authed_worker(secret: bytes) -> ShardWorker:
    w = ShardWorker(secret)
    nonce = os.urandom(16)
    h, _ = call(w, "hello", {"nonce": nonce})
    assert call(w, "auth", {"proof": proof(secret, b"client", nonce, h["result"]["nonce"])})[0]["ok"]
    return w
