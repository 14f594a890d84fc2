"""Structural check of a tool's JSON Schema (``parameters`` / ``input_schema``) while the
request is validated, so a malformed schema is a 400 naming the field rather than a
failure later, when the model writes a call and the parser reads the schema. Covers the keywords of
JSON Schema 2020-12 (and draft 7's ``definitions`` / array ``items``); values of unknown
keywords are free, as the specification says.
"""
from __future__ import annotations

TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
MAX_DEPTH = 64
MAX_NODES = 20_000
_SCHEMA = ("additionalProperties", "additionalItems", "not", "contains", "propertyNames", "if", "then", "else",
           "unevaluatedProperties", "unevaluatedItems", "contentSchema")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains",
           "maxContains")
_NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_STRINGS = ("title", "description", "format", "pattern", "$ref", "$id", "$schema", "$anchor", "$comment")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class _Checker:
    nodes = 0

    @staticmethod
    def fail(where: str, what: str):
        where = where if len(where) <= 160 else "..." + where[-160:]
        raise ValueError(f"{where}: {what}" if where else what)

    def schema(self, s, where: str, depth: int) -> None:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            self.fail("", f"schema has more than {MAX_NODES} subschemas")
        if depth > MAX_DEPTH:
            self.fail(where, f"schema nested deeper than {MAX_DEPTH} levels")
        if isinstance(s, bool):
            return
        if not isinstance(s, dict):
            self.fail(where, "a schema must be an object or a boolean")
        t = s.get("type")
        if t is not None:
            types = t if isinstance(t, list) else [t]
            if not types or any(not isinstance(x, str) or x not in TYPES for x in types):
                self.fail(_join(where, "type"), f"must be one of {sorted(TYPES)} or a non-empty list of them")
        for key in _SCHEMA_MAPS:
            if key in s:
                m = s[key]
                if not isinstance(m, dict):
                    self.fail(_join(where, key), "must be an object mapping names to schemas")
                for name, sub in m.items():
                    self.schema(sub, _join(where, f"{key}.{name}"), depth + 1)
        for key in _SCHEMA_LISTS:
            if key in s:
                lst = s[key]
                if not isinstance(lst, list) or (not lst and key != "prefixItems"):
                    self.fail(_join(where, key), "must be a non-empty list of schemas")
                for i, sub in enumerate(lst):
                    self.schema(sub, _join(where, f"{key}.{i}"), depth + 1)
        if "items" in s:
            items = s["items"]
            for i, sub in enumerate(items if isinstance(items, list) else [items]):
                self.schema(sub, _join(where, "items" + (f".{i}" if isinstance(items, list) else "")), depth + 1)
        for key in _SCHEMA:
            if key in s:
                self.schema(s[key], _join(where, key), depth + 1)
        req = s.get("required")
        if req is not None and (not isinstance(req, list) or any(not isinstance(x, str) for x in req)):
            self.fail(_join(where, "required"), "must be a list of property names")
        if "enum" in s and not isinstance(s["enum"], list):
            self.fail(_join(where, "enum"), "must be a list")
        for key in _COUNTS:
            if key in s and not (isinstance(s[key], int) and not isinstance(s[key], bool) and s[key] >= 0):
                self.fail(_join(where, key), "must be a non-negative integer")
        for key in _NUMBERS:
            if key in s and not _number(s[key]):
                self.fail(_join(where, key), "must be a number")
        for key in _STRINGS:
            if key in s and not isinstance(s[key], str):
                self.fail(_join(where, key), "must be a string")


def _join(where: str, key) -> str:
    return f"{where}.{key}" if where else str(key)


def check_parameters(schema):
    """``schema`` unchanged if it is a well-formed JSON Schema for a function's arguments
    (an object schema, or one that admits objects); else ValueError naming the place."""
    if schema is None:
        return schema
    c = _Checker()
    c.schema(schema, "", 0)
    t = schema.get("type") if isinstance(schema, dict) else None
    if t is not None and "object" not in (t if isinstance(t, list) else [t]):
        c.fail("type", "function parameters must be an object schema")
    return schema
