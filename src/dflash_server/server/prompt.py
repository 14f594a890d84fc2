"""Prompts: chat messages through the model's Jinja template, or raw text / token ids.

Every API first turns its input into HF-style messages
(``{"role", "content": str, "tool_calls"?, "tool_call_id"?, "reasoning_content"?}``);
this module renders them. A template that knows nothing about tools gets them as a
Hermes-style system note and tool traffic as inline ``<tool_call>`` / ``<tool_response>``
text, so tool calling works with any chat model.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cached_property

from ..weights.chat_template import render_chat
from .errors import bad_request
from .output_parser import QWEN_MARKUP, Markup, markup_for
from .reasoning import Thinking, close_text
from .tools import ToolSet, forced_prefix, tool_format

RESERVED_KWARGS = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}

_HERMES_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


@dataclass
class Prompt:
    ids: list[int]
    text: str = ""
    think_open: bool = False   # the prompt ends inside an open <think> block
    prefix: str = ""           # assistant text already in the prompt (forced tool call start)
    param: str = "messages"    # the request field it came from (named in errors)
    query: str | None = None   # the last user message's text (guides PFlash's selection)
    continuation: bool = False  # the history holds assistant or tool turns (PFlash leaves it whole)
    markup: Markup = QWEN_MARKUP  # how this model writes reasoning and tool calls


# Client text is text: a "<|im_start|>" written in a message, a tool result or a tool's
# description must not become the template's control token (one tool result could forge a
# system turn). The strings of the tokenizer's control tokens (Literals) are hidden behind
# these sentinels before rendering and encoded as plain text after it; only the template's own
# markup is encoded as control tokens (as the OpenAI and Anthropic APIs tokenize message text).
_OPEN, _CLOSE = "\U000FFFF0", "\U000FFFF1"
_END = "\U000FFFF2"  # marks where a prefill (an Anthropic final assistant message) ends
_CONTROL_SHAPE = re.compile(r"<\|[^<>|]*\|>")  # <|im_start|>, <|endoftext|>, <|eot_id|>: control by their shape
_SENTINEL = re.compile(_OPEN + r"(\d+)" + _CLOSE)


def _trie_pattern(strings: list[str]) -> str:
    """A regex matching the longest of ``strings`` at a position, as a trie: an alternation of
    thousands of added tokens (Gemma's) would try each one at every '<' of an HTML message."""
    trie: dict = {}
    for text in strings:
        node = trie
        for ch in text:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: dict) -> str:
        alts = [re.escape(ch) + build(node[ch]) for ch in sorted(k for k in node if k)]
        body = "" if not alts else alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return f"(?:{body})?" if "" in node and body else body

    return build(trie)


def _strip(text: str) -> str:
    """Without the halves of sentinels a template cut apart (a template slicing content)."""
    return text.replace(_OPEN, "").replace(_CLOSE, "").replace(_END, "")


