"""Step scheduling for continuous batching: which sequence holds which slot, which one
prefills how much this step, which ones decode. Bookkeeping only (no tensors), so it is
tested on its own.

Each step: waiting sequences take free slots in arrival order; the prefilling sequence
with the fewest prompt tokens left (``next_prefill``) runs a prefill forward of at most the
step's token budget left after the decode rows (its whole chunk when nothing else
decodes), and the engine goes on with it or the next ones while that budget lasts
(``Engine._prefill_step``); every sequence past prefill decodes one step. So a long prompt
costs running streams one bounded forward per step instead of a stall, a short prompt that
arrives while a long one prefills gets its first token without waiting for the whole long
prompt (shortest remaining first: the least total waiting for a first token), and a new
sequence starts as soon as a slot is free. Every step a prefilling sequence waits while
others prefill counts as a step's budget fewer tokens left, so a long prompt is passed over
for at most about as many steps as its own prefill takes.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

from .sequence import DECODE, DONE, PREFILL, WAITING

MIN_PREFILL_TOKENS = 16  # a prefill forward next to decode rows takes at least this many tokens


@dataclass
class StepPlan:
    prefill: object | None = None          # the sequence that runs a prefill forward
    prefill_tokens: int | None = None      # its budget (None: a whole chunk)
    decode: list = field(default_factory=list)
    admitted: list = field(default_factory=list)  # took a slot this step

    @property
    def empty(self) -> bool:
        return self.prefill is None and not self.decode


class StepScheduler:
    def __init__(self, lanes: int, step_tokens: int):
        if lanes < 1 or step_tokens < 1:
            raise ValueError("need at least one sequence slot and a positive step token budget")
        self.lanes, self.step_tokens = lanes, step_tokens
        self.free = list(range(lanes))
        self.waiting: collections.deque = collections.deque()
        self.prefilling: collections.deque = collections.deque()
        self.running: list = []

    def add(self, seq) -> None:
        seq.phase = WAITING
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    @property
    def active(self) -> list:
        """Sequences holding a slot, in admission order of the prefilling ones first."""
        return list(self.prefilling) + list(self.running)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        while self.waiting and self.free:
            seq = self.waiting.popleft()
            seq.lane, seq.phase = self.free.pop(0), PREFILL
            self.prefilling.append(seq)
            plan.admitted.append(seq)
        plan.decode = list(self.running)
        if self.prefilling:
            plan.prefill = self.next_prefill()
            if plan.decode:
                plan.prefill_tokens = max(MIN_PREFILL_TOKENS, self.step_tokens - len(plan.decode))
        return plan

    def next_prefill(self, skip=()):
        """The prefilling sequence to forward next (None if none but ``skip``): the fewest
        prompt tokens left, less a step's budget for every step it waited while others
        prefilled; ties in admission order."""
        cands = [s for s in self.prefilling if s not in skip]
        return min(cands, key=lambda s: s.prefill_left - s.prefill_waits * self.step_tokens) if cands else None

    def prefilled(self, served) -> None:
        """The step's prefill work is done: the prefilling sequences it did not serve waited."""
        for seq in self.prefilling:
            if seq not in served:
                seq.prefill_waits += 1

    def started(self, seq) -> None:
        """``seq`` finished its prefill: it decodes from the next step on."""
        self.prefilling.remove(seq)
        seq.phase = DECODE
        self.running.append(seq)

    def finish(self, seq) -> None:
        """``seq`` is done (finished, failed or cancelled): its slot is free again."""
        if seq.phase == WAITING:
            self.waiting.remove(seq)
        elif seq.phase == PREFILL:
            self.prefilling.remove(seq)
        elif seq.phase == DECODE:
            self.running.remove(seq)
        if seq.lane is not None:
            self.free.append(seq.lane)
            self.free.sort()
            seq.lane = None
        seq.phase = DONE
