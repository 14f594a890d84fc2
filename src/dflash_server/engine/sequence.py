"""One request in the engine: everything that belongs to a single sequence.

A ``Sequence`` owns its prompt, sampled tokens, position, sampler and RNG, reasoning
budget, output builder (events, stop strings, logprobs), speculative statistics, the
prefix-cache snapshot it took, and its sequence slot while it holds one. Plain and
speculative decoding both go through ``choose`` (forced or sampled token) and
``out.add`` (the finish decision).
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from .output import OutputBuilder, ThinkBudget, TokenEvent
from .sampling import Sampler

WAITING, PREFILL, DECODE, DONE = "waiting", "prefill", "decode", "done"


class Sequence:
    def __init__(self, seq_id: int, req, tokenizer, vocab_size: int, device,
                 on_event: Callable[[TokenEvent], None] | None = None, cancelled: Callable[[], bool] | None = None,
                 tag=None, constraint=None):
        self.id, self.req, self.tag = seq_id, req, tag
        self.constraint = constraint       # engine.grammar.Constraint: masks each token's logits
        self.prompt = list(req.prompt_ids)
        self._vocab, self._device = vocab_size, device
        self.sampler = Sampler(req.sampling, vocab_size, device, self.prompt)
        self.out = OutputBuilder(tokenizer, req, on_event)
        self.think = ThinkBudget(req)
        self._cancelled = cancelled
        self.phase = WAITING
        self.lane: int | None = None       # sequence slot while admitted
        self.pos = len(self.prompt)        # position of ``last`` (sampled, not yet in the cache)
        self.last: int | None = None
        self.prefill = None                # the prefill generator while prefilling
        self.prefilled = 0                 # prompt positions in the cache (forwarded or restored)
        self.prefill_waits = 0             # steps it waited while others prefilled (the scheduler's)
        self.pre = None                    # prefix.Prefilled once prefilled
        self.spec = None                   # SpecStats when drafting
        self.lookup = None                 # spec.lookup.LookupUse: its prompt-lookup drafts
        self.compressed = None             # pflash Compressed: the prompt was compressed
        self.on_commit = None              # disk checkpointer: (length, logits)
        self.t_submit = time.monotonic()
        self.t_start: float | None = None  # slot granted: prefill begins
        self.t_decode: float | None = None  # prefill done
        self.result = None                 # GenerationResult once done
        self.error: BaseException | None = None

    def replace_prompt(self, ids: list[int]) -> None:
        """What the model reads instead of the request's prompt (PFlash), before prefill."""
        if self.prefill is not None or self.pre is not None:
            raise RuntimeError("the prompt can only be replaced before its prefill")
        self.prompt = list(ids)
        self.pos = len(self.prompt)
        self.sampler = Sampler(self.req.sampling, self._vocab, self._device, self.prompt)

    @property
    def cancelled(self) -> bool:
        return self._cancelled is not None and self._cancelled()

    @property
    def prefill_left(self) -> int:
        """Prompt tokens still to forward (before the first prefill forward: all of them,
        a prefix-cache hit is not known yet)."""
        return max(0, len(self.prompt) - self.prefilled)

    @property
    def done(self) -> bool:
        return self.phase == DONE

    def choose(self, logits) -> int:
        """The next token: forced by the reasoning budget, else sampled from ``logits``."""
        tok = self.think.next_forced()
        if tok is None:
            tok = self.sampler.sample(logits)
        self.think.observe(tok)
        self.sampler.accept(tok)
        return tok

    def commit_draft(self, logits, token: int, q) -> tuple[bool, bool]:
        """Speculative sampling: ``token`` was drawn from the draft's distribution ``q``
        (V,); keep it with probability min(1, p(token) / q(token)), p the distribution this
        sequence samples from (penalties, temperature, truncation, grammar mask), else draw
        from the residual max(0, p - q), normalized. The token committed is distributed
        exactly as p (Leviathan et al. 2023, Chen et al. 2023). Returns (finished, kept)."""
        c = self.constraint
        if c is not None:
            logits = c.mask(logits)
        p = self.sampler.probs(logits)     # (fp32, as q: the test and the residual need no fp64 copies)
        q = q[:p.shape[-1]].to(p.device, p.dtype)
        g = self.sampler.generator
        u = float(torch.rand((1,), generator=g, dtype=torch.float64, device=g.device))
        qx = float(q[token]) if 0 <= token < q.shape[-1] else 0.0
        px = float(p[token]) if 0 <= token < p.shape[-1] else 0.0
        kept = qx > 0.0 and u * qx < px
        if kept:
            tok = token
        else:
            r = (p - q).clamp_min(0.0)
            if float(r.sum()) <= 0.0:     # (p == q up to rounding: a rejection is then measure zero)
                r = p
            tok = self.sampler.draw(r)
        self.think.observe(tok)
        self.sampler.accept(tok)
        self.last = tok
        if c is not None:
            c.consume(tok)
        return self.out.add(tok, logits) or (c is not None and c.stopped and self.out.finish_stop()), kept

    def commit(self, logits) -> bool:
        """Choose and record the token ``logits`` predict (it becomes ``last``). Returns
        True when the output is finished (a stop, a stop string, max_tokens, a grammar
        that admits nothing more)."""
        c = self.constraint
        if c is not None:
            logits = c.mask(logits)
        self.last = self.choose(logits)
        if c is not None:
            c.consume(self.last)
        return self.out.add(self.last, logits) or (c is not None and c.stopped and self.out.finish_stop())
