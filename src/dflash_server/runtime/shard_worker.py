"""The shard worker: serves a group of target layers to a server over the IPC channel.

It starts empty; the server's ``load`` names the model, the layer ranges and devices, so a
worker started by hand on another host needs only an address and the shared secret (and
``--model`` when the weights live at another path there; their fingerprint must match).
Operations mirror ``LocalStage`` (see RemoteStage); errors go back as replies and the
loop keeps serving. One client at a time: a new authenticated client replaces the old.
"""
from __future__ import annotations

import hmac
import logging
import os
import secrets
import time

import torch
import zmq

from ..layers.attention import KV_DTYPES
from . import heap
from .carry import carry_from_tensors
from .ipc_channel import DEFAULT_MAX_MESSAGE, proof
from .ipc_codec import DTYPES, PROTOCOL_VERSION, ProtocolError, decode, encode, pack_header, unpack_header
from .ipc_shm import SharedArea
from .kv_pager import KvFlashConfig

log = logging.getLogger("dflash_server.shard_worker")


class _Client:
    def __init__(self):
        self.nonces: tuple[bytes, bytes] | None = None
        self.authed = False
        self.req_area = self.rep_area = None

    def close(self):
        for a in (self.req_area, self.rep_area):
            if a is not None:
                a.close()
        self.req_area = self.rep_area = None


def _int(a: dict, key: str) -> int:
    v = a.get(key)
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"argument {key!r} must be an integer, got {v!r}")
    return v


def _ints(a: dict, key: str, limit: int = 64) -> tuple[int, ...]:
    v = a.get(key)
    if not isinstance(v, list) or not 0 < len(v) <= limit or \
            not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        raise ValueError(f"argument {key!r} must be a list of 1 to {limit} integers")
    return tuple(v)


def _trees(v, rows: int) -> dict[int, tuple[int, ...]] | None:
    """forward_rows' ``trees``: [slot, [parent, ...]] pairs (None: no trees)."""
    if v is None:
        return None
    if not isinstance(v, list) or len(v) > rows or not all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], int) and not isinstance(p[0], bool)
            for p in v):
        raise ValueError("forward_rows: trees must be a list of [slot, parents] pairs")
    out = {p[0]: _ints({"tree": p[1]}, "tree") for p in v}
    if len(out) != len(v):
        raise ValueError("forward_rows: one tree per slot")
    return out


def _tensor(t: dict, key: str):
    if key not in t:
        raise ValueError(f"missing tensor {key!r}")
    return t[key]


def _layer_of(name: str) -> int | None:
    tail = name.rsplit(".", 1)[-1]
    return int(tail) if tail.isdigit() else None


