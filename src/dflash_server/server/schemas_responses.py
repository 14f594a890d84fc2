"""OpenAI Responses request model and the conversion of its input items to messages.

``previous_response_id`` continues a stored response (``response_store``); the
``conversation`` object (OpenAI's server-side conversations) is refused.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from .errors import bad_request
from .reasoning import EFFORTS, Thinking
from .schemas_common import (MAX_TOKENS_LIMIT, Json, Model, SamplingFields, StopString, ToolName, ToolSchema,
                             output_grammar, text_of_parts)
from .tools import ToolSet, make_toolset

Effort = Literal[EFFORTS]  # type: ignore[valid-type]
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


class Item(Model):
    type: str | None = Field(None, max_length=64)
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[Json] | None = None
    call_id: str | None = Field(None, max_length=256)
    name: str | None = Field(None, max_length=256)
    arguments: str | None = None
    output: str | list[Json] | None = None
    summary: list[Json] | None = None


class ToolIn(Model):
    type: str = Field(max_length=64)
    name: ToolName | None = None
    description: str | None = None
    parameters: ToolSchema = None
    strict: bool | None = None


class NamedChoice(Model):
    type: Literal["function"]
    name: ToolName


class ReasoningIn(Model):
    effort: Effort | None = None
    summary: str | None = None


class TextFormat(Model):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=256)
    description: str | None = None
    schema_: Json | None = Field(None, alias="schema")
    strict: bool | None = None


class TextIn(Model):
    format: TextFormat | None = None


class ResponsesRequest(SamplingFields):
    model: str | None = Field(None, max_length=256)
    input: str | list[Item]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    # what chat-completions clients send (and some Responses clients too): the same limit
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    stop: StopString | list[StopString] | None = None
    stream: bool | None = False
    tools: list[ToolIn] | None = Field(None, max_length=512)
    tool_choice: Literal["auto", "none", "required"] | NamedChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningIn | None = None
    text: TextIn | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    previous_response_id: str | None = Field(None, max_length=256)
    conversation: Any = None
    chat_template_kwargs: Json | None = None
    store: bool | None = None
    metadata: Json | None = None
    user: str | None = None

    @property
    def output_limit(self) -> int | None:
        given = {self.max_output_tokens, self.max_completion_tokens, self.max_tokens} - {None}
        if len(given) > 1:
            raise bad_request("max_output_tokens, max_completion_tokens and max_tokens disagree; give one",
                              "max_output_tokens")
        return given.pop() if given else None

    def check_supported(self) -> None:
        if self.conversation:
            raise bad_request("conversation is not supported: continue a response with previous_response_id, "
                              "or send the full input", "conversation")
        if self.previous_response_id is not None and not self.previous_response_id:
            raise bad_request("previous_response_id is empty", "previous_response_id")

    def grammar(self) -> str | None:
        f = self.text.format if self.text else None
        return output_grammar(f.type, f.schema_, "text.format") if f is not None else None

    def thinking(self) -> Thinking:
        t = Thinking.from_effort(self.reasoning.effort if self.reasoning else None)
        flag = (self.chat_template_kwargs or {}).get("enable_thinking")
        return Thinking(enabled=flag, budget=t.budget if flag else None) if isinstance(flag, bool) else t

    def function_tools(self) -> list[ToolIn]:
        # hosted tools (web_search, file_search, ...) cannot run here: they are left out
        return [t for t in self.tools or [] if t.type == "function"]

    def toolset(self) -> ToolSet | None:
        tools, choice = self.function_tools(), self.tool_choice or "auto"
        if not tools:
            if isinstance(choice, NamedChoice) or choice == "required":
                raise bad_request("tool_choice requires function tools", "tool_choice")
            return None
        name = choice.name if isinstance(choice, NamedChoice) else None
        try:
            return make_toolset([{"name": t.name, "description": t.description, "parameters": t.parameters}
                                 for t in tools if t.name], "function" if name else choice, name,
                                self.parallel_tool_calls is not False)
        except ValueError as e:
            raise bad_request(str(e), "tools") from None

    def input_items(self) -> list[dict]:
        """The input as item dicts (a string input is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return [it.model_dump(exclude_none=True) for it in self.input]

    def continue_from(self, earlier: list[dict]) -> None:
        """Prepend a stored conversation's items to this request's input."""
        self.input = [Item.model_validate(d, strict=False) for d in earlier + self.input_items()]

    def hf_messages(self) -> list[dict]:
        out: list[dict] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            out.append({"role": "user", "content": self.input})
            return out
        reasoning = None
        for i, it in enumerate(self.input):
            where = f"input.{i}"
            kind = it.type or "message"
            if kind == "message":
                if it.role is None:
                    raise bad_request(f"{where}: a message needs a role", where)
                role = "system" if it.role == "developer" else it.role
                msg = {"role": role, "content": text_of_parts(it.content, where, _TEXT_PARTS)}
                if role == "assistant" and reasoning is not None:
                    msg["reasoning_content"], reasoning = reasoning, None
                if role == "system" and out and out[-1]["role"] == "system" and len(out) == 1:
                    out[-1]["content"] += "\n\n" + msg["content"]
                    continue
                out.append(msg)
            elif kind == "function_call":
                if not it.name or it.call_id is None:
                    raise bad_request(f"{where}: function_call needs name and call_id", where)
                call = {"id": it.call_id, "type": "function",
                        "function": {"name": it.name, "arguments": it.arguments or "{}"}}
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)
                else:
                    msg = {"role": "assistant", "content": "", "tool_calls": [call]}
                    if reasoning is not None:
                        msg["reasoning_content"], reasoning = reasoning, None
                    out.append(msg)
            elif kind == "function_call_output":
                out.append({"role": "tool", "tool_call_id": it.call_id or "",
                            "content": text_of_parts(it.output, where, _TEXT_PARTS)})
            elif kind == "reasoning":
                parts = (it.content if isinstance(it.content, list) else None) or it.summary or []
                reasoning = text_of_parts(parts, where, _TEXT_PARTS)
            else:
                raise bad_request(f"{where}: input item type {kind!r} is not supported", where)
        return out
