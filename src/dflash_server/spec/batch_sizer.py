"""Verify blocks for several speculating sequences in one forward (continuous batching).

In a batch, one forward carries every sequence's rows, and what it costs depends on the
total rows R rather than on any one block: on the 2-core CPU 4 rows cost ~1.3x one row, 8
rows ~1.8x, 16 ~2.8x; on a GPU a few dozen rows cost about one. So the blocks are chosen
together. For a total R, rows go where they are most likely to commit a token: sequence i's
(b+1)-th row commits one more token only if its first b drafts are all accepted, a chance
(``BlockSizer.acceptance``, per request) that falls with b, so handing the rows out one at a
time to the largest such chance is optimal for that R. The R chosen maximises expected
tokens per second, with c(n, R) the measured wall time of batch steps of about R rows for n
sequences (the whole step: draft pass, forward, commits; R rounded up to a candidate; each
total runs three times before it is judged). Costs are kept per batch size n because a
step's draft pass costs by the drafting sequences, not by rows: 4 rows of 3 sequences, one
drafting, cost ~1.2x 4 plain rows of 4 (a 2-core Zen 4), and sequences join and leave a
served batch all the time, which mixed the two under one total and made plain rows look
dearer than they are (draft on: 0.82x plain throughput at 4 concurrent greedy streams).
And a total is measured relative to the machine's current speed (as ``StepCosts``): a
cheap VM's speed moves by 1.5x within a minute, the chosen total is measured every step and
the others now and then, so raw seconds would compare a fast minute with a slow one. Each
step's seconds over the current speed is one sample of its total's relative cost, whose
median over the last few samples is that cost (a busy-machine spike is set aside); the
speed, kept per sequence count (totals are only compared at one n), is the median of the
last few steps' seconds over their totals' relative costs. R = n (every block 1) is plain
batched decoding, measured like the rest; larger totals are explored from the smallest up
while they may pay (as ``BlockSizer`` explores block sizes), and every ``explore_every``
steps the stalest total within half the best rate (or plain rows) runs again. Output does
not depend on the choice: every row verifies against the same target distribution.

DDTree verifies are sized the same way: a tree of b nodes is b + 1 rows, and what each row
adds is the slope of the request's ``TreeSizer`` estimate between candidate budgets (yields
concave in the budget: a best-first tree adds nodes in falling probability); a sequence's
rows are then rounded down to a candidate budget, whose yield its verify measures.
"""
from __future__ import annotations

from .block_sizer import BlockSizer, StepCosts, chain_gains
from .tree_sizer import TreeSizer

ROW_CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
WINDOW = 7  # step times per total whose median is its cost
JUDGED = 3  # step times before a total is compared with the others
SPEED_WINDOW = 5  # steps whose median is the machine's current speed


