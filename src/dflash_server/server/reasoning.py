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


def think_tokens(tokenizer) -> ThinkTokens | None:
    """The single-token <think> / </think> pair of this vocabulary, if it has one."""
    tok = getattr(tokenizer, "tok", None)
    if tok is None:
        return None
    start, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    if start is None or end is None:
        return None
    return ThinkTokens(start, end, tuple(tokenizer.encode(CLOSE_TEXT, add_bos=False)))


def budget_fields(thinking: Thinking, think_open: bool, max_tokens: int, tokens: ThinkTokens | None) -> dict:
    """GenerationRequest keyword arguments that enforce the budget (empty when there is none)."""
    if thinking.budget is None or tokens is None or thinking.enabled is False:
        return {}
    # leave room for an answer: at most ~3/4 of max_tokens goes to thinking
    budget = min(thinking.budget, max(0, max_tokens - max(1, min(1024, max_tokens // 4))))
    return {"think_budget": budget, "think_open": think_open, "think_start_id": tokens.start_id,
            "think_end_id": tokens.end_id, "think_close_ids": tokens.close_ids}
