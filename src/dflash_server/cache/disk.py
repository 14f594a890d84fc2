"""Restart-persistent prefix cache: snapshot files under ``<dir>/<model fingerprint>/``.

A cold start scans the directory (headers only), so the first request after a restart can
hit. Writes happen on one background thread (snapshot tensors are immutable copies), so
a response never waits for the disk. Anything wrong with a file (truncated, corrupt,
foreign version or fingerprint, tensors that do not fit the model, a full disk) is a miss
plus one warning line; the bad file is removed. File names are hashes of token ids, never
request data. A cache folder the server may not write is used read-only (one warning):
hits are served, nothing is written, removed or touched. What is the cache's own inside
the folder, and how folders are created, is ``disk_layout``'s business.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path

from .disk_format import SUFFIX, SnapshotFormatError, read_header, read_tensors, write_snapshot
from .disk_index import DiskEntry, DiskIndex
from .disk_layout import open_model_dir, snapshot_files, temp_files
from .prefix_index import prefix_key

log = logging.getLogger("dflash_server.cache")


def _writer_alive(tmp_name: str) -> bool:
    """Whether the process a temporary snapshot name belongs to (``.<name>.<pid>.tmp``) still
    runs: a server sharing the folder is writing it, not a crash's leftover."""
    try:
        pid = int(tmp_name.rsplit(".", 2)[-2])
        if pid == os.getpid():
            return False
        os.kill(pid, 0)
    except (ValueError, IndexError, ProcessLookupError):
        return False
    except PermissionError:   # another user's live process
        return True
    return True


