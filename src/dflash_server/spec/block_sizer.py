"""Adaptive verify block size: each step, the block (1 = a plain decode step) that is
expected to commit the most tokens per second.

A verify of B rows commits ``E(B) = 1 + sum_{j<B} prod_{k<=j} q_k`` tokens on average, where
``q_k`` is the chance that draft position k is accepted once positions 1..k-1 were. It costs
``c(B)`` seconds (draft + target verify), which grows with B at a rate that depends on the
device and the weight format: on a GPU a block of 16 costs about one decode step, on a
2-core CPU with weight-only int4 kernels a block of 8 costs ~2x one. So the best B depends on
the draft's acceptance for this request (code vs chat) and on the machine, and both are
measured rather than assumed:

- ``q_k``: accepted / reached counts per draft position, per request, shrunk towards the
  running counts of earlier requests of the same kind (which start from a neutral prior).
  Kinds are kept apart because acceptance differs by far more between greedy and sampled
  requests than between requests of one kind (sampling draws off the draft's argmax), and
  a server mixes them;
- ``c(B)``: a moving average of the measured wall time of steps with block B. The first
  steps of a block size may carry one-off costs (with ``--compile`` they compiled verify
  graphs: 16.8 s, and 87 s on a cold cache, instead of ~60 ms on the dev CPU), so the
  second time replaces the first, and a time under a quarter of the average replaces it.

Candidates are explored from the smallest up, each tried twice before it is judged, and
exploration stops where it cannot pay: a larger block costs at least what the largest
judged smaller one costs, and commits at most ``E(max_block)`` tokens under the current
acceptance estimate, so once that bound is below the best judged rate, the larger blocks
are left unmeasured (until the acceptance estimate rises). A weak draft thus costs two steps
of block 2 rather than two of every size (which halved a short answer's speed with the
shipped draft on the CPU, and on a GPU, where the eager verify costs ~4 CUDA-graph steps).
Every ``explore_every`` steps the least recently measured judged candidate runs again, so
costs follow the machine's load and deep positions keep being observed. Output does not
depend on the choice: every block size verifies against the same target distribution.
"""
from __future__ import annotations

CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


class StepCosts:
    """The measured wall time of steps per candidate (block size, tree budget), as each
    candidate's cost relative to the others times the machine's current speed: a cheap VM's
    speed moves by 2x within minutes (a neighbour's load), and candidates are measured at
    different times (the chosen one every step, the others now and then), so a per-candidate
    average of seconds compares a time measured in a slow minute with one from a fast minute.
    Each step updates the speed (a fast moving average of seconds / the candidate's relative
    cost) and then the candidate's relative cost (a moving average of seconds / speed), so
    a candidate measured now is compared with what the others cost now. A candidate's first
    time only holds a place, and a time under a quarter of its average replaces it outright
    (a one-off such as a compile must not stick). ``cost[c]`` is seconds per step of c at
    the current speed. Needs ``candidates``, ``cost_alpha`` and a ``steps`` counter."""

    speed_alpha = 0.3

    def reset_costs(self) -> None:
        self.cost: dict[int, float] = {}          # candidate -> seconds per step now (relative cost x speed)
        self.rel: dict[int, float] = {}           # candidate -> its relative cost (moving average)
        self.speed: float | None = None           # seconds per unit of relative cost, now
        self.measured: dict[int, int] = {}        # candidate -> step counter when last measured
        self.samples: dict[int, int] = {}         # candidate -> steps measured

    def fresh(self) -> list[int]:
        """Candidates not yet measured twice (each is tried twice before it is judged)."""
        return [b for b in self.candidates if self.samples.get(b, 0) < 2]

    def worth_exploring(self, bound_tokens: float, rates: dict[int, float]) -> int | None:
        """The smallest candidate not yet judged, if measuring it may pay, else None.
        Candidates are explored from the smallest up; a larger one costs at least the largest
        judged smaller one, and is taken to commit at most ``bound_tokens`` (the caller's
        estimate for the largest candidate), so once that rate is below the best judged one
        (``rates``), the rest stay unmeasured until the estimate rises."""
        fresh = self.fresh()
        if not fresh:
            return None
        nxt = fresh[0]
        floor = max((self.cost[b] for b in rates if b < nxt), default=0.0)
        if not floor or bound_tokens / floor > max(rates.values()):
            return nxt
        return None

    def measure(self, b: int, seconds: float) -> None:
        if b not in self.candidates:
            return
        if self.speed is None:
            self.speed = seconds          # (the first candidate measured has relative cost 1)
        old, n = self.rel.get(b), self.samples.get(b, 0)
        if n < 2 or seconds < old * self.speed / 4:
            self.rel[b] = seconds / self.speed
        else:
            self.speed += self.speed_alpha * (seconds / old - self.speed)
            self.rel[b] = old + self.cost_alpha * (seconds / self.speed - old)
        self.cost = {c: r * self.speed for c, r in self.rel.items()}
        self.measured[b] = self.steps
        self.samples[b] = n + 1


def chain_gains(acceptance: list[float], rows: int) -> list[float]:
    """What each row after the first adds to the expected tokens of a block of at most
    ``rows`` (``acceptance[k - 1]``: draft k's chance once 1..k-1 were accepted): row b + 1
    commits a token only if drafts 1..b are all accepted."""
    out, reach = [], 1.0
    for b in range(1, rows):
        reach *= acceptance[b - 1]
        out.append(reach)
    return out


