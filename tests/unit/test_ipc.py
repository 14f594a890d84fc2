"""Shard-worker IPC: codec round trips and bounds, shared memory, handshake, bad peers."""
import os
import threading
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

from dflash_server.errors import ShardError
from dflash_server.runtime import ipc_codec as codec
from dflash_server.runtime.ipc_channel import RemoteOpError, ShardClient
from dflash_server.runtime.ipc_shm import SharedArea, shm_dir
from dflash_server.runtime.shard_worker import ShardWorker

SECRET = b"s3cret-s3cret-s3cret"


def tensors():
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(3, 5, generator=g), "b": torch.randn(2, 7, generator=g).to(torch.bfloat16),
            "c": torch.arange(6, dtype=torch.int64).reshape(2, 3), "d": torch.zeros(0, 4),
            "e": torch.tensor(5, dtype=torch.int32), "f": torch.randn(4, 4, generator=g).t(),
            "g": torch.randn(3, generator=g).half(), "h": torch.arange(9, dtype=torch.uint8)}


def same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert codec.raw_bytes(a[k]).tolist() == codec.raw_bytes(b[k]).tolist(), k  # bit-exact


@pytest.mark.parametrize("shm", [False, True])
def test_round_trip_bit_exact(shm):
    area = SharedArea.create(1 << 16) if shm else None
    try:
        frames = codec.encode({"op": "x", "args": {"n": 1}}, tensors(), area)
        assert (len(frames) == 1) == shm  # shared memory: header only
        header, out = codec.decode(frames, area)
        assert header["op"] == "x" and header["args"] == {"n": 1}
        same(tensors(), out)
        out["a"].add_(1)  # decoded tensors own their memory
        assert codec.decode(frames, area)[1]["a"].equal(tensors()["a"])
    finally:
        if area:
            area.close()


def test_too_big_for_the_area_goes_inline():
    area = SharedArea.create(64)
    try:
        frames = codec.encode({}, {"x": torch.zeros(100)}, area)
        assert len(frames) == 2
        assert codec.decode(frames, area)[1]["x"].shape == (100,)
    finally:
        area.close()


def _frames(spec, payload=b"\0" * 16, **header):
    h = {"v": codec.PROTOCOL_VERSION, "tensors": [spec], **header}
    return [msgpack.packb(h), payload]


GOOD = {"name": "x", "dtype": "f32", "shape": [4], "nbytes": 16, "frame": 1}


@pytest.mark.parametrize("spec,why", [
    (dict(GOOD, dtype="c64"), "dtype"),
    (dict(GOOD, dtype="pickle"), "dtype"),
    (dict(GOOD, shape=[5]), "bytes"),
    (dict(GOOD, nbytes=15), "bytes"),
    (dict(GOOD, shape=[-4]), "shape"),
    (dict(GOOD, shape=[1] * 7, nbytes=4), "shape"),
    (dict(GOOD, shape="4"), "shape"),
    (dict(GOOD, frame=2), "frame"),
    (dict(GOOD, frame=0), "frame"),
    ({k: v for k, v in GOOD.items() if k != "frame"}, "location"),
    (dict(GOOD, name=""), "name"),
    (dict(GOOD, name="x" * 300), "name"),
    ({k: v for k, v in GOOD.items() if k != "frame"} | {"offset": 0}, "shared memory"),
    ("not a map", "map"),
])
def test_malformed_tensor_specs_are_rejected(spec, why):
    with pytest.raises(codec.ProtocolError, match=why):
        codec.decode(_frames(spec))


def test_frame_length_must_match_and_limits_hold():
    with pytest.raises(codec.ProtocolError, match="frame has"):
        codec.decode(_frames(GOOD, payload=b"\0" * 12))
    with pytest.raises(codec.ProtocolError, match="limit"):
        codec.decode(_frames(GOOD), max_bytes=8)
    area = SharedArea.create(32)
    try:
        spec = {k: v for k, v in GOOD.items() if k != "frame"} | {"offset": 20}
        with pytest.raises(codec.ProtocolError, match="outside"):
            codec.decode(_frames(spec)[:1], area)
    finally:
        area.close()


@pytest.mark.parametrize("frames,why", [
    ([], "empty"),
    ([b"\xc1garbage"], "undecodable"),
    ([msgpack.packb([1, 2])], "not a map"),
    ([msgpack.packb({"v": 99})], "version"),
    ([msgpack.packb({"tensors": []})], "version"),
    ([b"\0" * (codec.MAX_HEADER_BYTES + 1)], "exceeds"),
    ([msgpack.packb({"v": codec.PROTOCOL_VERSION, "tensors": [GOOD] * (codec.MAX_TENSORS + 1)})], "tensor list"),
])
def test_malformed_headers_are_rejected(frames, why):
    with pytest.raises(codec.ProtocolError, match=why):
        codec.decode(frames)


