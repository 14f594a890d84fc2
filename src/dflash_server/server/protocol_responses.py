"""OpenAI Responses: POST /v1/responses (JSON and SSE), with a store of recent responses
(``previous_response_id``, ``GET`` / ``DELETE /v1/responses/{id}``: ``response_store``)."""
from __future__ import annotations

import secrets
import time

from starlette.requests import Request
from starlette.responses import JSONResponse

from . import sse
from .errors import APIError, error_body
from .generation import GenOptions, Run, stream_failure
from .output_parser import Delta
from .protocol_openai import prompt_details
from .logprobs import chat_entries
from .reasoning import Thinking
from .schemas_common import stop_list
from .schemas_responses import ResponsesRequest


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class _Response:
    """The response object and its output items, as they build up."""

    def __init__(self, app, body: ResponsesRequest, model: str):
        self.body, self.model = body, model
        self.id, self.created = _id("resp"), time.time()
        self.output: list[dict] = []
        self.tools = [t.model_dump(exclude_none=True) for t in body.function_tools()]
        tc = body.tool_choice
        self.tool_choice = tc.model_dump() if hasattr(tc, "model_dump") else (tc or "auto")
        fmt = body.text.format if body.text and body.text.format else None
        self.text_format = fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}

    def obj(self, status: str, run: Run | None = None, output: list | None = None) -> dict:
        b = self.body
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
               "model": self.model, "error": None,
               # (a call whose arguments were still streaming when the response failed has no item)
               "output": [o for o in (self.output if output is None else output) if o is not None],
               "incomplete_details": None, "instructions": b.instructions, "max_output_tokens": b.output_limit,
               "parallel_tool_calls": b.parallel_tool_calls is not False, "tool_choice": self.tool_choice,
               "tools": self.tools, "temperature": b.temperature, "top_p": b.top_p,
               "reasoning": b.reasoning.model_dump() if b.reasoning else None,
               "text": {"format": self.text_format}, "metadata": b.metadata or {}, "usage": None,
               "previous_response_id": b.previous_response_id, "store": b.store is not False}
        if run is not None and run.result is not None:
            res = run.result
            out["usage"] = {"input_tokens": res.prompt_tokens,
                            "input_tokens_details": {"cache_write_tokens": 0, **prompt_details(res)},
                            "output_tokens": res.completion_tokens,
                            "output_tokens_details": {"reasoning_tokens": run.reasoning_tokens},
                            "total_tokens": res.prompt_tokens + res.completion_tokens}
            if status == "incomplete":
                out["incomplete_details"] = {"reason": "max_output_tokens"}
        return out


def _status(run: Run) -> str:
    return "incomplete" if run.finish_reason == "length" else "completed"


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def message_item(item_id: str, text: str, status: str = "completed", logprobs=None) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]
            if status != "in_progress" else []}


def call_item(item_id: str, call, status: str = "completed") -> dict:
    """A function_call item: in_progress (no arguments yet), completed, or incomplete (a call
    cut off by max_output_tokens: the arguments it had streamed)."""
    return {"id": item_id, "type": "function_call", "call_id": call.id, "name": call.name,
            "arguments": call.arguments if status != "in_progress" else "", "status": status}


def _not_found(rid: str, param: str | None = None) -> APIError:
    what = "Previous response" if param else "Response"
    return APIError(404, f"{what} with id {rid[:256]!r} not found", param=param, code="not_found")


def _remember(app, body: ResponsesRequest, resp: _Response, obj: dict, conversation: list[dict]) -> None:
    """Keep a finished response (unless ``store: false``) with the conversation it closes. A
    call cut off mid-stream (an incomplete item) was never made: a later turn replays its text,
    which the next message item holds, as a non-streamed response has it."""
    if body.store is not False:
        made = [o for o in resp.output if o is not None and not (o["type"] == "function_call"
                                                                    and o["status"] == "incomplete")]
        app.responses.put(resp.id, obj, conversation + made)