class Literals:
    """Hides a tokenizer's control-token strings in client text and encodes them as text.

    Control tokens: the special added tokens, BOS / EOS, those shaped ``<|...|>``, and the
    added tokens that ``markup`` (the chat template's source and the server's own reasoning /
    tool-call markup) writes, such as Qwen's ``<think>``, which tokenizers do not always flag
    as special. Other added tokens (Gemma's HTML tags) are ordinary text a model
    was trained to read as one token, and stay so."""

    def __init__(self, tokenizer, markup: str = ""):
        self.tokenizer = tokenizer
        decoder = tokenizer.tok.get_added_tokens_decoder()
        ends = {tokenizer.bos_token_id, *tokenizer.eos_token_ids}
        control = {a.content for i, a in decoder.items()
                   if a.special or i in ends or a.content in markup or _CONTROL_SHAPE.fullmatch(a.content)}
        # single characters and whitespace runs are ordinary text even when a tokenizer adds them
        self.hidden = sorted((a for a in control if len(a) >= 2 and not a.isspace()), key=len, reverse=True)
        self.hidden += [_OPEN, _CLOSE, _END]  # a client's own sentinel characters stay what they are
        self.index = {a: i for i, a in enumerate(self.hidden)}
        self.pattern = re.compile(_trie_pattern(self.hidden))
        self.control = set(decoder)   # ids a hidden string must not encode to

    def hide(self, value):
        """``value`` (a string, or JSON-like lists / dicts of them) with every control-token
        string replaced by its sentinel."""
        if isinstance(value, str):
            return self.pattern.sub(lambda m: f"{_OPEN}{self.index[m.group(0)]}{_CLOSE}", value)
        if isinstance(value, list):
            return [self.hide(v) for v in value]
        if isinstance(value, dict):
            return {self.hide(k): self.hide(v) for k, v in value.items()}
        return value

    def reveal(self, text: str) -> str:
        return "".join(self.hidden[int(part)] if n % 2 else _strip(part) for n, part in enumerate(_SENTINEL.split(text)))

    def encode(self, text: str) -> list[int]:
        """Ids of rendered text: the template's markup as it encodes, hidden strings as text."""
        if _OPEN not in text and _CLOSE not in text and _END not in text:
            return self.tokenizer.encode(text, add_bos=False)
        ids: list[int] = []
        for n, part in enumerate(_SENTINEL.split(text)):
            if n % 2:
                ids += self._as_text(self.hidden[int(part)])
            elif _strip(part):
                ids += self.tokenizer.encode(_strip(part), add_bos=False)
        return ids

    def _as_text(self, literal: str) -> list[int]:
        """``literal`` in ordinary tokens: split where no added token can match."""
        if len(literal) == 1:
            return self.tokenizer.encode(literal, add_bos=False)
        ids = self.tokenizer.encode(literal, add_bos=False)
        if not self.control.intersection(ids):
            return ids
        half = len(literal) // 2 if len(literal) > 2 else 1
        return self._as_text(literal[:half]) + self._as_text(literal[half:])