class BlockSizer(StepCosts):
    def __init__(self, max_block: int, *, explore_every: int = 24, prior: float = 0.5, prior_weight: float = 2.0,
                 request_weight: float = 6.0, decay: float = 0.995, cost_alpha: float = 0.25):
        if max_block < 2:
            raise ValueError(f"adaptive block size needs a draft block of >= 2, got {max_block}")
        self.max_block = max_block
        self.candidates = tuple(sorted({b for b in CANDIDATES if b <= max_block} | {max_block}))
        self.explore_every, self.decay, self.cost_alpha = explore_every, decay, cost_alpha
        self.prior, self.prior_weight, self.request_weight = prior, prior_weight, request_weight
        self.reset()

    def reset(self) -> None:
        """Forget every measurement (e.g. those of a warm-up that compiled graphs)."""
        self.reset_costs()
        # earlier requests' counts per kind, decayed; index k = draft position
        self.history: dict[str, tuple[list[float], list[float]]] = {}
        self.requests: dict = {}   # key -> (kind, reach, hits) of each running request
        self.steps = 0
        self.begin_request()

    def begin_request(self, kind: str = "greedy", key=None) -> None:
        """Start a request of ``kind`` (e.g. greedy / sampled): its acceptance is shrunk
        towards earlier requests of that kind only. ``key`` names it where several run at
        once (continuous batching): ``select(key)`` before each of its steps."""
        if kind not in self.history:
            self.history[kind] = ([0.0] * self.max_block, [0.0] * self.max_block)
        self.requests[key] = (kind, [0] * self.max_block, [0] * self.max_block)
        self.select(key)

    def select(self, key=None) -> None:
        """Make request ``key`` the one ``choose``/``observe`` act on."""
        self.kind, self.req_reach, self.req_hits = self.requests[key]  # this request's counts
        self.reach, self.hits = self.history[self.kind]

    def end_request(self, key=None) -> None:
        if key is not None:
            self.requests.pop(key, None)

    def acceptance(self) -> list[float]:
        """[k-1] = estimated chance that draft position k is accepted once 1..k-1 were.

        Earlier requests' counts are shrunk towards the previous position's estimate (the
        first towards ``prior``), this request's towards its own previous position scaled by
        the history's change from k-1 to k. A position seldom reached (deep in the block, when
        short blocks have been chosen) thus inherits its neighbour's rate instead of a fixed
        guess: optimistic where rates fall with depth, which makes the sizer try the longer
        block and measure it."""
        out, g_prev, r_prev = [], self.prior, None
        for k in range(1, self.max_block):
            g = (self.hits[k] + self.prior_weight * g_prev) / (self.reach[k] + self.prior_weight)
            prior = g if r_prev is None else min(1.0, r_prev * g / max(g_prev, 1e-6))
            r = (self.req_hits[k] + self.request_weight * prior) / (self.req_reach[k] + self.request_weight)
            out.append(min(r, 0.999))
            g_prev, r_prev = g, r
        return out

    def q(self, k: int) -> float:
        return self.acceptance()[k - 1]

    def expected_tokens(self, block: int, acceptance: list[float] | None = None) -> float:
        """Tokens a verify of ``block`` rows commits on average (the bonus token included)."""
        acceptance = self.acceptance() if acceptance is None else acceptance
        e = p = 1.0
        for k in range(1, block):
            p *= acceptance[k - 1]
            e += p
        return e

    def choose(self) -> int:
        acc = self.acceptance()
        fresh = self.fresh()
        rate = {b: self.expected_tokens(b, acc) / self.cost[b] for b in self.candidates if b not in fresh}
        nxt = self.worth_exploring(self.expected_tokens(self.max_block, acc), rate)
        if nxt is not None:
            return nxt
        if self.steps % self.explore_every == self.explore_every - 1:
            return min(rate, key=lambda b: self.measured[b])
        return max(rate, key=rate.__getitem__)

    def row_gains(self, rows: int) -> list[float]:
        return chain_gains(self.acceptance(), rows)

    def snap(self, extra: int) -> int:
        return extra

    def observe(self, block: int, accepted: int | None, seconds: float) -> None:
        """A step with ``block`` rows took ``seconds``; ``accepted`` drafts matched (None when
        the step ended early, e.g. at a stop string: acceptance not observed)."""
        self.steps += 1
        self.measure(block, seconds)
        self.learn(block, accepted)

    def learn(self, block: int, accepted: int | None) -> None:
        """Count a verify of ``block`` rows that accepted ``accepted`` drafts (None: not
        observed) towards the selected request's acceptance and its kind's history."""
        if accepted is None or block < 2:
            return
        for k in range(1, self.max_block):
            self.reach[k] *= self.decay
            self.hits[k] *= self.decay
        for k in range(1, min(block - 1, accepted + 1) + 1):     # positions reached
            hit = k <= accepted
            self.reach[k] += 1
            self.hits[k] += hit
            self.req_reach[k] += 1
            self.req_hits[k] += hit

    def to_dict(self) -> dict:
        return {"candidates": list(self.candidates), "kind": self.kind,
                "cost_ms": {b: round(c * 1e3, 3) for b, c in sorted(self.cost.items())},
                "acceptance": [round(q, 4) for q in self.acceptance()]}
