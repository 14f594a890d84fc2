"""The engine: a step loop over many sequences (continuous batching).

Callers see ``GenerationRequest`` -> ``TokenEvent``s -> ``GenerationResult``. ``submit``
queues a request as a ``Sequence``; each ``step`` lets the scheduler (``batching``) admit
waiting sequences into free slots, runs one prefill forward (bounded by the step's token
budget) and one decode step of every running sequence: all rows in one batched forward
(with a draft, each sequence's verify block among them), or a DFlash draft + verify for a
sequence decoding alone. ``generate`` is one sequence driven to its end (the CLI); the
server drives ``step`` from its worker thread. Speculative
decoding and prefix caching plug in underneath. Not thread-safe: one thread drives it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from ..errors import CompressionError
from ..runtime.kv_pool import merge_stats
from . import describe
from .batching import StepScheduler
from .budget import check_prompt
from .grammar import GrammarCompiler
from .output import TokenEvent
from .sampling import SamplingParams
from .sequence import Sequence
from .speculative import SpecStats, spec_begin, spec_end, speculative_rows, speculative_step

if TYPE_CHECKING:
    from ..spec.proposer_protocol import Proposer

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
    grammar: str | None = None          # llguidance grammar (engine.grammar): the output must match it
    # PFlash: keep this fraction of the prompt's chunks (None: prefill it whole); the last
    # user message's text guides the selection (anchors, query survival)
    compress: float | None = None
    compress_query: str | None = None
    speculate: bool = True              # False: this request decodes plainly even with a draft loaded

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
        if self.compress is not None and not 0.0 < self.compress <= 1.0:
            raise ValueError(f"compression keep ratio must be in (0, 1], got {self.compress}")
        if self.grammar is not None and (self.think_budget is not None or self.think_open):
            raise ValueError("a grammar constrains the whole output: it does not combine with a think block")


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
    def __init__(self, pipeline, *, chunk: int = 512, proposer: Proposer | None = None, prefix_slots: int = 0,
                 prefix_bytes: int | None = None, disk_cache=None, checkpoint_interval: int = 0,
                 step_tokens: int = 256, compressor=None, compress_policy=None):
        """``proposer``: a DFlashProposer for speculative decoding (None: plain decoding).
        ``prefix_slots``: in-memory prefix-cache snapshots (0 disables), with an optional
        byte budget; ``disk_cache``: a cache.disk.DiskCache for restart-persistent snapshots;
        ``checkpoint_interval`` > 0: during long generations, write a disk snapshot every
        that many tokens (the next turn, which resends the answer, resumes from it).
        Sequences run concurrently in the pipeline's sequence slots (``pipeline.lanes``);
        ``step_tokens``: the tokens one step may forward while others decode (a prompt's
        prefill goes in pieces of at most that, less the decode rows). ``compressor``: a
        pflash Compressor for requests that ask for prefill compression; ``compress_policy``:
        the pflash PFlashPolicy callers decide with (None: compression only on request)."""
        self.checkpoint_interval = checkpoint_interval
        from ..cache.prefix_index import PrefixIndex
        from .prefix import PrefixCache

        self.pipeline = pipeline
        self.tokenizer = pipeline.tokenizer
        self.chunk = chunk
        self.proposer = proposer
        self.prefix_cache = PrefixCache(pipeline, PrefixIndex(prefix_slots, prefix_bytes), proposer, disk_cache)
        self.scheduler = StepScheduler(pipeline.lanes, step_tokens)
        self.grammars = GrammarCompiler(self.tokenizer, pipeline.config.vocab_size)
        self.compressor = compressor
        self.compress_policy = compress_policy
        self._next_id = 0
        self.counters = {"steps": 0, "decode_rows": 0, "prefill_tokens": 0, "step_s": 0.0}
        self.batch_sizes: dict[int, int] = {}  # decode rows per step -> steps

    # --- requests -------------------------------------------------------------------------
    def submit(self, req: GenerationRequest, on_event: Callable[[TokenEvent], None] | None = None,
               cancelled: Callable[[], bool] | None = None, tag=None) -> Sequence:
        """Queue one request. ``on_event`` gets each token as it is produced (``token_id ==
        -1`` marks a final text-only flush); ``cancelled`` is polled once per step and ends
        the sequence with finish_reason "cancelled". ``tag``: the caller's, kept on the
        sequence."""
        pipe = self.pipeline
        if req.compress is not None and self.compressor is None:
            raise ValueError("prefill compression needs a drafter: start with --prefill-drafter")
        # (a compressed prompt must fit the context too: checked when it exists, _compress)
        check_prompt(len(req.prompt_ids), pipe.max_ctx, self.compressor.max_tokens if req.compress is not None else None)
        vocab = pipe.config.vocab_size
        bad = next((t for t in req.prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:   # (a tokenizer larger than the model's embedding; a client's own ids)
            raise ValueError(f"prompt token id {bad} is outside the model's vocabulary ({vocab} ids)")
        constraint = self.grammars.constraint(req.grammar) if req.grammar is not None else None
        seq = Sequence(self._next_id, req, self.tokenizer, pipe.config.vocab_size, pipe.device, on_event,
                       cancelled, tag, constraint)
        self._next_id += 1
        self.scheduler.add(seq)
        return seq

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def generate(self, req: GenerationRequest, on_event: Callable[[TokenEvent], None] | None = None,
                 cancelled: Callable[[], bool] | None = None) -> GenerationResult:
        """Run one request to completion (with whatever else is queued)."""
        seq = self.submit(req, on_event, cancelled)
        while not seq.done:
            self.step()
        if seq.error is not None:
            raise seq.error
        return seq.result

    # --- the step loop --------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """One scheduling step; returns the sequences that ended in it (``result`` set, or
        ``error``: a failure ends only the sequences of the forward that raised)."""
        t0 = time.perf_counter()
        ended: list[Sequence] = []
        sched = self.scheduler
        for seq in list(sched.waiting) + sched.active:
            if seq.cancelled:
                self._end(seq, "cancelled", ended)
        plan = sched.schedule()
        if plan.prefill is not None:
            self._prefill_step(plan, ended)
        rows = [s for s in plan.decode if not s.done]
        if rows:
            # with a draft, a sequence decoding alone speculates (draft + verify); several
            # verify their blocks (or DDTrees) in one forward where the stages take a slot's
            # rows together (KV Flash pools included), else decode plainly in one
            # batched forward, which also feeds each one's draft context
            # (a request may turn its draft off: it decodes plainly, a row in that forward)
            if self.proposer is not None and len(rows) == 1 and rows[0].req.speculate:
                self._speculate(rows[0], ended)
            elif self.proposer is not None and any(s.req.speculate for s in rows) \
                    and self.proposer.batch_verify(self.pipeline):
                self._speculate_rows(rows, ended)
            else:
                self._decode(rows, ended)
            self.batch_sizes[len(rows)] = self.batch_sizes.get(len(rows), 0) + 1
            self.counters["decode_rows"] += len(rows)
        if not plan.empty:
            self.counters["steps"] += 1
            self.counters["step_s"] += time.perf_counter() - t0
        return ended

    def _select(self, seq: Sequence) -> None:
        """Point the pipeline (and the draft) at ``seq``'s sequence slot."""
        self.pipeline.select(seq.lane)
        if self.proposer is not None:
            self.proposer.select(seq.lane)

    def _prefill_step(self, plan, ended: list) -> None:
        """This step's prefill work: a forward of the prefilling sequence with the fewest
        prompt tokens left (``StepScheduler.next_prefill``), then, while the step's prefill
        budget lasts, more forwards of it or of the next ones. So a burst of short prompts
        gets every first token before the next decode step, instead of each later prompt
        waiting a decode step per prompt ahead of it (time to first token), a short prompt
        does not wait behind a long one, and a long prompt still costs running streams one
        bounded forward per step."""
        sched = self.scheduler
        cap = sched.step_tokens if plan.prefill_tokens is None else plan.prefill_tokens
        seq, budget, spent, served, stuck = plan.prefill, plan.prefill_tokens, 0, set(), set()
        while seq is not None:
            served.add(seq)
            n = self._prefill(seq, budget, ended)
            spent += n
            if spent >= cap:
                break
            if n == 0:          # no progress (it failed, or restored without forwarding): not again this step
                stuck.add(seq)
            seq, budget = sched.next_prefill(skip=stuck), cap - spent
        sched.prefilled(served)

    def _prefill(self, seq: Sequence, budget: int | None, ended: list) -> int:
        """One prefill forward of ``seq`` (at most ``budget`` tokens; None: a chunk); at the
        prompt's end the sequence starts decoding with its first token. Returns the tokens
        forwarded."""
        pipe = self.pipeline
        self._select(seq)
        before = None
        try:
            if seq.prefill is None:
                seq.t_start = time.monotonic()
                if seq.req.compress is not None and seq.compressed is None:
                    self._compress(seq)
                seq.prefill = self.prefix_cache.prefill_steps(seq.prompt, self.chunk, seq.req.cache_scope)
                next(seq.prefill)          # up to the first forward: reset, cache lookup, restore
            before = pipe.length
            seq.prefill.send(budget)
            n = max(0, pipe.length - before)
            seq.prefilled = pipe.length
            self.counters["prefill_tokens"] += n
            return n
        except StopIteration as done:
            seq.pre, seq.prefill = done.value, None
        except Exception as e:  # noqa: BLE001 - this sequence fails, the others go on
            self._fail(seq, e, ended)
            return 0
        n = max(0, pipe.length - before) if before is not None else 0   # the prompt's last forward
        self.counters["prefill_tokens"] += n
        seq.t_decode = time.monotonic()
        self.scheduler.started(seq)
        seq.on_commit = self._checkpointer(seq)
        self._commit(seq, seq.pre.logits, ended)
        return n

    def _compress(self, seq: Sequence) -> None:
        """PFlash: replace the prompt by its compressed form before any prefill."""
        req = seq.req
        try:
            c = self.compressor.compress(seq.prompt, req.compress, req.compress_query)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - the drafter's failure, named as such
            raise CompressionError(f"PFlash compression failed: {type(e).__name__}: {e}") from e
        if len(c.ids) >= self.pipeline.max_ctx:
            raise ValueError(f"the compressed prompt has {len(c.ids)} tokens (of {len(seq.prompt)}); the context "
                             f"size is {self.pipeline.max_ctx}: keep a smaller fraction")
        seq.compressed = c
        seq.replace_prompt(c.ids)

    def _decode(self, rows: list[Sequence], ended: list) -> None:
        """One plain decode step of ``rows``: a single-sequence forward for one row, else
        one forward of all rows (each in its own slot). With a draft, the forward captures
        its taps and each row's features extend that sequence's draft context."""
        pipe, spec = self.pipeline, self.proposer
        if spec is not None:
            for seq in [s for s in rows if s.pos + 1 >= pipe.max_ctx]:   # (as plain decoding stops)
                self._end(seq, "length", ended)
            rows = [s for s in rows if not s.done]
            if not rows:
                return
        taps = spec.taps if spec is not None else ()
        try:
            if len(rows) == 1:
                pipe.select(rows[0].lane)
                out = pipe.forward([rows[0].last], rows[0].pos, capture=taps)
                logits = out.logits[-1:]
            else:
                out = pipe.forward_rows([s.last for s in rows], [s.lane for s in rows], [s.pos for s in rows],
                                        capture=taps)
                logits = out.logits
        except Exception as e:  # noqa: BLE001 - the rows of this forward fail
            for seq in rows:
                self._fail(seq, e, ended)
            return
        if spec is not None:   # (one call for all rows: fewer tensor ops in the step loop)
            spec.add_rows(out.captures, [s.lane for s in rows], [s.pos for s in rows])
        for seq, row in zip(rows, logits):
            if spec is not None:
                spec_begin(spec, seq)
                seq.spec.record(0, 0)
            seq.pos += 1
            if seq.on_commit is not None:
                self._select(seq)
                seq.on_commit(seq.pos, row)
            self._commit(seq, row, ended)

    def _speculate(self, seq: Sequence, ended: list) -> None:
        self._select(seq)
        try:
            finish = speculative_step(self.pipeline, self.proposer, seq)
        except Exception as e:  # noqa: BLE001
            self._fail(seq, e, ended)
            return
        if finish is not None:
            self._end(seq, finish, ended)

    def _speculate_rows(self, rows: list[Sequence], ended: list) -> None:
        for seq in [s for s in rows if s.pos + 1 >= self.pipeline.max_ctx]:   # no token past the context
            self._end(seq, "length", ended)
        rows = [s for s in rows if not s.done]
        if not rows:
            return
        for seq, outcome in speculative_rows(self.pipeline, self.proposer, rows, self._select):
            if isinstance(outcome, BaseException):
                self._fail(seq, outcome, ended)
            elif outcome is not None:
                self._end(seq, outcome, ended)

    def abort(self, e: BaseException) -> list[Sequence]:
        """Fail every sequence the engine holds with ``e`` (after an unexpected error in a
        step, whose state is then unknown); returns them."""
        ended: list[Sequence] = []
        for seq in list(self.scheduler.waiting) + self.scheduler.active:
            seq.error = e
            try:
                self._end(seq, "error", ended)
            except Exception:  # noqa: BLE001 - freeing its slot is what matters
                self.scheduler.finish(seq)
                ended.append(seq)
        return ended

    def _commit(self, seq: Sequence, logits, ended: list) -> None:
        """Choose and record ``seq``'s next token; a failure there (e.g. its grammar's)
        ends only this sequence."""
        try:
            finished = seq.commit(logits)
        except Exception as e:  # noqa: BLE001
            self._fail(seq, e, ended)
            return
        self._after_commit(seq, finished, ended)

    def _after_commit(self, seq: Sequence, finished: bool, ended: list) -> None:
        if finished:
            self._end(seq, seq.out.finish, ended)
        elif self.proposer is None and seq.pos + 1 >= self.pipeline.max_ctx:
            self._end(seq, "length", ended)

    def _fail(self, seq: Sequence, e: BaseException, ended: list) -> None:
        seq.error = e
        self._end(seq, "error", ended)

    def _end(self, seq: Sequence, finish: str, ended: list) -> None:
        if seq.prefill is not None:        # cancelled or failed mid-prefill: drops its snapshot
            self._select(seq)
            seq.prefill.close()
            seq.prefill = None
        pending = seq.pre.pending if seq.pre is not None else None
        if seq.error is None:
            seq.result = self._result(seq, finish)
        if seq.error is None and seq.result.finish_reason in ("stop", "length"):
            self.prefix_cache.commit(pending)
        else:
            self.prefix_cache.discard(pending)
        if self.proposer is not None:
            spec_end(self.proposer, seq)
        self.scheduler.finish(seq)
        ended.append(seq)

    def _result(self, seq: Sequence, finish: str) -> GenerationResult:
        out = seq.out
        out.close(finish)
        now = time.monotonic()
        t_start = seq.t_start or now
        t_decode = seq.t_decode or now
        # prompt_tokens counts the request's prompt, not what PFlash left of it
        res = GenerationResult(out.tokens, "".join(out.pieces), out.finish, len(seq.req.prompt_ids),
                               t_decode - t_start, now - t_decode, stop_reason=out.stop_reason, logprobs=out.events)
        if seq.compressed is not None:
            res.extra["pflash"] = seq.compressed.describe()
        if seq.pre is not None:
            res.cached_tokens = seq.pre.cached_tokens
            res.extra["cache"] = seq.pre.source
            if seq.lane is not None:
                self.pipeline.select(seq.lane)
            kv = self.pipeline.kvflash_stats()
            if kv:  # summed over stages (each runs its own pool of the same size)
                res.extra["kvflash"] = merge_stats(kv)
            if self.proposer is not None:
                res.extra["spec"] = (seq.spec or SpecStats(self.proposer.block_size)).to_dict()
        return res

    # --- lifecycle ------------------------------------------------------------------------
    def warm_up(self, max_tokens: int = 64) -> GenerationResult:
        """One throwaway greedy generation with the prefix cache off, so that lazily built
        things (``torch.compile``'s graphs: the decode step and, with a draft, the verify
        blocks, which the adaptive block size tries all of in its first steps) are built
        before the first real request rather than during it."""
        ids = self.tokenizer.encode("Count from one to twenty, one number per line.")
        ids = ids[:max(1, self.pipeline.max_ctx // 2)]   # a tiny --max-ctx still warms up
        room = self.pipeline.max_ctx - len(ids) - 1
        res = self.generate(GenerationRequest(tuple(ids), max_tokens=max(1, min(max_tokens, room)),
                                              ignore_eos=True, cache_scope="off"))
        if self.proposer is not None and self.proposer.sizer is not None:
            self.proposer.sizer.reset()   # its step times included the compiles
        if self.proposer is not None and self.proposer.batch_sizer is not None:
            self.proposer.batch_sizer.reset()
        return res

    def close(self) -> None:
        """Graceful shutdown: persist prefix snapshots to the disk cache, stop shard workers."""
        try:
            self.prefix_cache.close()
        finally:
            self.pipeline.close()
            if self.proposer is not None:
                self.proposer.draft.close()  # stops a draft worker
            if self.compressor is not None:
                self.compressor.close()      # a prefill drafter in its own worker

    def health(self) -> dict:
        """{"status": "ok"} or {"status": "degraded", "error": ...} while a shard worker restarts."""
        h = self.pipeline.health()
        dh = self.proposer.draft.health() if h["status"] == "ok" and self.proposer is not None else {"status": "ok"}
        if dh["status"] != "ok":
            return {"status": "degraded", "error": dh["error"], "stage": "draft"}
        return h

    def occupancy(self) -> tuple[int, int, int]:
        """(sequences waiting for a slot, sequences holding one, slots)."""
        sched = self.scheduler
        return len(sched.waiting), len(sched.prefilling) + len(sched.running), sched.lanes

    def stats(self) -> dict:
        """Slots, step-loop counters and the parts' state (draft, caches, KV Flash, shard
        workers): all that /props, /slots and /metrics read of the engine."""
        sched = self.scheduler
        slots = []
        for seq in sched.active:
            slots.append({"id": seq.lane, "seq": seq.id, "state": seq.phase, "n_prompt_tokens": len(seq.prompt),
                          "n_decoded": len(seq.out.tokens)})
        busy = {s["id"] for s in slots}
        slots += [{"id": i, "state": "idle"} for i in range(sched.lanes) if i not in busy]
        return {"slots_total": sched.lanes, "slots_busy": len(busy), "waiting": len(sched.waiting),
                "running": len(sched.running), "prefilling": len(sched.prefilling), "step_tokens": sched.step_tokens,
                "slots": sorted(slots, key=lambda s: s["id"]), **self.counters,
                "batch_sizes": dict(sorted(self.batch_sizes.items())),
                "speculative": describe.speculative(self.proposer), "cache": describe.cache(self.prefix_cache),
                "kvflash": describe.kvflash(self.pipeline), "shards": describe.shards(self.pipeline),
                "pflash": describe.pflash(self.compressor, self.compress_policy),
                "grammar": True}

    def _checkpointer(self, seq: Sequence):
        """on_commit(length, logits) writing a disk snapshot every checkpoint_interval tokens
        (the sequence's slot is selected when it is called)."""
        cache, every, req = self.prefix_cache, self.checkpoint_interval, seq.req
        if every <= 0 or cache.disk is None or req.cache_scope in ("off", "memory"):
            return None
        prompt, out = seq.prompt, seq.out
        due = [len(prompt) + every]

        def on_commit(length: int, logits) -> None:
            if length >= due[0]:
                ids = prompt + out.tokens[:length - len(prompt)]
                if len(ids) == length:
                    cache.checkpoint(ids, logits)
                due[0] = length + every
        return on_commit
