"""Reasoning control: whether the template opens a think block, and its token budget.

Each API says it differently (chat ``reasoning_effort`` / ``chat_template_kwargs``,
Responses ``reasoning.effort``, Anthropic ``thinking``); they all become a ``Thinking``.
The budget is enforced by the engine: after ``budget`` tokens inside ``<think>`` it
force-feeds the close sequence, so the answer still comes within max_tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

# reasoning tokens per effort tier (None: no cap beyond max_tokens)
EFFORT_BUDGETS = {"minimal": 256, "low": 1024, "medium": 4096, "high": 16384, "xhigh": None, "max": None}
EFFORTS = ("none", *EFFORT_BUDGETS)
CLOSE_TEXT = "\n</think>\n\n"


def close_text(markup) -> str:
    """What closes a think block early (the budget, a forced tool call): Qwen's "</think>"
    with its blank line, Gemma 4's "<channel|>"."""
    return CLOSE_TEXT if markup.think_close == "</think>" else markup.think_close


@dataclass(frozen=True)
class Thinking:
    enabled: bool | None = None     # None: the chat template's default
    budget: int | None = None       # max tokens inside <think>; None: unlimited

    @classmethod
    def from_effort(cls, effort: str | None) -> "Thinking":
        if effort is None:
            return cls()
        if effort == "none":
            return cls(enabled=False)
        return cls(enabled=True, budget=EFFORT_BUDGETS[effort])


@dataclass(frozen=True)
class ThinkTokens:
    start_id: int
    end_id: int
    close_ids: tuple[int, ...]


def think_tokens(tokenizer, markup=None) -> ThinkTokens | None:
    """The single-token open / close pair of this vocabulary's think block (``<think>`` /
    ``</think>``; Gemma 4: ``<|channel>`` / ``<channel|>``), if it has one."""
    tok = getattr(tokenizer, "tok", None)
    if tok is None:
        return None
    opener, closer = ("<think>", "</think>") if markup is None or markup.think_close == "</think>" \
        else ("<|channel>", markup.think_close)
    start, end = tok.token_to_id(opener), tok.token_to_id(closer)
    if start is None or end is None:
        return None
    text = CLOSE_TEXT if markup is None else close_text(markup)
    return ThinkTokens(start, end, tuple(tokenizer.encode(text, add_bos=False)))


def budget_fields(thinking: Thinking, think_open: bool, max_tokens: int, tokens: ThinkTokens | None) -> dict:
    """GenerationRequest keyword arguments that enforce the budget (empty when there is none)."""
    if thinking.budget is None or tokens is None or thinking.enabled is False:
        return {}
    # leave room for an answer: at most ~3/4 of max_tokens goes to thinking
    budget = min(thinking.budget, max(0, max_tokens - max(1, min(1024, max_tokens // 4))))
    return {"think_budget": budget, "think_open": think_open, "think_start_id": tokens.start_id,
            "think_end_id": tokens.end_id, "think_close_ids": tokens.close_ids}
