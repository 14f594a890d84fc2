"""API-neutral generation: admission (context and queue), running a job, parsing its output.

The protocol modules build a ``Prompt`` and ``GenOptions``, call ``Service.start`` and
then either iterate the ``Run`` (streaming) or ``collect`` it; both paths feed the same
``OutputParser`` with the same engine deltas, so streamed and non-streamed output agree.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from anyio import to_thread

from ..engine.budget import ContextBudgetError, plan_new_tokens
from ..engine.generate import GenerationRequest, GenerationResult, TokenEvent
from ..engine.sampling import SamplingParams
from ..errors import CompressionError, ShardError
from ..pflash.policy import KeepRatioBandit, PFlashPolicy
from .errors import APIError, bad_request, redact_paths
from .output_parser import Delta, OutputParser
from .prompt import Prompt
from .reasoning import Thinking, budget_fields
from .scheduler import QueueFull, ShuttingDown
from .tool_grammar import tool_grammar
from .tools import ToolSet

log = logging.getLogger("dflash_server")


@dataclass
class GenOptions:
    max_tokens: int | None = None           # None: the server default, clamped to what fits
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    ignore_eos: bool = False
    thinking: Thinking = field(default_factory=Thinking)
    tools: ToolSet | None = None
    parse_output: bool = True               # split <think> / tool calls (chat APIs)
    cache_scope: str | None = None          # prefix cache override: off | memory | full
    grammar: str | None = None              # llguidance grammar the output must match (response_format)
    compression: object | None = None       # the request's PFlash override (pflash.policy.Override)
    session_id: str | None = None           # keys the PFlash keep-ratio bandit
    speculative: bool = True                # False: no DFlash draft for this request


@dataclass
class Step:
    deltas: list[Delta]
    logprobs: list[TokenEvent]


def engine_error(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, ShuttingDown):
        return APIError(503, str(e), headers={"Retry-After": "5"})
    if isinstance(e, ShardError):
        return APIError(503, redact_paths(str(e)), headers={"Retry-After": "5"})
    if isinstance(e, CompressionError):
        return APIError(500, redact_paths(str(e))[:500])
    if isinstance(e, ValueError):
        return bad_request(str(e))
    return APIError(500, f"generation failed: {type(e).__name__}")


def stream_failure(app, e: Exception, api: str) -> APIError:
    """A streamed response failed after its 200 went out: the APIError for its error event
    (an unexpected exception is logged with its traceback and becomes a 500), counted in
    ``dflash_stream_errors_total``."""
    if not isinstance(e, APIError):
        log.exception("streaming a %s response failed", api)
        e = APIError(500, f"internal error while streaming the response ({type(e).__name__})")
    app.metrics.stream_errors.labels(api, str(e.status)).inc()
    return e


def _merge(out: list[Delta], d: Delta) -> None:
    """Neighbours of one kind become one delta (a burst, one chunk): text of one kind, or
    argument fragments of one call."""
    last = out[-1] if out else None
    if last is not None and d.kind == last.kind and (d.kind in ("content", "reasoning") or (
            d.kind == "tool_args" and d.call is last.call)):
        out[-1] = Delta(d.kind, last.text + d.text, d.call)
    else:
        out.append(d)


class Run:
    """One generation in flight, as parsed output steps."""

    def __init__(self, job, prompt: Prompt, opts: GenOptions, stop_ids: set[int], on_result=None):
        self.job, self.prompt, self.opts = job, prompt, opts
        self.on_result = on_result
        self.parser = OutputParser(think_open=prompt.think_open, tools=opts.tools, markup=prompt.markup) \
            if opts.parse_output else None
        if self.parser is not None and prompt.prefix:
            self.parser.push(prompt.prefix)  # already in the prompt; opens the tool-call block
        self.stop_ids = stop_ids
        self.result: GenerationResult | None = None
        self.blocks: list[Delta] = []   # the output in order: runs of one kind merged, calls apart
        self.text_parts: list[str] = []
        self.reasoning_tokens = 0
        self._pending = None

    def cancel(self) -> None:
        self.job.cancel()

    async def start(self) -> None:
        """Wait for the first engine event; a failure before any output raises APIError."""
        item = await self.job.next()
        if isinstance(item, BaseException):
            raise engine_error(item)
        self._pending = item

    def _step(self, events: list[TokenEvent]) -> Step:
        lps, texts = [], []
        for ev in events:
            if ev.token_id >= 0 and ev.token_id not in self.stop_ids and ev.logprob is not None:
                lps.append(ev)
            if ev.token_id >= 0 and self.parser is not None and self.parser.mode == "reasoning":
                self.reasoning_tokens += 1
            if ev.text:
                self.text_parts.append(ev.text)
                if self.parser is None:
                    texts.append(Delta("content", ev.text))
                else:
                    texts.extend(self.parser.push(ev.text))
        deltas: list[Delta] = []
        for d in texts:  # merge neighbours of one kind (a burst becomes one chunk)
            _merge(deltas, d)
        self._record(deltas)
        return Step(deltas, lps)

    def _record(self, deltas: list[Delta]) -> None:
        for d in deltas:  # a call is one block, whole (its start and fragments are for streams)
            if d.kind not in ("tool_start", "tool_args"):
                _merge(self.blocks, Delta(d.kind, d.text, d.call))

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        while self.result is None:
            if self._pending is not None:
                items, self._pending = [self._pending], None
            else:
                items = await self.job.next_batch()
            events = [x for x in items if isinstance(x, TokenEvent)]
            if events:
                step = self._step(events)
                if step.deltas or step.logprobs:
                    yield step
            item = items[-1]
            if isinstance(item, BaseException):
                raise engine_error(item)
            if isinstance(item, GenerationResult):
                if item.finish_reason == "cancelled":
                    # the client left (nobody reads this) or the server is shutting down
                    raise APIError(503, "generation was cancelled: the server is shutting down",
                                   headers={"Retry-After": "5"})
                self.result = item
                if self.on_result is not None:
                    self.on_result(opts=self.opts, result=item)
                if self.parser is not None:
                    tail = self.parser.finish(cut=item.finish_reason == "length")
                    if tail:
                        self._record(tail)
                        yield Step(tail, [])
                return

    async def collect(self) -> list[TokenEvent]:
        """Run to the end (non-streaming); returns the logprob events."""
        lps: list[TokenEvent] = []
        async for step in self:
            lps.extend(step.logprobs)
        return lps

    # --- results -------------------------------------------------------------------------
    @property
    def content(self) -> str:
        return self.parser.text if self.parser is not None else "".join(self.text_parts)

    @property
    def reasoning(self) -> str:
        return self.parser.reasoning_text if self.parser is not None else ""

    @property
    def tool_calls(self) -> list:
        return self.parser.calls if self.parser is not None else []

    @property
    def finish_reason(self) -> str:
        """stop | length | tool_calls | cancelled"""
        r = self.result.finish_reason
        if r == "stop" and self.tool_calls:
            return "tool_calls"
        return r

    @property
    def stop_string(self) -> str | None:
        """The client's stop sequence that ended the output (not the server's own stops)."""
        s = self.result.stop_reason
        return s if isinstance(s, str) and s in self.opts.stop else None


class Service:
    def __init__(self, config, tokenizer, scheduler, prompts, think_tokens, max_ctx: int):
        self.config, self.tokenizer, self.scheduler = config, tokenizer, scheduler
        self.prompts, self.think_tokens, self.max_ctx = prompts, think_tokens, max_ctx
        engine = scheduler.engine
        self.compress_policy = engine.compress_policy or PFlashPolicy()
        self.can_compress = engine.compressor is not None
        self.bandit = KeepRatioBandit()

    def keep_ratio(self, prompt: Prompt, opts: GenOptions) -> float | None:
        """PFlash: the fraction of ``prompt`` to keep, or None (prefill it whole)."""
        session = self.bandit.ratio(opts.session_id) if opts.session_id and self.can_compress else None
        keep = self.compress_policy.decide(len(prompt.ids), opts.compression, prompt.continuation, session)
        if keep is not None and not self.can_compress:
            raise bad_request("prefill_compression: this server has no prefill drafter (start it with "
                              "--prefill-drafter)", "prefill_compression")
        return keep

    def observe(self, opts: GenOptions, result: GenerationResult) -> None:
        """Feed a compressed answer's DFlash acceptance to its session's keep ratio."""
        spec = result.extra.get("spec")
        if opts.session_id and "pflash" in result.extra and spec and spec.get("proposed"):
            self.bandit.observe(opts.session_id, min(1.0, spec["accepted"] / spec["proposed"]))

    def request(self, prompt: Prompt, opts: GenOptions, seed_offset: int = 0) -> GenerationRequest:
        keep = self.keep_ratio(prompt, opts)
        limit = self.scheduler.engine.compressor.max_tokens if keep is not None else None
        try:
            max_tokens = plan_new_tokens(len(prompt.ids), self.max_ctx, opts.max_tokens,
                                         self.config.default_max_tokens, limit)
        except ContextBudgetError as e:
            raise bad_request(str(e), prompt.param if e.param == "prompt" else e.param) from None
        grammar = opts.grammar
        if opts.tools is not None:  # a forced call's shape; a format with tools: the answer or calls
            compiler = self.scheduler.engine.grammars
            try:
                grammar = grammar if compiler is None else tool_grammar(opts.tools, self.prompts.tool_format,
                                                                          compiler.lark_text, grammar)
            except ValueError as e:
                raise bad_request(f"tools: a parameters schema cannot be enforced: {str(e)[:300]}", "tools") from None
        # a grammar shapes the whole output: a forced call's prompt has closed the think block
        # already (and a format grammar turned thinking off), so a reasoning budget has nothing
        # to limit (reasoning_effort, which clients send on every call, must not refuse it)
        budget = {} if grammar is not None and not prompt.think_open else \
            budget_fields(opts.thinking, prompt.think_open, max_tokens, self.think_tokens)
        sampling = opts.sampling
        if seed_offset and sampling.seed is not None:
            sampling = SamplingParams(**{**sampling.__dict__, "seed": (sampling.seed + seed_offset) % 2**63})
        try:
            return GenerationRequest(tuple(prompt.ids), sampling, max_tokens, ignore_eos=opts.ignore_eos,
                                     stop=opts.stop + self._call_end(opts), logprobs=opts.logprobs,
                                     cache_scope=opts.cache_scope, grammar=grammar, compress=keep,
                                     speculate=opts.speculative,
                                     compress_query=prompt.query if keep is not None else None,
                                     **budget)
        except ValueError as e:
            raise bad_request(str(e)) from None

    def _call_end(self, opts: GenOptions) -> tuple[str, ...]:
        """A stop at the end of the first tool call when only one may be made (tool_choice
        names a function, or parallel_tool_calls is false): the model would otherwise go
        on writing after it. The parser completes a block cut at its closing tag."""
        tools = opts.tools
        if tools is None or not tools.active or (tools.forced_name is None and tools.parallel):
            return ()
        return (self.prompts.markup.tool_markers[0][1],)  # "</tool_call>" (Gemma 4: "<tool_call|>")

    async def start(self, prompt: Prompt, opts: GenOptions, n: int = 1, label: str = "") -> list[Run]:
        """Queue ``n`` generations of one prompt back to back (all or none)."""
        if n > self.scheduler.capacity:   # never admissible: a retryable 503 would be retried for ever
            raise bad_request(f"n={n} generations cannot all be queued on this server: it runs and queues "
                              f"{self.scheduler.capacity} at most (--parallel, --max-queue)", "n")
        reqs = [self.request(prompt, opts, i) for i in range(n)]
        if reqs[0].grammar is not None and reqs[0].grammar != opts.grammar:
            # a tool call's grammar, compiled here off the engine's thread (a format grammar
            # was, by check_grammar); the engine's sequences start from the compiled matcher
            try:
                await to_thread.run_sync(self.scheduler.engine.grammars.check, reqs[0].grammar)
            except ValueError as e:
                raise bad_request(f"tools: a parameters schema cannot be enforced: {str(e)[:300]}", "tools") from None
        stop_ids = set() if opts.ignore_eos else set(self.tokenizer.eos_token_ids)
        try:
            jobs = self.scheduler.submit_all(reqs, label)   # all n, or none
        except QueueFull as e:
            raise APIError(503, "the server is busy: the request queue is full; retry later",
                           code="queue_full", headers={"Retry-After": str(e.retry_after_s)}) from None
        except ShuttingDown as e:
            raise engine_error(e) from None
        return [Run(job, prompt, opts, stop_ids, self.observe) for job in jobs]
