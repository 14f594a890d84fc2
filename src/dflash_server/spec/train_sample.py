"""Sampling the target for draft-training data: continuations of prompts with the tapped
layers' features, the target's argmax and its most likely tokens at every position.

Two ways to draw B continuations at once:

- **sequence slots** (``build_pipeline(..., lanes=B)``, what ``train-draft`` uses on a CPU):
  each continuation decodes one row of a batched forward (``forward_rows``), each row's
  result as alone. ``sample_stream`` keeps the slots busy: the slots form B/K groups of K
  continuations of one prompt, and as soon as a group's continuations have all ended
  (EOS or the token limit) its samples are handed out and the next prompt is prefilled
  into its slots, while the other groups decode on. A continuation that ended leaves the
  batch at once. Each prompt samples from its own generator, so what a prompt yields
  does not depend on which prompts shared the batch or when it started (a resumed run
  writes the same data as an uninterrupted one).
- **a lockstep batch** (``batch=B``): the rows share positions, one prompt at a time.

``sample_prompt`` is one batch of either kind. The features are captured during
generation, so no second teacher-forced pass is needed (a position's feature is the layer
output when that token went through the target, as in a prefill).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from .. import kernels

TOP_K = 256  # sampling looks at the 256 most likely tokens (a full-vocabulary sort per step is slow)
SOFT_K = 16  # the target's most likely tokens kept per position, with their probabilities
PROMPT_SNAPSHOT = 1 << 30  # snapshot slot of the prompt's state while sampling (no prefix cache here)


@dataclass
class Sample:
    ids: torch.Tensor        # (L,) int64: prompt + response (EOS included when reached)
    prompt_len: int
    features: torch.Tensor   # (L-1, taps*H): tapped outputs at positions [0, L-1)
    targets: torch.Tensor | None = None  # (L,) int64: the target's argmax for each position, -1 in the prompt
    soft_ids: torch.Tensor | None = None  # (L, SOFT_K) integer: its most likely tokens there, -1 in the prompt
    soft_p: torch.Tensor | None = None    # (L, SOFT_K) float: their probabilities (0 in the prompt; fp16 when loaded)


@dataclass
class Job:
    """One prompt to continue: ``key`` comes back with its samples; the first
    ``greedy_rows`` continuations decode greedily; ``gen`` draws everything random of it."""
    key: int
    ids: list[int]
    greedy_rows: int
    gen: torch.Generator | None


def _last_logits(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """(B, V) logits of the last position for either output layout of the pipeline."""
    rows = logits[:, -1] if logits.dim() == 3 else logits[-1:]
    return rows[..., :vocab].float()


def soft_labels(vals: torch.Tensor, idx: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, probabilities) of the SOFT_K most likely tokens from ``logits.topk`` (``vals``,
    ``idx``, sorted descending): softmax at temperature 1 over the whole last dimension."""
    k = min(SOFT_K, vals.shape[-1])
    return idx[..., :k].cpu(), torch.exp(vals[..., :k] - torch.logsumexp(logits, dim=-1, keepdim=True)).cpu()


def _sample(logits: torch.Tensor, temperature: float, top_p: float, greedy: torch.Tensor, gens) -> tuple:
    """(chosen tokens, argmax tokens, soft_labels) for each row; rows where ``greedy`` is set
    take the argmax. ``gens``: one generator (or None) for all rows, or ``[(generator, n),
    ...]``: consecutive chunks of rows, each drawn with its own generator."""
    vals, idx = logits.topk(min(TOP_K, logits.shape[-1]), dim=-1)     # sorted, descending
    soft = soft_labels(vals, idx, logits)
    probs = torch.softmax(vals / max(temperature, 1e-5), dim=-1)
    if top_p < 1.0:
        probs[(probs.cumsum(-1) - probs) > top_p] = 0.0
    probs = probs.cpu()
    chunks = gens if isinstance(gens, list) else [(gens, probs.shape[0])]
    picks, r = [], 0
    for gen, n in chunks:
        picks.append(torch.multinomial(probs[r:r + n], 1, generator=gen))
        r += n
    tok = idx.cpu().gather(-1, torch.cat(picks)).squeeze(-1)
    top = kernels.argmax(logits).cpu()                              # what greedy serving picks
    return torch.where(greedy, top, tok), top, soft


