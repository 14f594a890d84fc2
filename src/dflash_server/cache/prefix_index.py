"""Prefix-cache bookkeeping (no tensors): which token prefixes have a snapshot, in which
slot, how many bytes; LRU eviction by slot count and byte budget.

Keys hash the token ids, but a hit is always confirmed against the stored ids, never by
hash alone.
"""
from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np


def prefix_key(token_ids) -> str:
    """blake2b-128 of the length (8 bytes) and the ids (4 bytes each, little-endian)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(len(token_ids).to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype="<i4").tobytes())  # (an id outside int32: OverflowError)
    return h.hexdigest()


@dataclass
class PrefixEntry:
    key: str
    token_ids: tuple[int, ...]
    slot: int
    nbytes: int
    hits: int = 0
    meta: dict = field(default_factory=dict)

    @property
    def length(self) -> int:
        return len(self.token_ids)


class PrefixIndex:
    """LRU over entries; ``max_slots`` 0 disables caching; ``max_bytes`` None = no budget."""

    def __init__(self, max_slots: int, max_bytes: int | None = None):
        if max_slots < 0 or (max_bytes is not None and max_bytes < 0):
            raise ValueError("prefix cache limits must be >= 0")
        self.max_slots, self.max_bytes = max_slots, max_bytes
        self.entries: OrderedDict[str, PrefixEntry] = OrderedDict()  # oldest first
        self.total_bytes = 0
        self.hits = self.misses = self.evictions = 0
        self.tokens_saved = 0
        self._slot_ids = itertools.count()

    @property
    def enabled(self) -> bool:
        return self.max_slots > 0

    def lookup(self, token_ids, boundaries) -> PrefixEntry | None:
        """Longest cached prefix ``token_ids[:b]`` over ``boundaries`` (confirmed by ids);
        marks it most recently used."""
        # only boundaries at the length of some entry can hit: a prompt of thousands of
        # end-of-turn ids has thousands of boundaries, and hashing each prefix was quadratic
        lengths = {e.length for e in self.entries.values()}
        for b in sorted(set(boundaries) & lengths, reverse=True):
            if b <= 0 or b > len(token_ids):
                continue
            e = self.entries.get(prefix_key(token_ids[:b]))
            if e is not None and e.token_ids == tuple(token_ids[:b]):
                self.entries.move_to_end(e.key)
                e.hits += 1
                self.hits += 1
                self.tokens_saved += e.length
                return e
        self.misses += 1
        return None

    def contains(self, token_ids) -> bool:
        e = self.entries.get(prefix_key(token_ids))
        return e is not None and e.token_ids == tuple(token_ids)

    def fits(self, nbytes: int) -> bool:
        return self.enabled and (self.max_bytes is None or nbytes <= self.max_bytes)

    def new_slot(self) -> int:
        return next(self._slot_ids)

    def insert(self, token_ids, slot: int, nbytes: int, meta: dict | None = None) -> list[PrefixEntry]:
        """Add an entry (replacing one with the same ids); returns the entries evicted to
        make room, whose slots the caller must free (the replaced one included)."""
        token_ids = tuple(token_ids)
        key = prefix_key(token_ids)
        evicted = []
        if key in self.entries:
            old = self.entries.pop(key)
            self.total_bytes -= old.nbytes
            evicted.append(old)
        self.entries[key] = PrefixEntry(key, token_ids, slot, nbytes, meta=dict(meta or {}))
        self.total_bytes += nbytes
        while self.entries and (len(self.entries) > self.max_slots or
                                (self.max_bytes is not None and self.total_bytes > self.max_bytes)):
            _, old = self.entries.popitem(last=False)
            self.total_bytes -= old.nbytes
            self.evictions += 1
            evicted.append(old)
        return evicted

    def remove(self, key: str) -> PrefixEntry | None:
        e = self.entries.pop(key, None)
        if e is not None:
            self.total_bytes -= e.nbytes
        return e

    def stats(self) -> dict:
        return {"slots": len(self.entries), "max_slots": self.max_slots, "bytes": self.total_bytes,
                "max_bytes": self.max_bytes, "hits": self.hits, "misses": self.misses,
                "evictions": self.evictions, "tokens_saved": self.tokens_saved}
