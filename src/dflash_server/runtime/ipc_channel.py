"""ZeroMQ request/reply channel between the server (DEALER) and a shard worker (ROUTER).

Handshake (both sides prove they know the shared secret; nothing secret crosses the wire):
  client -> ``hello {nonce_c}``; worker -> ``{nonce_w, proof_w = HMAC(secret, "worker"|c|w)}``;
  client checks proof_w, sends ``auth {proof_c = HMAC(secret, "client"|c|w), shm}``; the
  worker checks proof_c, maps the offered shared-memory areas and answers whether it could.
Every later message carries a request id; a reply with an older id (left over from a call
that timed out) is dropped. Header versions are checked by the codec on every message.
"""
from __future__ import annotations

import hashlib
import hmac
import itertools
import secrets
import time

import zmq

from ..errors import ShardError
from .ipc_codec import ProtocolError, decode, encode
from .ipc_shm import SharedArea

DEFAULT_MAX_MESSAGE = 1 << 32  # 4 GiB: snapshot exports of long contexts are large


def proof(secret: bytes, role: bytes, nonce_c: bytes, nonce_w: bytes) -> bytes:
    return hmac.new(secret, role + b"|" + nonce_c + b"|" + nonce_w, hashlib.sha256).digest()


class RemoteOpError(Exception):
    """The worker ran the operation and reported an error (``kind``: value | internal)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class ShardClient:
    def __init__(self, address: str, secret: bytes, *, timeout_s: float, shm_bytes: int = 0,
                 max_message: int = DEFAULT_MAX_MESSAGE, alive=None):
        """``shm_bytes`` > 0 offers two shared areas of that size (one per direction);
        ``alive`` is polled while waiting, so a dead worker fails a call at once."""
        self.address, self.secret, self.timeout_s = address, secret, timeout_s
        self.alive = alive
        self._ids = itertools.count(1)
        self._ctx = zmq.Context.instance()
        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_message)
        self.sock.setsockopt(zmq.IPV6, 1)   # tcp://[::1]:port (IPv4 addresses work as well)
        self.sock.connect(address)
        self.max_message = max_message
        self.req_area = self.rep_area = None
        self._offer = shm_bytes

    def handshake(self, timeout_s: float) -> dict:
        nonce_c = secrets.token_bytes(16)
        res, _ = self.call("hello", {"nonce": nonce_c}, timeout_s=timeout_s)
        nonce_w, got = res.get("nonce"), res.get("proof")
        if not isinstance(nonce_w, bytes) or not isinstance(got, bytes) or not hmac.compare_digest(
                proof(self.secret, b"worker", nonce_c, nonce_w), got):
            raise ShardError(f"shard worker at {self.address} failed authentication (check the shared secret)")
        args = {"proof": proof(self.secret, b"client", nonce_c, nonce_w)}
        areas = []
        if self._offer > 0:
            try:
                for _ in range(2):
                    areas.append(SharedArea.create(self._offer))
                args["shm"] = {"req": areas[0].path, "rep": areas[1].path, "size": self._offer}
            except OSError:  # no room in the shm dir: tensors travel inline
                for a in areas:
                    a.close()
                areas = []
        try:
            res, _ = self.call("auth", args, timeout_s=timeout_s)
        finally:
            for a in areas:
                a.unlink()  # both mappings exist now (or never will): drop the names
        if res.get("shm") and areas:
            self.req_area, self.rep_area = areas
        else:
            for a in areas:
                a.close()
        return res

    def call(self, op: str, args: dict | None = None, tensors: dict | None = None, *,
             timeout_s: float | None = None):
        """Send one request and wait for its reply: (result dict, tensors). Raises
        ShardError (timeout, dead worker, malformed reply) or RemoteOpError."""
        rid = next(self._ids)
        try:
            self.sock.send_multipart(encode({"op": op, "id": rid, "args": args or {}}, tensors or {},
                                            self.req_area), copy=False)
        except (zmq.ZMQError, ProtocolError) as e:
            raise ShardError(f"shard worker at {self.address}: send failed: {e}") from None
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ShardError(f"shard worker at {self.address} did not answer {op!r} within "
                                 f"{self.timeout_s if timeout_s is None else timeout_s:g} s")
            if not self.sock.poll(min(left, 0.1) * 1000):
                if self.alive is not None and not self.alive():
                    raise ShardError(f"shard worker at {self.address} exited during {op!r}")
                continue
            frames = self.sock.recv_multipart(copy=False)
            try:
                header, out = decode(frames, self.rep_area, self.max_message)
            except ProtocolError as e:
                raise ShardError(f"shard worker at {self.address} sent a malformed reply to {op!r}: {e}") from None
            if header.get("id") != rid:
                continue  # the late answer to a call that already timed out
            if not header.get("ok"):
                err = header.get("error") or {}
                raise RemoteOpError(str(err.get("kind", "internal")), str(err.get("message", "unknown error")))
            res = header.get("result")
            if not isinstance(res, dict):
                raise ShardError(f"shard worker at {self.address} sent a reply without a result")
            return res, out

    def close(self) -> None:
        self.sock.close(0)
        for a in (self.req_area, self.rep_area):
            if a is not None:
                a.close()
        self.req_area = self.rep_area = None
