"""Prefill through the prefix cache.

Looks up the longest cached chat-turn boundary prefix of the prompt, restores its snapshot
(target state, last logits, DFlash draft context) and prefills only the rest. The snapshot
for the next turn is taken during this prefill, at the end of the last completed turn,
and is entered into the cache only when the request succeeds (``commit``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.boundaries import TurnBoundaries
from ..cache.prefix_index import PrefixIndex


@dataclass
class Prefilled:
    logits: torch.Tensor            # last prompt position
    cached_tokens: int
    pending: tuple | None = None    # (token_ids, slot) snapshot taken during this prefill


class PrefixCache:
    def __init__(self, pipeline, index: PrefixIndex, proposer=None):
        self.pipeline, self.index, self.proposer = pipeline, index, proposer
        self.boundaries = TurnBoundaries(pipeline.tokenizer)
        self.extras: dict[int, dict] = {}  # slot -> {"logits", "draft"}

    def _run(self, ids: list[int], start: int, chunk: int) -> torch.Tensor:
        spec = self.proposer
        out = self.pipeline.prefill(ids, start=start, chunk=chunk, capture=spec.taps if spec else ())
        if spec:
            spec.add_context(out.captures, start)
        return out.logits[-1]

    def prefill(self, prompt: list[int], chunk: int) -> Prefilled:
        pipe, spec = self.pipeline, self.proposer
        pipe.reset()
        if spec:
            spec.reset()
        bounds = [b for b in self.boundaries.find(prompt) if b < len(prompt)]
        hit_len = 0
        if self.index.enabled:
            hit = self.index.lookup(prompt, bounds)
            extra = self.extras.get(hit.slot, {}) if hit else {}
            # a snapshot taken without a draft cannot serve a request that drafts
            if hit is not None and (spec is None or extra.get("draft") is not None):
                pipe.snapshot_restore(hit.slot)
                if spec:
                    spec.restore(extra["draft"])
                hit_len = hit.length
        start = hit_len
        save_at = max((b for b in bounds if b > start), default=None)
        pending = None
        if save_at is not None and self.index.enabled and not self.index.contains(prompt[:save_at]):
            logits = self._run(prompt[start:save_at], start, chunk)
            slot = self.index.new_slot()
            pipe.snapshot_save(slot)
            self.extras[slot] = {"logits": logits.clone(), "draft": spec.snapshot() if spec else None}
            pending = (tuple(prompt[:save_at]), slot)
            start = save_at
        try:
            logits = self._run(prompt[start:], start, chunk)
        except BaseException:
            self.discard(pending)
            raise
        return Prefilled(logits, hit_len, pending)

    def commit(self, pending) -> None:
        if pending is None:
            return
        token_ids, slot = pending
        nbytes = self.pipeline.snapshot_nbytes(slot) + sum(
            t.numel() * t.element_size() for t in (self.extras[slot].get("draft") or {}).values())
        if not self.index.fits(nbytes):
            self.discard(pending)
            return
        for old in self.index.insert(token_ids, slot, nbytes):
            self._free(old.slot)

    def discard(self, pending) -> None:
        if pending is not None:
            self._free(pending[1])

    def _free(self, slot: int) -> None:
        self.pipeline.snapshot_free(slot)
        self.extras.pop(slot, None)

    def stats(self) -> dict:
        return self.index.stats()
