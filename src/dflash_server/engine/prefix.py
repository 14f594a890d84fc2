"""Prefill through the prefix cache (memory slots, then disk).

Looks up the longest cached chat-turn boundary prefix of the prompt, restores its snapshot
(target state, last logits, DFlash draft context) and prefills only the rest. The snapshot
for the next turn is taken during this prefill, at the end of the last completed turn,
and enters the cache only when the request succeeds (``commit``); committed snapshots are
also written to the disk cache (in the background) when one is configured.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.boundaries import TurnBoundaries
from ..cache.prefix_index import PrefixIndex
from ..runtime.pipeline import drain

SCOPES = ("off", "memory", "full")  # per request; None = the server's default


@dataclass
class Prefilled:
    logits: torch.Tensor            # last prompt position
    cached_tokens: int
    pending: tuple | None = None    # (token_ids, slot, scope) snapshot taken during this prefill
    source: str | None = None       # "memory" | "disk" for a hit


class PrefixCache:
    def __init__(self, pipeline, index: PrefixIndex, proposer=None, disk=None):
        self.pipeline, self.index, self.proposer, self.disk = pipeline, index, proposer, disk
        # a snapshot holds the draft's context beside the target's state, where there is a draft
        # (prompt lookup alone keeps no context: its snapshots are the plain engine's)
        self.drafts = proposer is not None and bool(proposer.taps)
        self.boundaries = TurnBoundaries(pipeline.tokenizer)
        self.extras: dict[int, dict] = {}  # slot -> {"logits", "draft"}
        self.epoch = pipeline.epoch

    @property
    def enabled(self) -> bool:
        return self.index.enabled or self.disk is not None

    def _run(self, ids: list[int], start: int, chunk: int):
        spec = self.proposer
        out = yield from self.pipeline.prefill_steps(ids, start, chunk, spec.taps if spec else ())
        if spec:
            spec.add_context(out.captures, start)
        return out.logits[-1]

    def _restore(self, slot: int) -> bool:
        extra = self.extras.get(slot, {})
        if self.drafts and extra.get("draft") is None:
            return False  # taken without a draft: cannot serve a request that drafts
        self.pipeline.snapshot_restore(slot)
        if self.drafts:
            self.proposer.restore(extra["draft"])
        return True

    def _from_disk(self, prompt, longer_than: int):
        # any stored length works (turn boundaries and mid-answer checkpoints): the ids are
        # compared exactly, and the state of a prefix is the state of a prefix
        got = self.disk.lookup(prompt, range(longer_than + 1, len(prompt)))
        if got is None:
            return None
        entry, tensors = got
        slot = self.index.new_slot()
        draft = {k[len("dflash."):]: v for k, v in tensors.items() if k.startswith("dflash.")}
        try:
            self.pipeline.snapshot_import(slot, {k: v for k, v in tensors.items() if k.startswith("ls")})
            if self.drafts:
                if not draft:
                    raise ValueError("snapshot has no draft context")
                self.proposer.restore(draft)  # validates shapes now, restored again below
        except (ValueError, KeyError) as e:
            self.pipeline.snapshot_free(slot)
            self.disk.invalidate(entry, f"does not fit this model: {e}")
            return None
        self.extras[slot] = {"logits": tensors.get("logits"), "draft": draft or None}
        return entry.token_ids, slot

    def prefill(self, prompt: list[int], chunk: int, scope: str | None = None, cancelled=None) -> Prefilled:
        """``cancelled``: polled between prefill chunks (raises errors.Cancelled; nothing is
        committed to the cache)."""
        return drain(self.prefill_steps(prompt, chunk, scope), cancelled)

    def prefill_steps(self, prompt: list[int], chunk: int, scope: str | None = None):
        """``prefill`` as a generator of forwards (``TargetPipeline.prefill_steps``) on the
        selected sequence slot; returns the ``Prefilled``. Closing it early discards the
        snapshot it took."""
        pipe, spec = self.pipeline, self.proposer
        if pipe.epoch != self.epoch:
            self.drop_memory()
        pipe.reset()
        if spec:
            spec.reset()
        use = self.enabled and scope != "off"
        bounds = [b for b in self.boundaries.find(prompt) if b < len(prompt)] if use else []
        hit_len, source = 0, None
        if use and self.index.enabled:
            hit = self.index.lookup(prompt, bounds)
            if hit is not None and self._restore(hit.slot):
                hit_len, source = hit.length, "memory"
        if use and self.disk is not None:
            got = self._from_disk(prompt, hit_len)
            if got is not None:
                ids, slot = got
                self._restore(slot)
                hit_len, source = len(ids), "disk"
                if self.index.enabled and self.index.fits(self._nbytes(slot)):
                    for old in self.index.insert(ids, slot, self._nbytes(slot)):
                        if old.slot != slot:
                            self._free(old.slot)
                else:   # (a snapshot larger than the memory budget was kept nowhere: freed)
                    self._free(slot)
        start = hit_len
        save_at = max((b for b in bounds if b > start), default=None)
        pending = None
        if save_at is not None and not self.index.contains(prompt[:save_at]):
            logits = yield from self._run(prompt[start:save_at], start, chunk)
            slot = self.index.new_slot()
            pipe.snapshot_save(slot)
            self.extras[slot] = {"logits": logits.clone(), "draft": spec.snapshot() if self.drafts else None}
            pending = (tuple(prompt[:save_at]), slot, scope)
            start = save_at
        try:
            logits = yield from self._run(prompt[start:], start, chunk)
        except BaseException:
            self.discard(pending)
            raise
        return Prefilled(logits, hit_len, pending, source)

    def _nbytes(self, slot: int) -> int:
        return self.pipeline.snapshot_nbytes(slot) + sum(
            t.numel() * t.element_size() for t in (self.extras[slot].get("draft") or {}).values())

    def export(self, slot: int) -> dict[str, torch.Tensor]:
        """Flat tensor dict of a snapshot (every shard, last logits, draft context)."""
        out = dict(self.pipeline.snapshot_export(slot))
        extra = self.extras[slot]
        if extra.get("logits") is not None:
            out["logits"] = extra["logits"].detach().cpu()
        for k, v in (extra.get("draft") or {}).items():
            out[f"dflash.{k}"] = v.detach().cpu()
        return out

    def commit(self, pending) -> None:
        if pending is None:
            return
        token_ids, slot, scope = pending
        if self.disk is not None and scope != "memory":
            self.disk.save(token_ids, self.export(slot), force=scope == "full")
        # a request that kept its prefix off the disk keeps it off at shutdown too (close)
        self.extras[slot]["memory_only"] = scope == "memory"
        if not self.index.fits(self._nbytes(slot)):
            self._free(slot)
            return
        for old in self.index.insert(token_ids, slot, self._nbytes(slot)):
            self._free(old.slot)

    def discard(self, pending) -> None:
        if pending is not None:
            self._free(pending[1])

    def checkpoint(self, token_ids: list[int], logits: torch.Tensor) -> None:
        """Write the current state (positions of ``token_ids``) to the disk cache; the
        memory slots are left alone (a long answer is resumed after a restart or by the
        next turn, which resends it). Skipped while an earlier write is still queued: only
        the latest checkpoint is worth keeping, and each copy costs the whole state."""
        if self.disk.backlog():
            return
        slot = self.index.new_slot()
        try:
            self.pipeline.snapshot_save(slot)
            self.extras[slot] = {"logits": logits.detach().clone(),
                                 "draft": self.proposer.snapshot() if self.drafts else None}
            self.disk.save(token_ids, self.export(slot), force=True)
        finally:
            self._free(slot)

    def drop_memory(self) -> None:
        """Forget every in-memory snapshot: a shard worker restarted and lost its part."""
        for e in list(self.index.entries.values()):
            self.index.remove(e.key)
            self._free(e.slot)
        self.epoch = self.pipeline.epoch

    def _free(self, slot: int) -> None:
        self.pipeline.snapshot_free(slot)
        self.extras.pop(slot, None)

    def close(self) -> None:
        """Graceful shutdown: write memory snapshots that are not on disk yet, then flush."""
        if self.disk is None:
            return
        for e in list(self.index.entries.values()):
            if not self.extras.get(e.slot, {}).get("memory_only") and not self.disk.contains(e.token_ids):
                self.disk.save(e.token_ids, self.export(e.slot), wait=True)
        self.disk.close()

    def stats(self) -> dict:
        out = {"memory": self.index.stats()}
        if self.disk is not None:
            out["disk"] = self.disk.stats()
        return out
