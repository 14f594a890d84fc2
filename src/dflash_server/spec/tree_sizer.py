"""Adaptive DDTree budget: each step, the tree size (0 = a plain decode step) expected to
commit the most tokens per second.

The chain's ``BlockSizer`` predicts any block's yield from per-position acceptance rates; a
tree's yield has no such closed form, so it is measured per budget: the tokens each step
with that budget committed (the bonus token included), a decayed running mean per request
kind (greedy / sampled) with this request's own steps shrunk towards it, and the step's wall
time as a moving average (``BlockSizer``'s cost rules: the first time only holds a place, a
time under a quarter of the average replaces it). One fact ties the budgets together: the
best-first tree of N nodes is contained in the tree of N + 1 built from the same draft pass,
so a larger budget never accepts less; the estimate for N is therefore the largest estimate
of any budget up to N, and a budget not yet measured inherits its smaller neighbours'.
A plain step commits exactly one token. Budgets are explored from the smallest up, each
tried twice, while a larger one may pay (``explore``: the yield is concave in the budget, so
it grows at most at the average rate from the plain step to the largest judged budget), and
every ``explore_every`` steps the least recently measured of the best budget and its two
neighbours runs again (so costs and yields follow the machine and the request, while a far
costlier budget is not re-tried for nothing). The output does not
depend on the choice (every tree is verified against the same target).
"""
from __future__ import annotations

from .block_sizer import StepCosts

TREE_CANDIDATES = (0, 1, 2, 4, 8, 16, 32)


