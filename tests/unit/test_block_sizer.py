"""BlockSizer: picks the verify block with the most expected tokens per second."""
import random

import pytest

from dflash_server.spec.block_sizer import BlockSizer


def simulate(sizer, q, cost, steps=400, seed=0):
    """Drive the sizer with a draft whose positions are each accepted with chance ``q``
    and a machine where a block of B costs ``cost(B)`` seconds; returns the chosen blocks."""
    rng = random.Random(seed)
    chosen = []
    for _ in range(steps):
        b = sizer.choose()
        acc = 0
        while acc < b - 1 and rng.random() < q:
            acc += 1
        sizer.observe(b, acc, cost(b))
        chosen.append(b)
    return chosen


def cpu_int4(b):      # measured shape on the 2-core dev CPU: a block of 8 ~ 2x one decode step
    return 0.018 * (1 + 0.14 * (b - 1))


def gpu(b):           # a GPU: a block of 16 costs about one decode step
    return 0.010 * (1 + 0.01 * (b - 1))


def test_candidates_and_exploration_order():
    s = BlockSizer(8, explore_every=10)
    assert s.candidates == (1, 2, 3, 4, 6, 8)
    # from the smallest up, each tried twice; its first time (here a one-off stall, like a
    # cold torch.compile) is replaced by the second
    order = []
    for i in range(6):
        b = s.choose()
        order.append(b)
        s.observe(b, 0, cpu_int4(b) + (30.0 if i == 0 else 0.0))
    assert order == [1, 1, 2, 2, 3, 3]
    assert s.cost[1] == cpu_int4(1)
    picks = []
    for _ in range(30):
        b = s.choose()
        picks.append((s.steps, b))
        s.observe(b, 0, cpu_int4(b))
    # nothing is ever accepted: blocks past 3 cannot pay (they cost at least block 3's time
    # and would commit ~1.1 tokens), so they are never run; exploitation picks 1, and every
    # 10th step re-measures the stalest judged candidate
    assert {b for n, b in picks if n % 10 != 9} == {1}
    assert [b for n, b in picks if n % 10 == 9] == [2, 3, 2]
    assert sorted(s.cost) == [1, 2, 3]
    with pytest.raises(ValueError):
        BlockSizer(1)


def test_exploration_goes_on_while_longer_blocks_may_pay():
    """A draft that is accepted often: each size is measured in turn up to the longest, as
    the acceptance estimate keeps the bound above the best judged rate."""
    s = BlockSizer(8)
    order = []
    for _ in range(12):
        b = s.choose()
        order.append(b)
        s.observe(b, b - 1, cpu_int4(b))
    assert order == [1, 1, 2, 2, 3, 3, 4, 4, 6, 6, 8, 8]


def test_one_off_step_times_do_not_stick():
    """Under --compile the first two steps of a block size both compiled a graph (the second
    for another position): a later time under a quarter of the average replaces it at once
    instead of decaying by the moving average; reset() forgets everything (after a warm-up)."""
    s = BlockSizer(8)
    for seconds in (87.0, 40.0):
        s.observe(8, 0, seconds)
    assert s.cost[8] == 40.0
    s.observe(8, 0, 0.06)
    assert s.cost[8] == 0.06
    s.observe(8, 0, 0.10)                       # ordinary noise still averages: part of the way
    assert 0.06 < s.cost[8] < 0.10
    s.observe(2, 1, 0.03)
    s.reset()
    assert s.cost == {} and s.samples == {} and s.steps == 0 and s.acceptance() == BlockSizer(8).acceptance()
    assert s.choose() == 1


