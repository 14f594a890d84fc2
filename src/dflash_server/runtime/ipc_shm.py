"""Shared-memory areas for bulk tensors between the server and a worker on the same host.

The server creates a file under ``/dev/shm`` (or the temp dir), the worker maps it during
the handshake, and the server then unlinks the name at once: the memory lives exactly as
long as the two mappings, so a crash of either process after the handshake cannot leave a
segment behind. A server killed during the handshake (milliseconds) can: the name carries
the creator's pid, and every ``create`` removes the names of creators that are gone.
"""
from __future__ import annotations

import mmap
import os
import re
import secrets
import tempfile

import numpy as np
import torch

from .ipc_codec import ProtocolError, from_bytes
from .orphans import sweep

NAME_RE = re.compile(r"^dflash-shm-(\d+)-[0-9a-f]{32}$")


def shm_dir() -> str:
    d = "/dev/shm"
    return d if os.path.isdir(d) and os.access(d, os.W_OK) else tempfile.gettempdir()


def sweep_orphans() -> None:
    """Unlink areas whose creator has exited (left by a server killed mid-handshake); the
    names of live processes, other users' files and other names are left alone."""
    sweep(shm_dir(), NAME_RE, os.unlink)


class SharedArea:
    def __init__(self, path: str, size: int, fd: int, owner: bool):
        self.path, self.size, self.owner = path, size, owner
        try:
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)

    @classmethod
    def create(cls, size: int) -> SharedArea:
        sweep_orphans()
        path = os.path.join(shm_dir(), f"dflash-shm-{os.getpid()}-{secrets.token_hex(16)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            if hasattr(os, "posix_fallocate"):
                # reserve the pages now: a full tmpfs (Docker's 64 MB /dev/shm) must fail here,
                # not with SIGBUS on a later write into a sparse mapping
                os.posix_fallocate(fd, 0, size)
        except OSError:
            os.close(fd)
            os.unlink(path)
            raise
        return cls(path, size, fd, owner=True)

    @classmethod
    def attach(cls, path: str, size: int) -> SharedArea:
        """Map an area the peer created; only names this module creates are accepted."""
        if not isinstance(path, str) or os.path.dirname(path) != shm_dir() or \
                not NAME_RE.match(os.path.basename(path)):
            raise ProtocolError(f"refusing shared area path {path!r}")
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        st = os.fstat(fd)
        if not isinstance(size, int) or st.st_size != size or size <= 0:
            os.close(fd)
            raise ProtocolError(f"shared area {path}: size {st.st_size}, peer says {size!r}")
        return cls(path, size, fd, owner=False)

    def unlink(self) -> None:
        """Remove the name (the mappings stay valid)."""
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def write(self, offset: int, data: torch.Tensor) -> None:
        n = data.numel()
        np.frombuffer(self._mm, dtype=np.uint8, count=n, offset=offset)[:] = data.numpy()

    def read(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int) -> torch.Tensor:
        return from_bytes(self._mm, offset, dtype, shape, nbytes)

    def close(self) -> None:
        self.unlink()
        try:
            self._mm.close()
        except (BufferError, ValueError):  # a view is still alive somewhere: the GC unmaps it
            pass
