"""KV Flash page table: logical KV chunks -> chunks of a bounded pool (plain Python).

Positions are grouped in chunks of ``chunk`` tokens. A logical chunk is *resident* (it
occupies a physical pool chunk), *paged* (its rows live in host memory) or absent (not
written yet). When a write needs a chunk and the pool is full, the policy picks the
least valuable unprotected resident chunk to page out. Protected: the first
``sink_chunks`` (attention sink), the ``tail_chunks`` most recent, and the chunks being
written. The pager only plans; the pool (kv_pool.py) moves the bytes.

One pool chunk is kept spare. A speculative forward (a DFlash verify block, which may be
rolled back) that enters a new chunk takes the spare instead of evicting at once: the
victim is chosen exactly as plain decoding would choose it, stays visible to the block's
queries before the new chunk's first position (``slot_until``), and is paged out only when
that position is committed; a rollback before it undoes the allocation. So speculative
and plain decoding see the same keys at every position.
"""
from __future__ import annotations

from dataclasses import dataclass

MIN_AUTO_POOL = 512


@dataclass(frozen=True)
class KvFlashConfig:
    """``pool``: tokens per attention layer, or "auto" (half the context, at least 512)."""

    pool: int | str
    chunk: int = 64
    policy: str = "lru"
    sink_chunks: int = 1
    tail_chunks: int = 4
    tau: int = 64          # score policy: re-select residency at every multiple of tau positions

    def __post_init__(self):
        if self.pool != "auto" and (not isinstance(self.pool, int) or self.pool < 1):
            raise ValueError(f"kvflash pool must be a token count or 'auto', got {self.pool!r}")
        if not isinstance(self.chunk, int) or self.chunk < 1:
            raise ValueError(f"kvflash chunk must be >= 1, got {self.chunk!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown KV Flash policy {self.policy!r} (use {', '.join(POLICIES)})")
        if not isinstance(self.tau, int) or self.tau < 1:
            raise ValueError(f"kvflash tau must be >= 1, got {self.tau!r}")

    def pool_tokens(self, max_ctx: int, budget_tokens: int | None = None) -> int:
        """Rounded up to whole chunks (256 tokens for auto), at least the minimum pool, at
        most the context rounded up to a chunk. ``auto``: ``budget_tokens`` (what free
        device memory holds) when known, else half the context."""
        least = (self.sink_chunks + self.tail_chunks + 3) * self.chunk
        cap = -(-max_ctx // self.chunk) * self.chunk
        if self.pool == "auto":
            want = budget_tokens if budget_tokens is not None else max_ctx // 2
            n = max(MIN_AUTO_POOL, -(-want // 256) * 256)
        else:
            n = self.pool
        n = -(-n // self.chunk) * self.chunk
        return max(least, min(n, cap))

    def new_pager(self, max_ctx: int, budget_tokens: int | None = None) -> "KvPager":
        return KvPager(self.pool_tokens(max_ctx, budget_tokens), self.chunk, sink_chunks=self.sink_chunks,
                       tail_chunks=self.tail_chunks, policy=self.policy)


@dataclass(frozen=True)
class Move:
    kind: str        # "out": save physical chunk to host and free it | "in": host -> physical chunk
    logical: int
    physical: int


class LruPolicy:
    """Evict the chunk written or paged in longest ago."""

    name = "lru"

    def __init__(self):
        self.last_use: dict[int, int] = {}
        self.clock = 0

    def touch(self, logical: int) -> None:
        self.clock += 1
        self.last_use[logical] = self.clock

    def forget(self, logical: int) -> None:
        self.last_use.pop(logical, None)

    def value(self, logical: int) -> float:
        return self.last_use.get(logical, 0)

    def state(self) -> tuple[list[tuple[int, int, float]], int]:
        """(chunk, last use, score) rows and the clock: what a snapshot needs to continue
        with the same eviction choices."""
        return [(c, u, 0.0) for c, u in sorted(self.last_use.items())], self.clock

    def load(self, rows: list[tuple[int, int, float]], clock: int) -> None:
        self.last_use = {c: u for c, u, _ in rows if u}
        self.clock = clock


class ScorePolicy(LruPolicy):
    """Evict the chunk recent queries attended to least (decayed attention mass; ties by
    recency). ``observe`` takes per-chunk mass from any scorer (attention during decode
    here; a drafter-based scorer can feed the same method)."""

    name = "score"

    def __init__(self, decay: float = 0.9):
        super().__init__()
        self.decay = decay
        self.score: dict[int, float] = {}

    def observe(self, mass: dict[int, float]) -> None:
        for c in self.score:
            self.score[c] *= self.decay
        for c, m in mass.items():
            self.score[c] = self.score.get(c, 0.0) + m

    def forget(self, logical: int) -> None:
        super().forget(logical)
        self.score.pop(logical, None)

    def value(self, logical: int) -> tuple[float, int]:
        # ties by recency: only the order of uses counts, which a sequence's forwards do not move
        return self.score.get(logical, 0.0), self.last_use.get(logical, 0)

    def state(self) -> tuple[list[tuple[int, int, float]], int]:
        rows = sorted(self.last_use.keys() | self.score.keys())
        return [(c, self.last_use.get(c, 0), self.score.get(c, 0.0)) for c in rows], self.clock

    def load(self, rows: list[tuple[int, int, float]], clock: int) -> None:
        super().load(rows, clock)
        self.score = {c: v for c, _, v in rows}


POLICIES = {"lru": LruPolicy, "score": ScorePolicy}


def score_room(pos: int, chunk: int, tau: int, capacity: int | None) -> int:
    """The score policy's limit on a speculative forward at ``pos`` (the most positions it may
    commit): up to the next multiple of ``tau`` (a re-selection: KvPool.prepare) and, where
    the next chunk's first position evicts (its index reaches ``capacity``, the chunks the pool
    holds; None: unknown, assume it does), up to that position. Plain decoding re-selects and
    evicts there with the state of every position before it; a block that stopped short of
    neither would choose with fewer positions observed, or commit rows computed before the
    choice."""
    room = tau - pos % tau
    if capacity is None or pos // chunk + 1 >= capacity:
        room = min(room, chunk - pos % chunk)
    return room


class KvPager:
    def __init__(self, pool_tokens: int, chunk: int = 64, *, sink_chunks: int = 1, tail_chunks: int = 4,
                 policy: str = "lru"):
        if chunk < 1 or pool_tokens % chunk:
            raise ValueError(f"KV Flash pool of {pool_tokens} tokens is not a multiple of the chunk ({chunk})")
        self.chunk, self.num_physical = chunk, pool_tokens // chunk
        self.sink, self.tail = sink_chunks, tail_chunks
        if self.num_physical < sink_chunks + tail_chunks + 3:
            raise ValueError(f"KV Flash pool of {pool_tokens} tokens is too small: at least "
                             f"{(sink_chunks + tail_chunks + 3) * chunk} (sink + tail + 2 + a spare, "
                             f"chunks of {chunk})")
        if policy not in POLICIES:
            raise ValueError(f"unknown KV Flash policy {policy!r} (use {', '.join(POLICIES)})")
        self.policy = POLICIES[policy]()
        self.reset()
        self.page_ins = self.page_outs = 0

    @property
    def pool_tokens(self) -> int:
        return self.num_physical * self.chunk

    @property
    def capacity(self) -> int:
        """Chunks resident outside a speculative step (one pool chunk stays spare)."""
        return self.num_physical - 1

    @property
    def max_new_chunks(self) -> int:
        """Most chunks one forward may need (the rest of the pool is sink, tail and spare)."""
        return max(1, self.capacity - self.sink - self.tail - 1)

    def reset(self) -> None:
        self.resident: dict[int, int] = {}   # logical -> physical
        self.paged: set[int] = set()
        self.free = list(range(self.num_physical - 1, -1, -1))  # pop() yields 0, 1, 2, ...
        self.num_chunks = 0                  # logical chunks that hold written positions
        self.pending: tuple[int, int] | None = None  # (victim, position it leaves at): deferred eviction
        self.epoch = getattr(self, "epoch", 0) + 1
        self.policy = type(self.policy)()

    # --- planning -------------------------------------------------------------------------
    def plan_write(self, start: int, end: int, speculative: bool = False) -> list[Move]:
        """Make every chunk holding positions [start, end) resident. Returns the moves to
        perform in order (page-outs before the page-ins / fresh uses of their slots).
        ``speculative``: the positions may be rolled back (see the module docstring)."""
        first, last = start // self.chunk, (end - 1) // self.chunk
        need = list(range(first, last + 1))
        if len(need) > self.max_new_chunks + 1:
            raise ValueError(f"a forward of {end - start} tokens does not fit a KV Flash pool of "
                             f"{self.pool_tokens} (use a smaller prefill chunk)")
        top = max(self.num_chunks, last + 1)
        protected = set(range(self.sink)) | set(range(top - self.tail, top)) | set(need)
        moves, changed = [], False
        for c in need:
            if c in self.resident:
                self.policy.touch(c)
                continue
            changed = True
            if len(self.resident) >= self.capacity:
                if speculative and self.pending is None and self.free:
                    self.pending = (self._victim(protected), c * self.chunk)
                else:
                    moves.append(self._evict(protected))
            moves += self._place(c)
        self.num_chunks = top
        if changed:
            self.epoch += 1  # the slot -> position map changed: masks must be rebuilt
        return moves

    def _place(self, c: int) -> list[Move]:
        """Put chunk ``c`` in a free pool chunk; a page-in move if it was paged out."""
        phys = self.free.pop()
        self.resident[c] = phys
        self.policy.touch(c)
        if c not in self.paged:
            return []
        self.paged.discard(c)
        self.page_ins += 1
        return [Move("in", c, phys)]

    def _victim(self, protected: set[int]) -> int:
        pending = self.pending[0] if self.pending is not None else None
        candidates = [c for c in self.resident if c not in protected and c != pending]
        if not candidates:
            raise ValueError("KV Flash pool exhausted: every resident chunk is protected")
        return min(candidates, key=lambda c: (self.policy.value(c), c))

    def _evict(self, protected: set[int], victim: int | None = None) -> Move:
        victim = self._victim(protected) if victim is None else victim
        phys = self.resident.pop(victim)
        self.paged.add(victim)
        self.free.append(phys)
        self.page_outs += 1
        return Move("out", victim, phys)

    def plan_reselect(self, scores: dict[int, float]) -> list[Move]:
        """Make the protected chunks plus the highest-scoring others resident (as many as
        the pool holds); returns page-outs followed by page-ins."""
        written = self.resident.keys() | self.paged
        top = self.num_chunks
        protected = (set(range(self.sink)) | set(range(top - self.tail, top))) & written
        rest = sorted(written - protected, key=lambda c: (-scores.get(c, 0.0), -c))
        want = protected | set(rest[:max(0, self.capacity - len(protected))])
        moves = [self._evict(set(), c) for c in sorted(self.resident.keys() - want, key=lambda c: scores.get(c, 0.0))]
        for c in sorted(want - self.resident.keys()):
            moves += self._place(c)
        if moves:
            self.epoch += 1
        return moves

    def table(self) -> tuple[list[tuple[int, int]], list[int]]:
        """(resident (chunk, physical) pairs oldest-used first, free list): everything a
        snapshot needs to continue exactly as if never interrupted (lru)."""
        order = sorted(self.resident, key=lambda c: (self.policy.value(c), c))
        return [(c, self.resident[c]) for c in order], list(self.free)

    def adopt(self, num_chunks: int, table: list[tuple[int, int]], free: list[int] | None = None) -> None:
        """Reset to ``num_chunks`` written chunks with ``table``'s (chunk, physical) pairs
        resident (touched in that order), the others paged out (snapshot restore); ``free``
        (the free list, in order) must hold exactly the other physical chunks."""
        rest = self.check_table(num_chunks, table, free)
        self.reset()
        self.resident = dict(table)
        self.free = rest
        self.paged = set(range(num_chunks)) - self.resident.keys()
        self.num_chunks = num_chunks
        for c, _ in table:
            self.policy.touch(c)

    def check_table(self, num_chunks: int, table: list[tuple[int, int]], free: list[int] | None = None) -> list[int]:
        """Validate a page table from a snapshot against this pool (ValueError if it does
        not fit); returns the free list it implies."""
        chunks, phys = [c for c, _ in table], [p for _, p in table]
        rest = sorted(set(range(self.num_physical)) - set(phys), reverse=True) if free is None else list(free)
        if (len(table) > self.capacity or len(set(chunks)) != len(chunks) or len(set(phys)) != len(phys)
                or any(not 0 <= c < num_chunks for c in chunks)
                or sorted(phys + rest) != list(range(self.num_physical))):
            raise ValueError(f"KV Flash snapshot: page table {table[:8]} does not fit {num_chunks} chunks "
                             f"in a pool of {self.num_physical}")
        return rest

    def piece(self, pos: int, n: int) -> int:
        """Length (<= n) of a forward starting at ``pos``. Once the pool can be full,
        forwards stop at chunk boundaries, so each eviction happens at the first position
        of the chunk that needs the room, as in decoding: every position then sees the same
        keys however a prompt is split into forwards (prefix hit == miss)."""
        boundary = max(self.capacity * self.chunk, (pos // self.chunk + 1) * self.chunk)
        return max(1, boundary - pos) if pos + n > boundary else n

    def settle(self, length: int) -> list[Move]:
        """End of a speculative step with ``length`` positions kept: a deferred eviction
        happens now if its position was committed, else it is dropped (the new chunk goes
        with the truncation). Returns the page-out to perform, if any."""
        if self.pending is None:
            return []
        (victim, at), self.pending = self.pending, None
        self.epoch += 1
        if length > at:
            return [self._evict(set(), victim)]
        return []

    def slot_until(self) -> list[int] | None:
        """Per pool slot, the first query position that may no longer see it (a deferred
        victim's slots); None when nothing is pending."""
        if self.pending is None:
            return None
        victim, at = self.pending
        C, phys = self.chunk, self.resident[victim]
        out = [1 << 62] * self.pool_tokens
        out[phys * C:(phys + 1) * C] = [at] * C
        return out

    def truncate(self, length: int) -> None:
        """Forget chunks that hold no position below ``length`` (rollback, reset)."""
        keep = -(-length // self.chunk)
        for c in [c for c in self.resident if c >= keep]:
            self.free.append(self.resident.pop(c))
            self.policy.forget(c)
        for c in [c for c in self.paged if c >= keep]:
            self.paged.discard(c)
            self.policy.forget(c)
        if keep < self.num_chunks:
            self.num_chunks = keep
            self.epoch += 1

    # --- views ------------------------------------------------------------------------------
    def slots(self, start: int, end: int) -> list[int]:
        """Physical slot of each position in [start, end) (all resident)."""
        C = self.chunk
        return [self.resident[p // C] * C + p % C for p in range(start, end)]

    def slot_positions(self) -> list[int]:
        """Logical position held by each pool slot, -1 for a free slot."""
        C = self.chunk
        out = [-1] * self.pool_tokens
        for c, phys in self.resident.items():
            out[phys * C:(phys + 1) * C] = range(c * C, (c + 1) * C)
        return out

    def is_identity(self) -> bool:
        return not self.paged and all(c == p for c, p in self.resident.items())

    def stats(self) -> dict:
        return {"pool_tokens": self.pool_tokens, "chunk": self.chunk, "resident_chunks": len(self.resident),
                "paged_chunks": len(self.paged), "free_chunks": len(self.free), "page_ins": self.page_ins,
                "page_outs": self.page_outs, "policy": self.policy.name}

    def check_integrity(self) -> None:
        """resident + free == pool chunks, no physical chunk twice, nothing both resident and
        paged, every written chunk accounted for."""
        phys = list(self.resident.values()) + self.free
        assert sorted(phys) == list(range(self.num_physical)), ("physical chunks", self.resident, self.free)
        assert not (self.paged & self.resident.keys()), "chunk both resident and paged"
        assert self.paged | self.resident.keys() <= set(range(self.num_chunks)), "chunk beyond the written length"