def _prefill_slots(pipe, ids: list[int], lanes: range, taps: tuple[int, ...]):
    """Prefill ``ids`` in the first of ``lanes`` and copy the state into the others as a
    snapshot (the state bits a prefill of each would write, at a copy's cost). Returns the
    prompt's features (P, F) and its last logits (1, V)."""
    pipe.select(lanes[0])
    pipe.reset()
    out = pipe.prefill(ids, capture=taps)
    if len(lanes) > 1:
        pipe.snapshot_save(PROMPT_SNAPSHOT)
        try:
            for lane in lanes[1:]:
                pipe.select(lane)
                pipe.reset()
                pipe.snapshot_restore(PROMPT_SNAPSHOT)
        finally:
            pipe.snapshot_free(PROMPT_SNAPSHOT)
    feats = torch.cat([out.captures[t][:1] for t in taps], dim=-1)[0].cpu()   # rows are identical
    return feats, _last_logits(out.logits, pipe.config.vocab_size)


@dataclass
class _Group:
    """K continuations of one prompt in K sequence slots."""
    job: Job
    lanes: range
    max_new: int
    switch: torch.Tensor                   # (K,) a row decodes greedily from this token on
    prompt_feats: torch.Tensor | None = None
    n: int = 0                             # tokens sampled so far by the rows still running
    length: list[int] = field(default_factory=list)   # per row: tokens kept once ended, 0 while running
    toks: list[list[int]] = field(default_factory=list)
    tops: list[list[int]] = field(default_factory=list)
    soft: list[list[tuple]] = field(default_factory=list)
    feats: list[list[torch.Tensor]] = field(default_factory=list)

    def __post_init__(self):
        K = len(self.lanes)
        self.length = [0] * K
        self.toks, self.tops, self.soft, self.feats = ([[] for _ in range(K)] for _ in range(4))

    def running(self) -> list[int]:
        return [r for r, n in enumerate(self.length) if not n]

    def greedy(self) -> torch.Tensor:
        """Which running rows take the argmax at the next token."""
        return self.switch[self.running()] <= self.n

    def record(self, tok: torch.Tensor, top: torch.Tensor, sid: torch.Tensor, sp: torch.Tensor,
               eos: set[int]) -> bool:
        """The next token of each running row (``_sample``'s outputs, rows in ``running()``
        order); True once every row has ended."""
        rows = self.running()
        self.n += 1
        for i, r in enumerate(rows):
            t = int(tok[i])
            self.toks[r].append(t)
            self.tops[r].append(int(top[i]))
            self.soft[r].append((sid[i], sp[i]))
            if t in eos or self.n >= self.max_new:
                self.length[r] = self.n
        return all(self.length)

    def samples(self) -> list[Sample]:
        """The rows as samples (built outside inference mode: training differentiates
        through them); a row of fewer than 2 tokens is dropped."""
        return [_make_sample(self.job.ids, self.toks[r][:n], torch.tensor(self.tops[r][:n]),
                             torch.stack([s[0] for s in self.soft[r][:n]]),
                             torch.stack([s[1] for s in self.soft[r][:n]]), self.prompt_feats,
                             torch.stack(self.feats[r][:n - 1]))
                for r, n in enumerate(self.length) if n >= 2]


def _make_sample(prompt: list[int], toks: list[int], tops: torch.Tensor, sid: torch.Tensor, sp: torch.Tensor,
                 prompt_feats: torch.Tensor, feats: torch.Tensor) -> Sample:
    """A continuation of ``prompt`` as a Sample: its n tokens, the target's argmax and soft
    labels at each (``tops`` (n,), ``sid`` / ``sp`` (n, K)), the prompt's features (P, F) and
    those of the first n - 1 response tokens (``feats``)."""
    P = len(prompt)
    full = torch.tensor(prompt + toks, dtype=torch.long)
    K = sid.shape[-1]
    return Sample(full, P, torch.cat([prompt_feats, feats])[:len(full) - 1].clone(),
                  torch.cat([torch.full((P,), -1, dtype=torch.long), tops.long()]),
                  torch.cat([torch.full((P, K), -1, dtype=torch.long), sid.long()]),
                  torch.cat([torch.zeros(P, K), sp.float()]))


