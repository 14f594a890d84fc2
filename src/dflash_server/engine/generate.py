"""The generation loop (one sequence at a time): prefill, then decode until a stop.

Callers (CLI, HTTP server) see only ``GenerationRequest`` -> ``TokenEvent``s ->
``GenerationResult``; speculative decoding and prefix caching plug in underneath. The
engine is not thread-safe: one generation at a time (the server queues requests).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable


from ..errors import Cancelled
from ..runtime.kv_pool import merge_stats
from .output import OutputBuilder, ThinkBudget, TokenEvent
from .sampling import Sampler, SamplingParams
from .speculative import SpecStats, speculative_decode

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
    cache_scope: str | None = None      # prefix cache: "off" | "memory" | "full" | None (default)

    def __post_init__(self):
        if not self.prompt_ids:
            raise ValueError("prompt is empty")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        if self.cache_scope not in (None, "off", "memory", "full"):
            raise ValueError(f"cache scope must be off, memory or full, got {self.cache_scope!r}")
        if self.think_budget is not None and (self.think_budget < 0 or not self.think_close_ids):
            raise ValueError("think_budget needs a non-negative budget and think_close_ids")


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


class Engine:
    def __init__(self, pipeline, *, chunk: int = 512, proposer=None, prefix_slots: int = 0,
                 prefix_bytes: int | None = None, disk_cache=None, checkpoint_interval: int = 0):
        """``proposer``: a DFlashProposer for speculative decoding (None: plain decoding).
        ``prefix_slots``: in-memory prefix-cache snapshots (0 disables), with an optional
        byte budget; ``disk_cache``: a cache.disk.DiskCache for restart-persistent snapshots;
        ``checkpoint_interval`` > 0: during long generations, write a disk snapshot every
        that many tokens (the next turn, which resends the answer, resumes from it)."""
        self.checkpoint_interval = checkpoint_interval
        from ..cache.prefix_index import PrefixIndex
        from .prefix import PrefixCache

        self.pipeline = pipeline
        self.tokenizer = pipeline.tokenizer
        self.chunk = chunk
        self.proposer = proposer
        self.prefix_cache = PrefixCache(pipeline, PrefixIndex(prefix_slots, prefix_bytes), proposer, disk_cache)

    def generate(self, req: GenerationRequest, on_event: Callable[[TokenEvent], None] | None = None,
                 cancelled: Callable[[], bool] | None = None) -> GenerationResult:
        """Run one request to completion. ``on_event`` gets each token as it is produced
        (``token_id == -1`` marks a final text-only flush); ``cancelled`` is polled between
        prefill chunks and once per decode step and ends generation with finish_reason
        "cancelled"."""
        pipe, prompt = self.pipeline, list(req.prompt_ids)
        if len(prompt) >= pipe.max_ctx:
            raise ValueError(f"prompt has {len(prompt)} tokens; the context size is {pipe.max_ctx}")
        sampler = Sampler(req.sampling, pipe.config.vocab_size, pipe.device, prompt)
        out = OutputBuilder(self.tokenizer, req, on_event)
        t0 = time.perf_counter()
        try:
            pre = self.prefix_cache.prefill(prompt, self.chunk, req.cache_scope, cancelled)
        except Cancelled:
            return self._result(out, "cancelled", req, t0, time.perf_counter())
        logits = pre.logits
        t1 = time.perf_counter()
        try:
            res = self._decode(req, sampler, out, logits, cancelled, t0, t1)
        except BaseException:
            self.prefix_cache.discard(pre.pending)
            raise
        res.cached_tokens = pre.cached_tokens
        res.extra["cache"] = pre.source
        kv = pipe.kvflash_stats()
        if kv:  # summed over stages (each runs its own pool of the same size)
            res.extra["kvflash"] = merge_stats(kv)
        if res.finish_reason in ("stop", "length"):
            self.prefix_cache.commit(pre.pending)
        else:
            self.prefix_cache.discard(pre.pending)
        return res

    def warm_up(self, max_tokens: int = 64) -> GenerationResult:
        """One throwaway greedy generation with the prefix cache off, so that lazily built
        things (``torch.compile``'s graphs: the decode step and, with a draft, the verify
        blocks, which the adaptive block size tries all of in its first steps) are built
        before the first real request rather than during it."""
        ids = self.tokenizer.encode("Count from one to twenty, one number per line.")
        room = self.pipeline.max_ctx - len(ids) - 1
        res = self.generate(GenerationRequest(tuple(ids), max_tokens=max(1, min(max_tokens, room)),
                                              ignore_eos=True, cache_scope="off"))
        sizer = getattr(self.proposer, "sizer", None)
        if sizer is not None:       # its step times included the compiles
            sizer.reset()
        return res

    def close(self) -> None:
        """Graceful shutdown: persist prefix snapshots to the disk cache, stop shard workers."""
        try:
            self.prefix_cache.close()
        finally:
            self.pipeline.close()
            if hasattr(getattr(self.proposer, "draft", None), "close"):
                self.proposer.draft.close()  # a draft in its own worker

    def health(self) -> dict:
        """{"status": "ok"} or {"status": "degraded", "error": ...} while a shard worker restarts."""
        h = self.pipeline.health()
        draft = getattr(self.proposer, "draft", None)
        dh = draft.health() if h["status"] == "ok" and hasattr(draft, "health") else {"status": "ok"}
        if dh["status"] != "ok":
            return {"status": "degraded", "error": dh["error"], "stage": "draft"}
        return h

    def _checkpointer(self, req, out):
        """on_commit(length, logits) writing a disk snapshot every checkpoint_interval tokens."""
        cache, every = self.prefix_cache, self.checkpoint_interval
        if every <= 0 or cache.disk is None or req.cache_scope in ("off", "memory"):
            return None
        prompt = list(req.prompt_ids)
        due = [len(prompt) + every]

        def on_commit(length: int, logits) -> None:
            if length >= due[0]:
                ids = prompt + out.tokens[:length - len(prompt)]
                if len(ids) == length:
                    cache.checkpoint(ids, logits)
                due[0] = length + every
        return on_commit

    def _decode(self, req, sampler, out, logits, cancelled, t0, t1) -> GenerationResult:
        pipe, spec = self.pipeline, self.proposer
        pos = len(req.prompt_ids)
        finish = "length"
        think = ThinkBudget(req)
        on_commit = self._checkpointer(req, out)
        if spec:
            return self._speculative(req, sampler, out, think, logits, pos, cancelled, t0, t1, on_commit)
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
            if on_commit is not None:
                on_commit(pos, logits)
        return self._result(out, finish, req, t0, t1)

    def _speculative(self, req, sampler, out, think, logits, pos, cancelled, t0, t1, on_commit) -> GenerationResult:
        stats = SpecStats(self.proposer.block_size)
        tok = think.next_forced()
        if tok is None:
            tok = sampler.sample(logits)
        think.observe(tok)
        sampler.accept(tok)
        finish = "stop"
        if not out.add(tok, logits):
            finish = speculative_decode(self.pipeline, self.proposer, sampler, out, think, tok, pos,
                                        req.max_tokens, stats, cancelled, on_commit)
        res = self._result(out, finish, req, t0, t1)
        res.extra["spec"] = stats.to_dict()
        return res

    def _result(self, out, finish, req, t0, t1) -> GenerationResult:
        out.close(finish)
        t2 = time.perf_counter()
        return GenerationResult(out.tokens, "".join(out.pieces), out.finish, len(req.prompt_ids), t1 - t0,
                                t2 - t1, stop_reason=out.stop_reason, logprobs=out.events)