class ShardWorker:
    def __init__(self, secret: bytes, model_override: str | None = None, max_message: int = DEFAULT_MAX_MESSAGE,
                 providers: tuple = (), settle_heap: bool = False):
        """``providers``: objects whose ``op_*`` methods serve more operations (the draft's).
        ``settle_heap``: freeze the Python heap after each load (runtime.heap; the worker
        process's own, not a test process driving a worker in place)."""
        self.secret, self.model_override, self.max_message = secret, model_override, max_message
        self.settle_heap = settle_heap
        self.providers = providers
        self.pipeline = None  # TargetPipeline over this worker's stages (after load)
        self.load_key = None
        self.clients: dict[bytes, _Client] = {}
        self.stopping = False

    # --- operations -----------------------------------------------------------------
    @property
    def stages(self) -> list:
        return self.pipeline.stages if self.pipeline is not None else []

    def op_load(self, a, t):
        from ..weights.loader import open_model
        from .pipeline import build_pipeline
        from .placement import ShardSpec

        kv = a.get("kvflash")
        lanes = a.get("lanes", 1)
        if not isinstance(lanes, int) or isinstance(lanes, bool) or not 1 <= lanes <= 256:
            raise ValueError(f"lanes must be an integer in [1, 256], got {lanes!r}")
        kv_dtype = a.get("kv_dtype", "auto")
        if not isinstance(kv_dtype, str) or (kv_dtype != "auto" and kv_dtype not in KV_DTYPES):
            raise ValueError(f"kv_dtype must be one of auto, {', '.join(KV_DTYPES)}; got {kv_dtype!r}")
        key = (a["model"], tuple(map(tuple, a["shards"])), a["dtype"], a["max_ctx"], tuple(a["quantize"]),
               tuple(sorted(kv.items())) if isinstance(kv, dict) else None, lanes, kv_dtype)
        if key != self.load_key:
            if self.pipeline is not None:
                if self.settle_heap:
                    heap.thaw()   # (the old layers were frozen with the rest: let them go)
                self.pipeline.close()
            self.pipeline, self.load_key = None, None
            if a.get("threads"):
                torch.set_num_threads(int(a["threads"]))
            source = open_model(self.model_override or a["model"])
            if a.get("fingerprint") and source.fingerprint(mtime=False) != a["fingerprint"]:
                raise ValueError("the worker's weights differ from the server's (fingerprint mismatch)")
            dtype = DTYPES[a["dtype"]]
            n = source.config.num_layers
            shards = [(str(d), int(b), int(e)) for d, b, e in a["shards"]]
            kvflash = KvFlashConfig(**kv) if isinstance(kv, dict) else None
            for k, (dev, b, e) in enumerate(shards):
                if not 0 <= b < e <= n or (k and b != shards[k - 1][2]) or dev.startswith("remote:"):
                    raise ValueError(f"bad layer ranges {shards} for a model of {n} layers")
            # the same pipeline a server builds, over hidden states instead of token ids
            self.pipeline = build_pipeline(source, [ShardSpec(*sh) for sh in shards], dtype=dtype,
                                           max_ctx=int(a["max_ctx"]), quantize=tuple(a["quantize"]), progress=False,
                                           kvflash=kvflash, lanes=lanes, embeds=False, kv_dtype=kv_dtype)
            self.load_key = key
            if self.settle_heap:
                heap.settle()
        for lane in range(lanes):
            self._each("select", lane)
            self._each("reset")
        self._each("select", 0)
        pagers = [s.pager for s in self.stages if s.pager is not None]
        return {"weight_bytes": sum(s.weight_bytes() for s in self.stages), "pid": os.getpid(),
                "can_ragged": all(s.can_ragged for s in self.stages),
                "can_tree_rows": all(s.can_tree_rows for s in self.stages),
                # the chunks its KV Flash pools hold (RemoteStage.spec_room)
                "kvflash_capacity": min(p.capacity for p in pagers) if pagers else None}, {}

    def _need(self):
        if self.pipeline is None:
            raise ValueError("no layers loaded (send load first)")
        return self.pipeline

    def _select(self, a) -> None:
        """Point every stage at the request's sequence slot (``lane``, default 0)."""
        lane = a.get("lane", 0)
        if not isinstance(lane, int) or isinstance(lane, bool):
            raise ValueError(f"argument 'lane' must be an integer, got {lane!r}")
        self._need().select(lane)

    def _each(self, name, *args):
        """A state operation of the pipeline (it fans out to every stage); the new length."""
        if self.pipeline is None:
            return {"length": 0}, {}
        getattr(self.pipeline, name)(*args)
        return {"length": self.pipeline.length}, {}

    def op_forward_rows(self, a, t):
        pipe = self._need()
        lanes, positions, capture = a.get("lanes"), a.get("positions"), a.get("capture", [])
        for v in (lanes, positions, capture):
            if not isinstance(v, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
                raise ValueError("forward_rows: lanes, positions and capture must be lists of integers")
        trees = _trees(a.get("trees"), len(lanes))
        x, out_t, carry = _tensor(t, "x"), {}, carry_from_tensors(t)
        t0 = time.perf_counter()
        out = pipe.run_rows(x, lanes, positions, tuple(capture), carry=carry, trees=trees)
        out_t.update({f"cap.{k}": v for k, v in out.captures.items()})
        if out.head_logits is not None:
            out_t["logits"] = out.head_logits
        if out.hidden is not None:
            out_t["hidden"] = out.hidden
        return {"lengths": [pipe.stages[-1].lanes[lane].length for lane in lanes],
                "compute_s": time.perf_counter() - t0}, out_t

    def op_forward(self, a, t):
        pipe = self._need()
        self._select(a)
        x, start, mode, capture = _tensor(t, "x"), _int(a, "start"), a.get("logits", "last"), a.get("capture", [])
        if mode not in ("last", "all", "none") or not isinstance(capture, list) or \
                not all(isinstance(c, int) for c in capture):
            raise ValueError("forward: logits must be last|all|none and capture a list of layer ids")
        capture, out_t, carry = tuple(capture), {}, carry_from_tensors(t)
        tree = {"tree": _ints(a, "tree")} if a.get("tree") is not None else {}
        observe = a.get("observe", True)
        if not isinstance(observe, bool):
            raise ValueError("forward: observe must be a boolean")
        t0 = time.perf_counter()
        out = pipe.run(x, start, logits=mode, capture=capture, carry=carry, observe=observe, **tree)
        out_t.update({f"cap.{k}": v for k, v in out.captures.items()})
        if out.head_logits is not None:
            # in the head's dtype (bf16: half the bytes of fp32, and not widened here); the
            # client widens it exactly as a local stage does
            out_t["logits"] = out.head_logits
        if out.hidden is not None:
            out_t["hidden"] = out.hidden
        # compute time lets the client tell IPC overhead from work (benchmarks/split.py)
        res = {"length": pipe.length, "compute_s": time.perf_counter() - t0}
        kv = pipe.kvflash_stats()
        if kv:
            res["kvflash"] = kv
        return res, out_t

    def op_reselect(self, a, t):
        self._select(a)
        return {"changed": any([st.reselect() for st in self._need().stages])}, {}

    def op_project(self, a, t):
        return {}, {"logits": self._need().project(_tensor(t, "hidden"))}

    def op_compile(self, a, t):
        return self._each("compile_decode")

    def op_cuda_graphs(self, a, t):
        return {"stages": self._need().use_cuda_graphs()}, {}

    def op_reset(self, a, t):
        self._select(a)
        return self._each("reset")

    def op_checkpoint(self, a, t):
        self._select(a)
        return self._each("checkpoint")

    def op_rollback(self, a, t):
        self._select(a)
        return self._each("rollback", _int(a, "length"))

    def op_rollback_tree(self, a, t):
        self._select(a)
        return self._each("rollback_tree", list(_ints(a, "path")))

    def op_commit(self, a, t):
        self._select(a)
        return self._each("commit")

    def op_snapshot_save(self, a, t):
        self._select(a)
        return self._each("snapshot_save", _int(a, "slot"))

    def op_snapshot_restore(self, a, t):
        self._select(a)
        return self._each("snapshot_restore", _int(a, "slot"))

    def op_snapshot_free(self, a, t):
        return self._each("snapshot_free", _int(a, "slot"))

    def op_snapshot_nbytes(self, a, t):
        return {"nbytes": self._need().snapshot_nbytes(_int(a, "slot"))}, {}

    def op_snapshot_export(self, a, t):
        out = {}  # named by layer (the client routes them), not by stage as the pipeline's own export
        for st in self._need().stages:
            out.update(st.snapshot_export(_int(a, "slot")))
        return {}, out

    def op_snapshot_import(self, a, t):
        slot, stages = _int(a, "slot"), self._need().stages
        if "length" not in t:
            raise ValueError("snapshot has no length")
        owned = set()
        for st in stages:
            part = {k: v for k, v in t.items() if (i := _layer_of(k)) is not None and st.begin <= i < st.end}
            owned |= part.keys()
            st.snapshot_import(slot, dict(part, length=t["length"]))
        stray = set(t) - owned - {"length"}
        if stray:
            self._each("snapshot_free", slot)
            raise ValueError(f"snapshot tensors for layers this worker does not hold: {sorted(stray)[:3]}")
        return {}, {}

    def op_health(self, a, t):
        return {"loaded": self.pipeline is not None,
                "length": self.pipeline.length if self.pipeline is not None else 0}, {}

    def op_shutdown(self, a, t):
        self.stopping = True
        return {}, {}

    # --- transport --------------------------------------------------------------------
    def _handshake(self, client: _Client, op: str, args: dict):
        if op == "hello":
            nonce_c = args.get("nonce")
            if not isinstance(nonce_c, bytes) or len(nonce_c) != 16:
                raise ProtocolError("hello without a 16-byte nonce")
            nonce_w = secrets.token_bytes(16)
            client.nonces, client.authed = (nonce_c, nonce_w), False
            return {"nonce": nonce_w, "proof": proof(self.secret, b"worker", nonce_c, nonce_w),
                    "protocol": PROTOCOL_VERSION}
        if client.nonces is None or not hmac.compare_digest(
                proof(self.secret, b"client", *client.nonces), args.get("proof") or b""):
            client.nonces = None
            raise PermissionError("authentication failed (wrong shared secret)")
        for other in list(self.clients.values()):  # one client at a time
            if other is not client:
                other.close()
                other.authed = False
        client.authed, shm = True, args.get("shm")
        client.close()
        if isinstance(shm, dict):
            try:
                client.req_area = SharedArea.attach(shm.get("req"), shm.get("size"))
                client.rep_area = SharedArea.attach(shm.get("rep"), shm.get("size"))
            except (OSError, ProtocolError) as e:
                log.warning("shared memory not usable (%s): tensors travel inline", e)
                client.close()
        return {"shm": client.rep_area is not None}

    def handle(self, ident: bytes, frames: list) -> list:
        client = self.clients.setdefault(ident, _Client())
        if len(self.clients) > 64:  # drop half-open handshakes from many identities
            for k in [k for k, c in self.clients.items() if not c.authed and k != ident][:32]:
                del self.clients[k]
        rid = None
        try:
            if not client.authed and (len(frames) != 1 or unpack_header(frames[0]).get("tensors")):
                # before authentication only a header is read: a peer without the secret gets
                # nothing decoded or copied for what it sends (hello and auth carry no tensors)
                raise PermissionError("not authenticated (no tensors before authentication)")
            header, tensors = decode(frames, client.req_area if client.authed else None, self.max_message)
            rid, op, args = header.get("id"), header.get("op"), header.get("args")
            if not isinstance(op, str) or not isinstance(args, dict):
                raise ProtocolError("request without op or args")
            if op in ("hello", "auth"):
                return encode({"id": rid, "ok": True, "result": self._handshake(client, op, args)}, {})
            if not client.authed:
                raise PermissionError("not authenticated")
            fn = next((f for obj in (self, *self.providers) if (f := getattr(obj, f"op_{op}", None))), None)
            if fn is None:
                raise ProtocolError(f"unknown operation {op!r}")
            result, out = fn(args, tensors)
            return encode({"id": rid, "ok": True, "result": result}, out, client.rep_area)
        except Exception as e:  # noqa: BLE001 - every failure is answered, the loop lives on
            kind = "value" if isinstance(e, (ValueError, KeyError)) else \
                "auth" if isinstance(e, PermissionError) else \
                "protocol" if isinstance(e, ProtocolError) else "internal"
            if kind == "internal":
                log.exception("operation failed")
            msg = f"{type(e).__name__}: {e}" if kind in ("value", "internal") else str(e)
            # the error reply is plain msgpack: it must be readable even when the request was not
            return [pack_header({"v": PROTOCOL_VERSION, "id": rid, "ok": False,
                                 "error": {"kind": kind, "message": msg[:2000]}, "tensors": []})]

    def serve(self, address: str, parent_pid: int | None = None) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message)
        sock.setsockopt(zmq.IPV6, 1)   # tcp://[::1]:port (IPv4 addresses work as well)
        sock.bind(address)
        print(f"shard worker ready on {sock.getsockopt_string(zmq.LAST_ENDPOINT)}", flush=True)
        try:
            while not self.stopping:
                if not sock.poll(1000):
                    if parent_pid is not None and os.getppid() != parent_pid:
                        log.warning("parent process %d is gone: exiting", parent_pid)
                        return
                    continue
                msg = sock.recv_multipart(copy=False)
                if len(msg) < 2:
                    continue
                reply = self.handle(msg[0].bytes, msg[1:])
                sock.send_multipart([msg[0], *reply], copy=False)
        finally:
            for c in self.clients.values():
                c.close()
            sock.close(0)
