"""Per-forward context shared by all layers of one stage forward."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class ForwardContext:
    """Positions ``[start, start + length)`` are being written this forward.

    ``cos``/``sin`` are the rotary rows for those positions; ``mask`` is built lazily and
    shared by every full-attention layer of the stage (it only depends on positions).
    ``record`` asks recurrent layers to keep what a rollback replay needs.
    """

    start: int
    length: int
    cos: torch.Tensor | None
    sin: torch.Tensor | None
    record: bool = False
    # KV Flash: physical pool slot of each written position (T,), and the logical position
    # held by each pool slot (P,), -1 = free or paged out; None = plain position-addressed KV
    slots: torch.Tensor | None = None
    slot_pos: torch.Tensor | None = None
    slot_until: torch.Tensor | None = None  # (P,): first query position that no longer sees a slot
    pool_chunk: int = 0                    # ... the pool's chunk (tokens)
    # the score policy: (T, pool chunks) int64, the attention each row paid to each pool chunk,
    # in fixed point (attention.MASS_ONE), over layers and heads (a key counted in the chunk its
    # position occupies once committed: a tree row's ancestors at their depths); and each
    # attention layer's rotated queries of every row, (1, T, nh, hd)
    attn_mass: torch.Tensor | None = None
    last_q: list | None = None
    # PFlash scoring: (L, end) float32, the running max over attention layers and heads of
    # the attention the last L rows of this forward pay to each position
    tail_attn: torch.Tensor | None = None
    # continuous batching: row b is one decode token of the sequence in KV lane lanes[b], at
    # positions[b] (start/length then only give the row count; cos/sin are per row)
    lanes: tuple[int, ...] | None = None
    positions: tuple[int, ...] | None = None
    # the rotary rows of sliding-window layers where they have their own base (Gemma)
    cos_local: torch.Tensor | None = None
    sin_local: torch.Tensor | None = None
    # Gemma 4 E2B / E4B: per-layer inputs (B, T, layers, size) by global layer index, and the
    # KV state each "store" layer leaves for the KV-shared layers after it, by layer kind
    per_layer: torch.Tensor | None = None
    shared_kv: dict = field(default_factory=dict)
    # the K/V rows of this forward that a previous stage's source layers wrote, by layer kind
    # ((B, nkv, T, hd) each), for this stage's mirrors of them
    carry_kv: dict = field(default_factory=dict)
    # DDTree verify: row t's parent row (-1: the root, after the cached prefix), as a tuple
    # and a (T,) long tensor; row t sits at position start + depth(t) (cos/sin are per row)
    # and attends to the cache before ``start`` and to its ancestors, itself included
    tree: tuple[int, ...] | None = None
    tree_parents: torch.Tensor | None = None
    # DDTree verifies in a rows forward: {lane: its rows' parents within its block} (each such
    # lane's rows are one tree, at cache rows from its first row's position on; cos/sin already
    # at each row's depth) and every row's parent row in the whole forward (B,), -1 for none
    row_trees: dict | None = None
    row_parents: torch.Tensor | None = None
    # KV Flash pools in a rows forward: each slot's adjacent rows (b, e), whose ``block(b, e)``
    # its pool prepared (slots, visible keys) as for that sequence's own block forward
    row_pools: tuple[tuple[int, int], ...] | None = None
    # ... and their score policy: (rows, pool chunks) int64, a slot's rows its block's ``attn_mass``
    rows_mass: torch.Tensor | None = None
    # a CUDA-graph step (runtime.cuda_graph): the rows' positions as a (T,) device tensor,
    # and how many cache rows the step attends over (masked past each row's position)
    graph_pos: torch.Tensor | None = None
    graph_span: int = 0
    # a CUDA-graph step over decode rows of several slots: row b's slot (ascending), as a tuple
    # and a (T,) device tensor; the layers' states are then the KV banks of all slots
    graph_lanes: tuple[int, ...] | None = None
    graph_lane_ids: torch.Tensor | None = None
    _masks: dict = field(default_factory=dict)

    def rope(self, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.cos_local, self.sin_local) if local else (self.cos, self.sin)

    def rope_f32(self, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin in fp32 (what the native attention step reads), converted once per forward
        rather than once per layer."""
        key = ("rope_f32", local)
        got = self._masks.get(key)
        if got is None:
            cos, sin = self.rope(local)
            got = self._masks[key] = (cos.float().contiguous(), sin.float().contiguous())
        return got

    def block(self, b: int, e: int) -> "ForwardContext":
        """Rows [b, e) of a rows forward (one slot's adjacent rows) as that sequence's own
        block forward from ``positions[b]``: a causal block, or its DDTree. Made once per
        forward (every layer reads the same one, with the masks it caches)."""
        key = ("block", b, e)
        got = self._masks.get(key)
        if got is None:
            local = self.cos_local is not None
            tree = (self.row_trees or {}).get(self.lanes[b])
            got = self._masks[key] = ForwardContext(
                self.positions[b], e - b, self.cos[b:e], self.sin[b:e],
                cos_local=self.cos_local[b:e] if local else None, sin_local=self.sin_local[b:e] if local else None,
                tree=tree, tree_parents=None if tree is None else torch.tensor(tree, dtype=torch.long))
        return got

    def rows_args(self, window: int | None = None) -> dict:
        """The native rows ops' arguments past lanes and positions: with KV Flash pools each
        row's write slot and visible keys (``pool_args`` of its slot's block, one row each;
        a tree's rows see their paths in their key lists), else the ``tree`` ({} without)."""
        if self.row_pools is None:
            return {} if self.row_parents is None else {"tree": self.row_parents}
        key = ("rows_pool_args", window)
        got = self._masks.get(key)
        if got is None:
            parts = [self.block(b, e).pool_args(window) for b, e in self.row_pools]
            width = max(p["key_rows"].shape[1] for p in parts)
            got = self._masks[key] = {
                "write_rows": torch.cat([p["write_rows"] for p in parts]),
                "key_rows": torch.cat([F.pad(p["key_rows"], (0, width - p["key_rows"].shape[1])) for p in parts]),
                "key_counts": torch.cat([p["key_counts"] for p in parts])}
            if self.rows_mass is not None:   # the score policy: each listed key's chunk (``mass_keys``)
                keys = [self.block(b, e).mass_keys(window) for b, e in self.row_pools]
                got["mass_keys"] = torch.cat([F.pad(k, (0, width - k.shape[1])) for k in keys])
        return got

    def row_writes(self) -> list[int]:
        """The cache row (of its slot's lane) where each row of a rows forward writes: its
        position, or its KV Flash pool slot."""
        if self.row_pools is None:
            return list(self.positions)
        return self.rows_args()["write_rows"].tolist()

    @property
    def end(self) -> int:
        return self.start + self.length

    def _pool_view(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """KV Flash: (ok (T, P), key_pos (T, P)) on the CPU: whether row t may attend to pool
        slot p, and the logical position of that key. A slot may be attended when it holds a
        position before the row's (and inside the window), free / paged-out slots never; a
        deferred eviction's slots are gone for rows from its position on. A tree row (DDTree)
        sits at start + its depth and sees the cache before ``start`` and its ancestors' rows
        (written at start + their row index, logically at start + their depth)."""
        key = ("pool_view", window)
        got = self._masks.get(key)
        if got is not None:
            return got
        pos = self.slot_pos.cpu()[None, :]                     # (1, P)
        T = self.length
        if self.tree is None:
            q = torch.arange(self.start, self.end)[:, None]    # (T, 1) the rows' positions
            key_pos = pos.expand(T, -1)
            ok = (pos >= 0) & (pos <= q)
        else:
            depth = torch.tensor(tree_depths(self.tree))
            anc = torch.zeros(T, T, dtype=torch.bool)
            for t, par in enumerate(self.tree):
                if par >= 0:
                    anc[t] = anc[par]
                anc[t, t] = True
            q = (self.start + depth)[:, None]
            inside = (pos >= self.start) & (pos < self.end)    # the block's rows
            row = (pos - self.start).clamp(0, T - 1)[0]        # (P,) block row of each slot
            key_pos = torch.where(inside, self.start + depth[row][None, :], pos).expand(T, -1)
            ok = ((pos >= 0) & (pos < self.start)) | (inside & anc[:, row])
        if self.slot_until is not None:
            ok = ok & (q < self.slot_until.cpu()[None, :])
        if window is not None:
            ok = ok & (key_pos > q - window)
        got = self._masks[key] = (ok, key_pos)
        return got

    def pool_mask(self, device: torch.device, window: int | None = None) -> tuple[int, torch.Tensor | None]:
        """(n, mask): attend to pool slots [0, n) under the bool (T, n) mask (``_pool_view``).
        A single query whose valid slots are exactly [0, n) gets no mask (the fast unmasked
        path, as without KV Flash)."""
        key = ("pool", str(device), window)
        m = self._masks.get(key)
        if m is None:
            ok = self._pool_view(window)[0]
            n = int(ok[0].sum())
            if self.length == 1 and window is None and bool(ok[0, :n].all()):
                m = (n, None)
            else:
                m = (ok.shape[1], ok.to(device))
            self._masks[key] = m
        return m

    def pool_keys(self, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """KV Flash for the native attention step: (key_rows (T, L), key_counts (T,)), each
        row's visible pool slots (``_pool_view``) in logical-position order, so the step
        reads the same keys in the same order as over position-addressed KV (a tree row: as
        the plain step of its path)."""
        key = ("pool_keys", window)
        got = self._masks.get(key)
        if got is None:
            ok, key_pos = self._pool_view(window)
            P = ok.shape[1]
            counts = ok.sum(1)
            L = max(1, int(counts.max()))
            # visible slots first, by logical position (unique among a row's visible keys)
            order = torch.where(ok, key_pos, 1 << 62).argsort(dim=1, stable=True)[:, :L]
            got = self._masks[key] = (order.clamp(max=P - 1), counts)
        return got

    def mass_keys(self, window: int | None = None) -> torch.Tensor:
        """The score policy's (T, L) int64, as ``pool_keys``' key rows: the pool chunk of each
        listed key's position once committed (its slot's chunk; a block row's, which a tree row
        sees at its depth, the chunk of the slot that position is written to), so a row's masses
        per chunk are those of the plain decode step at its position."""
        key = ("mass_keys", window)
        got = self._masks.get(key)
        if got is None:
            rows, _ = self.pool_keys(window)
            got = self._masks[key] = self._chunk_of(rows, self._pool_view(window)[1].gather(1, rows))
        return got

    def slot_mass_keys(self, window: int | None = None) -> torch.Tensor:
        """``mass_keys`` for every pool slot (T, P): the aten path's masses, in slot space."""
        key = ("slot_mass_keys", window)
        got = self._masks.get(key)
        if got is None:
            key_pos = self._pool_view(window)[1]
            got = self._masks[key] = self._chunk_of(torch.arange(key_pos.shape[1]).expand_as(key_pos), key_pos)
        return got

    def _chunk_of(self, slots: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        block = key_pos >= self.start
        rows = (key_pos - self.start).clamp(0, self.length - 1)
        return torch.where(block, self.slots.cpu()[rows], slots) // self.pool_chunk

    def pool_args(self, window: int | None = None) -> dict:
        """The native attention ops' KV Flash arguments (write_rows, key_rows, key_counts),
        the same for every layer of a window (``pool_keys``)."""
        key = ("pool_args", window)
        got = self._masks.get(key)
        if got is None:
            rows, counts = self.pool_keys(window)
            got = self._masks[key] = {"write_rows": self.slots.cpu(), "key_rows": rows, "key_counts": counts}
        return got

    def graph_mask(self, window: int | None = None) -> torch.Tensor:
        """A CUDA-graph step's bool (T, graph_span) mask: for each row the keys at or before
        its position (and inside the window), computed on the device from the positions."""
        key = ("graph", window)
        m = self._masks.get(key)
        if m is None:
            k_pos = torch.arange(self.graph_span, device=self.graph_pos.device)[None, :]
            q_pos = self.graph_pos[:, None]
            m = k_pos <= q_pos
            if window is not None:
                m = m & (k_pos > q_pos - window)
            self._masks[key] = m
        return m

    def causal_mask(self, device: torch.device, window: int | None = None) -> torch.Tensor | None:
        """Bool (T, end) mask, True = may attend; None when plain full attention over the
        prefix is already correct (a single query, no window)."""
        if self.length == 1 and window is None:
            return None
        key = (str(device), window)
        m = self._masks.get(key)
        if m is None and self.tree is not None:
            m = self._masks[key] = self._tree_mask(device, window)
        if m is None:
            q_pos = torch.arange(self.start, self.end, device=device)[:, None]
            k_pos = torch.arange(0, self.end, device=device)[None, :]
            m = k_pos <= q_pos
            if window is not None:
                m = m & (k_pos > q_pos - window)
            self._masks[key] = m
        return m

    def _tree_mask(self, device: torch.device, window: int | None) -> torch.Tensor:
        """(T, end): the cached prefix, then each row's ancestors and itself."""
        T, depth = self.length, tree_depths(self.tree)
        anc = torch.zeros(T, T, dtype=torch.bool)
        for t, p in enumerate(self.tree):
            if p >= 0:
                anc[t] = anc[p]
            anc[t, t] = True
        q_pos = self.start + torch.tensor(depth)[:, None]
        k_pos = torch.cat([torch.arange(self.start), self.start + torch.tensor(depth)])[None, :]
        m = torch.cat([torch.ones(T, self.start, dtype=torch.bool), anc], dim=1)
        if window is not None:
            m = m & (k_pos > q_pos - window)
        return m.to(device)


def runs(keys: list) -> list[tuple[int, int]]:
    """[b, e) spans of adjacent equal keys (a rows forward's rows of one slot or one state)."""
    out, b = [], 0
    while b < len(keys):
        e = b + 1
        while e < len(keys) and keys[e] == keys[b]:
            e += 1
        out.append((b, e))
        b = e
    return out


def tree_depths(parents) -> list[int]:
    """The depth of each row of a tree given by parent rows (-1: a root, depth 0)."""
    depth: list[int] = []
    for t, p in enumerate(parents):
        if not -1 <= p < t:
            raise ValueError(f"tree row {t}: parent {p} must be an earlier row or -1")
        depth.append(0 if p < 0 else depth[p] + 1)
    return depth
