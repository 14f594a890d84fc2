"""A prompt through the drafter and the selection: the ids the target prefills instead.

With ``self:N`` (or any drafter sharing the target's tokenizer) the kept ids are taken
from the prompt itself, so they are exactly a subsequence of it. A drafter of another
family reads the prompt re-tokenized in its own vocabulary: the prompt's text goes
target -> text -> drafter ids, the kept drafter ids go back to text and that text is
encoded by the target (chat markup included: the template is not rendered again).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from .select import Selection, SelectParams, select


@dataclass
class Compressed:
    ids: list[int]            # what the target prefills
    raw_tokens: int           # the prompt's length in target tokens
    drafter_tokens: int       # ... in drafter tokens
    kept_drafter_tokens: int
    keep_ratio: float
    drafter_s: float          # the drafter's forward
    total_s: float            # everything: tokenizing, forward, selection
    selection: Selection

    def describe(self) -> dict:
        s = self.selection
        return {"raw_tokens": self.raw_tokens, "compressed_tokens": len(self.ids),
                "drafter_tokens": self.drafter_tokens, "kept_drafter_tokens": self.kept_drafter_tokens,
                "keep_ratio": round(self.keep_ratio, 4), "kept_chunks": s.kept_chunks, "total_chunks": s.total_chunks,
                "anchor_chunks": s.anchor_chunks, "query_forced": s.query_forced, "spans": len(s.spans),
                "drafter_s": round(self.drafter_s, 4), "total_s": round(self.total_s, 4)}


def find_span(ids: list[int], sub: list[int]) -> tuple[int, int] | None:
    """[start, end) of the last place ``sub`` was tokenized inside ``ids``. Its first and
    last tokens may have merged with their neighbours in context, so the inner part is
    searched and the range widened back by one token on each side."""
    if not sub:
        return None
    inner = sub[1:-1] if len(sub) > 2 else sub
    m, n = len(inner), len(ids)
    first = inner[0]
    for i in range(n - m, -1, -1):
        if ids[i] == first and ids[i:i + m] == inner:
            start = i - (1 if len(sub) > 2 else 0)
            return max(0, start), min(n, start + len(sub))
    return None


class Compressor:
    def __init__(self, scorer, tokenizer, params: SelectParams = SelectParams()):
        """``scorer``: a PromptScorer; ``tokenizer``: the target's."""
        self.scorer, self.tokenizer, self.params = scorer, tokenizer, params
        d = scorer.tokenizer
        self.same_vocab = d is None or d is tokenizer
        self.drafter_tokenizer = tokenizer if d is None else d
        self.calls = 0
        self.raw_tokens = 0
        self.compressed_tokens = 0
        self.drafter_s = 0.0

    @property
    def max_tokens(self) -> int:
        """The longest prompt (in drafter tokens) the drafter reads."""
        return self.scorer.max_tokens

    def compress(self, ids: list[int], keep_ratio: float, query: str | None = None) -> Compressed:
        t0 = time.perf_counter()
        ids = list(ids)
        dtok = self.drafter_tokenizer
        if self.same_vocab:
            d_ids = ids
        else:
            d_ids = dtok.encode(self.tokenizer.decode(ids), add_bos=False)
            if not d_ids:
                raise ValueError("the drafter's tokenizer made nothing of the prompt")
        span = None
        if query:
            span = find_span(d_ids, dtok.encode(query, add_bos=False))
        scores = self.scorer.score(d_ids)
        sel = select(scores, d_ids, keep_ratio, self.params, span)
        kept = sel.take(d_ids)
        out = kept if self.same_vocab else self.tokenizer.encode(dtok.decode(kept), add_bos=False)
        if not out:
            raise ValueError("compression left nothing of the prompt")
        res = Compressed(out, len(ids), len(d_ids), len(kept), keep_ratio, self.scorer.last_s,
                         time.perf_counter() - t0, sel)
        self.calls += 1
        self.raw_tokens += len(ids)
        self.compressed_tokens += len(out)
        self.drafter_s += res.drafter_s
        return res

    def close(self) -> None:
        self.scorer.close()

    def stats(self) -> dict:
        return {"drafter": self.scorer.name, "scoring_layers": len(self.scorer.layers), "calls": self.calls,
                "raw_tokens": self.raw_tokens, "compressed_tokens": self.compressed_tokens,
                "compression_ratio": round(self.compressed_tokens / self.raw_tokens, 4) if self.raw_tokens else None,
                "drafter_s": round(self.drafter_s, 3)}