class DiskCache:
    def __init__(self, root: str | Path, fingerprint: str, budget_bytes: int, min_tokens: int = 0):
        self.root = Path(root)
        self.fingerprint = fingerprint
        self.dir, mode = open_model_dir(self.root, fingerprint)
        self.read_only, self.ignored = mode != "rw", mode == "off"
        if self.ignored:
            log.warning("kv cache: %s belongs to another user (uid %d): not used; give --kv-cache-dir a folder of "
                        "your own", self.dir, os.lstat(self.dir).st_uid)
        elif self.read_only:
            log.warning("kv cache: %s is not writable: its snapshots are read, none are written", self.dir)
        self.index = DiskIndex(budget_bytes)
        self.min_tokens = min_tokens
        self.counters = {"hits": 0, "misses": 0, "reads": 0, "writes": 0, "evictions": 0, "errors": 0, "dropped": 0}
        self._lock = threading.Lock()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-cache-writer")
        self._pending: list[Future] = []
        self.scan()

    def _path(self, key: str) -> Path:
        return self.dir / f"{key}{SUFFIX}"

    def _bad(self, path: Path, why: str) -> None:
        log.warning("kv cache: ignoring %s: %s", path.name, why)
        self.counters["errors"] += 1
        if not self.read_only:
            try:
                path.unlink()
            except OSError:
                pass

    def scan(self) -> None:
        if self.ignored or not self.dir.is_dir():
            return  # another user's folder, or a read-only root without a folder for this model
        if not self.read_only:
            for tmp in temp_files(self.dir):  # left by a crash mid-write (not a live writer's)
                if not _writer_alive(tmp.name):
                    tmp.unlink(missing_ok=True)
        for path in snapshot_files(self.dir):
            self._admit(path)
        self._evict(self.index.victims())   # a smaller budget than last time, or several servers' files

    def _admit(self, path: Path) -> None:
        """Index a snapshot file found in the folder (a bad one is a warning, and removed)."""
        try:
            rec = read_header(path, self.fingerprint)
        except SnapshotFormatError as e:
            self._bad(path, str(e))
            return
        key = prefix_key(rec["token_ids"])
        if path.name != f"{key}{SUFFIX}":
            self._bad(path, "file name does not match its token ids")
            return
        try:
            st = path.stat()
        except OSError:   # removed meanwhile (another server sharing the folder evicted it)
            return
        with self._lock:
            self.index.add(DiskEntry(key, tuple(rec["token_ids"]), st.st_size, st.st_mtime))

    def _refresh(self) -> None:
        """Servers may share a folder: before a write, files the others added are indexed and
        those they removed forgotten, so the budget bounds the folder, not this process's
        share of it."""
        try:
            present = {p.name: p for p in snapshot_files(self.dir)}
        except OSError:   # the folder is gone (`cache clear` under a live server): start it again
            with self._lock:
                for key in list(self.index.entries):
                    self.index.remove(key)
            try:
                self.dir, mode = open_model_dir(self.root, self.fingerprint)
            except OSError:
                return    # (the write will say why)
            if mode != "rw":
                return
            present = {}
        with self._lock:
            known = {f"{k}{SUFFIX}": k for k in self.index.entries}
            for name, key in known.items():
                if name not in present:
                    self.index.remove(key)
        for name, path in present.items():
            if name not in known:
                self._admit(path)

    def _evict(self, victims) -> None:
        with self._lock:
            for v in victims:
                self.index.remove(v.key)
        if self.read_only:
            return
        for v in victims:
            self._path(v.key).unlink(missing_ok=True)
            self.counters["evictions"] += 1

    def lookup(self, token_ids, boundaries) -> tuple[DiskEntry, dict] | None:
        """Longest snapshot whose ids equal ``token_ids[:n]`` for an ``n`` in ``boundaries``
        (any container; a range costs nothing): (entry, tensors) or None."""
        lengths = boundaries if isinstance(boundaries, (range, set, frozenset)) else set(boundaries)
        with self._lock:
            e = self.index.longest_match(token_ids, lengths)
        if e is None:
            self.counters["misses"] += 1
            return None
        path = self._path(e.key)
        try:
            rec = read_header(path, self.fingerprint)
            if tuple(rec["token_ids"]) != e.token_ids:
                raise SnapshotFormatError("token ids changed on disk")
            tensors = read_tensors(path, rec)
        except (SnapshotFormatError, OSError) as err:
            with self._lock:
                self.index.remove(e.key)
            self._bad(path, str(err))
            self.counters["misses"] += 1
            return None
        with self._lock:
            self.index.touch(e.key)
        if not self.read_only:
            try:
                os.utime(path)  # the eviction order survives a restart
            except OSError:
                pass
        self.counters["hits"] += 1
        self.counters["reads"] += 1
        return e, tensors

    def invalidate(self, entry: DiskEntry, why: str) -> None:
        """A file that read fine but does not fit the model: remove it."""
        with self._lock:
            self.index.remove(entry.key)
        self._bad(self._path(entry.key), why)

    def contains(self, token_ids) -> bool:
        return prefix_key(token_ids) in self.index.entries

    MAX_QUEUED = 4  # snapshot copies waiting for the writer at most; more are dropped

    def backlog(self) -> int:
        """Writes queued or running."""
        self._pending = [f for f in self._pending if not f.done()]
        return len(self._pending)

    def save(self, token_ids, tensors: dict, force: bool = False, wait: bool = False) -> Future | None:
        """Queue a write (skipped if too short, already present or over budget, or when the
        writer is MAX_QUEUED behind: each queued write holds a copy of the state, and a disk
        slower than decoding would otherwise grow memory by a snapshot per checkpoint).
        ``wait``: rather than drop it, wait for the writer to catch up (shutdown)."""
        token_ids = tuple(token_ids)
        if self.read_only:
            return None
        if (len(token_ids) < self.min_tokens and not force) or self.contains(token_ids):
            return None
        while wait and self.backlog() >= self.MAX_QUEUED:
            wait_futures(self._pending, return_when=FIRST_COMPLETED)
        if self.backlog() >= self.MAX_QUEUED:
            self.counters["dropped"] += 1
            return None
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if nbytes > self.index.budget:
            return None
        fut = self._writer.submit(self._write, token_ids, tensors, nbytes)
        self._pending.append(fut)
        return fut

    def _write(self, token_ids, tensors, nbytes) -> None:
        key = prefix_key(token_ids)
        self._refresh()
        with self._lock:
            victims = self.index.victims(nbytes, keep=key)
        self._evict(victims)
        try:
            size = write_snapshot(self._path(key), tensors, token_ids, self.fingerprint)
        except OSError as e:  # disk full, permissions, ...
            log.warning("kv cache: cannot write snapshot (%s); continuing without it", e)
            self.counters["errors"] += 1
            return
        with self._lock:
            self.index.add(DiskEntry(key, token_ids, size, time.time()))
        self.counters["writes"] += 1

    def flush(self) -> None:
        """Wait for the queued writes. A write that failed is a warning and an error count,
        never an exception here (graceful shutdown, ``generate``'s exit run through it)."""
        for f in list(self._pending):
            try:
                f.result()
            except Exception as e:  # noqa: BLE001 - a cache write never fails its caller
                log.warning("kv cache: a snapshot write failed (%s); continuing without it", e)
                self.counters["errors"] += 1
        self._pending = []

    def close(self) -> None:
        self.flush()
        self._writer.shutdown(wait=True)

    def stats(self) -> dict:
        return {"dir": str(self.dir), "read_only": self.read_only, "ignored": self.ignored,
                "files": len(self.index.entries), "bytes": self.index.total_bytes, "budget_bytes": self.index.budget,
                **self.counters}
