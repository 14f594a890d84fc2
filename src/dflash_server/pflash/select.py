"""Which chunks of a prompt survive compression, from per-token scores (no model here).

The prompt is cut into chunks of ``chunk`` tokens. Each token's score is smoothed by
average pooling, a chunk scores the mean of its tokens, and the ``keep_ratio`` best chunks
survive, after the forced ones:

- the first ``head_chunks`` and last ``tail_chunks`` chunks (the system prompt and the
  question with the template's generation prompt); they take at most half the budget and
  shrink in proportion beyond that (the tail keeps at least one chunk). The seed shrinks
  them only past the whole budget, which suits its 64K-128K prompts; at the 2K-8K prompts
  of a CPU the 32 forced chunks (1024 tokens) would be the whole budget and no chunk
  would be chosen by its score;
- anchors: a ``ngram``-token sequence of the query's last ``query_tokens`` tokens that
  also occurs earlier in the prompt (a document pasted into the question included) forces
  the chunks around each earlier occurrence (``anchor_radius`` tokens on either side, or
  just its own chunks when that does not fit), unless it occurs more than
  ``max_anchor_hits`` times there (a common phrase says nothing about where to look);
  rarest n-grams first, all of one n-gram's places or none, within a quarter of the
  budget (at least 2 chunks; a repetitive document would otherwise force most of itself);
- the query's own chunks, when fewer than ``survival`` of its tokens would survive and it
  is shorter than ``survival_max_query`` tokens and than the budget (the query-survival
  rule; a "query" longer than the whole budget is the document pasted with the question,
  which the rule cannot keep whole).

Spans come back merged and in prompt order, so the kept ids are a subsequence of the prompt.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SelectParams:
    chunk: int = 32
    head_chunks: int = 8
    tail_chunks: int = 24
    pool_kernel: int = 13
    query_tokens: int = 96
    ngram: int = 4
    anchor_radius: int = 16          # tokens around an anchor's place kept with it
    max_anchor_hits: int = 8
    survival: float = 0.8
    survival_max_query: int = 1000

    def __post_init__(self):
        if self.chunk < 1 or self.pool_kernel < 1 or self.ngram < 1 or self.query_tokens < 0:
            raise ValueError("chunk, pool_kernel and ngram must be >= 1, query_tokens >= 0")
        if min(self.head_chunks, self.tail_chunks, self.anchor_radius, self.max_anchor_hits) < 0:
            raise ValueError("head_chunks, tail_chunks, anchor_radius and max_anchor_hits must be >= 0")
        if not 0.0 <= self.survival <= 1.0:
            raise ValueError("survival must be in [0, 1]")


@dataclass
class Selection:
    spans: list[tuple[int, int]]     # kept [start, end) token ranges, in order, disjoint, not touching
    kept_chunks: int
    total_chunks: int
    anchor_chunks: int = 0           # chunks forced by anchors (beyond head and tail)
    query_forced: bool = False       # the query-survival rule added the query's chunks

    @property
    def kept_tokens(self) -> int:
        return sum(e - s for s, e in self.spans)

    def take(self, ids):
        """The kept ids of ``ids`` (a subsequence, in order)."""
        return [t for s, e in self.spans for t in ids[s:e]]


def smooth(scores: np.ndarray, kernel: int) -> np.ndarray:
    """Average pooling with a centred window of ``kernel`` tokens (edges: the window's part
    inside the prompt)."""
    x = np.asarray(scores, dtype=np.float64)
    if kernel <= 1 or x.size == 0:
        return x.copy()
    c = np.concatenate([[0.0], np.cumsum(x)])
    half = kernel // 2
    lo = np.clip(np.arange(x.size) - half, 0, x.size)
    hi = np.clip(np.arange(x.size) + kernel - half, 0, x.size)
    return (c[hi] - c[lo]) / (hi - lo)


def chunk_scores(scores: np.ndarray, chunk: int) -> np.ndarray:
    n = len(scores)
    n_chunks = math.ceil(n / chunk)
    padded = np.zeros(n_chunks * chunk)
    padded[:n] = scores
    counts = np.full(n_chunks, chunk, dtype=np.float64)
    counts[-1] = n - (n_chunks - 1) * chunk
    return padded.reshape(n_chunks, chunk).sum(1) / counts


def anchor_positions(ids, query: tuple[int, int], p: SelectParams) -> list[list[int]]:
    """Per n-gram of the query's last ``query_tokens`` tokens, its start positions before
    those tokens (n-grams with more than ``max_anchor_hits`` there left out), rarest first."""
    q0, q1 = query
    t0 = max(q0, q1 - p.query_tokens)
    tail = list(ids[t0:q1])
    n = p.ngram
    if len(tail) < n or t0 < n:
        return []
    grams = {tuple(tail[i:i + n]) for i in range(len(tail) - n + 1)}
    hits: dict[tuple, list[int]] = {}
    body = list(ids[:t0])   # everything before the query's tail: a document pasted in the message too
    for i in range(len(body) - n + 1):
        g = tuple(body[i:i + n])
        if g in grams:
            hits.setdefault(g, []).append(i)
    return sorted((w for w in hits.values() if len(w) <= p.max_anchor_hits), key=lambda w: (len(w), w[0]))


def survived(query_ids, kept_ids) -> float:
    """The fraction of ``query_ids`` found, in order, in ``kept_ids`` (greedy subsequence match)."""
    if not query_ids:
        return 1.0
    j, hit = 0, 0
    for t in query_ids:
        k = j
        while k < len(kept_ids) and kept_ids[k] != t:
            k += 1
        if k < len(kept_ids):
            hit += 1
            j = k + 1
    return hit / len(query_ids)


def select(scores, ids, keep_ratio: float, p: SelectParams = SelectParams(),
           query: tuple[int, int] | None = None) -> Selection:
    """Choose the kept spans of a prompt of ``len(ids)`` tokens from per-token ``scores``.
    ``query``: the [start, end) token range of the last user message, if known (anchors and
    the survival rule use it; without it the prompt's last ``query_tokens`` tokens give
    the anchors)."""
    n = len(ids)
    if len(scores) != n:
        raise ValueError(f"{len(scores)} scores for {n} tokens")
    if not 0.0 < keep_ratio <= 1.0:
        raise ValueError(f"keep ratio must be in (0, 1], got {keep_ratio}")
    if n == 0:
        return Selection([], 0, 0)
    if query is not None and not 0 <= query[0] <= query[1] <= n:
        raise ValueError(f"query range {query} outside the prompt of {n} tokens")
    n_chunks = math.ceil(n / p.chunk)
    n_keep = max(1, min(n_chunks, int(n_chunks * keep_ratio)))
    head, tail = p.head_chunks, p.tail_chunks
    cap = max(1, n_keep // 2)
    if head + tail > cap:           # head and tail take at most half the budget: shrink both
        head = int(cap * head / (head + tail))
        tail = max(1 if p.tail_chunks else 0, cap - head)
    keep = np.zeros(n_chunks, dtype=bool)
    keep[:head] = True
    if tail:
        keep[max(0, n_chunks - tail):] = True
    forced_base = keep.copy()
    q = query if query is not None else (max(0, n - p.query_tokens), n)
    anchor_cap = max(2, n_keep // 4)   # anchors force at most a quarter of the budget, rarest n-grams first
    for where in anchor_positions(ids, q, p):
        for radius in (p.anchor_radius, 0):   # with its surroundings if they fit, else the bare place
            trial = keep.copy()
            for pos in where:
                c0 = max(0, pos - radius) // p.chunk
                c1 = min(n - 1, pos + p.ngram - 1 + radius) // p.chunk
                trial[c0:c1 + 1] = True
            if int((trial & ~forced_base).sum()) <= anchor_cap:
                keep = trial
                break
    anchors = int((keep & ~forced_base).sum())
    budget = n_keep - int(keep.sum())
    if budget > 0:
        cs = chunk_scores(smooth(scores, p.pool_kernel), p.chunk)
        order = np.argsort(-cs, kind="stable")   # best first; ties: earlier chunk first
        free = order[~keep[order]][:budget]
        keep[free] = True
    query_forced = False
    q_len = query[1] - query[0] if query is not None else 0
    if 0 < q_len < min(p.survival_max_query, n_keep * p.chunk):
        sel = _spans(keep, p.chunk, n)
        qids = list(ids[query[0]:query[1]])
        if survived(qids, Selection(sel, 0, 0).take(ids)) < p.survival:
            before = keep.copy()
            keep[query[0] // p.chunk:(query[1] - 1) // p.chunk + 1] = True
            query_forced = bool((keep & ~before).any())
    return Selection(_spans(keep, p.chunk, n), int(keep.sum()), n_chunks, anchors, query_forced)


def _spans(keep: np.ndarray, chunk: int, n: int) -> list[tuple[int, int]]:
    spans: list[tuple[int, int]] = []
    for c in np.flatnonzero(keep):
        s, e = int(c) * chunk, min(n, (int(c) + 1) * chunk)
        if spans and spans[-1][1] == s:
            spans[-1] = (spans[-1][0], e)
        else:
            spans.append((s, e))
    return spans
