"""Tool-call arguments streamed while the model writes them, one argument at a time.

A call's start (its id and name) goes out as soon as the name is known and declared; then
each argument once it is complete, as a JSON fragment: ``{"city": "Paris"`` then
``, "days": 3`` and, when the call closes, ``}``. The fragments are written the way
``tools.dumps_args`` writes the whole object (``json.dumps``: ``", "`` and ``": "``), so
their concatenation is exactly the call's final ``arguments``, every prefix a prefix of
valid JSON (what the OpenAI, Anthropic and Responses stream helpers accumulate). Three
formats (``tools``): Hermes/Qwen3 JSON (``{"name": "f", "arguments": {...}}``), Qwen3.5 XML
(``<function=f><parameter=p>v</parameter>...``) and Gemma 4 (``call:f{k:v,...}``).
"""
from __future__ import annotations

import json
import re

from .tools import GEMMA4_QUOTE, _Gemma4Reader, _strip_nl, coerce_value, loads

_JSON_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]+)"\s*,\s*"arguments"\s*:\s*\{')
_XML_HEAD = re.compile(r"\s*<function=([^>\n]+)>")
_GEMMA4_HEAD = re.compile(r"\s*call:([^{\s]+)\{")
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def fragment(first: bool, key: str, value) -> str:
    return ("{" if first else ", ") + json.dumps(key, ensure_ascii=False) + ": " + \
        json.dumps(value, ensure_ascii=False, allow_nan=False)


class ArgumentStream:
    """Follows one tool-call block as it grows: ``head`` finds the function's name, ``members``
    the arguments completed so far (each parsed once, in order)."""

    def __init__(self, tools: dict[str, dict]):
        self.tools = tools
        self.name: str | None = None
        self.body_at = 0          # where the arguments begin in the block
        self.done = 0             # arguments parsed so far
        self.scan_at = 0          # where the next argument starts
        self.broken = False       # an argument did not parse: no more fragments
        # where ``_scan`` stopped, so the next call resumes there instead of rescanning the
        # unfinished argument (a 40k-character argument cost 22 s of quadratic scanning on
        # the event loop): the next index, the nesting depth, and whether it is in a string
        self._at, self._depth, self._quoted = 0, 0, False
        self._xml_seen = 0        # XML: the block's length when no parameter had closed yet

    def head(self, block: str) -> str | None:
        """The declared function this block calls, once its name is written (else None)."""
        if self.name is not None:
            return self.name
        for rx, fmt in ((_JSON_HEAD, "json"), (_XML_HEAD, "xml"), (_GEMMA4_HEAD, "gemma4")):
            m = rx.match(block)
            if m is not None and m.group(1).strip() in self.tools:
                self.name, self.fmt, self.body_at = m.group(1).strip(), fmt, m.end()
                self.scan_at = self.body_at
                return self.name
        return None

    def members(self, block: str) -> list[str]:
        """Fragments of the arguments completed since the last call."""
        if self.name is None or self.broken:
            return []
        try:
            pairs = self._xml(block) if self.fmt == "xml" else self._scan(block)
        except (ValueError, TypeError, RecursionError):
            self.broken = True
            return []
        out = []
        for key, value in pairs:
            out.append(fragment(self.done == 0, key, value))
            self.done += 1
        return out

    def _xml(self, block: str) -> list[tuple[str, object]]:
        params = self.tools[self.name]
        props = params.get("properties") if isinstance(params, dict) else None
        props = props if isinstance(props, dict) else {}
        out = []
        closer = "</parameter>"
        if block.find(closer, max(self.scan_at, self._xml_seen - len(closer))) < 0:
            self._xml_seen = len(block)     # nothing closed since: only the new text is searched
            return out
        for m in _XML_PARAM.finditer(block, self.scan_at):  # from the end of the last one found
            out.append((m.group(1).strip(), coerce_value(_strip_nl(m.group(2)), props.get(m.group(1).strip()))))
            self.scan_at = m.end()
        self._xml_seen = self.scan_at
        return out

    def _scan(self, block: str) -> list[tuple[str, object]]:
        """JSON / Gemma 4: each top-level member that a ``,`` or the closing ``}`` ended.
        Resumes where the last call stopped (the block only grows between calls)."""
        out, start = [], self.scan_at
        i, depth, quoted = max(self._at, self.scan_at), self._depth, self._quoted
        gemma = self.fmt == "gemma4"
        q = GEMMA4_QUOTE
        while i < len(block):
            if quoted:   # inside a string: find its end (or stop at the block's end, to resume)
                if gemma:
                    j = block.find(q, i)
                    if j < 0:
                        i = max(i, len(block) - len(q) + 1)   # a closer may be cut at the end
                        break
                    i, quoted = j + len(q), False
                    continue
                j = i
                while j < len(block) and block[j] != '"':
                    j += 2 if block[j] == "\\" else 1
                if j >= len(block):
                    i = len(block) - 1 if j > len(block) else len(block)   # resume at a cut escape
                    break
                i, quoted = j + 1, False
                continue
            if gemma and block.startswith(q, i):
                i, quoted = i + len(q), True
                continue
            if gemma and len(block) - i < len(q) and q.startswith(block[i:]):   # a quote cut at the end: wait
                break
            c = block[i]
            if c == '"' and not gemma:
                i, quoted = i + 1, True
                continue
            if c in "{[":
                depth += 1
            elif c in "}]" and depth > 0:
                depth -= 1
            elif depth == 0 and c in ",}":
                member = block[start:i].strip()
                if member:
                    out.append(self._member(member))
                start = self.scan_at = i + 1
                if c == "}":
                    self.broken = True  # the arguments are closed: nothing more to scan
                    i += 1
                    break
            i += 1
        self._at, self._depth, self._quoted = i, depth, quoted
        return out

    def _member(self, text: str) -> tuple[str, object]:
        if self.fmt == "gemma4":
            obj = _Gemma4Reader("{" + text + "}").mapping()
        else:
            obj = loads("{" + text + "}")
        if not isinstance(obj, dict) or len(obj) != 1:
            raise ValueError("not one argument")
        return next(iter(obj.items()))
