"""Anthropic Messages: POST /v1/messages (JSON and SSE) and /v1/messages/count_tokens."""
from __future__ import annotations

import secrets

from starlette.requests import Request
from starlette.responses import JSONResponse

from . import sse
from .errors import error_body
from .generation import GenOptions, Run, stream_failure
from .reasoning import Thinking
from .schemas_anthropic import CountTokensRequest, MessagesRequest
from .schemas_common import SamplingFields, stop_list


def tool_use_id(call) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def stop_reason(run: Run) -> tuple[str, str | None]:
    r = run.finish_reason
    if r == "length":
        return "max_tokens", None
    if r == "tool_calls":
        return "tool_use", None
    if run.stop_string is not None:
        return "stop_sequence", run.stop_string
    return "end_turn", None


def _usage(run: Run, prompt_tokens: int, output_tokens: int) -> dict:
    cached = run.result.cached_tokens if run.result else 0
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


async def count_tokens(app, request: Request):
    body = await app.parse(request, CountTokensRequest)
    app.check_model(body.model)
    prompt = await app.render_chat(body.hf_messages(), body.toolset(), body.thinking_mode())
    return JSONResponse({"input_tokens": len(prompt.ids)})


async def handle(app, request: Request):
    body = await app.parse(request, MessagesRequest)
    app.check_model(body.model)
    tools = body.toolset()
    grammar = await app.check_grammar(body.grammar(), "output_config.format")
    # a grammar shapes the whole output: no thinking before it
    thinking = body.thinking_mode(body.max_tokens) if grammar is None else Thinking(enabled=False)
    prompt = await app.render_chat(body.hf_messages(), tools, thinking)
    sampling = SamplingFields(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k)
    opts = GenOptions(max_tokens=body.max_tokens, sampling=sampling.sampling(app.sampling_defaults),
                      stop=stop_list(body.stop_sequences, 16, "stop_sequences"), thinking=thinking, tools=tools,
                      grammar=grammar, **body.engine_options())
    runs = await app.service.start(prompt, opts, 1, label="messages")
    run, mid = runs[0], "msg_" + secrets.token_hex(12)
    model = body.model or app.config.model_name
    if body.stream:
        return await sse.start_stream(request, runs, _stream(app, run, mid, model, len(prompt.ids)))
    await sse.collect(request, runs)
    # blocks in the order the model wrote them, as the stream sends them
    content = [_block(b) for b in run.blocks] or [{"type": "text", "text": ""}]
    reason, seq = stop_reason(run)
    return JSONResponse({"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
                         "stop_reason": reason, "stop_sequence": seq,
                         "usage": _usage(run, run.result.prompt_tokens, run.result.completion_tokens)})


def _block(d) -> dict:
    if d.kind == "reasoning":
        return {"type": "thinking", "thinking": d.text, "signature": ""}
    if d.kind == "content":
        return {"type": "text", "text": d.text}
    return {"type": "tool_use", "id": tool_use_id(d.call), "name": d.call.name, "input": d.call.input}


async def _stream(app, run: Run, mid: str, model: str, prompt_tokens: int):
    start = {"id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
             "stop_reason": None, "stop_sequence": None, "usage": _usage(run, prompt_tokens, 0)}
    yield sse.event("message_start", {"type": "message_start", "message": start})
    index, open_kind = -1, None

    def open_block(kind, block):
        nonlocal index, open_kind
        out = []
        if open_kind is not None:
            out.append(sse.event("content_block_stop", {"type": "content_block_stop", "index": index}))
        index, open_kind = index + 1, kind
        out.append(sse.event("content_block_start", {"type": "content_block_start", "index": index,
                                                     "content_block": block}))
        return b"".join(out)

    def delta(d):
        return sse.event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": d})

    try:
        async for step in run:
            for d in step.deltas:
                if d.kind == "reasoning":
                    if open_kind != "thinking":
                        yield open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                    yield delta({"type": "thinking_delta", "thinking": d.text})
                elif d.kind == "content":
                    if open_kind != "text":
                        yield open_block("text", {"type": "text", "text": ""})
                    yield delta({"type": "text_delta", "text": d.text})
                elif d.kind == "tool_start":
                    c = d.call
                    yield open_block("tool_use", {"type": "tool_use", "id": tool_use_id(c), "name": c.name,
                                                  "input": {}})
                elif d.kind == "tool_args":
                    yield delta({"type": "input_json_delta", "partial_json": d.text})
        if open_kind is None:  # an empty answer is still one (empty) text block
            yield open_block("text", {"type": "text", "text": ""})
        yield sse.event("content_block_stop", {"type": "content_block_stop", "index": index})
        reason, seq = stop_reason(run)
        yield sse.event("message_delta", {"type": "message_delta",
                                          "delta": {"stop_reason": reason, "stop_sequence": seq},
                                          "usage": _usage(run, run.result.prompt_tokens,
                                                          run.result.completion_tokens)})
        yield sse.event("message_stop", {"type": "message_stop"})
    except Exception as e:  # noqa: BLE001 - every failure becomes an error event
        e = stream_failure(app, e, "messages")
        yield sse.event("error", error_body(e, anthropic=True))
