"""The generation loop (one sequence at a time): prefill, then decode until a stop.

Callers (CLI, HTTP server) see only ``GenerationRequest`` -> ``TokenEvent``s ->
``GenerationResult``; speculative decoding and prefix caching plug in underneath. The
engine is not thread-safe: one generation at a time (the server queues requests).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .detok import IncrementalDetokenizer
from .sampling import Sampler, SamplingParams
from .stops import StopStringMatcher

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()          # stop strings: generation ends there, excluded from text
    logprobs: int | None = None         # None: off; k >= 0: chosen token + k alternatives
    # reasoning budget: at most ``think_budget`` tokens inside <think>..</think>, then the
    # engine force-feeds ``think_close_ids`` (e.g. the tokens of "\n</think>\n\n")
    think_budget: int | None = None
    think_open: bool = False            # the prompt ends inside an open think block
    think_start_id: int | None = None
    think_end_id: int | None = None
    think_close_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.prompt_ids:
            raise ValueError("prompt is empty")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        if self.think_budget is not None and (self.think_budget < 0 or not self.think_close_ids):
            raise ValueError("think_budget needs a non-negative budget and think_close_ids")


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

    def observe(self, token: int) -> None:
        r = self.req
        if token == r.think_start_id:
            self.inside = True
        elif token == r.think_end_id:
            self.inside = False
        elif self.inside:
            self.used += 1


@dataclass
class TokenEvent:
    """One generated token. ``text`` is the text released with it: possibly empty (an
    incomplete UTF-8 character or a possible stop-string prefix is held back)."""
    token_id: int
    text: str
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str          # "stop" | "length" | "cancelled"
    prompt_tokens: int
    prefill_s: float = 0.0
    decode_s: float = 0.0
    cached_tokens: int = 0      # prompt tokens restored from a cache instead of prefilled
    stop_reason: str | int | None = None  # matched stop string or stop token id
    logprobs: list[TokenEvent] | None = None
    extra: dict = field(default_factory=dict)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def decode_tokens_per_s(self) -> float:
        # the first token comes from the prefill logits; decode produced the rest
        n = max(0, self.completion_tokens - 1)
        return n / self.decode_s if self.decode_s > 0 else 0.0

    def timings(self) -> dict:
        return {"prefill_s": round(self.prefill_s, 4), "decode_s": round(self.decode_s, 4),
                "prefill_tokens_per_s": round(self.prompt_tokens / self.prefill_s, 2) if self.prefill_s else 0.0,
                "decode_tokens_per_s": round(self.decode_tokens_per_s, 2)}


class _Output:
    """Turns sampled tokens into events, text and a finish decision."""

    def __init__(self, engine: "Engine", req: GenerationRequest, on_event):
        self.req, self.on_event = req, on_event
        self.stop_ids = set(req.stop_token_ids)
        if not req.ignore_eos:
            self.stop_ids |= set(engine.tokenizer.eos_token_ids)
        self.detok = IncrementalDetokenizer(engine.tokenizer, skip_ids=tuple(self.stop_ids))
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


class Engine:
    def __init__(self, pipeline, *, chunk: int = 512):
        self.pipeline = pipeline
        self.tokenizer = pipeline.tokenizer
        self.chunk = chunk

    def generate(self, req: GenerationRequest, on_event: Callable[[TokenEvent], None] | None = None,
                 cancelled: Callable[[], bool] | None = None) -> GenerationResult:
        """Run one request to completion. ``on_event`` gets each token as it is produced
        (``token_id == -1`` marks a final text-only flush); ``cancelled`` is polled once per
        decode step and ends generation with finish_reason "cancelled"."""
        pipe, prompt = self.pipeline, list(req.prompt_ids)
        if len(prompt) >= pipe.max_ctx:
            raise ValueError(f"prompt has {len(prompt)} tokens; the context size is {pipe.max_ctx}")
        sampler = Sampler(req.sampling, pipe.config.vocab_size, pipe.device, prompt)
        out = _Output(self, req, on_event)
        t0 = time.perf_counter()
        pipe.reset()
        logits = pipe.prefill(prompt, chunk=self.chunk).logits[-1]
        t1 = time.perf_counter()
        pos = len(prompt)
        finish = "length"
        think = ThinkBudget(req)
        while True:
            tok = think.next_forced()
            if tok is None:
                tok = sampler.sample(logits)
            think.observe(tok)
            sampler.accept(tok)
            if out.add(tok, logits):
                break
            if pos + 1 >= pipe.max_ctx:
                break
            if cancelled is not None and cancelled():
                finish = "cancelled"
                break
            logits = pipe.forward([tok], pos).logits[-1]
            pos += 1
        out.close(finish)
        t2 = time.perf_counter()
        return GenerationResult(out.tokens, "".join(out.pieces), out.finish, len(prompt), t1 - t0, t2 - t1,
                                stop_reason=out.stop_reason, logprobs=out.events)
