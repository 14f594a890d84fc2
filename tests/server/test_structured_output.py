"""Structured output over HTTP with the official client: ``response_format`` json_object /
json_schema (chat, also through the SDK's ``parse`` helper with a pydantic model) and
Responses ``text.format``; outputs validate against their schema; stream == non-stream;
unusable schemas are 400s."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pydantic
import pytest

from .conftest import start_tiny

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "days", "unit"],
          "properties": {"city": {"type": "string", "maxLength": 10},
                         "days": {"type": "integer", "minimum": 1, "maximum": 7},
                         "unit": {"enum": ["C", "F"]}}}
MSG = [{"role": "user", "content": "Weather for Paris as JSON."}]


class Forecast(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    city: str = pydantic.Field(max_length=10)
    days: int = pydantic.Field(ge=1, le=7)


@pytest.fixture(scope="module")
def srv(tiny_dir):
    s = start_tiny(tiny_dir, "llama")
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def oa(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)


def _fmt(schema=SCHEMA):
    return {"type": "json_schema", "json_schema": {"name": "forecast", "schema": schema, "strict": True}}


def test_chat_json_schema_greedy_sampled_and_streamed(oa):
    for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 5}):
        r = oa.chat.completions.create(model="tiny", messages=MSG, max_tokens=60, response_format=_fmt(), **kw)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    whole = oa.chat.completions.create(model="tiny", messages=MSG, max_tokens=60, temperature=0,
                                       response_format=_fmt()).choices[0].message.content
    parts = oa.chat.completions.create(model="tiny", messages=MSG, max_tokens=60, temperature=0,
                                       response_format=_fmt(), stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == whole


def test_sdk_parse_helper_and_json_object(oa):
    r = oa.chat.completions.parse(model="tiny", messages=MSG, max_tokens=60, temperature=0, response_format=Forecast)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Forecast) and 1 <= parsed.days <= 7
    r = oa.chat.completions.create(model="tiny", messages=MSG, max_tokens=80, temperature=0,
                                   response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # a random tiny model may write one endless key: still JSON's beginning
        assert r.choices[0].message.content.startswith("{")


def test_responses_text_format(oa):
    fmt = {"type": "json_schema", "name": "forecast", "schema": SCHEMA, "strict": True}
    r = oa.responses.create(model="tiny", input="Weather for Paris as JSON.", max_output_tokens=60, temperature=0,
                            text={"format": fmt})
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema"


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "x", "schema": {"type": "bogus"}}}}),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": "nope"}}}),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}),
    ("/v1/chat/completions", {"response_format": _fmt({"type": "bogus"}), "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}}}], "tool_choice": "required"}),
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "schema": {"type": "object", "minProperties": "x"}}}}),
])
def test_unusable_formats_are_400(srv, path, body):
    base = {"model": "tiny", "max_tokens": 5}
    base.update({"messages": MSG} if path.endswith("completions") else {"input": "hi"})
    r = httpx.post(srv.url + path, json={**base, **body}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["message"], r.text


class _Raw(str):
    """A schema already written as JSON text (deeper than Python's encoder goes)."""


def _deep(n, raw=False):
    if raw:
        return _Raw('{"type":"object","properties":{"a":' * n + '{"type":"integer"}' + '},"required":["a"]}' * n)
    s = {"type": "integer"}
    for _ in range(n):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


@pytest.mark.parametrize("schema, ok", [
    (_deep(200), False),                                              # llguidance's recursion limit
    (_deep(5000, raw=True), False),                                   # deeper than a JSON parser likes
    ({"enum": [f"v{i}" for i in range(100_000)]}, False),             # a lexer too big
    ({"$ref": "#/$defs/x", "$defs": {"x": {"$ref": "#/$defs/x"}}}, None),  # a reference loop
    ({"type": "object", "properties": {"s": {"type": "string", "pattern": "(a+)+$"}}, "required": ["s"]}, True),
])
def test_hostile_schemas_are_bounded(srv, schema, ok):
    """A schema the grammar engine cannot take is a 400, never a 500 or a hang; one it can
    take (even a catastrophic-backtracking pattern) is served within the engine's work
    bounds, and the server serves the next request."""
    if isinstance(schema, _Raw):
        body = ('{"model": "tiny", "max_tokens": 8, "messages": ' + json.dumps(MSG) + ', "response_format": '
                '{"type": "json_schema", "json_schema": {"name": "x", "schema": ' + schema + '}}}')
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, content=body,
                       headers={"content-type": "application/json"})
    else:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "model": "tiny", "messages": MSG, "max_tokens": 8, "response_format": _fmt(schema)})
    assert r.status_code in ((200,) if ok else (400,) if ok is False else (200, 400)), r.text
    assert r.status_code == 400 or r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert httpx.get(srv.url + "/health", timeout=30).status_code == 200


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "days"],
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1,
                                                                          "maximum": 7}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def tool_model(tiny_dir, request):
    """Qwen3's template writes Hermes JSON calls, Qwen3.5's XML ones."""
    s = start_tiny(tiny_dir, request.param)
    yield openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0), request.param
    assert s.stop() == 0, s.output()


