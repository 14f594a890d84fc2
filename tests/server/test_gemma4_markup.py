"""Gemma 4's reasoning and tool-call markup: ``<|channel>thought ...<channel|>`` and
``<|tool_call>call:f{key:<|"|>text<|"|>,n:42}<tool_call|>``. The cases are the ones llama.cpp's
own chat tests use for this format (tests/test-chat.cpp, Gemma 4), re-stated here; the
grammar for forced calls is checked with llguidance on the smol tokenizer."""
import json

import pytest

from dflash_server.server.output_parser import GEMMA4_MARKUP, OutputParser, markup_for
from dflash_server.server.tools import forced_prefix, make_toolset, parse_tool_block, tool_format

Q = '<|"|>'
TOOLS = make_toolset([
    {"name": "get_time", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
    {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
    {"name": "empty_args"},
    {"name": "special_function", "parameters": {"type": "object", "properties": {"arg1": {"type": "integer"}}}},
    {"name": "todo", "parameters": {"type": "object", "properties": {"items": {"type": "array"},
                                                                    "meta": {"type": "object"}}}},
])


def feed(text: str, step: int, **kw):
    p = OutputParser(markup=GEMMA4_MARKUP, **kw)
    for i in range(0, len(text), step):
        p.push(text[i:i + step])
    p.finish()
    return p


def calls(p):
    return [(c.name, json.loads(c.arguments)) for c in p.calls]


def test_the_template_selects_the_format():
    assert tool_format("...{{- '<|tool_call>call:' + function['name'] + '{' -}}...") == "gemma4"
    assert markup_for("gemma4") is GEMMA4_MARKUP
    assert tool_format("<tool_call>{{ x }}</tool_call>") == "json"


@pytest.mark.parametrize("step", [1, 3, 10_000])
def test_reasoning_then_content(step):
    p = feed("<|channel>thought\nI'm\nthinking<channel|>Hello, world!\nWhat's up?", step)
    assert (p.reasoning_text, p.text) == ("I'm\nthinking", "Hello, world!\nWhat's up?")
    p = feed("<|channel>thought<channel|>Hello, world!\nWhat's up?", step)  # an empty thought (budget 0)
    assert (p.reasoning_text, p.text) == ("", "Hello, world!\nWhat's up?")


@pytest.mark.parametrize("text,expected", [
    (f"call:get_time{{city:{Q}London{Q}}}", ("get_time", {"city": "London"})),
    (f"call:get_time{{city:{Q}San Francisco{Q}}}", ("get_time", {"city": "San Francisco"})),
    ("call:empty_args{}", ("empty_args", {})),
    ("call:special_function{arg1:42}", ("special_function", {"arg1": 42})),
    ("call:special_function{arg1:-7}", ("special_function", {"arg1": -7})),
    ("call:special_function{arg1:3.14}", ("special_function", {"arg1": 3.14})),
    ("call:special_function{arg1:true}", ("special_function", {"arg1": True})),
    ("call:special_function{arg1:null}", ("special_function", {"arg1": None})),
    (f"call:todo{{items:[{Q}buy milk{Q},{Q}a:b, c}}{Q}],meta:{{done:false,n:[1, 2.5]}}}}",
     ("todo", {"items": ["buy milk", "a:b, c}"], "meta": {"done": False, "n": [1, 2.5]}})),
])
def test_call_syntax(text, expected):
    got = parse_tool_block(text, TOOLS.names)
    assert [(c.name, json.loads(c.arguments)) for c in got] == [expected]


@pytest.mark.parametrize("bad", [
    f"call:unknown{{city:{Q}x{Q}}}",       # a tool the request did not declare
    f"call:get_time{{city:{Q}x}}",          # an unterminated string
    "call:get_time{city:London}",           # a bare word is not a value
    "call:get_time{:1}",                    # no key
    f"call:get_time{{city:{Q}x{Q}}} extra",  # text after the call
    "call:special_function{arg1:1e999}",    # not a finite number
    "call:get_time" + "{a:[" * 100 + "]}" * 100,  # nested without end
])
def test_malformed_calls_are_text(bad):
    assert parse_tool_block(bad, TOOLS.names) is None


@pytest.mark.parametrize("step", [1, 4, 10_000])
def test_calls_in_a_stream(step):
    text = (f"Hello, world!\nWhat's up?<|tool_call>call:get_time{{city:{Q}London{Q}}}<tool_call|>"
            f"<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}<tool_call|>")
    p = feed(text, step, tools=TOOLS)
    assert p.text == "Hello, world!\nWhat's up?"
    assert calls(p) == [("get_time", {"city": "London"}), ("get_weather", {"city": "Paris"})]
    p = feed(f"<|channel>thought\nI'm\nthinking<channel|><|tool_call>call:get_time{{city:{Q}Paris{Q}}}"
             "<tool_call|>", step, tools=TOOLS)
    assert p.reasoning_text == "I'm\nthinking" and calls(p) == [("get_time", {"city": "Paris"})]
    p = feed("<|tool_call>call:get_time{city:London}<tool_call|>", step, tools=TOOLS)  # malformed: kept as text
    assert p.calls == [] and p.text == "<|tool_call>call:get_time{city:London}<tool_call|>"


def test_forced_prefix_and_grammar():
    from dflash_server.server.tool_grammar import tool_grammar
    from helpers.grammar import accepts, smol_compiler

    named = make_toolset(TOOLS_LIST, choice="function", forced_name="get_time", parallel=False)
    required = make_toolset(TOOLS_LIST, choice="required")
    assert forced_prefix(named, "gemma4") == "<|tool_call>call:get_time"
    assert forced_prefix(required, "gemma4") == "<|tool_call>call:"
    comp, _ = smol_compiler()
    g = tool_grammar(named, "gemma4", comp.lark_text)
    assert accepts(g, f"{{city:{Q}Paris{Q}}}<tool_call|>")
    assert not accepts(g, "{town:1}<tool_call|>")          # not a declared parameter
    assert not accepts(g, f"{{city:{Q}Paris{Q}}}")           # the call must close
    g = tool_grammar(required, "gemma4", comp.lark_text)
    assert accepts(g, f"get_weather{{city:{Q}Rome{Q}}}<tool_call|><|tool_call>call:empty_args{{}}<tool_call|>")
    assert accepts(g, "todo{items:[1,2],meta:{a:null}}<tool_call|>")
    assert not accepts(g, "nope{}<tool_call|>")


TOOLS_LIST = [{"name": s["function"]["name"], "parameters": s["function"]["parameters"]} for s in TOOLS.specs]