def sample_stream(pipe, next_job: Callable[[], Job | None], taps: tuple[int, ...], max_new: int, per: int, *,
                  temperature: float = 0.8, top_p: float = 0.95,
                  greedy_after: int = 0) -> Iterator[tuple[int, list[Sample]]]:
    """Continue prompts in the pipeline's sequence slots, ``per`` continuations each, the
    slots refilled as prompts finish: yields ``(job.key, samples)`` as each prompt's
    continuations have all ended (so out of order), and asks ``next_job()`` for the next
    prompt whenever a group of slots is free (None: none now; the stream ends when no
    group is running and none comes). Rows sample at ``temperature``
    / ``top_p``; with ``greedy_after`` > 0 each sampled row turns greedy after a random
    number of tokens in [1, greedy_after]. A continuation stops at EOS (kept) or after
    ``max_new`` tokens (fewer where the prompt leaves less room in the context)."""
    lanes = pipe.lanes
    if pipe.stages[0].batch != 1 or lanes < 2:
        raise ValueError("sample_stream needs a pipeline with sequence slots")
    if per < 1 or lanes % per:
        raise ValueError(f"{per} continuations per prompt do not divide the pipeline's {lanes} sequence slots")
    vocab, eos = pipe.config.vocab_size, set(pipe.tokenizer.eos_token_ids)
    groups: list[_Group | None] = [None] * (lanes // per)
    while True:
        for g, slot in enumerate(groups):            # refill free groups of slots
            while slot is None:
                job = next_job()
                if job is None:
                    break
                room = min(max_new, pipe.max_ctx - len(job.ids))
                if room < 1:
                    yield job.key, []
                    continue
                switch = torch.full((per,), room + 1)
                if greedy_after > 0:
                    switch = torch.randint(1, greedy_after + 1, (per,), generator=job.gen)
                switch[:job.greedy_rows] = 0
                slot = _Group(job, range(g * per, (g + 1) * per), room, switch)
                with torch.inference_mode():
                    slot.prompt_feats, first = _prefill_slots(pipe, job.ids, slot.lanes, taps)
                    tok, top, (sid, sp) = _sample(first.expand(per, -1), temperature, top_p, slot.greedy(), job.gen)
                    done = slot.record(tok, top, sid, sp, eos)
                if done:
                    yield job.key, slot.samples()
                    slot = None
            groups[g] = slot
        rows = [(g, r) for g, s in enumerate(groups) if s is not None for r in s.running()]
        if not rows:
            return
        with torch.inference_mode():
            step = pipe.forward_rows([groups[g].toks[r][-1] for g, r in rows],
                                     [groups[g].lanes[r] for g, r in rows],
                                     [len(groups[g].job.ids) + groups[g].n - 1 for g, r in rows], capture=taps)
            feats = torch.cat([step.captures[t][0] for t in taps], dim=-1).cpu()
            live = [(g, s, s.running()) for g, s in enumerate(groups) if s is not None]   # rows in this order
            greedy = torch.cat([s.greedy() for _, s, _ in live])
            tok, top, (sid, sp) = _sample(step.logits[:, :vocab].float(), temperature, top_p, greedy,
                                          [(s.job.gen, len(run)) for _, s, run in live])
            finished = []
            i = 0
            for g, s, run in live:
                for j, r in enumerate(run):
                    s.feats[r].append(feats[i + j])
                n = len(run)
                if s.record(tok[i:i + n], top[i:i + n], sid[i:i + n], sp[i:i + n], eos):
                    finished.append(g)
                i += n
        for g in finished:
            yield groups[g].job.key, groups[g].samples()
            groups[g] = None


def sample_prompt(pipe, ids, taps: tuple[int, ...], max_new: int, *, temperature: float = 0.8,
                  top_p: float = 0.95, greedy_rows: int = 1, greedy_after: int = 0,
                  gen: torch.Generator | None = None) -> list[Sample]:
    """B continuations with their features and the target's argmax at every position: B =
    the pipeline's sequence slots (``sample_stream`` over the prompts given) or its lockstep
    batch. ``ids`` is one prompt (every row continues it) or, with slots, a list of G
    prompts that divides B (B/G rows continue each; samples in prompt order). The first
    ``greedy_rows`` rows of each prompt decode greedily (what greedy serving sees); the rest
    sample, and with ``greedy_after`` > 0 each of them turns greedy after a random number of
    tokens in [1, greedy_after]."""
    lanes = pipe.lanes if pipe.stages[0].batch == 1 else 1   # B sequence slots: one decode row each
    groups = [list(p) for p in ids] if ids and not isinstance(ids[0], int) else [list(ids)]
    if len(groups) > 1 and (lanes == 1 or lanes % len(groups)):
        raise ValueError(f"{len(groups)} prompts do not divide the pipeline's {lanes} sequence slot(s)")
    if lanes > 1:
        seeds = torch.randint(1 << 62, (len(groups),), generator=gen).tolist()   # one generator per prompt
        jobs = iter(Job(i, p, greedy_rows, torch.Generator().manual_seed(s))
                    for i, (p, s) in enumerate(zip(groups, seeds)))
        got = dict(sample_stream(pipe, lambda: next(jobs, None), taps, max_new, lanes // len(groups),
                                 temperature=temperature, top_p=top_p, greedy_after=greedy_after))
        return [s for i in range(len(groups)) for s in got[i]]
    return _sample_lockstep(pipe, groups[0], taps, max_new, temperature=temperature, top_p=top_p,
                            greedy_rows=greedy_rows, greedy_after=greedy_after, gen=gen)


def _sample_lockstep(pipe, prompt: list[int], taps, max_new, *, temperature, top_p, greedy_rows, greedy_after,
                     gen) -> list[Sample]:
    """B continuations of one prompt as a lockstep batch (or one sequence): the rows share
    positions, so rows that reached EOS go on decoding (the batch keeps its shape); what
    they write after it is dropped."""
    vocab, eos = pipe.config.vocab_size, set(pipe.tokenizer.eos_token_ids)
    max_new = min(max_new, pipe.max_ctx - len(prompt))
    with torch.inference_mode():
        pipe.select(0)
        pipe.reset()
        out = pipe.prefill(prompt, capture=taps)
        prompt_feats = torch.cat([out.captures[t][:1] for t in taps], dim=-1)[0].cpu()   # rows are identical
        logits = _last_logits(out.logits, vocab)
        B = logits.shape[0]
        switch = torch.full((B,), max_new + 1)
        if greedy_after > 0:
            switch = torch.randint(1, greedy_after + 1, (B,), generator=gen)
        switch[:greedy_rows] = 0
        toks, tops, softs, feats, length = [], [], [], [], [0] * B
        for j in range(max_new):
            tok, top, soft = _sample(logits, temperature, top_p, switch <= j, gen)
            toks.append(tok)
            tops.append(top)
            softs.append(soft)
            for b in range(B):
                if not length[b] and int(tok[b]) in eos:
                    length[b] = j + 1
            if all(length) or j == max_new - 1:
                break
            step = pipe.forward(tok[:, None], len(prompt) + j, logits="last", capture=taps)
            feats.append(torch.cat([step.captures[t][:, -1] for t in taps], dim=-1).cpu())
            logits = _last_logits(step.logits, vocab)
        toks_t = torch.stack(toks, dim=1)                                       # (B, n)
        tops_t = torch.stack(tops, dim=1)
        soft_ids_t = torch.stack([s[0] for s in softs], dim=1)              # (B, n, K)
        soft_p_t = torch.stack([s[1] for s in softs], dim=1)
        feats_t = torch.stack(feats, dim=1) if feats else prompt_feats.new_zeros(B, 0, prompt_feats.shape[-1])
    samples = []  # built outside inference mode: training differentiates through these
    for b in range(B):
        n = length[b] or toks_t.shape[1]
        if n >= 2:
            samples.append(_make_sample(prompt, toks_t[b, :n].tolist(), tops_t[b, :n], soft_ids_t[b, :n],
                                        soft_p_t[b, :n], prompt_feats, feats_t[b, :n - 1]))
    return samples
