"""Grammars that make a forced tool call well formed (tool_choice ``required`` or a named
function), for the two call formats ``tools`` parses, as Lark for llguidance:

- JSON (Hermes / Qwen3): ``{"name": ..., "arguments": {...}}`` with the arguments matching the
  function's parameter schema (llguidance's ``%json``);
- XML (Qwen3.5): ``<function=f>`` then one ``<parameter=p>`` block per parameter, in the
  order the schema declares them (required ones always present), each value shaped by its
  type (string, with its maxLength; integer, number (with their bounds), boolean, null, an
  enum of strings; objects and arrays as JSON), then ``</function>``.

- Gemma 4: ``call:f{key:value,...}`` with keys among the function's declared parameters (any
  bare key when it declares none) and Gemma 4's values (``<|"|>``-quoted strings, numbers,
  booleans, null, arrays, nested mappings), as llama.cpp's Gemma 4 grammar (not typed by
  the schema).

Each call ends with ``</tool_call>`` (Gemma 4: ``<tool_call|>``); with parallel calls allowed more may follow. The
grammar starts where ``tools.forced_prefix`` leaves the prompt. ``term`` writes a text as a
Lark terminal (a special single token of the vocabulary must be named as that token).

A structured-output format together with tools (``tool_choice`` auto): the output is either
the answer in that format or tool calls, each opened by its marker (``<tool_call>``), as
the model chooses. With a forced call the format has nothing to shape in this turn (its
output is the call; the format applies to the answer of a later turn).
"""
from __future__ import annotations

import json

from .tools import ToolSet

# an XML parameter value and its closing tag in one terminal (no ambiguity about where a
# string ends: it cannot contain "</")
_CLOSE = r"\n<\/parameter>\n"
MAX_BOUNDED_STRING = 1000  # a string's maxLength up to this is enforced (longer: unbounded)
_XML_VALUES = {
    "string": r"([^<]|<[^\/])*",
    "integer": r"-?(0|[1-9][0-9]{0,17})",
    "number": r"-?(0|[1-9][0-9]{0,17})(\.[0-9]{1,17})?([eE][+-]?[0-9]{1,3})?",
    "boolean": r"(true|false)",
    "null": r"null",
}


def tool_grammar(tools: ToolSet | None, fmt: str, term=json.dumps, answer: str | None = None) -> str | None:
    """The llguidance grammar of the output: the rest of a forced call; with tool_choice auto
    and an ``answer`` grammar (a structured-output format), that answer or tool calls;
    otherwise ``answer`` (None: free text)."""
    if tools is None or not tools.active or (tools.choice not in ("required", "function") and answer is None):
        return answer
    import llguidance

    if fmt == "gemma4":
        begin = term("<|tool_call>")
        lark, opener = _gemma4_lark(tools, term("<tool_call|>"), begin, term('<|"|>')), f'{begin} "call:"'
    else:
        end, begin = term("</tool_call>"), term("<tool_call>")
        lark = _json_lark(tools, end, begin) if fmt == "json" else _xml_lark(tools, end, begin)
        opener = f'{begin} "\\n"'
    if tools.choice in ("required", "function"):
        return llguidance.LLMatcher.grammar_from_lark(lark)
    return _either(lark, opener, answer)


def _either(calls_lark: str, opener: str, answer: str) -> str:
    """tool_choice auto with a format: ``answer`` (an llguidance grammar, its first grammar
    the start) or the calls of ``calls_lark`` (its ``start`` rule begins after the opener)."""
    assert calls_lark.startswith("start: ")
    sub = json.loads(answer)["grammars"]
    lark = f"start: @answer | {opener} calls\ncalls: " + calls_lark[len("start: "):]
    return json.dumps({"grammars": [{"lark_grammar": lark}, {**sub[0], "name": "answer"}, *sub[1:]]})


def _gemma4_lark(tools: ToolSet, end: str, begin: str, quote: str) -> str:
    """The prompt ends with '<|tool_call>call:' (and the forced function's name)."""
    # a string: between two quote tokens where the vocabulary has <|"|> as one special token;
    # else one terminal, quotes included (as separate lexemes the string's regex would have
    # to give back the "<|" it started to read)
    string = f"string: {quote} STRING {quote}" if quote.startswith("<[") else \
        'string: QUOTED\nQUOTED: /<\\|"\\|>([^<]|<[^|])*<\\|"\\|>/'
    values = [
        "value: string | mapping | array | NUMBER | \"true\" | \"false\" | \"null\"",
        string,
        "mapping: \"{\" (pair (\",\" pair)*)? \"}\"",
        "pair: KEY \":\" value",
        "array: \"[\" (value (\",\" value)*)? \"]\"",
        "STRING: /([^<]|<[^|])*/",
        "KEY: /[A-Za-z_][A-Za-z0-9_.-]*/",
        "NUMBER: /-?(0|[1-9][0-9]{0,17})(\\.[0-9]{1,17})?([eE][+-]?[0-9]{1,3})?/",
    ]

    def args(name: str, rule: str) -> str:
        props = _params(tools, name).get("properties")
        if not isinstance(props, dict) or not props:
            return "mapping"
        keys = " | ".join(json.dumps(k) for k in props if k and ":" not in k and "," not in k and "}" not in k)
        values.append(f"{rule}_pair: ({keys}) \":\" value" if keys else f"{rule}_pair: pair")
        values.append(f"{rule}: \"{{\" ({rule}_pair (\",\" {rule}_pair)*)? \"}}\"")
        return rule
    if tools.forced_name is not None:
        head = f"start: {args(tools.forced_name, 'f0')} {end}"
    else:
        alts = [f"{json.dumps(name)} {args(name, f'f{i}')}" for i, name in enumerate(tools.names)]
        more = f" ({begin} \"call:\" call)*" if tools.parallel else ""
        head = f"start: call{more}\ncall: ({' | '.join(alts)}) {end}"
    return "\n".join([head] + values) + "\n"