async def get(app, rid: str) -> dict:
    got = app.responses.get(rid)
    if got is None:
        raise _not_found(rid)
    return got[0]


async def delete(app, rid: str) -> dict:
    if not app.responses.delete(rid):
        raise _not_found(rid)
    return {"id": rid, "object": "response.deleted", "deleted": True}


async def handle(app, request: Request):
    body = await app.parse(request, ResponsesRequest)
    app.check_model(body.model)
    body.check_supported()
    if body.previous_response_id:
        earlier = app.responses.get(body.previous_response_id)
        if earlier is None:
            raise _not_found(body.previous_response_id, "previous_response_id")
        body.continue_from(earlier[1])
    conversation = body.input_items()  # what a later turn replays (instructions are not carried over)
    tools = body.toolset()
    grammar = await app.check_grammar(body.grammar(), "text.format")
    thinking = body.thinking() if grammar is None else Thinking(enabled=False)  # the grammar shapes it all
    prompt = await app.render_chat(body.hf_messages(), tools, thinking, body.chat_template_kwargs)
    opts = GenOptions(max_tokens=body.output_limit, sampling=body.sampling(app.sampling_defaults),
                      stop=stop_list(body.stop, 4), logprobs=body.top_logprobs, thinking=thinking, tools=tools,
                      grammar=grammar, **body.engine_options())
    runs = await app.service.start(prompt, opts, 1, label="responses")
    resp = _Response(app, body, body.model or app.config.model_name)
    if body.stream:
        return await sse.start_stream(request, runs, _stream(app, runs[0], resp, body, conversation))
    lps = (await sse.collect(request, runs))[0]
    run = runs[0]
    entries = chat_entries(lps, app.token_texts) if body.top_logprobs is not None else None
    for b in run.blocks or [Delta("content", "")]:  # output items in the order the stream sends them
        if b.kind == "reasoning":
            resp.output.append(reasoning_item(_id("rs"), b.text))
        elif b.kind == "content":
            resp.output.append(message_item(_id("msg"), b.text, logprobs=entries))
            entries = None  # all of them on the first message
        else:
            resp.output.append(call_item(_id("fc"), b.call))
    obj = resp.obj(_status(run), run)
    _remember(app, body, resp, obj, conversation)
    return JSONResponse(obj)