class BatchSizer(StepCosts):
    def __init__(self, blocks: BlockSizer | TreeSizer, *, max_rows: int = 64, explore_every: int = 24):
        """``blocks``: the proposer's BlockSizer (or TreeSizer), whose per-request estimates
        (keyed by sequence) this reads (``row_gains``) and ``learn`` feeds; ``max_rows``: the
        most rows one batch step verifies."""
        self.blocks = blocks
        self.candidates = tuple(r for r in ROW_CANDIDATES if r <= max_rows) or (1,)
        self.explore_every = explore_every
        self.reset()

    def reset(self) -> None:
        """Forget the measured step times (e.g. a warm-up's, which included compiles)."""
        self.steps = 0
        self.reset_costs()

    def bucket(self, rows: int) -> int:
        """The candidate a step of ``rows`` rows is counted under: the smallest >= it."""
        return next((r for r in self.candidates if r >= rows), self.candidates[-1])

    @classmethod
    def grants(cls, acceptances: list[list[float]], caps: list[int], extra: int) -> tuple[list[int], list[float]]:
        """Up to ``extra`` rows beyond one per sequence, in the order they are handed out: each
        to the sequence whose next row is the likeliest to commit a token (at most its cap),
        ``acceptances`` being each sequence's per-position acceptance chances. Returns
        (sequence of each row, its chance), the chance being what the row adds to the
        expected tokens."""
        return cls.merge([chain_gains(acc, cap) for acc, cap in zip(acceptances, caps)], extra)

    @staticmethod
    def merge(row_gains: list[list[float]], extra: int) -> tuple[list[int], list[float]]:
        """Up to ``extra`` rows handed out one at a time, each to the sequence whose next row
        adds the most (``row_gains[i][k]``: what sequence i's row k + 2 adds; no more rows
        than it lists). Returns (sequence of each row, what it adds)."""
        taken = [0] * len(row_gains)
        order, gains = [], []
        for _ in range(max(0, extra)):
            best, gain = None, -1.0
            for i, mine in enumerate(row_gains):
                if taken[i] < len(mine) and mine[taken[i]] > gain:
                    best, gain = i, mine[taken[i]]
            if best is None:
                break
            taken[best] += 1
            order.append(best)
            gains.append(gain)
        return order, gains

    @staticmethod
    def blocks_after(n: int, order: list[int]) -> list[int]:
        """The blocks of ``n`` sequences after the grants ``order`` (one row each to start)."""
        out = [1] * n
        for i in order:
            out[i] += 1
        return out

    @classmethod
    def allocate(cls, acceptances: list[list[float]], total: int, caps: list[int]) -> list[int]:
        """Blocks (each >= 1, at most its cap) summing to at most ``total``: the first
        ``total - n`` grants."""
        return cls.blocks_after(len(caps), cls.grants(acceptances, caps, total - len(caps))[0])

    def choose(self, keys: list, caps: list[int]) -> list[int]:
        """The blocks of the sequences ``keys`` (their BlockSizer requests), ``caps[i]`` the
        largest block sequence i may take (>= 1)."""
        n = len(keys)
        row_gains = []
        for k, cap in zip(keys, caps):
            self.blocks.select(k)
            row_gains.append(self.blocks.row_gains(cap))
        top = min(sum(caps), self.candidates[-1])
        order, gains = self.merge(row_gains, top - n)
        cum = [float(n)]
        for g in gains:
            cum.append(cum[-1] + g)
        totals = sorted({n} | {r for r in self.candidates if n < r <= top})
        tokens = {r: cum[min(r - n, len(gains))] for r in totals}

        def plan(r: int) -> list[int]:   # (a tree's rows: its budget rounded down to a candidate, plus one)
            return [1 + self.blocks.snap(b - 1) for b in self.blocks_after(n, order[:r - n])]

        key = {r: (n, self.bucket(r)) for r in totals}
        judged = {r: tokens[r] / self.cost[key[r]] for r in totals if self.samples.get(key[r], 0) >= JUDGED}
        for r in totals:                 # the smallest total not judged yet, while it may pay
            if r in judged:
                continue
            floor = max((self.cost[key[j]] for j in judged if j < r), default=0.0)
            if not floor or tokens[totals[-1]] / floor > max(judged.values()):
                return plan(r)
            break
        best = max(judged, key=judged.__getitem__)
        if self.steps % self.explore_every == self.explore_every - 1:
            # re-measure the stalest total that a change of load or acceptance may make the
            # best (at least half the best rate; plain rows always): on a CPU with a weak
            # draft that is plain decoding or a row or two more, whose verify also observes
            # the acceptance again, not a costly total far behind
            near = [r for r in judged if judged[r] * 2 >= judged[best] or r == n]
            return plan(min(near, key=lambda r: self.measured[key[r]]))
        return plan(best)

    def observe(self, rows: int, seconds: float, sequences: int = 1) -> None:
        """A batch step of ``sequences`` sequences and ``rows`` rows in all took ``seconds``
        (drafting included)."""
        self.steps += 1
        self.measure((sequences, self.bucket(rows)), seconds)

    def measure(self, key: tuple[int, int], seconds: float) -> None:
        """One step of ``key`` (sequences n, rows bucket). Totals are only ever compared at
        the same n, so each n keeps its own unit: its speed (seconds per unit of relative
        cost) is the median of the last ``SPEED_WINDOW`` steps at n of seconds over their
        key's relative cost, following a change of load within a few steps while a single
        busy-machine spike is set aside; only steps since n last changed count (the batch
        size changes when the load does). A key's relative cost is the median of its last
        ``WINDOW`` samples, each a step's seconds over the speed at n that the steps before
        its run left: every step of its first run (until judged, ``JUDGED`` steps; a first
        step may carry a one-off cost, which the median sets aside), then the first step of
        each later run that follows a step at the same n (a re-measure right after the best
        total's steps, or the best total right after one: a pair measured at one speed).
        A run that starts after steps at another n (a sequence joined or left) is no such
        pair: its reference speed is from before, so it is not sampled. Within a run only
        the speed moves: a run of one key cannot tell a change of load from a change of its
        own cost. (One unit for all n chained the sequence counts' errors into each other.)"""
        n = key[0]
        paired = self.last_n == n
        if not paired:            # the speed at n is what the steps since n last changed say
            self.speeds[n] = []
        run_start = key != self.last_key
        if run_start:
            self.run_speed = self.speed[n] if paired else (self.speed.get(n) or seconds)
            self.last_key = key
        first_run = self.samples.get(key, 0) < JUDGED
        if (run_start and paired) or first_run or key not in self.rel:
            window = self.recent.setdefault(key, [])
            window.append(seconds / self.run_speed)
            del window[:-WINDOW]
            self.rel[key] = sorted(window)[len(window) // 2]
        speeds = self.speeds.setdefault(n, [])
        speeds.append(seconds / self.rel[key])
        del speeds[:-SPEED_WINDOW]
        self.speed[n] = sorted(speeds)[len(speeds) // 2]
        self.cost = {k: r * self.speed[k[0]] for k, r in self.rel.items() if k[0] in self.speed}
        self.measured[key] = self.steps
        self.samples[key] = self.samples.get(key, 0) + 1
        self.last_n = n

    def reset_costs(self) -> None:
        super().reset_costs()
        self.speed: dict[int, float] = {}             # sequences -> seconds per unit of relative cost
        self.recent: dict[tuple[int, int], list[float]] = {}
        self.speeds: dict[int, list[float]] = {}
        self.last_key, self.run_speed, self.last_n = None, None, None

    def to_dict(self) -> dict:
        """``cost_ms``: {sequences: {rows: ms per step now}}; ``steps``: {sequences: {rows:
        steps run}} (how often each total was chosen, exploration included)."""
        costs: dict[int, dict[int, float]] = {}
        steps: dict[int, dict[int, int]] = {}
        for (n, r), c in sorted(self.cost.items()):
            costs.setdefault(n, {})[r] = round(c * 1e3, 3)
            steps.setdefault(n, {})[r] = self.samples.get((n, r), 0)
        return {"row_candidates": list(self.candidates), "cost_ms": costs, "steps": steps}
