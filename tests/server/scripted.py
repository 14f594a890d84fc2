"""An engine that "generates" scripted text, and the real app served from a thread.

A tiny random model cannot decide to call a tool; this engine emits exactly the text a
real model would (tool-call markup, think blocks, odd Unicode), token by token through
the real tokenizer and the engine's own detokenizer / stop-string logic, so the parser,
emitters and official clients see realistic streams.
"""
from __future__ import annotations

import re
import threading
import time
from types import SimpleNamespace

import uvicorn

from dflash_server.engine.detok import IncrementalDetokenizer
from dflash_server.engine.generate import GenerationResult, TokenEvent
from dflash_server.engine.stops import StopStringMatcher
from dflash_server.server.app import create_app
from dflash_server.server.config import ServerConfig
from dflash_server.server.state import ServerState

from .serverproc import free_port


class ScriptedEngine:
    def __init__(self, tokenizer, scripts: dict[str, str], max_ctx: int = 4096, delay_s: float = 0.0,
                 lanes: int = 1):
        self.tokenizer, self.scripts, self.delay_s = tokenizer, scripts, delay_s
        self.pipeline = SimpleNamespace(max_ctx=max_ctx)
        self.prompts: list[str] = []
        self.requests: list = []
        self.scheduler = SimpleNamespace(lanes=lanes, waiting=[], running=[])
        self.spec: dict | None = None  # speculative-decoding stats to report in results' extra
        # the rest of engine.serving.ServingEngine: no draft, no PFlash, no grammars (a grammar
        # request gets the server's 400), nothing for /props or /metrics to report
        self.proposer = self.compressor = self.compress_policy = self.grammars = None

    def stats(self):
        return None

    def health(self):
        return {"status": "ok"}

    def close(self):
        pass

    # the engine's step-loop interface (what server.scheduler drives): each step advances
    # every admitted sequence by one token; ``lanes`` of them at a time
    def submit(self, req, on_event=None, cancelled=None, tag=None):
        seq = SimpleNamespace(req=req, tag=tag, lane=None, t_start=None, result=None, error=None,
                              cancelled=cancelled, gen=self._run(req, on_event, cancelled))
        self.scheduler.waiting.append(seq)
        return seq

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def step(self):
        sched, ended = self.scheduler, []
        while sched.waiting and len(sched.running) < sched.lanes:
            seq = sched.waiting.pop(0)
            seq.lane, seq.t_start = len(sched.running), time.monotonic()
            sched.running.append(seq)
        for seq in list(sched.running):
            try:
                next(seq.gen)
                continue
            except StopIteration as done:
                seq.result = done.value
            except Exception as e:  # noqa: BLE001 - a scripted failure ends this sequence
                seq.error = e
            sched.running.remove(seq)
            ended.append(seq)
        for seq in list(sched.waiting):  # cancelled while waiting: never run
            if seq.cancelled is not None and seq.cancelled():
                sched.waiting.remove(seq)
                seq.result = GenerationResult([], "", "cancelled", len(seq.req.prompt_ids))
                ended.append(seq)
        return ended

    def occupancy(self):
        return len(self.scheduler.waiting), len(self.scheduler.running), self.scheduler.lanes

    def abort(self, e):
        ended = self.scheduler.waiting + self.scheduler.running
        self.scheduler.waiting, self.scheduler.running = [], []
        for seq in ended:
            seq.error = e
        return ended

    def generate(self, req, on_event=None, cancelled=None):
        gen = self._run(req, on_event, cancelled)
        while True:
            try:
                next(gen)
            except StopIteration as done:
                return done.value

    def _run(self, req, on_event=None, cancelled=None):
        """A generator: one yield per token, returns the GenerationResult."""
        prompt = self.tokenizer.decode(list(req.prompt_ids))
        self.prompts.append(prompt)
        self.requests.append(req)
        names = re.findall(r"SCRIPT=(\w+)", prompt)
        script = self.scripts[names[-1]] if names else "Hello."
        if script == "FAIL_EARLY":
            raise RuntimeError("scripted failure before the first token")
        fail_at = None
        if script.startswith("FAIL_MID:"):
            script, fail_at = script.removeprefix("FAIL_MID:"), 3
        eos = self.tokenizer.eos_token_ids[0]
        ids = self.tokenizer.encode(script, add_bos=False) + [eos]
        t0 = time.monotonic()
        detok = IncrementalDetokenizer(self.tokenizer, skip_ids=(eos,))
        stops = StopStringMatcher(req.stop)
        tokens, pieces, finish, stop_reason = [], [], "length", None
        emit = on_event or (lambda ev: None)
        for i, t in enumerate(ids):
            if i == fail_at:
                raise RuntimeError("scripted failure mid-generation")
            if self.delay_s:
                time.sleep(self.delay_s)  # pace like a real decode: one token per chunk
            tokens.append(t)
            if t == eos:
                finish, stop_reason = "stop", t
                emit(TokenEvent(t, ""))
                break
            text, stopped = stops.push(detok.push(t))
            pieces.append(text)
            emit(TokenEvent(t, text))
            if stopped:
                finish, stop_reason = "stop", stops.matched
                break
            if len(tokens) >= req.max_tokens:
                break
            if cancelled is not None and cancelled():
                finish = "cancelled"
                break
            yield
        if stops.matched is None:
            tail = stops.push(detok.flush())[0] + stops.flush()
            if tail:
                pieces.append(tail)
                emit(TokenEvent(-1, tail))
        return GenerationResult(tokens, "".join(pieces), finish, len(req.prompt_ids), stop_reason=stop_reason,
                                decode_s=time.monotonic() - t0,
                                extra={"spec": dict(self.spec)} if self.spec else {})


class ThreadServer:
    """The real ASGI app (routes, middleware, scheduler) on loopback, in this process."""

    def __init__(self, engine, info: dict | None = None, **config):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.state = ServerState(ServerConfig(port=self.port, model_name="scripted", **config))
        self.state.attach(engine, {"max_ctx": engine.pipeline.max_ctx, **(info or {})})
        app = create_app(self.state, on_shutdown=lambda: self.state.close())
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("in-process server did not start")
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)


def qwen35_tokenizer(tmp_path_factory):
    """The Qwen3.5 tokenizer and chat template (think tokens, XML tool calls), written once."""
    from dflash_server.weights.tokenizer import Tokenizer
    from helpers.qwen_tokenizer import write_qwen_tokenizer

    d = tmp_path_factory.mktemp("qwen35_tok")
    write_qwen_tokenizer(d, "qwen3_5")
    return Tokenizer.from_hf_dir(d)


def scripted_server(tmp_path_factory, scripts: dict[str, str]):
    """A ThreadServer over a ScriptedEngine on the Qwen3.5 tokenizer (``.engine`` set)."""
    engine = ScriptedEngine(qwen35_tokenizer(tmp_path_factory), scripts)
    s = ThreadServer(engine)
    s.engine = engine
    return s


def official_clients(url: str):
    """(openai.OpenAI, anthropic.Anthropic) with strict response validation, no retries."""
    import anthropic
    import openai

    return (openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, _strict_response_validation=True),
            anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, _strict_response_validation=True))