def _types_only(schema: dict) -> dict:
    """What the XML grammar enforces: types, enums, required keys (not lengths or bounds)."""
    drop = ("maxLength", "minimum", "maximum")
    return {**schema, "properties": {k: {x: v for x, v in p.items() if x not in drop}
                                     for k, p in schema["properties"].items()}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
@pytest.mark.parametrize("parallel", [True, False])
def test_forced_tool_calls_always_parse(tool_model, choice, parallel):
    """tool_choice required / named on a random tiny model, JSON and XML call formats: every
    call parses, names a declared function (the named one) and its arguments match its
    schema (the XML grammar enforces types, enums and required keys; JSON all of it)."""
    client, family = tool_model
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        r = client.chat.completions.create(model="tiny", messages=MSG, tools=[WEATHER, TIME], tool_choice=choice,
                                           parallel_tool_calls=parallel, max_tokens=160, **kw)
        calls = r.choices[0].message.tool_calls
        assert calls, r.choices[0]
        if not parallel or isinstance(choice, dict):
            assert len(calls) == 1 and r.choices[0].finish_reason == "tool_calls", r.choices[0]
        # (parallel calls: a random model never ends its list, so max_tokens may cut the last one)
        for c in calls:
            if isinstance(choice, dict):
                assert c.function.name == "get_time"
            schema = schemas[c.function.name]
            jsonschema.validate(json.loads(c.function.arguments), schema if family == "qwen3" else _types_only(schema))


def test_format_with_tools(tool_model):
    """A structured-output format with tools: under tool_choice auto each answer is either
    JSON of the format's schema or calls that parse (the model chooses); stream ==
    non-stream; with a forced call the output is the call. Through the official clients'
    chat, Responses and Anthropic shapes."""
    import anthropic

    client, family = tool_model
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    check = (lambda a, s: jsonschema.validate(a, s if family == "qwen3" else _types_only(s)))
    kinds = set()
    for kw in ({"temperature": 0}, *({"temperature": 1.0, "seed": i} for i in range(4))):
        args = dict(model="tiny", messages=MSG, tools=[WEATHER, TIME], response_format=_fmt(), max_tokens=120,
                    parallel_tool_calls=False, **kw)
        m = client.chat.completions.create(**args).choices[0]
        if m.message.tool_calls:
            kinds.add("call")
            assert m.finish_reason == "tool_calls" and len(m.message.tool_calls) == 1 and not m.message.content
            c = m.message.tool_calls[0]
            check(json.loads(c.function.arguments), schemas[c.function.name])
        else:
            kinds.add("json")
            assert m.finish_reason == "stop", m
            jsonschema.validate(json.loads(m.message.content), SCHEMA)
        parts = list(client.chat.completions.create(**args, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == (m.message.content or "")
        streamed = "".join(t.function.arguments or "" for c in parts if c.choices
                           for t in (c.choices[0].delta.tool_calls or []))
        assert streamed == (m.message.tool_calls[0].function.arguments if m.message.tool_calls else "")
    if family == "qwen3":  # (seeded: this tiny model chooses both across these samples; qwen3_5 JSON only)
        assert kinds == {"json", "call"}, kinds
    m = client.chat.completions.create(model="tiny", messages=MSG, tools=[WEATHER, TIME], response_format=_fmt(),
                                       tool_choice="required", parallel_tool_calls=False, max_tokens=120,
                                       temperature=0).choices[0]
    assert len(m.message.tool_calls) == 1 and m.finish_reason == "tool_calls", m
    r = client.responses.create(model="tiny", input="Weather for Paris as JSON.", max_output_tokens=120,
                                temperature=0, tools=[{"type": "function", **WEATHER["function"]}],
                                text={"format": {"type": "json_schema", "name": "f", "schema": SCHEMA}})
    assert r.status == "completed"
    fc = [o for o in r.output if o.type == "function_call"]
    if fc:
        check(json.loads(fc[0].arguments), schemas["get_weather"])
    else:
        jsonschema.validate(json.loads(r.output_text), SCHEMA)
    an = anthropic.Anthropic(base_url=str(client.base_url).removesuffix("/v1/"), api_key="x", max_retries=0)
    r = an.messages.create(model="tiny", max_tokens=120, messages=MSG, output_config={
        "format": {"type": "json_schema", "schema": SCHEMA}}, tools=[
        {"name": "get_time", "input_schema": TIME["function"]["parameters"]}])
    uses = [b for b in r.content if b.type == "tool_use"]
    if uses:
        check(uses[0].input, schemas["get_time"])
    else:
        jsonschema.validate(json.loads(r.content[0].text), SCHEMA)


def test_anthropic_output_format_and_forced_tools(tool_model, tiny_dir):
    """The official Anthropic client: ``output_config.format`` json_schema, and tool_choice
    ``any`` / ``tool`` (enforced as required / named)."""
    import anthropic

    client, family = tool_model
    an = anthropic.Anthropic(base_url=str(client.base_url).removesuffix("/v1/"), api_key="x", max_retries=0)
    r = an.messages.create(model="tiny", max_tokens=60, messages=MSG,
                           output_config={"format": {"type": "json_schema", "schema": SCHEMA}})
    jsonschema.validate(json.loads(r.content[0].text), SCHEMA)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in (WEATHER, TIME)]
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_time", "disable_parallel_tool_use": True}):
        r = an.messages.create(model="tiny", max_tokens=160, messages=MSG, tools=tools,
                               tool_choice=choice)
        uses = [b for b in r.content if b.type == "tool_use"]
        assert uses, r.content
        for u in uses:
            assert choice["type"] == "any" or u.name == "get_time"
            schema = {t["name"]: t["input_schema"] for t in tools}[u.name]
            jsonschema.validate(u.input, schema if family == "qwen3" else _types_only(schema))
    with pytest.raises(anthropic.BadRequestError):
        an.messages.create(model="tiny", max_tokens=5, messages=MSG,
                           output_config={"format": {"type": "json_schema", "schema": {"type": "bogus"}}})