class TreeSizer(StepCosts):
    def __init__(self, max_budget: int, *, explore_every: int = 24, prior: float = 1.5, prior_weight: float = 2.0,
                 request_weight: float = 6.0, decay: float = 0.995, cost_alpha: float = 0.25):
        if max_budget < 1:
            raise ValueError(f"an adaptive tree budget needs a budget >= 1, got {max_budget}")
        self.max_budget = max_budget
        self.candidates = tuple(sorted({b for b in TREE_CANDIDATES if b <= max_budget} | {max_budget}))
        self.explore_every, self.decay, self.cost_alpha = explore_every, decay, cost_alpha
        self.prior, self.prior_weight, self.request_weight = prior, prior_weight, request_weight
        self.reset()

    def reset(self) -> None:
        self.reset_costs()
        self.history: dict[str, dict[int, list[float]]] = {}   # kind -> budget -> [tokens, steps]
        self.requests: dict = {}
        self.steps = 0
        self.begin_request()

    def begin_request(self, kind: str = "greedy", key=None) -> None:
        if kind not in self.history:
            self.history[kind] = {b: [0.0, 0.0] for b in self.candidates}
        self.requests[key] = (kind, {b: [0.0, 0.0] for b in self.candidates})
        self.select(key)

    def select(self, key=None) -> None:
        self.kind, self.req = self.requests[key]

    def end_request(self, key=None) -> None:
        if key is not None:
            self.requests.pop(key, None)

    def expected_tokens(self) -> dict[int, float]:
        """Budget -> tokens a step commits on average (monotone in the budget)."""
        hist, out, best = self.history[self.kind], {}, 1.0
        for b in self.candidates:
            if b == 0:
                out[b] = 1.0
                continue
            tokens, steps = hist[b]
            g = (tokens + self.prior_weight * max(self.prior, best)) / (steps + self.prior_weight)
            rt, rs = self.req[b]
            est = (rt + self.request_weight * g) / (rs + self.request_weight)
            best = max(best, est)
            out[b] = best
        return out

    def explore(self, est: dict[int, float]) -> int | None:
        """The smallest budget not yet judged, if measuring it may pay, else None. Budgets
        are explored from the smallest up. A larger tree costs at least what the largest
        judged one M costs, and its yield grows at most as fast as it did on average from
        the plain step (one token) to M: a best-first tree adds nodes in falling draft
        probability, so each further node adds less to the expected yield (concave in the
        budget). So the largest budget yields at most est(M) + (max - M) x that slope, and
        once that rate is below the best judged one the larger budgets stay unmeasured
        (until the estimates change)."""
        fresh = self.fresh()
        if not fresh:
            return None
        judged = [b for b in self.candidates if b < fresh[0]]
        hi = judged[-1] if judged else 0
        if hi == 0:
            return fresh[0]
        bound = est[hi] + (self.max_budget - hi) * self.slope_to(est, hi)
        return self.worth_exploring(bound, {b: est[b] / self.cost[b] for b in judged})

    def slope_to(self, est: dict[int, float], hi: int) -> float:
        """The average yield per node from the plain step (exactly one token, no noise) to
        budget ``hi`` (the prior's before any): never below the slope just before ``hi`` on a
        concave yield, so an optimistic bound for the budgets past it."""
        return (est[hi] - 1.0) / hi if hi else self.prior - 1.0

    def choose(self) -> int:
        est = self.expected_tokens()
        nxt = self.explore(est)
        if nxt is not None:
            return nxt
        fresh = self.fresh()
        known = [b for b in self.candidates if b not in fresh]
        best = max(known, key=lambda b: est[b] / self.cost[b])
        if self.steps % self.explore_every == self.explore_every - 1:
            # re-measure the best's neighbours (not every budget: on a CPU a tree of 22 costs
            # ~6 plain steps, and re-trying it every 24 steps would cost ~20%)
            i = known.index(best)
            near = known[max(0, i - 1):i + 2]
            return min(near, key=lambda b: self.measured[b])
        return best

    def observe(self, budget: int, committed: int | None, seconds: float) -> None:
        """A step with ``budget`` nodes took ``seconds`` and committed ``committed`` tokens
        (None when it ended early, e.g. at a stop: its yield is not observed)."""
        self.steps += 1
        self.measure(budget, seconds)
        self.learn(budget, committed)

    def row_gains(self, rows: int) -> list[float]:
        """What each row after the first adds to the expected tokens of a verify of at most
        ``rows`` rows (a tree of ``rows - 1`` nodes): between two candidate budgets the
        estimate's slope (BatchSizer hands rows out by these; ``snap`` then rounds a
        sequence's rows down to a candidate budget). Past the largest budget whose yield
        was observed, the optimistic slope ``explore`` bounds by (the average from the plain
        step to that budget; the prior's before any), so larger trees get rows and are
        measured while they may pay."""
        est, out, prev = self.expected_tokens(), [], 0
        hist = self.history[self.kind]
        seen = [b for b in self.candidates[1:] if hist[b][1] > 0 or self.req[b][1] > 0]
        hi = seen[-1] if seen else 0
        bound = self.slope_to(est, hi)
        for b in self.candidates[1:]:
            if b > rows - 1:
                break
            out += [(est[b] - est[prev]) / (b - prev) if b <= hi else bound] * (b - prev)
            prev = b
        return out

    def snap(self, budget: int) -> int:
        """The largest candidate budget up to ``budget``."""
        return max(b for b in self.candidates if b <= budget)

    def learn(self, budget: int, committed: int | None) -> None:
        """Count a tree step's yield towards the selected request and its kind (a batch step
        measures its cost as a whole: BatchSizer)."""
        if committed is None or budget == 0 or budget not in self.candidates:
            return
        hist = self.history[self.kind]
        for v in hist.values():
            v[0] *= self.decay
            v[1] *= self.decay
        hist[budget][0] += committed
        hist[budget][1] += 1
        self.req[budget][0] += committed
        self.req[budget][1] += 1

    def to_dict(self) -> dict:
        est = self.expected_tokens()
        return {"candidates": list(self.candidates), "kind": self.kind, "tree": True,
                "cost_ms": {b: round(c * 1e3, 3) for b, c in sorted(self.cost.items())},
                "expected_tokens": {b: round(e, 3) for b, e in est.items()}}
