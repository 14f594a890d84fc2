"""Prompt-lookup drafts, beside the DFlash draft or alone (``LookupProposer``): when the last
few tokens of a sequence (prompt + output) occurred before in it, propose what followed them then.

Model output often copies from its context: names, numbers and code from the prompt, its own
earlier lines. The DFlash draft predicts such runs poorly past its first position, while a
copy is either right for several tokens or wrong at once. So a step whose context has an
earlier occurrence of its last ``n`` tokens (``N_MAX`` down to ``N_MIN``) verifies the
``depth`` tokens that followed the most recent such occurrence, instead of drafting. It
costs a dictionary lookup (no draft pass) and is lossless like any draft: the target
verifies every token (exact match; benchmarks/spec.py measures what it gains).

``LookupIndex`` holds one sequence's tokens and, per n, the position after the latest
earlier occurrence of each n-gram; ``LookupUse`` the per-sequence record that turns it off
where its proposals are mostly rejected; ``LookupProposer`` speculates by lookups alone, with
no draft model (engine.speculative.lookup_drafts takes the lookups for either proposer).
``LookupStore`` (``--lookup-store N``, off by default) is the same across requests: the prompts
and outputs of finished requests, looked up where the sequence's own context has no match.
"""
from __future__ import annotations

N_MIN, N_MAX = 2, 4      # suffix lengths tried, longest first (one token matches too often by chance)
MAX_DEPTH = 16           # most tokens a lookup may propose (a verify of depth + 1 rows)
# Lookups run for a sequence decoding alone. In a step of several sequences every lookup's rows
# are paid at the compute-bound rate of a batch, and that was measured not to pay (the default
# model on the 2-core Zen 4 VM, 8 evaluation prompts, 96 tokens, lookup alone vs plain rows:
# 2 together 0.91-0.96x, 4 together 0.91-0.94x), so a batch decodes its rows plainly (or verifies
# the draft's blocks) and each sequence looks up again once it runs alone.


class LookupIndex:
    def __init__(self, n_min: int = N_MIN, n_max: int = N_MAX):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram lengths must satisfy 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        # n -> {n-gram: index of the token that followed its latest occurrence}
        self.after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}

    def sync(self, *parts: list[int]) -> None:
        """Index the tokens of ``parts`` (concatenated) past those already indexed: a
        sequence's prompt and output only grow, so this appends their new tail."""
        have = len(self.tokens)
        for part in parts:
            if have >= len(part):
                have -= len(part)
                continue
            for tok in part[have:]:
                self._append(int(tok))
            have = 0

    def _append(self, tok: int) -> None:
        toks, e = self.tokens, len(self.tokens)
        for n, table in self.after.items():
            if e >= n:
                table[tuple(toks[e - n:e])] = e     # that n-gram was followed by the token at e
        toks.append(tok)

    def propose(self, depth: int) -> list[int]:
        """``depth`` tokens copied from after the latest earlier occurrence of the longest
        matching suffix ([] when none matches). A copy that reaches the end of the context
        goes on from its own start, as an overlapping LZ77 copy does: after ``x x x`` it
        proposes ``x`` again and again, after ``a b a b`` ``a b a b ...``."""
        toks, length = self.tokens, len(self.tokens)
        if depth < 1:
            return []
        for n in range(self.n_max, self.n_min - 1, -1):
            if length < n:
                continue
            e = self.after[n].get(tuple(toks[length - n:]))
            if e is not None:
                out = toks[e:e + depth]
                while len(out) < depth:     # (e + i past the end: the copy's own token i - (length - e))
                    out.append(out[len(out) - (length - e)])
                return out
        return []


