"""Disk prefix-cache bookkeeping: which snapshot files exist, their sizes, ages and hits;
eviction under a byte budget (age- and hit-aware). No tensors here."""
from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class DiskEntry:
    key: str
    token_ids: tuple[int, ...]
    nbytes: int
    last_used: float
    hits: int = 0

    def score(self, now: float, half_life_s: float) -> float:
        """Higher = keep. Recency decays by half every ``half_life_s``; each hit counts
        like one more recent use."""
        age = max(0.0, now - self.last_used)
        return (1.0 + self.hits) * 0.5 ** (age / half_life_s)


class DiskIndex:
    def __init__(self, budget_bytes: int, half_life_s: float = 3600.0):
        if budget_bytes < 0:
            raise ValueError("disk cache budget must be >= 0")
        self.budget, self.half_life = budget_bytes, half_life_s
        self.entries: dict[str, DiskEntry] = {}
        self.total_bytes = 0

    def add(self, entry: DiskEntry) -> None:
        old = self.entries.pop(entry.key, None)
        if old:
            self.total_bytes -= old.nbytes
        self.entries[entry.key] = entry
        self.total_bytes += entry.nbytes

    def remove(self, key: str) -> DiskEntry | None:
        e = self.entries.pop(key, None)
        if e:
            self.total_bytes -= e.nbytes
        return e

    def touch(self, key: str, now: float | None = None) -> None:
        e = self.entries[key]
        e.hits += 1
        e.last_used = time.time() if now is None else now

    def over_budget(self, incoming: int = 0) -> bool:
        return self.total_bytes + incoming > self.budget

    def victims(self, incoming: int = 0, now: float | None = None, keep: str | None = None) -> list[DiskEntry]:
        """Entries to delete (lowest score first) so that ``incoming`` more bytes fit."""
        now = time.time() if now is None else now
        order = sorted((e for e in self.entries.values() if e.key != keep), key=lambda e: e.score(now, self.half_life))
        out, total = [], self.total_bytes
        for e in order:
            if total + incoming <= self.budget:
                break
            out.append(e)
            total -= e.nbytes
        return out

    def longest_match(self, token_ids, boundaries) -> DiskEntry | None:
        best = None
        for e in self.entries.values():
            n = len(e.token_ids)
            if n in boundaries and (best is None or n > len(best.token_ids)) and tuple(token_ids[:n]) == e.token_ids:
                best = e
        return best
