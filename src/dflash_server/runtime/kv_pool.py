"""KvPool: one stage's KV Flash pool, the tensor side of the page table (kv_pager.py).

Moves chunk rows between the pool (the attention layers' K/V tensors, allocated at pool
size) and host memory, gives each forward its write slots and the slot -> position map
(cached per residency epoch), feeds the score policy, and re-selects residency at every
multiple of ``tau`` positions by scoring every chunk (resident or paged out) against the
latest queries.

The score policy's state depends only on the committed tokens, not on which forwards
computed them (plain decode rows, verify blocks, trees, rows batched with other sequences):
an observed forward leaves each row's attention per chunk (exact fixed-point sums: on the
native CPU attention ops the same bits for a row in any forward; aten's, on other devices or
without the kernels, come from batched matmuls whose rounding may depend on the rows) and its
queries *pending*; a row is observed, one by one in
position order as a plain decode step would be, only once its position is committed (the
next forward's start, a rollback's length, a tree's accepted path), and dropped if rolled
back. Re-selection and eviction read committed state only, and the engine keeps speculative
blocks from committing past a position where plain decoding would re-select or evict
(``spec_room``), so a drafted sequence pages as the same sequence decoded plainly would.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layers.attention import MASS_ONE, SCORE_QUERY_ROWS
from .kv_pager import KvPager, Move, score_room

# the re-selections at multiples of tau score with the latest this many committed rows' queries
# (the one on a prompt's tail with all its rows, up to SCORE_QUERY_ROWS): at 4096 tokens, default
# model, a re-selection cost 33 / 43 / 75 ms with 1 / 8 / 32 rows (measured in one process)
SCORE_DECODE_ROWS = 8
SCORE_TOP = 4        # re-selection: a chunk's score is the mean of its largest attention masses
SCORE_NEXT = 0.5     # ... and at least this share of its predecessor's


@dataclass
class _Observed:
    """An observed forward's rows, waiting for their positions to be committed."""
    start: int
    rows: list[int]                 # the forward's rows in position order (start, start + 1, ...)
    mass: torch.Tensor | None       # (T, pool chunks) int64: each row's attention per physical chunk
    chunks: list[int]               # physical chunk -> logical chunk at the forward (-1: none)
    queries: list[torch.Tensor]     # per attention layer (1, T, nh, hd)


def merge_stats(stats: list[dict]) -> dict:
    """Several pools' stats as one: counts summed, the rest (policy) from the first."""
    return {k: sum(s[k] for s in stats) if isinstance(v, int) else v for k, v in stats[0].items()}


