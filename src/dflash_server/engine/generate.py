"""The generation loop (one sequence at a time): prefill, then decode until a stop.

Speculative decoding and prefix caching plug in here later without changing the
request/result types, so callers (CLI, HTTP server) stay the same.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from .detok import IncrementalDetokenizer
from .sampling import Sampler, SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if not self.prompt_ids:
            raise ValueError("prompt is empty")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str          # "stop" | "length" | "cancelled"
    prompt_tokens: int
    prefill_s: float = 0.0
    decode_s: float = 0.0
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


class Engine:
    def __init__(self, pipeline, *, chunk: int = 512):
        self.pipeline = pipeline
        self.tokenizer = pipeline.tokenizer
        self.chunk = chunk

    def generate(self, req: GenerationRequest, on_text: Callable[[str], None] | None = None,
                 cancelled: Callable[[], bool] | None = None) -> GenerationResult:
        pipe, prompt = self.pipeline, list(req.prompt_ids)
        if len(prompt) + 1 > pipe.max_ctx:
            raise ValueError(f"prompt has {len(prompt)} tokens; the context size is {pipe.max_ctx}")
        stop_ids = set(req.stop_token_ids)
        if not req.ignore_eos:
            stop_ids |= set(self.tokenizer.eos_token_ids)
        sampler = Sampler(req.sampling, pipe.config.vocab_size, pipe.device, prompt)
        detok = IncrementalDetokenizer(self.tokenizer, skip_ids=tuple(stop_ids))
        pieces: list[str] = []

        def emit(text: str):
            if text:
                pieces.append(text)
                if on_text:
                    on_text(text)

        t0 = time.perf_counter()
        pipe.reset()
        logits = pipe.prefill(prompt, chunk=self.chunk).logits[-1]
        t1 = time.perf_counter()
        out: list[int] = []
        finish = "length"
        pos = len(prompt)
        while True:
            tok = sampler.sample(logits)
            sampler.accept(tok)
            out.append(tok)
            if tok in stop_ids:
                finish = "stop"
                break
            emit(detok.push(tok))
            if len(out) >= req.max_tokens or pos + 1 >= pipe.max_ctx:
                break
            if cancelled is not None and cancelled():
                finish = "cancelled"
                break
            logits = pipe.forward([tok], pos).logits[-1]
            pos += 1
        emit(detok.flush())
        t2 = time.perf_counter()
        return GenerationResult(out, "".join(pieces), finish, len(prompt), t1 - t0, t2 - t1)
