"""The step scheduler's bookkeeping (slots, admission order, prefill order and budget), without tensors."""
from types import SimpleNamespace

import pytest

from dflash_server.engine.batching import MIN_PREFILL_TOKENS, StepScheduler
from dflash_server.engine.sequence import DECODE, DONE, PREFILL, WAITING


def seq(name, left=0):
    return SimpleNamespace(name=name, lane=None, phase=None, prefill_left=left, prefill_waits=0)


def test_admission_fifo_and_slots_reused():
    s = StepScheduler(lanes=2, step_tokens=64)
    a, b, c = seq("a"), seq("b"), seq("c")
    for x in (a, b, c):
        s.add(x)
    plan = s.schedule()
    assert plan.admitted == [a, b] and (a.lane, b.lane) == (0, 1) and c.phase == WAITING
    assert plan.prefill is a and plan.prefill_tokens is None and plan.decode == []  # alone: a whole chunk
    s.started(a)
    plan = s.schedule()
    assert plan.prefill is b and plan.decode == [a]
    assert plan.prefill_tokens == 63          # the budget less the decode row
    s.finish(a)                               # a's slot goes to c at the next step
    assert a.phase == DONE and a.lane is None
    plan = s.schedule()
    assert plan.admitted == [c] and c.lane == 0 and plan.prefill is b


def test_budget_floor_and_many_rows():
    s = StepScheduler(lanes=40, step_tokens=32)
    xs = [seq(i) for i in range(40)]
    for x in xs:
        s.add(x)
    s.schedule()
    for x in xs[:-1]:
        s.started(x)
    plan = s.schedule()
    assert plan.prefill is xs[-1] and len(plan.decode) == 39
    assert plan.prefill_tokens == MIN_PREFILL_TOKENS   # never starved to nothing


def test_finish_from_any_phase_frees_the_slot():
    s = StepScheduler(lanes=1, step_tokens=8)
    a, b = seq("a"), seq("b")
    s.add(a)
    s.add(b)
    s.schedule()
    assert a.phase == PREFILL and b.phase == WAITING
    s.finish(b)                               # cancelled while waiting
    assert b.phase == DONE and not s.waiting
    s.finish(a)                               # failed during prefill
    assert s.free == [0] and not s.has_work
    c = seq("c")
    s.add(c)
    s.schedule()
    s.started(c)
    assert c.phase == DECODE and s.running == [c]
    s.finish(c)
    assert s.free == [0] and not s.has_work


def test_hundred_sequences_on_four_slots():
    s = StepScheduler(lanes=4, step_tokens=16)
    xs = [seq(i) for i in range(100)]
    for x in xs:
        s.add(x)
    order, steps = [], 0
    while s.has_work:
        plan = s.schedule()
        assert len(s.active) <= 4 and len({x.lane for x in s.active}) == len(s.active)
        if plan.prefill is not None:
            s.started(plan.prefill)
            order.append(plan.prefill.name)
        for x in plan.decode:                 # each decodes one step, then ends
            s.finish(x)
        steps += 1
    assert order == list(range(100)) and sorted(s.free) == [0, 1, 2, 3]


def test_bad_configuration():
    with pytest.raises(ValueError):
        StepScheduler(lanes=0, step_tokens=8)
    with pytest.raises(ValueError):
        StepScheduler(lanes=2, step_tokens=0)


def test_shortest_prefill_first_and_long_prompts_age():
    """The prefilling sequence with the fewest prompt tokens left goes first (ties: the
    older), so a short prompt does not wait behind a long one; a step spent waiting while
    others prefill counts as a step's budget, so a long prompt is passed over only so long."""
    s = StepScheduler(lanes=8, step_tokens=100)
    long, short, mid = seq("long", 900), seq("short", 40), seq("mid", 40)
    for x in (long, short, mid):
        s.add(x)
    assert s.schedule().prefill is short                      # equal lengths: admission order
    assert s.next_prefill(skip=[short]) is mid and s.next_prefill(skip=[short, mid]) is long
    s.prefilled([short, mid])                                 # long waited this step
    assert long.prefill_waits == 1 and short.prefill_waits == 0
    s.started(short)
    s.started(mid)
    late = seq("late", 50)                                    # short prompts keep arriving
    s.add(late)
    assert s.schedule().prefill is late
    s.prefilled([late])
    s.started(late)
    # long: 900 - 2 * 100 = 700 against a new 650-token prompt: the new one still goes first,
    # but after 3 more steps passed over (900 - 5 * 100 = 400) long wins against it
    new = seq("new", 650)
    s.add(new)
    assert s.schedule().prefill is new
    for _ in range(3):
        s.prefilled([new])
    assert long.prefill_waits == 5 and s.next_prefill() is long
    assert s.next_prefill(skip=[long, new]) is None
