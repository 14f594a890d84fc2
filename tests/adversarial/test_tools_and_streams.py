"""Hostile tool schemas, model output JSON cannot carry, failures in the server's own
streaming code, forced calls, and the order of content blocks: through all the APIs,
with the official clients, on scripted model output (Qwen3.5 tokenizer and template)."""
import json
import math

import anthropic
import httpx
import openai
import pytest

from dflash_server.server import generation
from dflash_server.server.tools import ToolSet, parse_tool_block
from server.scripted import official_clients, scripted_server

CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n{days}\n"
        "</parameter>\n</function>\n</tool_call>")
SCRIPTS = {
    "huge_json": 'OK.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                 '"days": 1e999}}\n</tool_call>',
    "nan_json": 'OK.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": NaN}}\n</tool_call>',
    "huge_xml": "OK.\n</think>\n\n" + CALL.format(days="1e999"),
    "long_int": "OK.\n</think>\n\n" + CALL.format(days="9" * 5000),
    "boom": "Some text BOOM and more text after it",
    "forced_then_more": "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n"
                        "</tool_call>\nAnd now a long essay nobody asked for.",
    "text_call_text": "Let me check.\n</think>\n\nLooking it up." + "\n" + CALL.format(days="3") + "\nDone, wait.",
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "number"}}}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ANTH_TOOLS = [{"name": "get_weather", "input_schema": WEATHER}]
BAD_SCHEMAS = [
    {"type": "object", "properties": "x"},
    {"type": "object", "properties": {"city": {"type": "strnig"}}},
    {"type": "object", "properties": {"city": 5}},
    {"type": "object", "required": "city"},
    {"type": "string"},
    {"type": "object", "anyOf": []},
    {"type": "object", "properties": {"a": {"items": [{"type": 7}]}}},
]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = scripted_server(tmp_path_factory, SCRIPTS)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oa(srv):
    return official_clients(srv.url)[0]


@pytest.fixture(scope="module")
def an(srv):
    return official_clients(srv.url)[1]


def ask(script):
    return f"Weather? SCRIPT={script}"


def metric(srv, name: str) -> float:
    total = 0.0
    for line in httpx.get(srv.url + "/metrics").text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.parametrize("schema", BAD_SCHEMAS)
def test_malformed_tool_schema_is_a_400_naming_the_field(srv, schema):
    msgs = [{"role": "user", "content": ask("huge_json")}]
    cases = [
        ("/v1/chat/completions", {"messages": msgs, "tools": [{"type": "function", "function": {
            "name": "get_weather", "parameters": schema}}]}, "tools.0.function.parameters"),
        ("/v1/messages", {"max_tokens": 20, "messages": msgs, "tools": [{"name": "get_weather",
                                                                         "input_schema": schema}]},
         "tools.0.input_schema"),
        ("/v1/messages/count_tokens", {"messages": msgs, "tools": [{"name": "get_weather", "input_schema": schema}]},
         "tools.0.input_schema"),
        ("/v1/responses", {"input": ask("huge_json"), "tools": [{"type": "function", "name": "get_weather",
                                                                 "parameters": schema}]}, "tools.0.parameters"),
    ]
    for path, body, field in cases:
        for stream in (False, True):
            if path.endswith("count_tokens") and stream:
                continue
            r = httpx.post(srv.url + path, json={**body, "stream": stream} if stream else body, timeout=30)
            assert r.status_code == 400, (path, r.text)
            msg = r.json()["error"]["message"]
            assert field in msg, (path, msg)


def test_parser_never_raises_whatever_the_schema():
    tools = {"get_weather": {"type": "object", "properties": "x"}, "f": "not a dict", "g": {"properties": {
        "a": {"type": [{"x": 1}]}}}}
    for block in ("<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>",
                  "<function=f>\n<parameter=a>\n1\n</parameter>\n</function>",
                  "<function=g>\n<parameter=a>\n1\n</parameter>\n</function>",
                  '{"name": "get_weather", "arguments": {"x": ' + "[" * 5000 + "]" * 5000 + "}}"):
        calls = parse_tool_block(block, tools)
        for c in calls or []:
            json.loads(c.arguments)


def _valid_json(text: str):
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in JSON output"))