def _args_obj(arguments):
    """Templates iterate tool-call arguments as a mapping; clients send a JSON string."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments) if arguments.strip() else {}
            return value if isinstance(value, dict) else arguments
        except ValueError:
            return arguments
    return arguments if arguments is not None else {}


class PromptBuilder:
    def __init__(self, tokenizer, template: str | None = None, max_tokens: int | None = None):
        """``max_tokens``: the context size; text too long to fit in it is refused before it
        is tokenized (tokenizing tens of MB takes the better part of a minute and leaves
        the process gigabytes larger)."""
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.max_chars = tokenizer.max_chars(max_tokens) if max_tokens is not None else None
        self.template = template if template is not None else tokenizer.chat_template
        self.template_tools = bool(self.template) and "tools" in self.template
        self.tool_format = tool_format(self.template) if self.template_tools else "json"
        self.markup = markup_for(self.tool_format)

    @cached_property
    def literals(self) -> Literals:
        m = self.markup
        markup = "\n".join([self.template or "", _HERMES_TOOLS, m.think_open, m.think_close,
                            *(t for marker in m.tool_markers for t in marker[:2])])
        return Literals(self.tokenizer, markup)

    def chat(self, messages: list[dict], tools: ToolSet | None = None, thinking: Thinking = Thinking(),
             template_kwargs: dict | None = None) -> Prompt:
        if not self.template:
            raise bad_request("this model has no chat template; start the server with --chat-template-file")
        if not messages:
            raise bad_request("messages must not be empty", "messages")
        self.check_size(sum(len(m.get("content") or "") + len(m.get("reasoning_content") or "") for m in messages),
                        "messages")
        lit = self.literals
        msgs = []
        for m in messages:
            m = {k: (v if k in ("role", "_continue") else lit.hide(v)) for k, v in m.items()}
            if m.get("tool_calls"):
                m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _args_obj(
                    c["function"].get("arguments"))}} for c in m["tool_calls"]]
            msgs.append(m)
        # an Anthropic prefill: the answer continues the final assistant message, cut after
        # its end marker (a search for its text could match the template's markup or an
        # earlier message, and templates trim content)
        prefill = bool(msgs[-1].pop("_continue", False) and msgs[-1].get("content"))
        if prefill:
            msgs[-1]["content"] += _END
        specs = lit.hide(list(tools.specs)) if tools is not None and tools.active else []
        if not self.template_tools:
            msgs = self._inline_tools(msgs, specs)
            specs = []
        kwargs = {k: lit.hide(v) for k, v in (template_kwargs or {}).items() if k not in RESERVED_KWARGS}
        if thinking.enabled is not None:
            kwargs["enable_thinking"] = thinking.enabled
        try:
            text = render_chat(self.template, msgs, add_generation_prompt=not prefill, tools=specs or None,
                               bos_token=self.tokenizer.bos_token or "", eos_token=self.tokenizer.eos_token or "",
                               **kwargs)
        except Exception as e:  # noqa: BLE001 - template errors and template bugs alike are a 400
            raise bad_request(f"chat template: {e}") from None
        if prefill:  # the rendered turn, cut after its content (transformers' continue_final_message)
            if text.count(_END) != 1:
                raise bad_request("this model's chat template changes the final assistant message, so the "
                                  "answer cannot continue it", "messages")
            text = text[:text.index(_END)]
        think_open = text.rstrip().endswith(self.markup.think_open)
        prefix = forced_prefix(tools, self.tool_format) if tools is not None and tools.active else ""
        if prefix and think_open:
            text, think_open = text + close_text(self.markup).lstrip("\n"), False
        text += prefix
        self.check_size(len(text), "messages")
        users = [m for m in messages if m.get("role") == "user" and isinstance(m.get("content"), str)]
        return Prompt(lit.encode(text), lit.reveal(text), think_open, prefix,
                      query=users[-1]["content"] if users else None,
                      continuation=any(m.get("role") in ("assistant", "tool") for m in messages), markup=self.markup)

    def check_size(self, chars: int, param: str) -> None:
        """400 when ``chars`` characters of text cannot fit in the context."""
        if self.max_chars is not None and chars > self.max_chars:
            raise bad_request(f"the prompt has {chars} characters: more than the context of {self.max_tokens} "
                              f"tokens can hold (one token of this model spans at most "
                              f"{self.tokenizer.max_token_chars - 1} characters)", param)

    def encode(self, text: str, add_bos: bool | None = None, param: str = "prompt") -> list[int]:
        """Plain text to ids, refused by size first (see check_size)."""
        self.check_size(len(text), param)
        return self.tokenizer.encode(text, add_bos=add_bos)

    def raw(self, prompt: str | list[int]) -> Prompt:
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("prompt must not be empty", "prompt")
            return Prompt(self.encode(prompt), prompt, param="prompt")
        vocab = self.tokenizer.vocab_size
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        if any(not 0 <= t < vocab for t in prompt):
            raise bad_request(f"prompt token ids must be in [0, {vocab})", "prompt")
        return Prompt(list(prompt), "", param="prompt")

    @staticmethod
    def _inline_tools(msgs: list[dict], specs: list[dict]) -> list[dict]:
        out = []
        for m in msgs:
            if m.get("role") == "assistant" and m.get("tool_calls"):
                calls = "\n".join("<tool_call>\n" + json.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                    ensure_ascii=False) + "\n</tool_call>" for c in m["tool_calls"])
                content = m.get("content") or ""
                out.append({"role": "assistant", "content": (content + "\n" if content else "") + calls})
            elif m.get("role") == "tool":
                text = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
                if out and out[-1].get("_tool_turn"):
                    out[-1]["content"] += "\n" + text
                else:
                    out.append({"role": "user", "content": text, "_tool_turn": True})
            else:
                out.append({k: v for k, v in m.items() if k != "tool_calls"})
        for m in out:
            m.pop("_tool_turn", None)
        if specs:
            note = _HERMES_TOOLS.format(tools="\n".join(json.dumps(s, ensure_ascii=False) for s in specs))
            if out and out[0].get("role") == "system":
                out[0] = {**out[0], "content": (out[0].get("content") or "") + "\n\n" + note}
            else:
                out.insert(0, {"role": "system", "content": note})
        return out