def test_duplicate_tensor_names_are_rejected():
    with pytest.raises(codec.ProtocolError, match="twice"):
        codec.decode([msgpack.packb({"v": codec.PROTOCOL_VERSION, "tensors": [GOOD, GOOD]}), b"\0" * 16])


def test_shared_area_refuses_foreign_paths(tmp_path):
    name = f"dflash-shm-{os.getpid()}-" + "0" * 32
    for path in ["/etc/passwd", str(tmp_path / name), os.path.join(shm_dir(), "x"),
                 os.path.join(shm_dir(), "..", name), os.path.join(shm_dir(), "dflash-shm-" + "0" * 32)]:
        with pytest.raises(codec.ProtocolError):
            SharedArea.attach(path, 64)
    a = SharedArea.create(64)
    try:
        with pytest.raises(codec.ProtocolError, match="size"):
            SharedArea.attach(a.path, 128)
        b = SharedArea.attach(a.path, 64)
        a.unlink()
        assert not os.path.exists(a.path)  # the mappings outlive the name
        b.write(0, torch.arange(8, dtype=torch.uint8))
        assert a.read(0, torch.uint8, (8,), 8).tolist() == list(range(8))
        b.close()
    finally:
        a.close()


def test_create_sweeps_areas_of_exited_creators():
    """A server killed mid-handshake leaves a named area; the next create removes it, and
    only names of exited creators."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    names = {"dead": f"dflash-shm-{dead}-" + "a" * 32, "live": f"dflash-shm-{os.getpid()}-" + "b" * 32,
             "other": "dflash-shm-" + "c" * 32}
    for n in names.values():
        with open(os.path.join(shm_dir(), n), "wb") as f:
            f.write(b"x")
    a = SharedArea.create(64)
    try:
        left = set(os.listdir(shm_dir()))
        assert names["dead"] not in left
        assert names["live"] in left and names["other"] in left
        assert os.path.basename(a.path).startswith(f"dflash-shm-{os.getpid()}-")
    finally:
        a.close()
        for n in names.values():
            try:
                os.unlink(os.path.join(shm_dir(), n))
            except FileNotFoundError:
                pass


def test_worker_start_sweeps_socket_folders_of_killed_servers(tmp_path, monkeypatch):
    """A server killed with SIGKILL leaves its worker's socket folder; the next worker
    start removes it: only folders of exited creators, only with nothing but the socket."""
    import subprocess
    import sys
    import tempfile

    from dflash_server.runtime.worker_link import WorkerProcess

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    gone = tmp_path / f"dflash-shard-{dead}-ab_c1234"
    live = tmp_path / f"dflash-shard-{os.getpid()}-zz999999"
    busy = tmp_path / f"dflash-shard-{dead}-q0000000"
    for d in (gone, live, busy):
        d.mkdir()
        (d / "worker.sock").write_text("")
    (busy / "notes.txt").write_text("not the worker's")
    (tmp_path / "dflash-shard-notapid").mkdir()
    w = WorkerProcess("/bin/true")  # exits at once: only the folder handling runs
    w.start(b"secret")
    mine = Path(w.dir)
    assert mine.name.startswith(f"dflash-shard-{os.getpid()}-")
    w.stop()
    assert not gone.exists() and not mine.exists()
    assert live.exists() and (busy / "notes.txt").exists() and (tmp_path / "dflash-shard-notapid").exists()


# --- the worker's message handling (no sockets) ------------------------------------------
def _call(worker, ident, op, args=None, tensors=None):
    frames = codec.encode({"op": op, "id": 1, "args": args or {}}, tensors or {})
    header, out = codec.decode(worker.handle(ident, frames))
    return header, out


def _authenticate(worker, ident, secret=SECRET):
    from dflash_server.runtime.ipc_channel import proof

    nonce = os.urandom(16)
    h, _ = _call(worker, ident, "hello", {"nonce": nonce})
    return _call(worker, ident, "auth", {"proof": proof(secret, b"client", nonce, h["result"]["nonce"])})[0]


def test_worker_requires_the_handshake_and_survives_garbage():
    w = ShardWorker(SECRET)
    h, _ = _call(w, b"a", "health")
    assert not h["ok"] and h["error"]["kind"] == "auth"
    assert not _authenticate(w, b"a", b"wrong-secret-wrong")["ok"]
    assert not _call(w, b"a", "health")[0]["ok"]
    for garbage in ([b"\xc1"], [msgpack.packb({"v": 99, "op": "health"})], [b""], [msgpack.packb("x")]):
        h = msgpack.unpackb(w.handle(b"a", garbage)[0])
        assert h["ok"] is False and h["error"]["kind"] == "protocol"
    assert _authenticate(w, b"a")["ok"]
    h, _ = _call(w, b"a", "health")
    assert h["ok"] and h["result"] == {"loaded": False, "length": 0}
    h, _ = _call(w, b"a", "forward", {"start": 0})
    assert not h["ok"] and h["error"]["kind"] == "value" and "load" in h["error"]["message"]
    h, _ = _call(w, b"a", "no_such_op")
    assert not h["ok"] and "unknown operation" in h["error"]["message"]
    assert _authenticate(w, b"b")["ok"]  # a new client replaces the old one
    assert not _call(w, b"a", "health")[0]["ok"]


# --- client against a real socket ----------------------------------------------------------
@pytest.fixture
def worker_address(tmp_path):
    addr = f"ipc://{tmp_path}/w.sock"
    w = ShardWorker(SECRET)
    t = threading.Thread(target=w.serve, args=(addr,), daemon=True)
    t.start()
    yield addr
    c = ShardClient(addr, SECRET, timeout_s=5)
    try:
        c.handshake(5)
        c.call("shutdown")
    finally:
        c.close()
    t.join(5)


def test_handshake_with_shared_memory_leaves_no_segments(worker_address):
    before = set(os.listdir(shm_dir()))
    c = ShardClient(worker_address, SECRET, timeout_s=5, shm_bytes=1 << 16)
    assert c.handshake(5)["shm"] is True
    assert set(os.listdir(shm_dir())) == before  # names unlinked as soon as both sides mapped
    res, _ = c.call("health")
    assert res["loaded"] is False
    c.close()


def test_wrong_secret_is_refused(worker_address):
    c = ShardClient(worker_address, b"not-the-secret-at-all", timeout_s=5)
    with pytest.raises(ShardError, match="authentication"):
        c.handshake(5)
    with pytest.raises(RemoteOpError, match="not authenticated"):
        c.call("health")
    c.close()


def test_wrong_protocol_version_is_a_clear_error(worker_address):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(worker_address)
    sock.send_multipart([msgpack.packb({"v": 99, "op": "hello", "id": 1, "args": {}, "tensors": []})])
    assert sock.poll(5000)
    reply = msgpack.unpackb(sock.recv_multipart()[0])
    sock.close(0)
    assert reply["ok"] is False and reply["error"]["message"] == "protocol version 99; this side speaks 2"


def _fake_worker(addr, reply):
    """A ROUTER answering every request with ``reply(frames)``; returns its stop function
    (ZeroMQ sockets belong to one thread: the serving thread closes its own)."""
    stop, bound = threading.Event(), threading.Event()

    def serve():
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(addr)
        bound.set()
        while not stop.is_set():
            if sock.poll(50):
                msg = sock.recv_multipart()
                sock.send_multipart([msg[0], *reply(msg[1:])])
        sock.close(0)
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    bound.wait(5)

    def stopper():
        stop.set()
        t.join(5)
    return stopper


@pytest.mark.parametrize("reply,why", [
    (lambda m: [b"garbage"], "malformed"),
    (lambda m: [msgpack.packb({"v": 2, "id": 1, "ok": True, "result": {},
                               "tensors": [{"name": "x", "dtype": "f32", "shape": [1 << 20], "nbytes": 4 << 20,
                                            "frame": 1}]}), b"\0" * 8], "malformed"),
    (lambda m: [msgpack.packb({"v": 2, "id": 1, "ok": True, "result": 5, "tensors": []})], "without a result"),
    (lambda m: [msgpack.packb({"v": 1, "id": 1, "ok": True, "result": {}, "tensors": []})],
     "protocol version 1; this side speaks 2"),
    (lambda m: [b"\0" * 4096], "did not answer"),  # over MAXMSGSIZE: dropped by ZeroMQ
    (lambda m: [], "did not answer"),
])
def test_bad_replies_fail_the_call(tmp_path, reply, why):
    addr = f"ipc://{tmp_path}/fake.sock"
    stop = _fake_worker(addr, reply)
    c = ShardClient(addr, SECRET, timeout_s=0.5, max_message=1024)
    try:
        with pytest.raises(ShardError, match=why):
            c.call("health")
    finally:
        c.close()
        stop()


def test_no_room_for_shared_memory_falls_back_to_inline(worker_address, monkeypatch):
    """A full shm dir (e.g. Docker's 64 MB /dev/shm): the handshake continues without
    shared memory and leaves no half-created area behind."""
    before = set(os.listdir(shm_dir()))
    made = []
    real = SharedArea.create

    def second_fails(size):
        if made:
            raise OSError(28, "No space left on device")
        made.append(real(size))
        return made[-1]
    monkeypatch.setattr(SharedArea, "create", staticmethod(second_fails))
    c = ShardClient(worker_address, SECRET, timeout_s=5, shm_bytes=1 << 16)
    assert c.handshake(5)["shm"] is False
    assert c.req_area is None and set(os.listdir(shm_dir())) == before
    res, out = c.call("health")
    assert res["loaded"] is False
    c.close()
