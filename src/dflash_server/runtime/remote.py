"""RemoteStage: the last group of target layers, served by a shard-worker process.

It implements the LocalStage interface (the pipeline cannot tell them apart). The worker
is either spawned and supervised here (``python -m dflash_server shard-worker`` with any
interpreter) or attached by address. Any transport failure, timeout, malformed reply or
internal worker error fails the call with ``ShardError``, kills a spawned worker and
restarts it in the background; ``epoch`` counts restarts so callers know that state held
by the worker (sequence, snapshots) is gone. ``health()`` says "degraded" meanwhile.
"""
from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass

import torch

from ..errors import ShardError
from .ipc_channel import RemoteOpError, ShardClient
from .stage import StageOutput

SECRET_ENV = "DFLASH_SHARD_SECRET"


@dataclass(frozen=True)
class RemoteOptions:
    python: str | None = None          # interpreter that spawns the worker (default: this one)
    connect: str | None = None         # attach to a running worker instead of spawning one
    secret: bytes | None = None        # required with ``connect``; random when spawning
    timeout_s: float = 60.0            # per operation
    start_timeout_s: float = 600.0     # spawn + load weights
    transport: str = "auto"            # auto | shm | inline
    shm_bytes: int = 64 << 20


class WorkerProcess:
    """A spawned worker on a private ipc:// socket; the worker exits if we die."""

    def __init__(self, python: str | None):
        self.python = python or sys.executable
        self.dir = self.proc = None

    def start(self, secret: bytes) -> str:
        self.dir = tempfile.mkdtemp(prefix="dflash-shard-")
        address = f"ipc://{self.dir}/worker.sock"
        env = dict(os.environ, **{SECRET_ENV: secret.decode()})
        env.setdefault("GOMP_SPINCOUNT", "3000")  # see cli/__init__.py: OPENMP_SPIN
        self.proc = subprocess.Popen([self.python, "-m", "dflash_server", "shard-worker", "--bind", address,
                                      "--parent-pid", str(os.getpid())], env=env, stdin=subprocess.DEVNULL,
                                     stdout=2)  # our stdout may be machine-readable output
        return address

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 3.0) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            self.proc = None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


