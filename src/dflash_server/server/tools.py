"""Tool calls: the tool set of a request, and parsing the model's tool-call markup.

Three output formats are understood, inside ``<tool_call>...</tool_call>`` (Gemma 4:
``<|tool_call>...<tool_call|>``):
- Hermes / Qwen3 JSON: ``{"name": "f", "arguments": {...}}``
- Qwen3.5 XML: ``<function=f><parameter=p>value</parameter></function>``; values are
  coerced to the JSON-schema type the tool declares for that parameter.
- Gemma 4: ``call:f{key:value,...}``, keys bare, strings between ``<|"|>`` marks, numbers,
  ``true`` / ``false`` / ``null``, ``[...]`` and nested ``{...}`` as in JSON.
A block that does not parse, names a tool the request did not declare, or holds values
JSON cannot carry (``1e999``, ``NaN``) is not a tool call: the caller keeps its raw text
as content rather than emitting half of it (or invalid JSON).
"""
from __future__ import annotations

import json
import logging
import math
import re
import secrets
from dataclasses import dataclass

log = logging.getLogger("dflash_server.tools")

# a function must be closed (a call cut off by max_tokens is not a call); inside it a
# parameter may end at the next <parameter= or </function> (models sometimes omit the tag)
_FUNC_RE = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_PARAM_RE = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)


def _finite(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"{text} is not a finite number")
    return v


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def loads(text: str):
    """json.loads that refuses what JSON cannot carry (NaN, Infinity, 1e999): ValueError."""
    return json.loads(text, parse_float=_finite, parse_constant=_no_constant)


def dumps_args(args: dict) -> str:
    return json.dumps(args, ensure_ascii=False, allow_nan=False)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    name: str
    arguments: str          # a JSON object, serialized
    id: str = ""

    def __post_init__(self):
        self.id = self.id or new_call_id()

    @property
    def input(self) -> dict:
        return loads(self.arguments)


@dataclass(frozen=True)
class ToolSet:
    """The request's function tools in the chat-completions shape templates expect."""
    specs: tuple[dict, ...]                 # [{"type": "function", "function": {...}}]
    choice: str = "auto"                    # auto | required | none | function
    forced_name: str | None = None          # tool_choice naming one function
    parallel: bool = True

    @property
    def names(self) -> dict[str, dict]:
        return {s["function"]["name"]: s["function"].get("parameters") or {} for s in self.specs}

    @property
    def active(self) -> bool:
        return bool(self.specs) and self.choice != "none"


def make_toolset(functions: list[dict], choice: str = "auto", forced_name: str | None = None,
                 parallel: bool = True) -> ToolSet:
    """``functions``: [{"name", "description"?, "parameters"?}]. Raises ValueError."""
    specs, seen = [], set()
    for f in functions:
        name = f["name"]
        if name in seen:
            raise ValueError(f"tool {name!r} is declared twice")
        seen.add(name)
        fn = {"name": name}
        if f.get("description") is not None:
            fn["description"] = f["description"]
        fn["parameters"] = f.get("parameters") if f.get("parameters") is not None else \
            {"type": "object", "properties": {}}
        specs.append({"type": "function", "function": fn})
    if choice in ("required", "function") and not specs:
        raise ValueError(f"tool_choice {choice!r} needs at least one tool")
    if forced_name is not None and forced_name not in seen:
        raise ValueError(f"tool_choice names {forced_name!r}, which is not among the tools")
    return ToolSet(tuple(specs), choice, forced_name, parallel)


def _schema_types(schema) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    types = set(t) if isinstance(t, list) else ({t} if isinstance(t, str) else set())
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            types |= _schema_types(sub)
    enum = schema.get("enum")
    if not types and isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        types = {"string"}
    return types


def coerce_value(raw: str, schema) -> object:
    """A parameter value from XML markup, typed by its JSON schema."""
    types = _schema_types(schema)
    if types == {"string"}:
        return raw
    text = raw.strip()
    if "integer" in types and re.fullmatch(r"-?\d+", text):
        return int(text)
    if "number" in types:
        try:
            v = _finite(text)
            return int(v) if v.is_integer() and "." not in text and "e" not in text.lower() else v
        except ValueError:
            pass
    if "boolean" in types and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if "null" in types and text.lower() in ("null", "none"):
        return None
    if types & {"object", "array"} or not types:
        try:
            return loads(text)
        except ValueError:
            pass
    return raw


def _strip_nl(v: str) -> str:
    v = v[1:] if v.startswith("\n") else v
    return v[:-1] if v.endswith("\n") else v


def parse_tool_block(block: str, tools: dict[str, dict]) -> list[ToolCall] | None:
    """``block``: the text between <tool_call> and </tool_call> (or a bare <function=...>
    block). Returns the calls it holds, or None when it is not a valid tool call. Whatever
    the model wrote and whatever the schemas say, this never raises."""
    try:
        return _parse_tool_block(block, tools)
    except (ValueError, TypeError, AttributeError, RecursionError) as e:
        log.warning("tool call not parsed (%s: %s); kept as text", type(e).__name__, e)
        return None


