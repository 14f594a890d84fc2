"""Hostile review (2026-11-27). An unauthenticated peer's message is decoded in full (every tensor frame copied) before
the worker looks at authentication; the socket takes frames of up to 4 GiB from anyone."""
import os

import msgpack

from dflash_server.runtime import ipc_codec as codec
from dflash_server.runtime.shard_worker import ShardWorker

SECRET = b"preauth-secret-preauth-secret"


def test_unauthenticated_messages_are_not_decoded(monkeypatch):
    w = ShardWorker(SECRET)
    copied = []
    real = codec.from_bytes

    def counting(buf, offset, dtype, shape, nbytes):
        copied.append(nbytes)
        return real(buf, offset, dtype, shape, nbytes)
    monkeypatch.setattr(codec, "from_bytes", counting)
    n = 8 << 20
    specs = [{"name": f"t{i}", "dtype": "u8", "shape": [n], "nbytes": n, "frame": i + 1} for i in range(4)]
    frames = [b"", *[bytes(n)] * 4]
    for op in ("health", "hello"):
        frames[0] = msgpack.packb({"v": codec.PROTOCOL_VERSION, "op": op, "id": 1,
                                   "args": {"nonce": os.urandom(16)}, "tensors": specs})
        reply = msgpack.unpackb(w.handle(b"stranger", frames)[0])
        assert reply["ok"] is False or op == "hello"
    assert copied == [], f"{sum(copied) >> 20} MiB copied for a peer that never authenticated"


def test_a_handshake_still_works_after_the_check():
    """hello and auth (header-only messages) go through; an authenticated peer's tensors too."""
    from dflash_server.runtime.ipc_channel import proof

    w = ShardWorker(SECRET)
    nonce_c = os.urandom(16)
    hello = msgpack.packb({"v": codec.PROTOCOL_VERSION, "op": "hello", "id": 1, "args": {"nonce": nonce_c}})
    res = msgpack.unpackb(w.handle(b"peer", [hello])[0])
    assert res["ok"], res
    nonce_w = res["result"]["nonce"]
    auth = msgpack.packb({"v": codec.PROTOCOL_VERSION, "op": "auth", "id": 2,
                          "args": {"proof": proof(SECRET, b"client", nonce_c, nonce_w)}})
    assert msgpack.unpackb(w.handle(b"peer", [auth])[0])["ok"]
    health = msgpack.packb({"v": codec.PROTOCOL_VERSION, "op": "health", "id": 3, "args": {}})
    assert msgpack.unpackb(w.handle(b"peer", [health])[0])["ok"]