class RemoteStage:
    is_first, is_last, batch = False, True, 1

    def __init__(self, model: str, shards: list[tuple[str, int, int]], *, dtype: torch.dtype, max_ctx: int,
                 quantize: tuple[str, str], home: str, options: RemoteOptions, fingerprint: str | None = None,
                 threads: int | None = None, kvflash=None):
        """``shards``: the worker's (device, begin, end) ranges, contiguous, ending at the
        last layer; ``home``: the local device results are delivered to."""
        self.begin, self.end = shards[0][1], shards[-1][2]
        self.device, self.dtype, self.max_ctx = torch.device(home), dtype, max_ctx
        self.options = options
        self.label = f"remote:{','.join(s[0] for s in shards)}"
        self._load = {"model": str(model), "shards": [list(s) for s in shards], "max_ctx": max_ctx,
                      "dtype": {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}[dtype],
                      "quantize": list(quantize), "fingerprint": fingerprint, "threads": threads,
                      "kvflash": dataclasses.asdict(kvflash) if kvflash is not None else None}
        self._kvflash_stats: list[dict] = []
        self._compile = False
        self.length = 0
        self.epoch = 0
        self.restarts = 0
        self.client: ShardClient | None = None
        self.proc = WorkerProcess(options.python) if options.connect is None else None
        self._weight_bytes = 0
        self._status, self._error = "starting", None
        self._lock = threading.Lock()
        self._restart_thread: threading.Thread | None = None
        self._start()

    # --- lifecycle ----------------------------------------------------------------------
    def _start(self) -> None:
        """(Re)start: spawn or attach, authenticate, load the layers. Raises ShardError."""
        opts = self.options
        secret = opts.secret if opts.connect else secrets.token_hex(32).encode()
        try:
            if self.proc is not None:
                self.proc.stop()
                address = self.proc.start(secret)
            else:
                address = opts.connect
            use_shm = opts.transport == "shm" or (opts.transport == "auto" and address.startswith("ipc://"))
            self.client = ShardClient(address, secret, timeout_s=opts.timeout_s,
                                      shm_bytes=opts.shm_bytes if use_shm else 0,
                                      alive=self.proc.alive if self.proc else None)
            # a spawned worker needs interpreter start-up time (and fails fast if it dies);
            # a running one must answer like any operation
            res = self.client.handshake(opts.start_timeout_s if self.proc is not None else opts.timeout_s)
            if opts.transport == "shm" and not res.get("shm"):
                raise ShardError(f"shard worker at {address} could not map shared memory (--shard-transport shm)")
            res, _ = self.client.call("load", self._load, timeout_s=opts.start_timeout_s)
            self._weight_bytes = int(res.get("weight_bytes", 0))
            if self._compile:
                self.client.call("compile")
        except RemoteOpError as e:
            self._shutdown_worker()
            raise ShardError(f"shard worker ({self.label}, layers {self.begin}-{self.end - 1}) could not load: {e}") from None
        except ShardError:
            self._shutdown_worker()
            raise
        self.length = 0
        self._status, self._error = "ok", None

    def _shutdown_worker(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.proc is not None:
            self.proc.stop()

    def _fail(self, reason: str) -> ShardError:
        """Tear the worker down, restart it in the background, return the error to raise."""
        with self._lock:
            self._status, self._error = "degraded", reason
            self._shutdown_worker()
            self.epoch += 1
            self.restarts += 1
            self._restart_thread = threading.Thread(target=self._restart, name="dflash-shard-restart", daemon=True)
            self._restart_thread.start()
        return ShardError(f"shard worker ({self.label}, layers {self.begin}-{self.end - 1}) failed: {reason}; restarting it")

    def _restart(self) -> None:
        try:
            self._start()
        except ShardError as e:
            self._status, self._error = "failed", str(e)

    def _ready(self) -> ShardClient:
        t = self._restart_thread
        if t is not None and t is not threading.current_thread():
            t.join(self.options.start_timeout_s)
        if self._status == "failed":  # the last restart failed: try once more, now
            self._restart_thread = None
            try:
                self._start()
            except ShardError as e:
                self._status, self._error = "failed", str(e)
                raise
        if self.client is None or self._status != "ok":
            raise ShardError(f"shard worker ({self.label}, layers {self.begin}-{self.end - 1}) is not available: {self._error}")
        return self.client

    def health(self) -> dict:
        pid = self.proc.proc.pid if self.proc is not None and self.proc.proc is not None else None
        return {"status": self._status, "error": self._error, "restarts": self.restarts, "epoch": self.epoch,
                "pid": pid}

    def close(self) -> None:
        t = self._restart_thread
        if t is not None:
            t.join(self.options.start_timeout_s)
        if self.client is not None and self._status == "ok" and self.proc is not None:
            try:  # a worker we spawned; one started by hand keeps serving
                self.client.call("shutdown", timeout_s=2.0)
            except (ShardError, RemoteOpError):
                pass
        self._shutdown_worker()
        self._status = "stopped"

    def _call(self, op: str, args: dict | None = None, tensors: dict | None = None):
        client = self._ready()
        try:
            res, out = client.call(op, args, tensors)
        except RemoteOpError as e:
            if e.kind == "value":
                raise ValueError(str(e)) from None
            raise self._fail(f"{op}: {e}") from None
        except ShardError as e:
            raise self._fail(str(e)) from None
        if "length" in res:
            self.length = int(res["length"])
        return res, out

    # --- the stage interface ------------------------------------------------------------
    def compile_decode(self) -> None:
        self._compile = True
        self._call("compile")

    def weight_bytes(self) -> int:
        return self._weight_bytes

    def forward(self, x: torch.Tensor, start: int, *, logits: str = "last",
                capture: tuple[int, ...] = ()) -> StageOutput:
        if x.shape[0] != 1:
            raise ValueError("a remote stage runs batch 1")
        mine = [c for c in capture if self.begin <= c < self.end]
        res, out = self._call("forward", {"start": start, "logits": logits, "capture": mine},
                              {"x": x.to(self.dtype)})
        caps = {c: out[f"cap.{c}"].to(self.device) for c in mine if f"cap.{c}" in out}
        if "kvflash" in res:
            self._kvflash_stats = res["kvflash"]
        lg = out.get("logits")
        return StageOutput(hidden=out["hidden"].to(self.device) if "hidden" in out else None,
                           logits=lg.to(self.device) if lg is not None else None, captures=caps)

    def kvflash_stats(self) -> dict | None:
        """KV Flash counters of the worker's stages, as of the last forward (summed)."""
        kv = self._kvflash_stats
        if not kv:
            return None
        return {k: (sum(s[k] for s in kv) if isinstance(kv[0][k], int) else kv[0][k]) for k in kv[0]}

    def reselect(self) -> bool:
        return bool(self._load["kvflash"]) and bool(self._call("reselect")[0]["changed"])

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        _, out = self._call("project", tensors={"hidden": hidden.to(self.dtype)})
        return out["logits"].to(self.device)

    def reset(self) -> None:
        self._call("reset")

    def checkpoint(self) -> None:
        self._call("checkpoint")

    def rollback(self, length: int) -> None:
        self._call("rollback", {"length": int(length)})

    def commit(self) -> None:
        self._call("commit")

    def snapshot_save(self, slot: int) -> None:
        self._call("snapshot_save", {"slot": int(slot)})

    def snapshot_restore(self, slot: int) -> None:
        self._call("snapshot_restore", {"slot": int(slot)})

    def snapshot_free(self, slot: int) -> None:
        if self._status != "ok":
            return  # the worker lost every snapshot when it failed
        self._call("snapshot_free", {"slot": int(slot)})

    def snapshot_nbytes(self, slot: int) -> int:
        return int(self._call("snapshot_nbytes", {"slot": int(slot)})[0]["nbytes"])

    def snapshot_export(self, slot: int) -> dict[str, torch.Tensor]:
        return self._call("snapshot_export", {"slot": int(slot)})[1]

    def snapshot_import(self, slot: int, tensors: dict[str, torch.Tensor]) -> None:
        self._call("snapshot_import", {"slot": int(slot)}, tensors)