@pytest.mark.parametrize("script", ["huge_json", "nan_json", "huge_xml", "long_int"])
def test_numbers_json_cannot_carry_never_reach_the_client(srv, oa, script):
    for stream in (False, True):
        r = httpx.post(srv.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": ask(script)}], "tools": CHAT_TOOLS, "stream": stream},
            timeout=30)
        assert r.status_code == 200
        if stream:
            events = [_valid_json(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            calls: dict[int, str] = {}  # arguments stream in fragments: each call's, joined
            for t in (t for e in events for c in e["choices"] for t in c["delta"].get("tool_calls") or []):
                calls[t["index"]] = calls.get(t["index"], "") + t["function"]["arguments"]
            finish = [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")]
            args = list(calls.values())
            if finish == ["length"] and args:  # cut off mid-call (as OpenAI streams it): a JSON prefix
                args[-1] += "}" if args[-1] else "{}"
        else:
            msg = _valid_json(r.text)["choices"][0]["message"]
            args = [t["function"]["arguments"] for t in msg.get("tool_calls") or []]
        for a in args:  # a call that made it is valid, finite JSON
            for v in _valid_json(a).values():
                assert not isinstance(v, float) or math.isfinite(v)
    m = oa.chat.completions.create(model="scripted", messages=[{"role": "user", "content": ask(script)}],
                                   tools=CHAT_TOOLS)
    assert m.choices[0].message is not None


@pytest.fixture
def boom(monkeypatch):
    """A bug in the server's own output code, mid-stream (raises once BOOM was generated)."""
    step = generation.Run._step

    def exploding(self, events):
        self.seen = getattr(self, "seen", "") + "".join(e.text for e in events)  # tokens split the word
        if "BOOM" in self.seen:
            raise RuntimeError("output bug")
        return step(self, events)
    monkeypatch.setattr(generation.Run, "_step", exploding)


def test_a_failure_mid_stream_ends_with_an_error_event_in_each_shape(srv, oa, an, boom):
    before = metric(srv, "dflash_stream_errors_total")
    msgs = [{"role": "user", "content": ask("boom")}]
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": msgs, "stream": True}, timeout=30)
    last = [x for x in r.text.splitlines() if x.startswith("data: ")][-1]
    assert json.loads(last[6:])["error"]["type"] == "server_error"
    with pytest.raises(openai.APIError):
        for _ in oa.chat.completions.create(model="scripted", messages=msgs, stream=True):
            pass
    r = httpx.post(srv.url + "/v1/messages", json={"max_tokens": 50, "messages": msgs, "stream": True}, timeout=30)
    assert r.text.rstrip().split("\n")[-2:] == ["event: error", r.text.rstrip().split("\n")[-1]]
    assert json.loads(r.text.rstrip().split("\n")[-1][6:])["error"]["type"] == "api_error"
    with pytest.raises(anthropic.APIStatusError):
        with an.messages.stream(model="scripted", max_tokens=50, messages=msgs) as s:
            s.get_final_message()
    events = [e.type for e in oa.responses.create(model="scripted", input=ask("boom"), stream=True)]
    assert events[-2:] == ["error", "response.failed"]
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "SCRIPT=boom", "stream": True, "max_tokens": 50},
                   timeout=30)
    assert "error" in json.loads([x for x in r.text.splitlines() if x.startswith("data: ")][-1][6:])
    assert metric(srv, "dflash_stream_errors_total") - before == 6
    # non-streaming: a JSON 500 in the API's shape, never text/plain
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": msgs}, timeout=30)
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    assert r.json()["error"]["type"] == "server_error"
    r = httpx.post(srv.url + "/v1/messages", json={"max_tokens": 50, "messages": msgs}, timeout=30)
    assert r.status_code == 500 and r.json()["type"] == "error"


def test_generation_stops_after_a_forced_call(srv, oa, an):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for stream in (False, True):
        kw = dict(model="scripted", messages=[{"role": "user", "content": ask("forced_then_more")}],
                  tools=CHAT_TOOLS, tool_choice=named, stream_options={"include_usage": True} if stream else None)
        if stream:
            chunks = list(oa.chat.completions.create(stream=True, **{k: v for k, v in kw.items() if v is not None}))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            usage = chunks[-1].usage
        else:
            r = oa.chat.completions.create(**{k: v for k, v in kw.items() if v is not None})
            text, finish, usage = r.choices[0].message.content or "", [r.choices[0].finish_reason], r.usage
            assert [json.loads(t.function.arguments) for t in r.choices[0].message.tool_calls] == [
                {"city": "Paris", "days": 3}]
        assert finish == ["tool_calls"] and "essay" not in text
        assert usage.completion_tokens < 40  # the essay was never generated
    m = an.messages.create(model="scripted", max_tokens=200, tools=ANTH_TOOLS, tool_choice={
        "type": "tool", "name": "get_weather"}, messages=[{"role": "user", "content": ask("forced_then_more")}])
    assert m.stop_reason == "tool_use" and m.stop_sequence is None and [b.type for b in m.content] == ["tool_use"]
    r = oa.chat.completions.create(model="scripted", messages=[{"role": "user", "content": ask("text_call_text")}],
                                   tools=CHAT_TOOLS, parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls" and "Done" not in (r.choices[0].message.content or "")


def test_block_order_is_the_same_streamed_and_not(an, oa):
    kw = dict(model="scripted", max_tokens=300, tools=ANTH_TOOLS, thinking={"type": "enabled", "budget_tokens": 100},
              messages=[{"role": "user", "content": ask("text_call_text")}])
    plain = an.messages.create(**kw)
    with an.messages.stream(**kw) as s:
        streamed = s.get_final_message()
    order = [b.type for b in plain.content]
    assert order == [b.type for b in streamed.content] == ["thinking", "text", "tool_use", "text"]
    assert [b.model_dump() for b in plain.content if b.type != "tool_use"] == \
        [b.model_dump() for b in streamed.content if b.type != "tool_use"]
    rkw = dict(model="scripted", input=ask("text_call_text"), tools=[{"type": "function", "name": "get_weather",
                                                                      "parameters": WEATHER}])
    plain = oa.responses.create(**rkw)
    with oa.responses.stream(**rkw) as s:
        streamed = s.get_final_response()
    assert [o.type for o in plain.output] == [o.type for o in streamed.output] == [
        "reasoning", "message", "function_call", "message"]


def test_toolset_rejects_unknown_forced_name():
    with pytest.raises(ValueError):
        from dflash_server.server.tools import make_toolset
        make_toolset([{"name": "a"}], "function", "b")
    assert ToolSet(()).active is False