async def _stream(app, run: Run, resp: _Response, body: ResponsesRequest, conversation: list[dict]):
    seq = 0

    def ev(kind: str, **fields) -> bytes:
        nonlocal seq
        seq += 1
        return sse.event(kind, {"type": kind, "sequence_number": seq - 1, **fields})

    cur = None  # (kind, output_index, item_id, accumulated text)
    # top_logprobs: each text delta carries its tokens' entries; the first message item ends with
    # every token's, as a whole response has them
    want_lp = body.top_logprobs is not None
    pending_lp: list = []
    every_lp: list = []
    cur_lp: list[dict] = []   # the open message's entries
    first_msg: list[int] = []
    calling: dict[str, tuple[int, str, object]] = {}  # call id -> (output index, item id, call) while it streams

    def abandon() -> bytes:
        """Close the calls still streaming as incomplete items: the parser turned a call cut
        off by max_output_tokens into text, which comes next as a message (its own item), so
        every announced index keeps its item and the final output matches the stream."""
        out = []
        for idx, iid, call in calling.values():
            item = call_item(iid, call, "incomplete")
            resp.output[idx] = item
            out.append(ev("response.output_item.done", output_index=idx, item=item))
        calling.clear()
        return b"".join(out)

    def close():
        nonlocal cur
        if cur is None:
            return b""
        kind, idx, iid, text = cur
        cur = None
        if kind == "reasoning":
            item = reasoning_item(iid, text)
            part = {"type": "reasoning_text", "text": text}
            out = [ev("response.reasoning_text.done", item_id=iid, output_index=idx, content_index=0, text=text)]
        else:
            item = message_item(iid, text, logprobs=list(cur_lp))
            part = item["content"][0]
            out = [ev("response.output_text.done", item_id=iid, output_index=idx, content_index=0, text=text,
                      logprobs=list(cur_lp))]
            first_msg[:] = first_msg or [idx]
        out.append(ev("response.content_part.done", item_id=iid, output_index=idx, content_index=0, part=part))
        out.append(ev("response.output_item.done", output_index=idx, item=item))
        resp.output.append(item)
        return b"".join(out)

    def open_(kind: str) -> bytes:
        nonlocal cur
        cur_lp.clear()
        idx, iid = len(resp.output), _id("rs" if kind == "reasoning" else "msg")
        cur = (kind, idx, iid, "")
        if kind == "reasoning":
            item, part = reasoning_item(iid, "", "in_progress"), {"type": "reasoning_text", "text": ""}
        else:
            item, part = message_item(iid, "", "in_progress"), {"type": "output_text", "text": "", "annotations": [],
                                                                 "logprobs": []}
        return ev("response.output_item.added", output_index=idx, item=item) + ev(
            "response.content_part.added", item_id=iid, output_index=idx, content_index=0, part=part)

    yield ev("response.created", response=resp.obj("in_progress"))
    yield ev("response.in_progress", response=resp.obj("in_progress"))
    try:
        async for step in run:
            if want_lp:
                pending_lp.extend(step.logprobs)
                every_lp.extend(step.logprobs)
            for d in step.deltas:
                if d.kind == "tool_start":
                    yield close()
                    idx, iid = len(resp.output), _id("fc")
                    calling[d.call.id] = (idx, iid, d.call)
                    resp.output.append(None)  # its place; the item once the call is complete
                    yield ev("response.output_item.added", output_index=idx, item=call_item(iid, d.call, "in_progress"))
                    continue
                if d.kind == "tool_args":
                    idx, iid, _ = calling[d.call.id]
                    yield ev("response.function_call_arguments.delta", item_id=iid, output_index=idx, delta=d.text)
                    continue
                if d.kind == "tool_call":
                    idx, iid, _ = calling.pop(d.call.id)
                    yield ev("response.function_call_arguments.done", item_id=iid, output_index=idx,
                             name=d.call.name, arguments=d.call.arguments)
                    item = call_item(iid, d.call)
                    resp.output[idx] = item
                    yield ev("response.output_item.done", output_index=idx, item=item)
                    continue
                if calling:
                    yield abandon()
                kind = "reasoning" if d.kind == "reasoning" else "message"
                if cur is None or cur[0] != kind:
                    yield close()
                    yield open_(kind)
                k, idx, iid, text = cur
                cur = (k, idx, iid, text + d.text)
                name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
                extra = {}
                if kind == "message":
                    lp = chat_entries(pending_lp, app.token_texts) if pending_lp else []
                    pending_lp.clear()
                    cur_lp.extend(lp)
                    extra = {"logprobs": lp}
                yield ev(name, item_id=iid, output_index=idx, content_index=0, delta=d.text, **extra)
        yield abandon()
        if cur is None and not resp.output:
            yield open_("message")
        yield close()
        if want_lp and first_msg:   # the final output as a whole response has it
            resp.output[first_msg[0]]["content"][0]["logprobs"] = chat_entries(every_lp, app.token_texts)
        status = _status(run)
        obj = resp.obj(status, run)
        _remember(app, body, resp, obj, conversation)
        yield ev("response.completed" if status == "completed" else "response.incomplete", response=obj)
    except Exception as e:  # noqa: BLE001 - every failure becomes an error event
        e = stream_failure(app, e, "responses")
        err = error_body(e, anthropic=False)["error"]
        yield ev("error", code=err["code"], message=err["message"], param=err["param"])
        failed = resp.obj("failed")
        failed["error"] = {"code": "server_error", "message": e.message}
        yield ev("response.failed", response=failed)
