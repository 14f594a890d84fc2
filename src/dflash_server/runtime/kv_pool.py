"""KvPool: one stage's KV Flash pool, the tensor side of the page table (kv_pager.py).

Moves chunk rows between the pool (the attention layers' K/V tensors, allocated at pool
size) and host memory, gives each forward its write slots and the slot -> position map
(cached per residency epoch), feeds the score policy, and re-selects residency every
``tau`` tokens by scoring every chunk (resident or paged out) against the latest queries.
"""
from __future__ import annotations

import torch

from .kv_pager import KvPager, Move

SCORE_MAX_ROWS = 16  # the score policy observes decode and verify forwards, not prefill chunks
SCORE_TOP = 4        # re-selection: a chunk's score is the mean of its largest attention masses
SCORE_NEXT = 0.5     # ... and at least this share of its predecessor's


def merge_stats(stats: list[dict]) -> dict:
    """Several pools' stats as one: counts summed, the rest (policy) from the first."""
    return {k: sum(s[k] for s in stats) if isinstance(v, int) else v for k, v in stats[0].items()}


class KvPool:
    def __init__(self, pager: KvPager, states: list, device: torch.device, tau: int = 64):
        self.pager, self.device, self.tau = pager, device, tau
        self.states = [s for s in states if s.kind == "kv"]   # one per attention layer, in order
        self.host: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # paged-out chunks
        self._slot_pos: tuple[int, torch.Tensor] | None = None
        self.last_q: list[torch.Tensor] | None = None  # per attention layer: (B, <=32, nh, hd) latest queries
        self.since_select = 0
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
        ``speculative``: a verify block that may be rolled back (no re-selection then).
        ``observe``: the score policy re-selects before this forward when due and observes its
        attention and queries; False for a prompt's body (Pipeline.prefill_steps), which then
        does neither, so where the body's forwards begin and end (the chunk size, a step's
        token budget beside other sequences, a prefix-cache hit inside it) cannot move what
        the policy chooses, and a long prompt is not re-scored every ``tau`` tokens."""
        pager = self.pager
        if observe and not speculative and self.scoring and self.last_q is not None and \
                self.since_select >= self.tau:
            self.reselect(start)
        self.apply(pager.plan_write(start, end, speculative))
        ctx.slots = torch.tensor(pager.slots(start, end), device=self.device)
        if self._slot_pos is None or self._slot_pos[0] != pager.epoch:
            until = pager.slot_until()
            self._slot_pos = (pager.epoch, torch.tensor(pager.slot_positions(), device=self.device),
                              torch.tensor(until, device=self.device) if until is not None else None)
        ctx.slot_pos, ctx.slot_until = self._slot_pos[1], self._slot_pos[2]
        if self.scoring and observe:
            ctx.last_q = []
            if end - start <= SCORE_MAX_ROWS:
                ctx.attn_mass = torch.zeros(pager.pool_tokens, device=self.device)

    def finish(self, ctx, rows: int) -> None:
        """After the forward: feed the score policy, remember the latest queries."""
        if ctx.attn_mass is not None:
            per_phys = ctx.attn_mass.view(-1, self.pager.chunk).sum(-1).tolist()
            self.pager.policy.observe({c: per_phys[p] for c, p in self.pager.resident.items()})
        if ctx.last_q:
            self.last_q = ctx.last_q
            self.since_select += rows

    # --- re-selection ---------------------------------------------------------------------
    @torch.inference_mode()
    def chunk_scores(self, length: int) -> dict[int, float]:
        """How strongly the latest queries attend to every written chunk (resident or paged):
        full attention over the whole context, once per tau.

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
        if not chunks or not self.last_q:
            return {}
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
        for j, (s, q) in enumerate(zip(self.states, self.last_q)):
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

    def reselect(self, length: int) -> bool:
        """Page in the highest-scoring chunks (out go the lowest) by the attention of the
        latest queries on positions [0, length); True if residency changed."""
        pager = self.pager
        self.since_select = 0
        scores = self.chunk_scores(length)
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

    def policy_tensors(self) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """The residency policy's state for a snapshot: (chunk, last use, score) rows as
        float64 (N, 3), [clock, tokens since the last re-selection] as int64 (2,), and the
        latest queries per attention layer ((B, R, nh, hd); R = 0 before any)."""
        rows, clock = self.pager.policy.state()
        pol = torch.tensor(rows, dtype=torch.float64).reshape(-1, 3)
        counters = torch.tensor([clock, self.since_select], dtype=torch.int64)
        return pol, counters, list(self.last_q or [])  # snapshot_save copies what it keeps

    def check_policy_tensors(self, pol: torch.Tensor, counters: torch.Tensor, num_chunks: int) -> None:
        """ValueError unless ``pol``/``counters`` are a policy state for ``num_chunks`` chunks."""
        if pol.dim() != 2 or pol.shape[1] != 3 or counters.shape != (2,) or bool((counters < 0).any()):
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
            self.since_select = int(counters[1])
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
        """Rollback / commit to ``length``: settle a deferred eviction, drop later chunks."""
        self.apply(self.pager.settle(length))
        self.pager.truncate(length)
        for c in [c for c in self.host if c not in self.pager.paged]:
            del self.host[c]

    def reset(self) -> None:
        self.pager.reset()
        self.host.clear()
        self.last_q, self.since_select = None, 0

    def stats(self) -> dict:
        # every page holds one chunk of K and V per attention layer: host bytes follow from the count
        chunk_bytes = sum(2 * s.k[:, :, :self.pager.chunk].numel() * s.k.element_size() for s in self.states)
        return dict(self.pager.stats(), host_bytes=len(self.host) * chunk_bytes, reselects=self.reselects)
