"""OpenAI Chat Completions and Completions request models, and chat message conversion."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from .errors import bad_request
from .reasoning import EFFORTS
from .schemas_common import (MAX_TOKENS_LIMIT, Json, Model, SamplingFields, StopString, ToolName, ToolSchema,
                             output_grammar, text_of_parts)
from .tools import ToolSet, make_toolset

Effort = Literal[EFFORTS]  # type: ignore[valid-type]


class Part(Model):
    type: str = Field(max_length=64)
    text: str | None = None


class FunctionCall(Model):
    name: ToolName
    arguments: str | Json | None = None


class ToolCallIn(Model):
    id: str | None = Field(None, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Part] | None = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCallIn] | None = Field(None, max_length=128)
    tool_call_id: str | None = Field(None, max_length=256)
    reasoning_content: str | None = None


class FunctionDef(Model):
    name: ToolName
    description: str | None = None
    parameters: ToolSchema = None
    strict: bool | None = None


class Tool(Model):
    type: Literal["function"]
    function: FunctionDef


class NamedChoice(Model):
    type: Literal["function"]
    function: FunctionCall


class StreamOptions(Model):
    include_usage: bool | None = None


class JsonSchemaSpec(Model):
    name: str | None = Field(None, max_length=256)
    description: str | None = None
    schema_: Json | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    def grammar(self, where: str = "response_format") -> str | None:
        """The llguidance grammar the output must match (None: free text)."""
        return output_grammar(self.type, self.json_schema.schema_ if self.json_schema else None, where)


class ChatRequest(SamplingFields):
    model: str | None = Field(None, max_length=256)
    messages: list[Message] = Field(min_length=1, max_length=100_000)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    stop: StopString | list[StopString] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1, le=8)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, max_length=512)
    tool_choice: Literal["auto", "none", "required"] | NamedChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Effort | None = None
    chat_template_kwargs: Json | None = None
    response_format: ResponseFormat | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool | None = None
    user: str | None = None

    def check_supported(self) -> None:
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs: true", "top_logprobs")

    def grammar(self) -> str | None:
        return self.response_format.grammar() if self.response_format is not None else None

    def toolset(self) -> ToolSet | None:
        if not self.tools:
            if isinstance(self.tool_choice, NamedChoice) or self.tool_choice == "required":
                raise bad_request("tool_choice requires tools", "tool_choice")
            return None
        choice, name = self.tool_choice or "auto", None
        if isinstance(choice, NamedChoice):
            choice, name = "function", choice.function.name
        try:
            return make_toolset([t.function.model_dump() for t in self.tools], choice, name,
                                 self.parallel_tool_calls is not False)
        except ValueError as e:
            raise bad_request(str(e), "tools") from None

    def hf_messages(self) -> list[dict]:
        return hf_messages(self.messages)


class CompletionRequest(SamplingFields):
    model: str | None = Field(None, max_length=256)
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1, le=MAX_TOKENS_LIMIT)
    stop: StopString | list[StopString] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1, le=8)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=8)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool | None = None
    user: str | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            items = [p]
        else:
            items = list(p)
        if not items or len(items) > 8:
            raise bad_request("prompt: give 1 to 8 prompts", "prompt")
        return items

    def check_supported(self) -> None:
        if self.suffix:
            raise bad_request("suffix (fill-in-the-middle) is not supported", "suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise bad_request("best_of must equal n (no server-side ranking)", "best_of")
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")
        if (self.n or 1) * len(self.prompts()) > 8:
            raise bad_request("n x prompts must be at most 8", "n")


def hf_messages(messages: list[Message]) -> list[dict]:
    """OpenAI messages -> the HF chat-template convention."""
    out: list[dict] = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        msg = {"role": role, "content": text_of_parts(m.content, f"messages.{i}.content")}
        if m.tool_calls:
            if role != "assistant":
                raise bad_request(f"messages.{i}: only assistant messages carry tool_calls", "messages")
            msg["tool_calls"] = [{"id": c.id or f"call_{i}_{k}", "type": "function",
                                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                 for k, c in enumerate(m.tool_calls)]
        if role == "tool":
            msg["tool_call_id"] = m.tool_call_id or ""
            if m.name:
                msg["name"] = m.name
        if m.reasoning_content and role == "assistant":
            msg["reasoning_content"] = m.reasoning_content
        out.append(msg)
    # consecutive leading system/developer messages are one system turn to templates
    while len(out) > 1 and out[0]["role"] == "system" and out[1]["role"] == "system":
        out[0:2] = [{"role": "system", "content": out[0]["content"] + "\n\n" + out[1]["content"]}]
    return out