class LookupStore:
    """Finished requests' tokens (prompt + output), for lookups across requests: where a
    sequence's own context does not repeat its last ``N_MAX`` .. ``N_MIN`` tokens,
    what followed their latest occurrence in an earlier request (the idea of SuffixDecoding,
    arXiv 2411.04975, with n-gram tables instead of a suffix tree). Lossless like every
    lookup: the target verifies each token by exact match, so outputs do not depend on what
    the store holds (greedy, and seeded sampled requests: one draw per token). What it changes
    is speed, and so the timing of one user's request may tell whether another user's text
    continued the same way: off by default (``--lookup-store N``), like any cross-request cache.

    At most ``capacity`` tokens: past it the older half is dropped (the tables are rebuilt from
    the rest, so the cost stays linear in what is added). Keys are hashes of n-grams; a
    proposal is checked against the log, so a collision only costs a miss. About 0.6 KB a token."""
    N_MIN, N_MAX = 3, 8      # longer suffixes than within a sequence: another text matches by chance more often
    SEP = -1                 # between requests: no copy runs across it
    MIN_CAPACITY = 64
    MAX_ADD = 4096           # tokens kept of one request (its end: the output and the prompt's tail),
                             # so that indexing a long prompt does not stall the step loop

    def __init__(self, capacity: int):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < self.MIN_CAPACITY:
            raise ValueError(f"lookup store capacity must be an integer >= {self.MIN_CAPACITY} tokens, got {capacity!r}")
        self.capacity = capacity
        self.log: list[int] = []
        self.after: dict[int, dict[int, int]] = {n: {} for n in range(self.N_MIN, self.N_MAX + 1)}
        self.proposals = self.matches = 0

    def __len__(self) -> int:
        return len(self.log)

    def add(self, tokens: list[int]) -> None:
        """Remember one finished request's tokens (the newest occurrence of an n-gram wins)."""
        tokens = [int(t) for t in tokens][-min(self.MAX_ADD, self.capacity - 1):]
        if not tokens:
            return
        if len(self.log) + len(tokens) + 1 > self.capacity:
            kept = self.log[len(self.log) // 2:]
            kept = kept[kept.index(self.SEP) + 1:] if self.SEP in kept else []   # whole requests only
            if len(kept) + len(tokens) + 1 > self.capacity:
                kept = []
            self.log, self.after = [], {n: {} for n in self.after}
            start = 0
            for i, tok in enumerate(kept):
                if tok == self.SEP:
                    self._extend(kept[start:i])
                    start = i + 1
        self._extend(tokens)

    def _extend(self, tokens: list[int]) -> None:
        log, base = self.log, len(self.log)
        log.extend(tokens)
        log.append(self.SEP)
        for i in range(len(tokens) - 1):   # the n-gram ending at i is followed by the token at i + 1
            for n, table in self.after.items():
                if i + 1 >= n:
                    table[hash(tuple(log[base + i + 1 - n:base + i + 1]))] = base + i + 1

    def propose(self, context: list[int], depth: int) -> list[int]:
        """Up to ``depth`` tokens that followed the latest stored occurrence of the longest
        suffix of ``context`` (``N_MAX`` down to ``N_MIN`` tokens) found; [] when none is."""
        if depth < 1:
            return []
        self.proposals += 1
        log = self.log
        for n in range(self.N_MAX, self.N_MIN - 1, -1):
            if len(context) < n:
                continue
            key = [int(t) for t in context[-n:]]
            e = self.after[n].get(hash(tuple(key)))
            if e is None or log[e - n:e] != key:
                continue
            out = []
            for tok in log[e:e + depth]:
                if tok == self.SEP:
                    break
                out.append(tok)
            if out:
                self.matches += 1
                return out
        return []

    def to_dict(self) -> dict:
        return {"tokens": len(self.log), "capacity": self.capacity, "proposals": self.proposals,
                "matches": self.matches}


class LookupUse:
    """One sequence's lookups so far: used while they keep paying. A lookup step verifies
    ``depth + 1`` rows; about half of them are rejected at once (measured on the evaluation
    sets) and the rest copy runs of several tokens, 1.6-2.2 drafts a step on average. A
    sequence whose first ``TRIAL`` lookups accepted fewer than ``MIN_MEAN`` drafts a step on
    average stops looking up (its rows cost more than they commit). Lookups in its own context
    and in the store of earlier requests (``LookupStore``) are judged apart: ``learn`` counts a
    step for the source of the latest proposal (``source``), so copies from other requests that
    do not pay do not turn off the sequence's own."""
    TRIAL, MIN_MEAN = 4, 0.5

    def __init__(self, n_min: int = N_MIN, n_max: int = N_MAX):
        self.index = LookupIndex(n_min, n_max)
        self.record = {"own": [0, 0], "store": [0, 0]}   # source -> [steps, drafts accepted]
        self.source = "own"

    @property
    def steps(self) -> int:
        return self.record["own"][0]

    @property
    def accepted(self) -> int:
        return self.record["own"][1]

    def pays(self, source: str = "own") -> bool:
        steps, accepted = self.record[source]
        return steps < self.TRIAL or accepted >= self.MIN_MEAN * steps

    @property
    def paying(self) -> bool:
        return self.pays("own")

    def learn(self, accepted: int) -> None:
        rec = self.record[self.source]
        rec[0] += 1
        rec[1] += accepted


class _NoDraft:
    """The draft-model part of a proposer without one (what the engine asks of a draft)."""
    quantize = None

    def health(self) -> dict:
        return {"status": "ok"}

    def close(self) -> None:
        pass


class LookupProposer:
    """Speculation without a draft model (``--lookup N`` without ``--draft``): a step whose
    context repeats verifies the lookup's drafts (engine.speculative.lookup_drafts), every
    other step is a plain decode step. Implements the Proposer protocol
    (spec/proposer_protocol.py) with no taps and no draft context."""
    method = "lookup"
    draft = _NoDraft()
    taps: tuple[int, ...] = ()
    block_size = 1                 # a step without a lookup: one row, no draft
    sizer = batch_sizer = None
    tree_budget = 0
    lookup_store = None            # LookupStore (--lookup-store), set by the loader
    sampled_verify = "exact"       # lookups are verified by exact match, sampled or not
    vocab = None

    def __init__(self, pipeline, lookup: int):
        if not 1 <= lookup <= MAX_DEPTH:
            raise ValueError(f"lookup depth must be in [1, {MAX_DEPTH}], got {lookup}")
        self.pipeline, self.lookup_depth = pipeline, int(lookup)

    def select(self, lane: int) -> None:
        pass

    def reset(self) -> None:
        pass

    def add_context(self, captures, start: int, n: int | None = None, defer: bool = False) -> None:
        pass

    def add_rows(self, captures, lanes: list[int], positions: list[int]) -> None:
        pass

    def snapshot(self) -> dict:
        return {}      # no draft context (the prefix cache keeps none for a proposer without taps)

    def restore(self, tensors: dict) -> None:
        pass

    def uses_tree(self, pipeline) -> bool:
        return False

    def batch_verify(self, pipeline) -> bool:
        return False   # lookups run for a sequence alone: a batch decodes plain rows (see above)

    def rejection_sampling(self, sampling) -> bool:
        return False

    def draft_ahead(self, items) -> None:
        pass

    def propose(self, anchor: int, start: int, block: int) -> list[int]:
        return []

    def propose_tree(self, anchor: int, start: int, block: int, budget: int):
        raise RuntimeError("prompt lookup alone drafts no trees")

    def propose_sampled(self, anchor: int, start: int, block: int, sampling, generator):
        raise RuntimeError("prompt lookup alone drafts no sampled tokens")
