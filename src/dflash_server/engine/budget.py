"""The context budget of a request: whether its prompt fits the context (or the prefill
drafter, when PFlash compresses it) and how many new tokens it may ask for. Bookkeeping
only; the engine checks each submitted prompt with it, the server also plans ``max_tokens``
with it before a request is queued (a 400 naming the field instead of a cut answer)."""
from __future__ import annotations


class ContextBudgetError(ValueError):
    """A request that does not fit; ``param`` names the offending field ("prompt" or
    "max_tokens")."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check_prompt(prompt_tokens: int, max_ctx: int, compress_limit: int | None = None) -> int:
    """Raise when the prompt cannot run; return the room left for new tokens. With PFlash
    (``compress_limit``: the drafter's context) the prompt may exceed the context, its
    compressed form not: the room is known only once it exists, so the context less one."""
    if compress_limit is not None:
        if prompt_tokens > compress_limit:
            raise ContextBudgetError(f"the prompt has {prompt_tokens} tokens; the prefill drafter reads at most "
                                     f"{compress_limit}", "prompt")
        return max_ctx - 1
    if prompt_tokens >= max_ctx:
        raise ContextBudgetError(f"the prompt has {prompt_tokens} tokens; the context size is {max_ctx} tokens",
                                 "prompt")
    return max_ctx - prompt_tokens


def plan_new_tokens(prompt_tokens: int, max_ctx: int, requested: int | None, default: int,
                    compress_limit: int | None = None) -> int:
    """``max_tokens`` for a request: the requested count when it fits the room the prompt
    leaves, else an error; without one, ``default`` capped to that room."""
    room = check_prompt(prompt_tokens, max_ctx, compress_limit)
    if requested is None:
        return min(default, room)
    if requested > room:
        raise ContextBudgetError(f"prompt ({prompt_tokens} tokens) + max_tokens ({requested}) = "
                                 f"{prompt_tokens + requested} exceeds the context size ({max_ctx} tokens); at most "
                                 f"{room} new tokens fit", "max_tokens")
    return requested
