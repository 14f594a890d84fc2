"""What the routes share: config, metrics, and (once loaded) the model and its scheduler."""
from __future__ import annotations

import logging
from functools import partial

import anyio
from anyio import to_thread
from pydantic import ValidationError
from starlette.requests import Request

from .config import ServerConfig
from .errors import APIError, from_validation, redact_paths
from .generation import Service
from .logprobs import TokenTexts
from .metrics import Metrics
from .prompt import Prompt, PromptBuilder
from .reasoning import Thinking, think_tokens
from .response_store import ResponseStore
from .scheduler import Scheduler

log = logging.getLogger("dflash_server")
BODY_READ_TIMEOUT_S = 60     # a request body must arrive within this (else 408)
BODIES_BEYOND_CAPACITY = 8   # bodies received at once: (slots + --max-queue + this) x --max-body-mb
PARSE_INLINE_BYTES = 256 << 10  # bodies at least this large are parsed on a worker thread
# a request carrying text is refused unparsed when its body is larger than this many times the
# characters the context can hold, plus this slack (tools, schemas): validating 30 MB of
# messages holds the GIL for over a second, and /health must answer meanwhile
PROMPT_BODY_FACTOR, PROMPT_BODY_SLACK = 8, 4 << 20


class ServerState:
    def __init__(self, config: ServerConfig, metrics: Metrics | None = None):
        self.config = config
        self.metrics = metrics or Metrics()
        self.status = "loading"         # loading | ready | failed
        self.error: str | None = None
        self.info: dict = {}
        self.sampling_defaults, self.sampling_sources = config.sampling_defaults({})
        self.engine = None
        self.scheduler: Scheduler | None = None
        self.service: Service | None = None
        self.responses = ResponseStore()
        self._closed = False
        self._body_bytes = 0   # bytes reserved by request bodies being received

    # --- lifecycle ---------------------------------------------------------------------
    def attach(self, engine, info: dict) -> None:
        """The model is loaded: start the worker and open for requests (any thread)."""
        tok = engine.tokenizer
        self.tokenizer = tok
        max_ctx = int(info.get("max_ctx") or engine.pipeline.max_ctx)
        compressor = engine.compressor
        # with a prefill drafter, prompts up to what it reads are admitted (PFlash compresses them)
        self.prompts = PromptBuilder(tok, self.config.chat_template,
                                     max(max_ctx, compressor.max_tokens) if compressor is not None else max_ctx)
        self.think = think_tokens(tok, self.prompts.markup)
        self.token_texts = TokenTexts(tok)
        self.info = dict(info)
        self.sampling_defaults, self.sampling_sources = self.config.sampling_defaults(info.get("sampling") or {})
        self.fingerprint = "dflash-" + str(info.get("fingerprint", ""))[:12]
        self.engine = engine
        self.scheduler = Scheduler(engine, max_queue=self.config.max_queue, hooks=self.metrics)
        self.metrics.cache.engine = engine
        self.metrics.engine_stats.engine = engine
        self.service = Service(self.config, tok, self.scheduler, self.prompts, self.think, max_ctx)
        self.status = "ready"

    async def check_grammar(self, grammar: str | None, param: str) -> str | None:
        """``grammar`` once the engine can use it (compiled against its tokenizer off the
        event loop: a schema may take milliseconds); a 400 naming ``param`` otherwise."""
        if grammar is None:
            return None
        compiler = self.engine.grammars if self.engine is not None else None
        if compiler is None:
            raise APIError(400, "this engine cannot constrain its output", param=param)
        try:
            await to_thread.run_sync(compiler.check, grammar)
        except ValueError as e:
            raise APIError(400, f"{param}: {str(e)[:500]}", param=param) from None
        return grammar

    def fail(self, message: str) -> None:
        self.status, self.error = "failed", message

    def begin_shutdown(self) -> None:
        if self.scheduler is not None:
            self.scheduler.begin_shutdown(self.config.shutdown_grace_s)

    def close(self, cancel_running: bool = True) -> None:
        """Stop the worker, then let the engine persist what it keeps (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.scheduler is not None:
            self.scheduler.close(cancel_running=cancel_running)
            if self.scheduler.worker_alive:
                log.warning("the engine did not stop in time; skipping its shutdown work")
                return
        if self.engine is not None:
            self.engine.close()  # after the worker stopped: persist prefix snapshots to disk

    # --- helpers for the routes ------------------------------------------------------------
    def require_ready(self) -> None:
        if self.status != "ready":
            raise APIError(503, "the model is still loading" if self.status == "loading" else
                           f"the model failed to load: {redact_paths(self.error)}", headers={"Retry-After": "5"})

    def check_model(self, name: str | None) -> None:
        if not self.config.accepts_model(name):
            raise APIError(404, f"model {name!r} not found; this server serves {self.config.model_name!r}",
                           param="model", code="model_not_found")

    async def read_body(self, request: Request) -> bytes:
        """The whole body, within ``--max-body-mb``, BODY_READ_TIMEOUT_S (a 408 for a client
        that stops sending) and a budget for all bodies being received at once (a 503: a
        hundred connections each holding back the last byte of a large body otherwise pin a
        body's memory each, whatever ``--max-queue`` says)."""
        limit, chunks, size = self.config.max_body_bytes, [], 0
        declared = request.headers.get("content-length", "")
        # a chunked body is read as its chunks say, whatever Content-Length claims beside it
        chunked = "transfer-encoding" in request.headers
        reserve = min(limit, int(declared)) if declared.isdigit() and not chunked else limit
        budget = (BODIES_BEYOND_CAPACITY + (self.scheduler.capacity if self.scheduler else 0)) * limit
        if self._body_bytes + reserve > budget:
            raise APIError(503, "the server is busy receiving other requests; retry later", code="queue_full",
                           headers={"Retry-After": "1"})
        self._body_bytes += reserve
        try:
            with anyio.fail_after(BODY_READ_TIMEOUT_S):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise APIError(413, f"request body exceeds the limit of {limit} bytes")
                    chunks.append(chunk)
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {BODY_READ_TIMEOUT_S} s") from None
        finally:
            self._body_bytes -= reserve
        return b"".join(chunks)

    async def parse(self, request: Request, model_cls, prompt_sized: bool = True):
        """The body validated as ``model_cls``; ``prompt_sized``: it carries text for the model
        (a body far larger than the context can hold is refused before it is parsed)."""
        self.require_ready()
        body = await self.read_body(request)
        max_chars = self.prompts.max_chars if prompt_sized else None
        if max_chars is not None and len(body) > PROMPT_BODY_FACTOR * max_chars + PROMPT_BODY_SLACK:
            raise APIError(400, f"the request has {len(body)} characters of JSON: far more than the context of "
                                f"{self.prompts.max_tokens} tokens can hold (one token of this model spans at most "
                                f"{self.tokenizer.max_token_chars - 1} characters)")
        try:
            if len(body) < PARSE_INLINE_BYTES:
                return model_cls.model_validate_json(body)
            return await to_thread.run_sync(model_cls.model_validate_json, body)  # keep the loop free
        except ValidationError as e:
            raise from_validation(e) from None

    async def render_chat(self, messages: list[dict], tools=None, thinking: Thinking = Thinking(),
                          template_kwargs: dict | None = None) -> Prompt:
        # templates and tokenizers are CPU work: keep them off the event loop
        return await to_thread.run_sync(partial(self.prompts.chat, messages, tools, thinking, template_kwargs))

    async def render_raw(self, prompt) -> Prompt:
        return await to_thread.run_sync(partial(self.prompts.raw, prompt))

    async def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        return await to_thread.run_sync(partial(self.prompts.encode, text, add_bos, "content"))
