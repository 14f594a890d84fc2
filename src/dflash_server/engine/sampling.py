"""Sampling: penalties, temperature, top-k, top-p, min-p, seeded and reproducible.

Penalty semantics follow the usual server conventions: ``repetition_penalty`` (HF style,
divides positive logits / multiplies negative ones) applies to prompt and generated
tokens; ``frequency_penalty`` / ``presence_penalty`` (OpenAI style) to generated tokens.
All processing happens on the target distribution, so speculative verification that
samples from it stays lossless.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from .. import kernels


# below this a temperature is greedy (logits / T would overflow fp32 long before a draw differs)
MIN_TEMPERATURE = 1e-5

@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None

    def __post_init__(self):
        def check(name, ok, what):
            if not ok:
                raise ValueError(f"{name} must be {what}, got {getattr(self, name)!r}")
        check("temperature", 0.0 <= self.temperature <= 100.0, "in [0, 100]")
        check("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "an integer >= 0")
        check("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]")
        check("min_p", 0.0 <= self.min_p <= 1.0, "in [0, 1]")
        check("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0, "in (0, 10]")
        check("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "in [-2, 2]")
        check("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "in [-2, 2]")
        check("seed", self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63), "in [0, 2^63)")

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one so small that logits / T overflow fp32 (1e-40 gave NaN
        probabilities: the last vocabulary id every step, or a crash with min_p): the argmax,
        as vLLM does below 1e-5."""
        return self.temperature < MIN_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)


class Sampler:
    """Per-request sampler; call ``sample`` then ``accept`` for each emitted token."""

    def __init__(self, params: SamplingParams, vocab_size: int, device, prompt_ids: list[int] = ()):
        self.params, self.vocab_size, self.device = params, vocab_size, torch.device(device)
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(2**63)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.counts = None
        self.seen = None
        if params.has_penalties:
            self.counts = torch.zeros(vocab_size, device=self.device)
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=self.device)
            ids = [i for i in prompt_ids if 0 <= i < vocab_size]
            if ids:
                self.seen[torch.tensor(ids, device=self.device)] = True

    def accept(self, token: int) -> None:
        if self.counts is not None and 0 <= token < self.vocab_size:
            self.counts[token] += 1
            self.seen[token] = True

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """Penalised logits (…, V) in fp32."""
        p = self.params
        logits = logits[..., :self.vocab_size]
        if logits.dtype != torch.float32:   # (the pipeline's are fp32: no call, no GIL hand-off, per token)
            logits = logits.float()
        if self.counts is None:
            return logits
        if p.repetition_penalty != 1.0:
            pen = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
            logits = torch.where(self.seen, pen, logits)
        if p.frequency_penalty:
            logits = logits - p.frequency_penalty * self.counts
        if p.presence_penalty:
            logits = logits - p.presence_penalty * (self.counts > 0).float()
        return logits

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution actually sampled from (after temperature and truncation), over
        the whole vocabulary."""
        if self.params.greedy:
            logits = self.process(logits)
            out = torch.zeros_like(logits)
            out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
            return out
        probs, ids = self._truncated(logits)
        if ids is None:
            return probs
        n = min(logits.shape[-1], self.vocab_size)
        return torch.zeros(n, dtype=probs.dtype, device=probs.device).scatter_(-1, ids, probs)

    def _truncated(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(probs, ids): the sampling distribution on the tokens that can survive the
        truncation (``ids``; None: every token, ``probs`` over the vocabulary), normalized.

        Temperature, then top-k (softmax over the k best), then top-p (a token is dropped
        when the mass of the more likely ones already reaches top_p; at least one stays),
        then min-p (below min_p times the best token's probability). Only candidates are
        sorted: the k best, or for top-p alone the fewest best tokens whose mass reaches
        top_p (found by widening a top-n probe), so a step costs a top-k over the vocabulary
        instead of a sort of it."""
        p = self.params
        logits = self.process(logits)
        V = logits.shape[-1]
        ids = None
        if 0 < p.top_k < V:
            vals, ids = torch.topk(logits / p.temperature, p.top_k)
            probs = torch.softmax(vals, dim=-1)
        else:
            probs = kernels.softmax_t(logits, p.temperature)   # (the vocabulary's: native on a CPU)
            if p.top_p >= 1.0 and p.min_p <= 0.0:
                return probs, None     # every token, already normalized
            if p.top_p < 1.0 and (got := kernels.top_p_candidates(probs, p.top_p)) is not None:
                probs, ids = got       # (on a CPU: one pass and a sort of the candidates)
            elif p.top_p < 1.0:
                n = min(V, 512)
                while True:
                    top, top_ids = torch.topk(probs, n)
                    # every token past the n best has at least their mass before it: dropped
                    if n == V or float(top.sum()) >= p.top_p:
                        probs, ids = top, top_ids
                        break
                    n = min(V, 4 * n)
            elif p.min_p > 0.0:
                ids = torch.nonzero(probs >= p.min_p * probs.max()).squeeze(-1)
                probs = probs[ids]
        if p.top_p < 1.0:
            drop = (probs.cumsum(-1) - probs) >= p.top_p
            probs = probs.masked_fill(drop, 0.0)
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        return probs / probs.sum(), ids

    def sample(self, logits: torch.Tensor) -> int:
        """One token from (V,) logits (inverse CDF with one uniform draw from the request's
        generator: seeded requests repeat exactly)."""
        if self.params.greedy:
            return int(kernels.argmax(self.process(logits)))
        probs, ids = self._truncated(logits)
        if ids is not None:  # the candidates in token-id order, as without truncation: ranked by
            ids, order = ids.sort()   # probability, two near-equal ones swap under a rounding-sized
            probs = probs[order]      # change and move every draw that fell in either interval
        i = self.draw(probs)
        return int(ids[i]) if ids is not None else i

    def draw(self, weights: torch.Tensor) -> int:
        """An index drawn in proportion to (V,) non-negative ``weights`` (inverse CDF, one
        uniform from the request's generator)."""
        u = torch.rand((1,), generator=self.generator, dtype=torch.float64, device=self.generator.device)
        if (i := kernels.draw(weights, float(u))) is not None:   # (on a CPU: one pass, no fp64 copy)
            return i
        cdf = weights.double().cumsum(-1)
        return min(int(torch.searchsorted(cdf, u.to(cdf.device) * cdf[-1], right=True)), cdf.shape[-1] - 1)