GEMMA4_QUOTE = '<|"|>'
_GEMMA4_NUMBER = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?")
_GEMMA4_DEPTH = 64


class _Gemma4Reader:
    """A recursive-descent reader of Gemma 4's call arguments (ValueError when malformed)."""

    def __init__(self, text: str):
        self.text, self.i = text, 0

    def ws(self) -> None:
        while self.i < len(self.text) and self.text[self.i] in " \t\r\n":
            self.i += 1

    def expect(self, s: str) -> None:
        if not self.text.startswith(s, self.i):
            raise ValueError(f"expected {s!r} at {self.i}")
        self.i += len(s)

    def value(self, depth: int = 0):
        if depth > _GEMMA4_DEPTH:
            raise ValueError("arguments nested too deeply")
        self.ws()
        t = self.text
        if t.startswith(GEMMA4_QUOTE, self.i):
            j = t.find(GEMMA4_QUOTE, self.i + len(GEMMA4_QUOTE))
            if j < 0:
                raise ValueError("unterminated string")
            v, self.i = t[self.i + len(GEMMA4_QUOTE):j], j + len(GEMMA4_QUOTE)
            return v
        if t.startswith("{", self.i):
            return self.mapping(depth)
        if t.startswith("[", self.i):
            self.i += 1
            out = []
            self.ws()
            if t.startswith("]", self.i):
                self.i += 1
                return out
            while True:
                out.append(self.value(depth + 1))
                self.ws()
                if t.startswith("]", self.i):
                    self.i += 1
                    return out
                self.expect(",")
        for word, v in (("true", True), ("false", False), ("null", None)):
            if t.startswith(word, self.i):
                self.i += len(word)
                return v
        m = _GEMMA4_NUMBER.match(t, self.i)
        if m is None:
            raise ValueError(f"no value at {self.i}")
        self.i = m.end()
        return int(m.group()) if m.group(2) is None and m.group(3) is None else _finite(m.group())

    def mapping(self, depth: int = 0) -> dict:
        t = self.text
        self.expect("{")
        out: dict = {}
        self.ws()
        if t.startswith("}", self.i):
            self.i += 1
            return out
        while True:
            self.ws()
            j = t.find(":", self.i)
            key = t[self.i:j].strip() if j >= 0 else ""
            if not key or any(c in key for c in "{}[],") or key.startswith(GEMMA4_QUOTE):
                raise ValueError(f"no key at {self.i}")
            self.i = j + 1
            out[key] = self.value(depth + 1)
            self.ws()
            if t.startswith("}", self.i):
                self.i += 1
                return out
            self.expect(",")


def _gemma4_call(text: str, tools: dict[str, dict]) -> list[ToolCall] | None:
    """``call:f{...}`` (one call: the text between Gemma 4's tool-call marks)."""
    brace = text.find("{")
    name = text[len("call:"):brace].strip() if brace >= 0 else ""
    if name not in tools:
        return None
    reader = _Gemma4Reader(text)
    reader.i = brace
    args = reader.mapping()
    if text[reader.i:].strip():
        return None  # stray text after the call
    return [ToolCall(name, dumps_args(args))]


def _parse_tool_block(block: str, tools: dict[str, dict]) -> list[ToolCall] | None:
    text = block.strip()
    if not text:
        return None
    if text.startswith("call:"):
        return _gemma4_call(text, tools)
    if text.startswith("{"):
        obj = loads(text)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            args = loads(args) if args.strip() else {}
        if not isinstance(args, dict) or obj["name"] not in tools:
            return None
        return [ToolCall(obj["name"], dumps_args(args))]
    calls = []
    for m in _FUNC_RE.finditer(text):
        name = m.group(1).strip()
        if name not in tools:
            return None
        params = tools[name]
        props = params.get("properties") if isinstance(params, dict) else None
        props = props if isinstance(props, dict) else {}
        args = {}
        for p in _PARAM_RE.finditer(m.group(2)):
            key = p.group(1).strip()
            args[key] = coerce_value(_strip_nl(p.group(2)), props.get(key))
        if _PARAM_RE.sub("", m.group(2)).strip():
            return None  # text outside any parameter: not a well-formed call
        calls.append(ToolCall(name, dumps_args(args)))
    if not calls or _FUNC_RE.sub("", text).strip():
        return None  # no function, or stray text around it
    return calls


def tool_format(template: str | None) -> str:
    """Which markup a chat template teaches: "gemma4", "xml" (Qwen3.5), "json" (Hermes/Qwen3)."""
    if template and "<|tool_call>" in template:
        return "gemma4"
    if template and "<function=" in template:
        return "xml"
    return "json"


def forced_prefix(tools: ToolSet, fmt: str) -> str:
    """Assistant text that commits the model to a tool call (tool_choice required/named)."""
    if tools.choice not in ("required", "function"):
        return ""
    if fmt == "gemma4":
        return "<|tool_call>call:" + (tools.forced_name or "")
    if tools.forced_name is None:
        return "<tool_call>\n"
    if fmt == "xml":
        return f"<tool_call>\n<function={tools.forced_name}>\n"
    return '<tool_call>\n{"name": ' + json.dumps(tools.forced_name) + ', "arguments": '

