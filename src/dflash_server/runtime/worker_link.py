"""WorkerLink: one supervised connection to a shard-worker process.

Spawns the worker (``python -m dflash_server shard-worker`` with any interpreter) or
attaches to one by address, authenticates, sends the ``setup`` operations (load layers, a
draft, ...), and turns every failure (exit, timeout, malformed reply, internal worker
error) into ``ShardError`` after killing a spawned worker and restarting it in the
background. ``epoch`` counts restarts: state the worker held is gone after one.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass

from ..errors import ShardError
from .ipc_channel import RemoteOpError, ShardClient
from .openmp import tune_for_split
from .orphans import sweep

SECRET_ENV = "DFLASH_SHARD_SECRET"
SOCKET_DIR_RE = re.compile(r"dflash-shard-(\d+)-[a-z0-9_]+")
SOCKET = "worker.sock"


def _remove_socket_dir(path: str) -> None:
    """A dead server's worker socket folder: its socket, then the folder (only ours, and
    only if nothing else is in it)."""
    if os.lstat(path).st_uid != os.geteuid():
        return
    sock = os.path.join(path, SOCKET)
    if os.path.lexists(sock):
        os.unlink(sock)
    os.rmdir(path)


@dataclass(frozen=True)
class RemoteOptions:
    python: str | None = None          # interpreter that spawns the worker (default: this one)
    connect: str | None = None         # attach to a running worker instead of spawning one
    secret: bytes | None = None        # required with ``connect``; random when spawning
    timeout_s: float = 60.0            # per operation
    start_timeout_s: float = 600.0     # spawn + load weights
    transport: str = "auto"            # auto | shm | inline
    shm_bytes: int = 16 << 20         # per direction; larger messages (snapshot exports) go inline


class WorkerProcess:
    """A spawned worker on a private ipc:// socket; the worker exits if we die."""

    def __init__(self, python: str | None):
        self.python = python or sys.executable
        self.dir = self.proc = None

    def start(self, secret: bytes) -> str:
        # named with our pid, so the next server removes it if we are killed (SIGKILL)
        sweep(tempfile.gettempdir(), SOCKET_DIR_RE, _remove_socket_dir)
        self.dir = tempfile.mkdtemp(prefix=f"dflash-shard-{os.getpid()}-")
        address = f"ipc://{self.dir}/{SOCKET}"
        env = dict(os.environ, **{SECRET_ENV: secret.decode()})
        tune_for_split(env)
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


class WorkerLink:
    def __init__(self, options: RemoteOptions, setup: list[tuple[str, dict]], label: str):
        """``setup``: operations sent after every (re)start, e.g. [("load", {...})]."""
        self.options, self.setup, self.label = options, setup, label
        self.epoch = self.restarts = 0
        self.client: ShardClient | None = None
        self.proc = WorkerProcess(options.python) if options.connect is None else None
        self.setup_results: list[dict] = []
        self._status, self._error = "starting", None
        self._lock = threading.Lock()
        self._restart_thread: threading.Thread | None = None
        self._start()

    def _start(self) -> None:
        """(Re)start: spawn or attach, authenticate, run the setup operations. Raises ShardError."""
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
            self.setup_results = [self.client.call(op, args, timeout_s=opts.start_timeout_s)[0]
                                  for op, args in self.setup]
        except RemoteOpError as e:
            self._shutdown_worker()
            raise ShardError(f"shard worker ({self.label}) could not load: {e}") from None
        except ShardError:
            self._shutdown_worker()
            raise
        except Exception as e:  # noqa: BLE001 - a full /tmp, no file descriptors, a garbled answer, ...
            # any failure to start is a failed start: the worker comes down and the next
            # request tries again (a thread dying on it left the split down for good)
            self._shutdown_worker()
            raise ShardError(f"shard worker ({self.label}) could not start: {type(e).__name__}: {e}") from None
        self._status, self._error = "ok", None

    def _shutdown_worker(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.proc is not None:
            self.proc.stop()

    def fail(self, reason: str) -> ShardError:
        """Tear the worker down, restart it in the background, return the error to raise."""
        with self._lock:
            self._status, self._error = "degraded", reason
            self._shutdown_worker()
            self.epoch += 1
            self.restarts += 1
            self._restart_thread = threading.Thread(target=self._restart, name="dflash-shard-restart", daemon=True)
            self._restart_thread.start()
        return ShardError(f"shard worker ({self.label}) failed: {reason}; restarting it")

    def _restart(self) -> None:
        try:
            self._start()
        except ShardError as e:
            self._status, self._error = "failed", str(e)

    def ready(self) -> ShardClient:
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
            raise ShardError(f"shard worker ({self.label}) is not available: {self._error}")
        return self.client

    @property
    def ok(self) -> bool:
        return self._status == "ok"

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

    def call(self, op: str, args: dict | None = None, tensors: dict | None = None):
        """One operation; a worker-side ValueError comes back as ValueError (the worker
        is fine), every other failure as ShardError after scheduling a restart."""
        client = self.ready()
        try:
            return client.call(op, args, tensors)
        except RemoteOpError as e:
            if e.kind == "value":
                raise ValueError(str(e)) from None
            raise self.fail(f"{op}: {e}") from None
        except ShardError as e:
            raise self.fail(str(e)) from None
