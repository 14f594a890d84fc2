"""Split streamed model text into reasoning, content and tool calls.

Fed the engine's text deltas in order; returns typed deltas as soon as they are certain.
Text that may be the start of a marker (``<think>``, ``</think>``, ``<tool_call>``,
``<function=``) is held back until the next delta decides, and a tool call's text never
reaches the client as content: once its first argument is complete the call starts
(``tool_start``: id and name), each argument follows as soon as it is complete
(``tool_args``, JSON fragments: ``tool_stream``), and the closing tag ends it (``tool_call``,
the whole call). A block cut off (by max_tokens) or garbled before its first argument goes
out whole as content, never as a call; one garbled after its first argument ends as a call
with the arguments completed before it.
The same parser serves streaming and non-streaming responses, so both agree exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import logging

from .tool_stream import ArgumentStream
from .tools import ToolCall, ToolSet, parse_tool_block

log = logging.getLogger("dflash_server.tools")

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# (opener, closer, the opener belongs to the parsed block)
_TOOL_MARKERS = (("<tool_call>", "</tool_call>", False), ("<function=", "</function>", True))


@dataclass(frozen=True)
class Markup:
    """How a model family writes reasoning and tool calls."""
    think_open: str = THINK_OPEN
    think_close: str = THINK_CLOSE
    tool_markers: tuple = _TOOL_MARKERS


QWEN_MARKUP = Markup()
# Gemma 4: <|channel>thought ... <channel|>, <|tool_call>call:f{...}<tool_call|>
GEMMA4_MARKUP = Markup("<|channel>thought", "<channel|>", (("<|tool_call>", "<tool_call|>", False),))


def markup_for(tool_format: str) -> Markup:
    return GEMMA4_MARKUP if tool_format == "gemma4" else QWEN_MARKUP


@dataclass
class Delta:
    kind: str                     # "reasoning" | "content" | "tool_start" | "tool_args" | "tool_call"
    text: str = ""
    call: ToolCall | None = None


def _partial_suffix(text: str, markers) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a marker."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


class OutputParser:
    def __init__(self, *, think_open: bool = False, tools: ToolSet | None = None, markup: Markup = QWEN_MARKUP):
        self.markup = markup
        self.mode = "reasoning" if think_open else "content"
        self.buf = ""
        self.tools = tools.names if tools is not None and tools.active else None
        self.parallel = tools.parallel if tools is not None else True
        self.markers = markup.tool_markers if self.tools is not None else ()
        self.tool_marker = None
        self.at_start = think_open    # drop leading whitespace (after </think>, a tool call)
        self.emitted = think_open     # anything emitted (or a think block already open)
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: list[ToolCall] = []
        self.args: ArgumentStream | None = None  # the block being written, and its started call
        self.started: ToolCall | None = None
        self.cut = False

    @property
    def text(self) -> str:
        return "".join(self.content)

    @property
    def reasoning_text(self) -> str:
        return "".join(self.reasoning)

    def push(self, text: str) -> list[Delta]:
        self.buf += text
        return self._drain(final=False)

    def finish(self, cut: bool = False) -> list[Delta]:
        """The end of the output; ``cut``: it ended at max_tokens (an open tool call is then
        cut off; otherwise it ended at its closing tag, which a stop string took)."""
        self.cut = cut
        return self._drain(final=True)

    # ----------------------------------------------------------------------------------
    def _emit(self, out: list[Delta], kind: str, text: str) -> None:
        if self.at_start:
            text = text.lstrip()
        if not text:
            return
        self.at_start = False
        if kind == "content":
            self.content.append(text)
        else:
            self.reasoning.append(text)
        self.emitted = True
        if out and out[-1].kind == kind:
            out[-1].text += text
        else:
            out.append(Delta(kind, text))

    def _drain(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        opener, close = self.markup.think_open, self.markup.think_close
        while True:
            if self.mode == "reasoning":
                i = self.buf.find(close)
                if i >= 0:
                    self._emit(out, "reasoning", self.buf[:i].rstrip())
                    self.buf = self.buf[i + len(close):]
                    self.mode, self.at_start = "content", True
                    continue
                # hold back a possible "</think>" start and trailing whitespace (dropped at the close)
                cut = len(self.buf)
                if not final:
                    cut -= _partial_suffix(self.buf, (close,))
                    cut = len(self.buf[:cut].rstrip())
                self._emit(out, "reasoning", self.buf[:cut])
                self.buf = self.buf[cut:]
                return out
            if self.mode == "content":
                if self.at_start:
                    self.buf = self.buf.lstrip()
                if not self.emitted:  # a think block may open the output (after whitespace)
                    rest = self.buf.lstrip()
                    if rest.startswith(opener):
                        self.buf = rest[len(opener):]
                        self.mode, self.emitted, self.at_start = "reasoning", True, True
                        continue
                    if not final and opener.startswith(rest):
                        return out
                watch = [m[0] for m in self.markers]
                hits = [(i, m) for m in watch if (i := self.buf.find(m)) >= 0]
                if hits:
                    i, m = min(hits)
                    self._emit(out, "content", self.buf[:i])
                    self.tool_marker = next(t for t in self.markers if t[0] == m)
                    self.buf = self.buf[i if self.tool_marker[2] else i + len(m):]
                    self.mode = "tool"
                    continue
                keep = 0 if final else _partial_suffix(self.buf, watch)
                self._emit(out, "content", self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                return out
            # mode == "tool": buffer until the closing tag
            t_open, closer, inclusive = self.tool_marker
            j = self.buf.find(closer, len(t_open) if inclusive else 0)
            if j < 0 and not final:
                self._partial(out, self.buf)
                return out
            end = len(self.buf) if j < 0 else j + len(closer)
            block = self.buf[:end] if inclusive else self.buf[:j if j >= 0 else end]
            raw = ("" if inclusive else t_open) + self.buf[:end]
            self.buf = self.buf[end:]
            self._tool(out, block, raw, closed=j >= 0 or not self.cut)
            self.mode, self.at_start = "content", True
            if j < 0:
                return out

    def _partial(self, out: list[Delta], block: str) -> None:
        """A call's start and its completed arguments, while the block is still open. The
        call starts with its first complete argument: a block cut off or garbled before one
        never started, so it still goes out whole as content."""
        if self.args is None:
            self.args = ArgumentStream(self.tools or {})
        if self.started is None and (self.args.head(block) is None or (self.calls and not self.parallel)):
            return
        pieces = self.args.members(block)
        if pieces and self.started is None:
            self.started = ToolCall(self.args.name, "")
            self.emitted = True
            out.append(Delta("tool_start", call=self.started))
        for piece in pieces:
            self.started.arguments += piece
            out.append(Delta("tool_args", piece, call=self.started))

    def _tool(self, out: list[Delta], block: str, raw: str, closed: bool = True) -> None:
        self._partial(out, block)
        started, self.started, self.args = self.started, None, None
        calls = parse_tool_block(block, self.tools or {})
        if started is not None and not closed:
            # cut off (max_tokens): not a call (a stream has seen it begin, and its finish
            # reason says "length"); the text goes out as content, as a never-started one's
            log.info("tool call %s cut off before its end; kept as text", started.name)
            self._emit(out, "content", raw)
            return
        if started is not None:  # finish the call the client has seen begin
            sent = started.arguments
            whole = calls[0].arguments if calls and calls[0].name == started.name else None
            if whole is None or not whole.startswith(sent):
                log.warning("tool call %s did not parse to the arguments streamed so far; closed as sent",
                            started.name)
                whole = sent + "}" if sent else "{}"
            self._finish(out, started, whole)
            calls = (calls or [])[1:]
        elif calls is None:
            self._emit(out, "content", raw)  # not a valid call: the model's text, whole
            return
        for call in calls:
            if self.calls and not self.parallel:
                break
            out.append(Delta("tool_start", call=ToolCall(call.name, "", call.id)))
            self._finish(out, out[-1].call, call.arguments)

    def _finish(self, out: list[Delta], call: ToolCall, whole: str) -> None:
        rest = whole[len(call.arguments):]
        if rest:
            call.arguments = whole
            out.append(Delta("tool_args", rest, call=call))
        self.calls.append(call)
        self.emitted = True
        out.append(Delta("tool_call", call=call))
