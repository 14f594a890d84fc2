"""OpenAI Chat Completions: POST /v1/chat/completions (JSON and SSE)."""
from __future__ import annotations

import secrets
import time

from starlette.requests import Request
from starlette.responses import JSONResponse

from . import sse
from .errors import error_body
from .generation import GenOptions, Run, stream_failure
from .logprobs import chat_entries
from .reasoning import Thinking
from .schemas_common import stop_list
from .schemas_openai import ChatRequest


def chat_thinking(body: ChatRequest) -> Thinking:
    t = Thinking.from_effort(body.reasoning_effort)
    flag = (body.chat_template_kwargs or {}).get("enable_thinking")
    if isinstance(flag, bool):
        t = Thinking(enabled=flag, budget=t.budget if flag else None)
    return t


def prompt_details(res, cached: int | None = None) -> dict:
    """``prompt_tokens_details``: cached tokens, and with PFlash the tokens the target read
    (``prompt_tokens`` counts the raw prompt)."""
    out = {"cached_tokens": res.cached_tokens if cached is None else cached}
    pf = res.extra.get("pflash")
    if pf:
        out["compressed_tokens"] = pf["compressed_tokens"]
    return out


def usage(runs: list[Run], cached: int | None = None) -> dict:
    res = runs[0].result
    completion = sum(r.result.completion_tokens for r in runs)
    reasoning = sum(r.reasoning_tokens for r in runs)
    return {"prompt_tokens": res.prompt_tokens, "completion_tokens": completion,
            "total_tokens": res.prompt_tokens + completion,
            "prompt_tokens_details": prompt_details(res, cached),
            "completion_tokens_details": {"reasoning_tokens": reasoning}}


def timings(runs: list[Run]) -> dict:
    t = runs[0].result.timings()
    extra = runs[0].result.extra if isinstance(runs[0].result.extra, dict) else {}
    for key in ("spec", "pflash"):
        if isinstance(extra.get(key), dict):
            t[key] = {k: v for k, v in extra[key].items() if isinstance(v, (int, float, str, bool))}
    return t


def tool_call_json(call, index: int | None = None) -> dict:
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


async def handle(app, request: Request):
    body = await app.parse(request, ChatRequest)
    app.check_model(body.model)
    body.check_supported()
    tools = body.toolset()
    grammar = await app.check_grammar(body.grammar(), "response_format")
    # a grammar shapes the whole output: no think block before it
    thinking = chat_thinking(body) if grammar is None else Thinking(enabled=False)
    prompt = await app.render_chat(body.hf_messages(), tools, thinking, body.chat_template_kwargs)
    opts = GenOptions(max_tokens=body.max_completion_tokens or body.max_tokens,
                      sampling=body.sampling(app.sampling_defaults), stop=stop_list(body.stop, 4),
                      logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                      ignore_eos=bool(body.ignore_eos), thinking=thinking, tools=tools,
                      grammar=grammar, **body.engine_options())
    runs = await app.service.start(prompt, opts, body.n or 1, label="chat")
    cid, created = "chatcmpl-" + secrets.token_hex(12), int(time.time())
    model = body.model or app.config.model_name
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await sse.start_stream(request, runs, _stream(app, runs, cid, created, model, include_usage))
    lps = await sse.collect(request, runs)
    choices = []
    for i, (run, events) in enumerate(zip(runs, lps)):
        msg = {"role": "assistant", "content": run.content if (run.content or not run.tool_calls) else None}
        if run.reasoning:
            msg["reasoning_content"] = run.reasoning
        if run.tool_calls:
            msg["tool_calls"] = [tool_call_json(c) for c in run.tool_calls]
        choices.append({"index": i, "message": msg, "finish_reason": run.finish_reason,
                        "logprobs": {"content": chat_entries(events, app.token_texts)} if body.logprobs else None})
    return JSONResponse({"id": cid, "object": "chat.completion", "created": created, "model": model,
                         "system_fingerprint": app.fingerprint, "choices": choices, "usage": usage(runs),
                         "timings": timings(runs)})


async def _stream(app, runs: list[Run], cid: str, created: int, model: str, include_usage: bool):
    base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": app.fingerprint}
    extra = {"usage": None} if include_usage else {}

    def chunk(index, delta, finish=None, logprobs=None):
        return sse.data({**base, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                              "finish_reason": finish}], **extra})

    try:
        for i, run in enumerate(runs):
            yield chunk(i, {"role": "assistant", "content": ""})
            want_lp = run.opts.logprobs is not None
            pending_lp: list = []
            ncalls, index = 0, {}
            async for step in run:
                pending_lp.extend(step.logprobs)
                for d in step.deltas:
                    lp = None
                    if want_lp and d.kind == "content":
                        lp, pending_lp = {"content": chat_entries(pending_lp, app.token_texts)}, []
                    if d.kind == "content":
                        yield chunk(i, {"content": d.text}, logprobs=lp)
                    elif d.kind == "reasoning":
                        yield chunk(i, {"reasoning_content": d.text})
                    elif d.kind == "tool_start":  # id and name, then the arguments as they come
                        index[d.call.id] = ncalls
                        ncalls += 1
                        yield chunk(i, {"tool_calls": [{**tool_call_json(d.call, index[d.call.id]),
                                                        "function": {"name": d.call.name, "arguments": ""}}]})
                    elif d.kind == "tool_args":
                        yield chunk(i, {"tool_calls": [{"index": index[d.call.id],
                                                        "function": {"arguments": d.text}}]})
            lp = {"content": chat_entries(pending_lp, app.token_texts)} if want_lp else None
            yield chunk(i, {}, finish=run.finish_reason, logprobs=lp)
        if include_usage:
            yield sse.data({**base, "choices": [], "usage": usage(runs), "timings": timings(runs)})
        yield sse.data("[DONE]")
    except Exception as e:  # noqa: BLE001 - every failure becomes an error event
        e = stream_failure(app, e, "chat")
        yield sse.data(error_body(e, anthropic=False))
