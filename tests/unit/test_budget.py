"""The context budget (engine/budget.py): prompt fits, room, max_tokens planned or refused
with the field named; with PFlash the drafter's context bounds the prompt instead."""
import pytest

from dflash_server.engine.budget import ContextBudgetError, check_prompt, plan_new_tokens


def test_room_and_default():
    assert check_prompt(10, 512) == 502
    assert plan_new_tokens(10, 512, None, 256) == 256          # the default when it fits
    assert plan_new_tokens(400, 512, None, 256) == 112         # capped to the room
    assert plan_new_tokens(10, 512, 502, 256) == 502           # exactly the room
    assert plan_new_tokens(511, 512, 1, 256) == 1


@pytest.mark.parametrize("prompt", [512, 513, 10**9])
def test_a_prompt_at_or_past_the_context_is_refused(prompt):
    with pytest.raises(ContextBudgetError, match="the context size is 512 tokens") as e:
        plan_new_tokens(prompt, 512, None, 256)
    assert e.value.param == "prompt" and isinstance(e.value, ValueError)


def test_max_tokens_past_the_room_is_refused_naming_the_field():
    with pytest.raises(ContextBudgetError, match=r"at most 502 new tokens fit") as e:
        plan_new_tokens(10, 512, 503, 256)
    assert e.value.param == "max_tokens"


def test_pflash_bounds_the_prompt_by_the_drafter():
    assert check_prompt(4000, 512, compress_limit=8192) == 511   # longer than the context: compressed later
    with pytest.raises(ContextBudgetError, match="the prefill drafter reads at most 8192") as e:
        plan_new_tokens(9000, 512, None, 256, compress_limit=8192)
    assert e.value.param == "prompt"
