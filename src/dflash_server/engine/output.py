"""Turning sampled tokens into events, text and a finish decision (shared by plain and
speculative decoding)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .detok import IncrementalDetokenizer
from .stops import StopStringMatcher

if TYPE_CHECKING:  # generate imports this module
    from .generate import GenerationRequest


@dataclass
class TokenEvent:
    """One generated token. ``text`` is the text released with it: possibly empty (an
    incomplete UTF-8 character or a possible stop-string prefix is held back)."""
    token_id: int
    text: str
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class ThinkBudget:
    """Counts tokens inside the think block and says which tokens to force when the
    budget runs out."""

    def __init__(self, req: GenerationRequest):
        self.req = req
        self.inside = req.think_open
        self.used = 0
        self.forced: list[int] = []

    def next_forced(self) -> int | None:
        r = self.req
        if r.think_budget is None:
            return None
        if not self.forced and self.inside and self.used >= r.think_budget:
            self.forced = list(r.think_close_ids)
        return self.forced.pop(0) if self.forced else None

    def would_force(self) -> bool:
        """Whether the next token is forced (without taking it)."""
        r = self.req
        return r.think_budget is not None and bool(self.forced or (self.inside and self.used >= r.think_budget))

    def observe(self, token: int) -> None:
        r = self.req
        if token == r.think_start_id:
            self.inside = True
        elif token == r.think_end_id:
            self.inside = False
        elif self.inside:
            self.used += 1


class OutputBuilder:
    """Turns sampled tokens into events, text and a finish decision."""

    def __init__(self, tokenizer, req, on_event):
        self.req, self.on_event = req, on_event
        self.stop_ids = set(req.stop_token_ids)
        if not req.ignore_eos:
            self.stop_ids |= set(tokenizer.eos_token_ids)
        self.detok = IncrementalDetokenizer(tokenizer, skip_ids=tuple(self.stop_ids))
        self.stops = StopStringMatcher(req.stop)
        self.tokens: list[int] = []
        self.pieces: list[str] = []
        self.events: list[TokenEvent] | None = [] if req.logprobs is not None else None
        self.finish: str | None = None
        self.stop_reason = None

    def add(self, token: int, logits: torch.Tensor | None) -> bool:
        """Record one token (``logits``: the distribution it was chosen from, for logprobs).
        Returns True when generation must end."""
        self.tokens.append(token)
        ev = TokenEvent(token, "")
        if self.req.logprobs is not None and logits is not None:
            lp = torch.log_softmax(logits.float(), dim=-1)
            ev.logprob = float(lp[token])
            if self.req.logprobs:
                top = torch.topk(lp, self.req.logprobs)
                ev.top_logprobs = [(int(i), float(v)) for v, i in zip(top.values, top.indices)]
        if token in self.stop_ids:
            self.finish, self.stop_reason = "stop", token
        else:
            text, stopped = self.stops.push(self.detok.push(token))
            ev.text = text
            if stopped:
                self.finish, self.stop_reason = "stop", self.stops.matched
            elif len(self.tokens) >= self.req.max_tokens:
                self.finish = "length"
        self._emit(ev)
        return self.finish is not None

    def finish_stop(self) -> bool:
        """End here with "stop" (a grammar that admits nothing more)."""
        self.finish = self.finish or "stop"
        return True

    def _emit(self, ev: TokenEvent):
        if ev.text:
            self.pieces.append(ev.text)
        if self.events is not None:
            self.events.append(ev)
        if self.on_event:
            self.on_event(ev)

    def close(self, finish: str) -> None:
        """Release held-back text unless a stop string ended generation."""
        self.finish = self.finish or finish
        if self.stops.matched is None:
            tail = self.stops.push(self.detok.flush())[0] + self.stops.flush()
            if tail:
                self.pieces.append(tail)
                if self.on_event:
                    self.on_event(TokenEvent(-1, tail))  # text-only event: no new token