@pytest.mark.parametrize("q,cost,lo,hi", [
    (0.05, cpu_int4, 1, 1),      # a useless draft: plain decoding
    (0.5, cpu_int4, 2, 4),       # a weak draft on a CPU: short blocks
    (0.9, cpu_int4, 6, 8),       # a good draft: long blocks even where they cost
    (0.5, gpu, 6, 8),            # blocks nearly free: long even for a weak draft
])
def test_converges_to_the_fastest_block(q, cost, lo, hi):
    s = BlockSizer(8)
    chosen = simulate(s, q, cost)
    tail = [b for i, b in enumerate(chosen[100:], 100) if i % s.explore_every != s.explore_every - 1]
    def rate(b):                                              # true tokens per second
        return (1 - q ** b) / (1 - q) / cost(b)
    best = max(s.candidates, key=rate)
    assert lo <= best <= hi
    # near-ties (within a few %) may go either way; the throughput reached must not
    efficiency = sum(rate(b) for b in tail) / len(tail) / rate(best)
    assert efficiency > 0.95, (best, efficiency, s.to_dict())


def test_request_acceptance_overrides_history():
    """A request whose draft is much better than earlier ones moves to long blocks quickly."""
    s = BlockSizer(8)
    simulate(s, 0.05, cpu_int4, steps=300)
    assert s.choose() in (1, 2)
    s.begin_request()
    chosen = simulate(s, 0.95, cpu_int4, steps=40, seed=1)
    assert chosen[-1] == 8 and s.q(1) > 0.8
    s.begin_request()                                  # a new request starts from the history
    assert s.req_reach[1] == 0 and 0.3 < s.q(1) < 0.95


def test_greedy_and_sampled_requests_keep_separate_histories():
    """Sampled requests accept far less than greedy ones; after many greedy requests a
    sampled one starts from the neutral prior (not from the greedy rates), and sampled
    requests do not drag the greedy history down. Step costs are shared (the machine's)."""
    s = BlockSizer(8)
    for seed in range(3):
        s.begin_request("greedy")
        simulate(s, 0.9, cpu_int4, steps=100, seed=seed)
    assert s.q(1) > 0.8 and s.kind == "greedy"
    greedy = [list(x) for x in s.history["greedy"]]
    s.begin_request("sampled")
    assert s.q(1) == 0.5 and s.cost                        # prior, and the measured costs kept
    for seed in range(3):
        s.begin_request("sampled")
        simulate(s, 0.05, cpu_int4, steps=100, seed=seed)
    assert s.q(1) < 0.2 and s.choose() in (1, 2)
    s.begin_request("greedy")
    assert [list(x) for x in s.history["greedy"]] == greedy and s.q(1) > 0.8 and s.to_dict()["kind"] == "greedy"


def test_early_stop_is_not_a_rejection():
    s = BlockSizer(4)
    s.observe(4, None, 0.01)                           # the step ended at a stop string
    assert s.reach[1] == 0 and s.cost[4] == 0.01
    s.observe(4, 1, 0.02)                              # positions 1 (hit) and 2 (miss) reached; 3 not
    assert s.reach[1:] == [1, 1, 0] and s.hits[1:] == [1, 0, 0]


def test_a_slower_machine_does_not_make_the_chosen_block_look_costly():
    """A cheap VM slows down by 2.5x for a while (a neighbour's load): the block being run
    measures the slow machine every step, the others were last measured when it was fast.
    Costs are kept relative to the machine's current speed, so the sizer keeps the block that
    is best at any speed instead of switching to one whose stale time looks cheaper. (With
    a moving average of seconds per block it took 7 plain steps of these 60, each switch
    lasting until the plain step's own time caught up with the slow machine.)"""
    s = BlockSizer(2, explore_every=1000)
    costs = {1: 0.010, 2: 0.012}                          # relative costs: a block of 2 pays at q = 0.5
    rng = random.Random(0)
    picks = []
    for t in range(90):
        slow = 2.5 if t >= 30 else 1.0
        b = s.choose()
        acc = int(b == 2 and rng.random() < 0.5)
        s.observe(b, acc, slow * costs[b])
        if t >= 30:
            picks.append(b)
    assert picks.count(1) <= 1, picks
