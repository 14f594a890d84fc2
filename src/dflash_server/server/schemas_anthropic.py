"""Anthropic Messages request models and their conversion to template messages."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from .errors import bad_request
from .reasoning import Thinking
from .schemas_common import (MAX_TOKENS_LIMIT, CacheFields, Json, Model, StopString, ToolName, ToolSchema,
                             output_grammar, text_of_parts)
from .tools import ToolSet, make_toolset


class Block(Model):
    type: str = Field(max_length=64)
    text: str | None = None
    id: str | None = Field(None, max_length=256)
    name: str | None = Field(None, max_length=256)
    input: Any = None
    tool_use_id: str | None = Field(None, max_length=256)
    content: str | list[Json] | None = None
    is_error: bool | None = None
    thinking: str | None = None


class MessageIn(Model):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolIn(Model):
    type: str | None = None
    name: ToolName
    description: str | None = None
    input_schema: ToolSchema = None


class ToolChoiceIn(Model):
    type: Literal["auto", "any", "tool", "none"]
    name: ToolName | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingIn(Model):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS_LIMIT)


class CountTokensRequest(Model):
    model: str | None = Field(None, max_length=256)
    messages: list[MessageIn] = Field(min_length=1, max_length=100_000)
    system: str | list[Block] | None = None
    tools: list[ToolIn] | None = Field(None, max_length=512)
    tool_choice: ToolChoiceIn | None = None
    thinking: ThinkingIn | None = None

    def thinking_mode(self, max_tokens: int | None = None) -> Thinking:
        t = self.thinking
        if t is None or t.type == "disabled":
            return Thinking(enabled=False)  # Anthropic: no extended thinking unless asked
        if t.type == "adaptive":
            return Thinking(enabled=True)
        if t.budget_tokens is None:
            raise bad_request("thinking.budget_tokens is required when thinking is enabled", "thinking")
        if max_tokens is not None and t.budget_tokens >= max_tokens:
            raise bad_request(f"thinking.budget_tokens ({t.budget_tokens}) must be less than max_tokens "
                              f"({max_tokens})", "thinking.budget_tokens")
        return Thinking(enabled=True, budget=t.budget_tokens)

    def toolset(self) -> ToolSet | None:
        choice = self.tool_choice
        # server-side tools (web_search_*, code_execution_*, ...) run at Anthropic, not in a
        # model: like hosted tools on /v1/responses they are left out of the prompt
        tools = [t for t in self.tools or [] if t.type in (None, "custom")]
        if not tools:
            if choice is not None and choice.type in ("any", "tool"):
                raise bad_request("tool_choice requires tools", "tool_choice")
            return None
        kinds = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}
        kind = kinds[choice.type if choice else "auto"]
        if kind == "function" and not (choice and choice.name):
            raise bad_request("tool_choice type 'tool' needs a name", "tool_choice.name")
        try:
            return make_toolset([{"name": t.name, "description": t.description, "parameters": t.input_schema}
                                 for t in tools], kind, choice.name if kind == "function" else None,
                                not (choice and choice.disable_parallel_tool_use))
        except ValueError as e:
            raise bad_request(str(e), "tools") from None

    def hf_messages(self) -> list[dict]:
        out: list[dict] = []
        if self.system:
            out.append({"role": "system", "content": _text(self.system, "system")})
        last = len(self.messages) - 1
        for i, m in enumerate(self.messages):
            where = f"messages.{i}.content"
            if not m.content and not (i == last and m.role == "assistant"):  # the API's rule
                raise bad_request(f"messages.{i}: all messages must have non-empty content except for the "
                                  "optional final assistant message", where)
            if isinstance(m.content, str):
                out.append({"role": m.role, "content": m.content})
                continue
            texts, calls, thinking = [], [], []
            for b in m.content:
                if b.type == "text":
                    if not b.text:
                        raise bad_request(f"{where}: text content blocks must be non-empty", where)
                    texts.append(b.text)
                elif b.type == "tool_result" and m.role == "user":
                    content = _text(b.content, where) if b.content is not None else ""
                    out.append({"role": "tool", "tool_call_id": b.tool_use_id or "",
                                "content": ("Error: " + content) if b.is_error else content})
                elif b.type == "tool_use" and m.role == "assistant":
                    if not b.name or not isinstance(b.input, dict):
                        raise bad_request(f"{where}: tool_use needs a name and an input object", where)
                    calls.append({"id": b.id or f"toolu_{i}_{len(calls)}", "type": "function",
                                  "function": {"name": b.name, "arguments": b.input}})
                elif b.type == "thinking" and m.role == "assistant":
                    thinking.append(b.thinking or "")
                elif b.type == "redacted_thinking" and m.role == "assistant":
                    continue
                else:
                    raise bad_request(f"{where}: content block type {b.type!r} is not supported here", where)
            if texts or calls or thinking or m.role == "assistant":
                msg = {"role": m.role, "content": "\n".join(texts)}
                if calls:
                    msg["tool_calls"] = calls
                if thinking:
                    msg["reasoning_content"] = "\n".join(thinking)
                out.append(msg)
        final = out[-1] if out else {}
        if not self.messages or self.messages[-1].role != "assistant":
            return out
        if not final.get("content") and not final.get("tool_calls"):
            out.pop()  # an empty final assistant message: nothing to continue
        elif not final.get("tool_calls"):
            # a prefill: "the response content will continue immediately from" it
            if final["content"] != final["content"].rstrip():
                raise bad_request("final assistant content cannot end with trailing whitespace",
                                  f"messages.{last}.content")
            final["_continue"] = True
        return out


class OutputFormatIn(Model):
    type: Literal["json_schema"]
    schema_: Json | None = Field(None, alias="schema")


class OutputConfigIn(Model):
    format: OutputFormatIn | None = None
    effort: str | None = Field(None, max_length=16)  # accepted; the thinking settings decide


class MessagesRequest(CountTokensRequest, CacheFields):
    max_tokens: int = Field(ge=1, le=MAX_TOKENS_LIMIT)
    stop_sequences: list[StopString] | None = Field(None, max_length=16)
    stream: bool | None = False
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0, le=1_000_000)
    metadata: Json | None = None
    output_config: OutputConfigIn | None = None

    def grammar(self) -> str | None:
        """Structured output (``output_config.format``): the grammar of its JSON schema."""
        f = self.output_config.format if self.output_config else None
        if f is None:
            return None
        return output_grammar(f.type, f.schema_, "output_config.format")


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    parts = [b.model_dump() if isinstance(b, Model) else b for b in content]
    for p in parts:
        if isinstance(p, dict) and p.get("type") == "image":
            raise bad_request(f"{where}: image blocks are not supported (this server takes text)", where)
    return text_of_parts(parts, where, allowed=("text",)) if parts else ""