def _params(tools: ToolSet, name: str) -> dict:
    p = tools.names[name]
    return p if isinstance(p, dict) and p else {"type": "object"}


def _fixed(schema: dict) -> str:
    """A schema for ``%json`` with fixed whitespace (as ``json_schema_grammar``)."""
    return json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}})


def _json_lark(tools: ToolSet, end: str, begin: str) -> str:
    if tools.forced_name is not None:  # the prompt ends with '{"name": "f", "arguments": '
        return f'start: %json {_fixed(_params(tools, tools.forced_name))} "}}\\n" {end}\n'
    alts = []                          # the prompt ends with '<tool_call>\n'
    for name in tools.names:
        call = {"type": "object", "properties": {"name": {"const": name}, "arguments": _params(tools, name)},
                "required": ["name", "arguments"], "additionalProperties": False}
        alts.append(f"%json {_fixed(call)}")
    return f'start: call ("\\n" {begin} "\\n" call)*\ncall: ({" | ".join(alts)}) "\\n" {end}\n'


def _xml_value(schema) -> str:
    """A Lark expression for a parameter's value followed by its closing tag."""
    close = f"/{_CLOSE}/"
    if not isinstance(schema, dict):
        schema = {}
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) and "<" not in v for v in enum):
        return "(" + " | ".join(json.dumps(v) for v in enum) + f") {close}"
    t = schema.get("type")
    types = [t] if isinstance(t, str) else ([x for x in t if isinstance(x, str)] if isinstance(t, list) else [])
    if types and set(types) <= {"integer", "number"} and any(
            k in schema for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")):
        return f"%json {_fixed(schema)} {close}"  # bounds: llguidance's JSON numbers enforce them
    if types and all(x in _XML_VALUES for x in types):
        values = dict(_XML_VALUES)
        n = schema.get("maxLength")
        if isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_BOUNDED_STRING:
            values["string"] = f"([^<]|<[^\\/]){{0,{n}}}"  # (a "<x" pair counts as one: a bound, not exact)
        return "(" + " | ".join(f"/{values[x]}{_CLOSE}/" for x in types) + ")"
    return f"%json {_fixed(schema)} {close}"  # objects, arrays, anything else: JSON


def _xml_function(tools: ToolSet, name: str, rule: str, out: list[str]) -> str:
    """Rules for the parameters of ``name``; returns the expression of its parameter list."""
    params = _params(tools, name)
    props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
    required = set(params.get("required") or [])
    parts = []
    for i, (key, schema) in enumerate(props.items()):
        if ">" in key or "\n" in key or "<" in key:   # <parameter=NAME> could not be read back
            raise ValueError(f"{name}: parameter name {key[:80]!r} cannot be written in this model's XML tool "
                             f"format (no '<', '>' or newline)")
        r = f"{rule}_p{i}"
        out.append(f"{r}: {json.dumps(f'<parameter={key}>' + chr(10))} {_xml_value(schema)}")
        parts.append(r if key in required else f"{r}?")
    return " ".join(parts)


def _xml_lark(tools: ToolSet, end: str, begin: str) -> str:
    rules: list[str] = []
    close = f'"</function>\\n" {end}'
    if tools.forced_name is not None:  # the prompt ends with '<tool_call>\n<function=f>\n'
        body = _xml_function(tools, tools.forced_name, "f0", rules)
        return "\n".join([f"start: {body} {close}"] + rules) + "\n"
    alts = []                          # the prompt ends with '<tool_call>\n'
    for i, name in enumerate(tools.names):
        body = _xml_function(tools, name, f"f{i}", rules)
        alts.append(f'{json.dumps(f"<function={name}>" + chr(10))} {body} {close}')
    head = f'start: call ("\\n" {begin} "\\n" call)*\ncall: ' + " | ".join(f"({a})" for a in alts)
    return "\n".join([head] + rules) + "\n"