class KvPool:
    def __init__(self, pager: KvPager, states: list, device: torch.device, tau: int = 64):
        self.pager, self.device, self.tau = pager, device, tau
        self.states = [s for s in states if s.kind == "kv"]   # one per attention layer, in order
        self.host: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # paged-out chunks
        self._slot_pos: tuple[int, torch.Tensor] | None = None
        self.pending: list[_Observed] = []
        # the latest committed rows' queries (at most SCORE_QUERY_ROWS), in pieces: per piece one
        # (1, R, nh, hd) per attention layer
        self.recent: list[list[torch.Tensor]] = []
        self.due = tau          # the position of the next re-selection (a multiple of tau)
        self.reselects = 0

    @property
    def scoring(self) -> bool:
        return self.pager.policy.name == "score"

    # --- moving bytes ---------------------------------------------------------------------
    def apply(self, moves: list[Move]) -> None:
        C = self.pager.chunk
        for m in moves:
            rows = slice(m.physical * C, (m.physical + 1) * C)
            if m.kind == "out":
                self.host[m.logical] = [(s.k[:, :, rows].to("cpu", copy=True), s.v[:, :, rows].to("cpu", copy=True))
                                        for s in self.states]
            else:
                for s, (k, v) in zip(self.states, self.host.pop(m.logical)):
                    s.k[:, :, rows] = k.to(self.device)
                    s.v[:, :, rows] = v.to(self.device)

    def prepare(self, start: int, end: int, ctx, speculative: bool, observe: bool = True) -> None:
        """Make positions [start, end) resident and fill ``ctx`` for slot-space attention.
        ``speculative``: a verify block that may be rolled back. Positions before ``start``
        are committed (pending observations there are taken, later ones dropped).
        ``observe``: the score policy re-selects before this forward when due and observes its
        attention and queries; False for a prompt's body (Pipeline.prefill_steps), which then
        does neither, so where the body's forwards begin and end (the chunk size, a step's
        token budget beside other sequences, a prefix-cache hit inside it) cannot move what
        the policy chooses, and a long prompt is not re-scored every ``tau`` tokens."""
        pager = self.pager
        if self.scoring:
            self.commit(start)
            if observe and start >= self.due:
                if self.recent:
                    self.apply(pager.settle(start))
                    self.reselect(start, SCORE_DECODE_ROWS)
                else:
                    self.due = (start // self.tau + 1) * self.tau
        self.apply(pager.plan_write(start, end, speculative))
        ctx.slots = torch.tensor(pager.slots(start, end), device=self.device)
        if self._slot_pos is None or self._slot_pos[0] != pager.epoch:
            until = pager.slot_until()
            self._slot_pos = (pager.epoch, torch.tensor(pager.slot_positions(), device=self.device),
                              torch.tensor(until, device=self.device) if until is not None else None)
        ctx.slot_pos, ctx.slot_until = self._slot_pos[1], self._slot_pos[2]
        ctx.pool_chunk = pager.chunk
        if self.scoring and observe:
            ctx.last_q = []
            ctx.attn_mass = torch.zeros(end - start, pager.num_physical, dtype=torch.int64)

    def finish(self, ctx) -> None:
        """After the forward: its rows' masses and queries wait for their positions to be
        committed (``commit``)."""
        if ctx.last_q is None:
            return
        chunks = [-1] * self.pager.num_physical
        for c, p in self.pager.resident.items():
            chunks[p] = c
        self.pending.append(_Observed(ctx.start, list(range(ctx.length)), ctx.attn_mass, chunks, list(ctx.last_q)))

    def keep_path(self, path: list[int]) -> None:
        """After a tree forward: its rows ``path`` (root first) hold the committed positions
        from the tree's start on; the other rows are dropped."""
        if self.pending:
            self.pending[-1].rows = list(path)

    def commit(self, length: int) -> None:
        """Observe the pending rows at positions before ``length``, one by one in position
        order (each as a plain decode step's forward would: ScorePolicy.observe), their queries
        joining the latest committed ones; drop the rest."""
        policy = self.pager.policy
        for rec in self.pending:
            keep = [r for k, r in enumerate(rec.rows) if rec.start + k < length]
            if not keep:
                continue
            if rec.mass is not None:
                for row in rec.mass[keep].tolist():
                    policy.observe({rec.chunks[p]: m / MASS_ONE for p, m in enumerate(row) if m and rec.chunks[p] >= 0})
            if rec.queries:   # (a forward kept whole, e.g. a decode row: its tensors as they are)
                whole = keep == list(range(rec.queries[0].shape[1]))
                self.recent.append(rec.queries if whole else [q[:, keep] for q in rec.queries])
                while len(self.recent) > 1 and \
                        sum(p[0].shape[1] for p in self.recent[1:]) >= SCORE_QUERY_ROWS:
                    self.recent.pop(0)
        self.pending.clear()

    @property
    def last_q(self) -> list[torch.Tensor] | None:
        """Per attention layer, the latest committed rows' queries (1, R <= SCORE_QUERY_ROWS,
        nh, hd), or None before any."""
        if not self.recent or not self.recent[0]:
            return None
        if len(self.recent) > 1:
            self.recent = [[torch.cat(qs, dim=1) for qs in zip(*self.recent)]]
        if self.recent[0][0].shape[1] > SCORE_QUERY_ROWS:
            self.recent = [[q[:, -SCORE_QUERY_ROWS:] for q in self.recent[0]]]
        return self.recent[0]

    @last_q.setter
    def last_q(self, queries: list[torch.Tensor] | None) -> None:
        self.recent = [list(queries)] if queries else []

    def spec_room(self, pos: int) -> int:
        """The policy's limit on what a speculative forward at ``pos`` may commit (a verify
        block's rows, a tree's depth): with the score policy no further than the next
        re-selection or eviction (score_room), else none (the stage's ``max_spec_rows`` bounds
        the rows)."""
        return score_room(pos, self.pager.chunk, self.tau, self.pager.capacity) if self.scoring else 1 << 30

    # --- re-selection ---------------------------------------------------------------------
    @torch.inference_mode()
    def chunk_scores(self, length: int, rows: int = SCORE_QUERY_ROWS) -> dict[int, float]:
        """How strongly the latest ``rows`` committed queries attend to every written chunk
        (resident or paged): full attention over the whole context, once per tau.

        A chunk's score is the mean of its SCORE_TOP largest attention masses over every
        (layer, head, query row): the few heads that retrieve decide, not the many that look
        at the sink and the recent tokens (a sum drowns them; one maximum is noisy). A chunk
        right after a strong one inherits SCORE_NEXT of its score, since what a passage says
        about the name a query looks for usually follows the name (measured on the retrieval
        cases of benchmarks/kvflash.py and 20 others at pool 512, where 2 chunks are left
        after the sink and the tail: the answer's chunks are the chosen ones in 27 of 30
        cases, against 19 of 30 for the sum over layers of each layer's maximum)."""
        pager, C = self.pager, self.pager.chunk
        chunks = sorted(pager.resident.keys() | pager.paged)
        last_q = self.last_q
        if not chunks or not last_q:
            return {}
        last_q = [q[:, -rows:] for q in last_q]
        # keys in one tensor per layer: the resident chunks gathered from the pool in one index,
        # then the paged ones; columns in that order, scores put back in chunk order at the end
        resident = [c for c in chunks if c in pager.resident]
        paged = [c for c in chunks if c not in pager.resident]
        order = resident + paged
        slots = torch.tensor([pager.resident[c] * C + i for c in resident for i in range(C)], dtype=torch.long)
        pos = (torch.tensor(order)[:, None] * C + torch.arange(C)).flatten()
        valid = pos < length
        keep = None if bool(valid.all()) else valid
        best = torch.empty(0, len(order))
        for j, (s, q) in enumerate(zip(self.states, last_q)):
            parts = [s.k[:, :, slots.to(s.k.device)].cpu()] if resident else []
            parts += [self.host[c][j][0] for c in paged]
            k = torch.cat(parts, dim=2).float()              # (B, nkv, N, hd)
            B, nkv = k.shape[:2]
            qg = q.transpose(1, 2).float().cpu()             # (B, nh, R, hd): a kv head's query heads adjacent
            qg = qg.reshape(B, nkv, -1, qg.shape[-1]) * qg.shape[-1] ** -0.5   # (B, nkv, G * R, hd)
            w = qg @ k.transpose(-1, -2)
            if keep is not None:
                w = w.masked_fill(~keep, float("-inf"))
            per_chunk = w.softmax(-1).reshape(-1, len(order), C).sum(-1)  # (B * nh * R, chunks)
            best = torch.cat([best, per_chunk]).topk(min(SCORE_TOP, best.shape[0] + per_chunk.shape[0]), dim=0).values
        column = {c: i for i, c in enumerate(order)}
        best = best[:, torch.tensor([column[c] for c in chunks])]   # chunk order
        scores = best.mean(0)
        # (not from the sink, whose mass is where heads park attention, not content)
        heir = torch.tensor([b == a + 1 and a >= pager.sink for a, b in zip(chunks, chunks[1:])])
        scores[1:] = torch.maximum(scores[1:], SCORE_NEXT * scores[:-1] * heir)
        return dict(zip(chunks, scores.tolist()))

    def reselect(self, length: int, rows: int = SCORE_QUERY_ROWS) -> bool:
        """Page in the highest-scoring chunks (out go the lowest) by the attention of the
        latest ``rows`` committed queries on positions [0, length) (committed: ``commit``);
        True if residency changed. The next one is due at the next multiple of tau."""
        pager = self.pager
        self.commit(length)
        self.due = (length // self.tau + 1) * self.tau
        scores = self.chunk_scores(length, rows)
        if not scores:
            return False
        pager.policy.observe(scores)
        moves = pager.plan_reselect(scores)
        self.apply(moves)
        self.reselects += 1
        return bool(moves)

    # --- snapshots: the logical KV rows plus which chunks were resident -------------------
    def logical_rows(self, j: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows [0, length) of attention layer ``j`` in position order, gathered
        from the pool and from host memory (on the CPU)."""
        pager, C, s = self.pager, self.pager.chunk, self.states[j]
        ks, vs = [], []
        for c in range(-(-length // C)):
            if c in pager.resident:
                p = pager.resident[c]
                ks.append(s.k[:, :, p * C:(p + 1) * C].cpu())
                vs.append(s.v[:, :, p * C:(p + 1) * C].cpu())
            else:
                k, v = self.host[c][j]
                ks.append(k)
                vs.append(v)
        if not ks:
            return s.k[:, :, :0].cpu(), s.v[:, :, :0].cpu()
        return torch.cat(ks, dim=2)[:, :, :length].clone(), torch.cat(vs, dim=2)[:, :, :length].clone()

    def policy_tensors(self, length: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """The residency policy's state at ``length`` committed positions, for a snapshot:
        (chunk, last use, score) rows as float64 (N, 3), [clock, the next re-selection's
        position] as int64 (2,), and the latest committed queries per attention layer
        ((B, R, nh, hd); R = 0 before any)."""
        self.commit(length)
        rows, clock = self.pager.policy.state()
        pol = torch.tensor(rows, dtype=torch.float64).reshape(-1, 3)
        counters = torch.tensor([clock, self.due], dtype=torch.int64)
        return pol, counters, list(self.last_q or [])  # snapshot_save copies what it keeps

    def check_policy_tensors(self, pol: torch.Tensor, counters: torch.Tensor, num_chunks: int) -> None:
        """ValueError unless ``pol``/``counters`` are a policy state for ``num_chunks`` chunks
        (the next re-selection at a multiple of tau: ``spec_room`` stops blocks there)."""
        if pol.dim() != 2 or pol.shape[1] != 3 or counters.shape != (2,) or bool((counters < 0).any()) \
                or int(counters[1]) % self.tau:
            raise ValueError("snapshot: invalid KV Flash policy state")
        if pol.numel() and (not bool(torch.isfinite(pol).all()) or bool((pol[:, :2] < 0).any())
                            or bool((pol[:, 0] >= num_chunks).any()) or bool((pol[:, 0] != pol[:, 0].round()).any())):
            raise ValueError("snapshot: invalid KV Flash policy state")

    def restore(self, length: int, rows: list[tuple[torch.Tensor, torch.Tensor]], table, free,
                policy: tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]] | None = None) -> None:
        """Rebuild pool and host pages from logical rows and the saved page table (see
        KvPager.table); ``policy``: the state from ``policy_tensors``."""
        pager, C = self.pager, self.pager.chunk
        n = -(-length // C)
        self.reset()
        pager.adopt(n, table, free)
        if policy is not None:
            pol, counters, last_q = policy
            pager.policy.load([(int(c), int(u), float(v)) for c, u, v in pol.tolist()], int(counters[0]))
            self.due = int(counters[1])
            self.last_q = [q.to(self.device).clone() for q in last_q] if last_q and last_q[0].shape[1] else None
        for c in range(n):
            for j, (s, (k, v)) in enumerate(zip(self.states, rows)):
                kc, vc = k[:, :, c * C:(c + 1) * C], v[:, :, c * C:(c + 1) * C]
                if kc.shape[2] < C:  # the last, partly written chunk
                    pad = (0, 0, 0, C - kc.shape[2])
                    kc, vc = torch.nn.functional.pad(kc, pad), torch.nn.functional.pad(vc, pad)
                if c in pager.resident:
                    p = pager.resident[c]
                    s.k[:, :, p * C:(p + 1) * C] = kc.to(self.device, s.k.dtype)
                    s.v[:, :, p * C:(p + 1) * C] = vc.to(self.device, s.v.dtype)
                else:
                    self.host.setdefault(c, []).append((kc.to("cpu", s.k.dtype).clone(), vc.to("cpu", s.v.dtype).clone()))

    # --- bookkeeping ------------------------------------------------------------------------
    def truncate(self, length: int) -> None:
        """Rollback / commit to ``length``: observe the committed rows, settle a deferred
        eviction, drop later chunks."""
        self.commit(length)
        self.apply(self.pager.settle(length))
        self.pager.truncate(length)
        for c in [c for c in self.host if c not in self.pager.paged]:
            del self.host[c]

    def reset(self) -> None:
        self.pager.reset()
        self.host.clear()
        self.pending, self.recent, self.due = [], [], self.tau

    def stats(self) -> dict:
        # every page holds one chunk of K and V per attention layer: host bytes follow from the count
        chunk_bytes = sum(2 * s.k[:, :, :self.pager.chunk].numel() * s.k.element_size() for s in self.states)
        return dict(self.pager.stats(), host_bytes=len(self.host) * chunk_bytes, reselects=self.reselects)
