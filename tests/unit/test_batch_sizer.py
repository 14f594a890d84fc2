"""BatchSizer: the verify blocks of several sequences in one forward, chosen together."""
import random

from dflash_server.spec.batch_sizer import BatchSizer
from dflash_server.spec.block_sizer import BlockSizer


def _sizer(keys, max_block=8, **kw):
    blocks = BlockSizer(max_block)
    for k in keys:
        blocks.begin_request(key=k)
    return BatchSizer(blocks, **kw)


def simulate(sizer, keys, q, cost, steps=300, seed=0):
    """Sequences ``keys`` whose drafts are each accepted with chance ``q[key]``, on a machine
    where a forward of R rows costs ``cost(R)``; returns the chosen blocks of every step."""
    rng = random.Random(seed)
    out = []
    for _ in range(steps):
        blocks = sizer.choose(keys, [8] * len(keys))
        for k, b in zip(keys, blocks):
            acc = 0
            while acc < b - 1 and rng.random() < q[k]:
                acc += 1
            sizer.blocks.select(k)
            sizer.blocks.learn(b, acc)
        sizer.observe(sum(blocks), cost(sum(blocks)), len(keys))
        out.append(blocks)
    return out


def cpu(rows):     # the 2-core CPU's shape: 4 rows ~1.3x one, 8 ~1.8x, 16 ~2.8x
    return 0.007 * (1 + 0.115 * (rows - 1))


def gpu(rows):     # a GPU: a few dozen rows cost about one
    return 0.004 * (1 + 0.005 * (rows - 1))


def test_allocation_follows_the_acceptance():
    # the next row goes where the chance that it commits a token is largest
    acc = [[0.9] * 7, [0.2] * 7, [0.5] * 7]
    assert BatchSizer.allocate(acc, 3, [8, 8, 8]) == [1, 1, 1]
    assert BatchSizer.allocate(acc, 5, [8, 8, 8]) == [3, 1, 1]   # 0.9, 0.81 before 0.5
    assert BatchSizer.allocate(acc, 7, [8, 8, 8]) == [5, 1, 1]   # 0.729, 0.656 before 0.5
    assert BatchSizer.allocate(acc, 10, [8, 8, 8]) == [7, 1, 2]  # 0.59, 0.53, then 0.5 before 0.478
    assert BatchSizer.allocate(acc, 30, [8, 2, 3]) == [8, 2, 3]  # caps hold; the rest stays unused
    assert BatchSizer.allocate(acc, 2, [8, 8, 8]) == [1, 1, 1]   # never below a row each


def test_starts_with_plain_rows_and_explores_upwards():
    s = _sizer(["a", "b"], explore_every=1000)
    order = [sum(simulate(s, ["a", "b"], {"a": 0.0, "b": 0.0}, cpu, steps=1)[0]) for _ in range(6)]
    assert order == [2, 2, 2, 3, 3, 3]     # plain rows (every block 1) first, each total three times
    assert s.bucket(5) == 6 and s.bucket(100) == 64


def test_a_useless_draft_decodes_plainly_on_a_cpu():
    keys = ["a", "b", "c", "d"]
    s = _sizer(keys, explore_every=25)
    picks = simulate(s, keys, dict.fromkeys(keys, 0.0), cpu)
    tail = [sum(b) for b in picks[100:]]
    assert tail.count(4) >= 0.9 * len(tail)   # plain batched rows, but an occasional re-measure
    assert max(sum(b) for b in picks) <= 8    # larger totals cannot pay: never measured


def test_a_good_draft_gets_the_rows_where_they_pay():
    """One sequence the draft predicts well, one it does not: on the CPU the rows go to the
    first (the second decodes plainly); on a GPU, where rows cost almost nothing, the first
    takes whole blocks and the second a few rows too."""
    keys = ["good", "poor"]
    for cost, want in ((cpu, [7, 1]), (gpu, [8, 4])):
        s = _sizer(keys, explore_every=1000)
        picks = simulate(s, keys, {"good": 0.9, "poor": 0.1}, cost, steps=200)
        assert all(b == want for b in picks[-50:]), cost.__name__


def test_rows_cost_per_total_are_learned():
    """Costs per (sequences, rows bucket): the median of a total's last samples, each taken
    relative to the machine's speed at the time (tracked through the total measured)."""
    s = _sizer(["a"])
    s.observe(3, 0.010, 2)
    s.observe(3, 0.011, 2)
    s.observe(5, 0.020, 2)
    s.observe(3, 0.010, 3)                             # 3 sequences: a cost of its own
    assert set(s.cost) == {(2, 3), (2, 6), (3, 3)} and s.samples == {(2, 3): 2, (2, 6): 1, (3, 3): 1}
    assert abs(s.cost[(2, 6)] / s.cost[(2, 3)] - 1.9) < 0.15
    assert set(s.to_dict()["cost_ms"]) == {2, 3} and set(s.to_dict()["cost_ms"][2]) == {3, 6}
    assert s.to_dict()["steps"] == {2: {3: 2, 6: 1}, 3: {3: 1}}
    s = _sizer(["a"])
    for _ in range(5):
        s.observe(4, 0.010, 4)
    for ms in (12, 40, 12, 45, 12, 12, 12):            # busy-machine spikes do not move it
        s.observe(4, ms / 1e3, 4)
    assert abs(s.cost[(4, 4)] - 0.012) < 0.002
    for ms in (20, 20, 20, 20, 20, 20):                # a lasting change does
        s.observe(4, ms / 1e3, 4)
    assert abs(s.cost[(4, 4)] - 0.020) < 0.002


def test_a_total_measured_in_a_slow_minute_is_compared_at_todays_speed():
    """Plain rows measured while the machine ran at half speed, then 8 rows measured for a
    long while at full speed: plain rows' cost follows the speed (not the slow minute's
    seconds), so the ratio of the two stays what the machine gives (1.5x)."""
    s = _sizer(["a"])
    for _ in range(5):
        s.observe(4, 0.040, 4)        # 4 rows, at half speed (20 ms at full speed)
    for _ in range(5):
        s.observe(8, 0.060, 4)        # 8 rows, still half speed (30 ms)
    for _ in range(30):
        s.observe(8, 0.030, 4)        # full speed from here on
    assert abs(s.cost[(4, 8)] - 0.030) < 0.002
    assert abs(s.cost[(4, 4)] / s.cost[(4, 8)] - 2 / 3) < 0.05   # not 40 / 30


def test_remeasures_the_stalest_total_near_the_best_only():
    keys = ["a", "b", "c", "d"]
    s = _sizer(keys, explore_every=10, max_rows=16)
    for k in keys:                       # a draft that is never right
        s.blocks.select(k)
        for _ in range(20):
            s.blocks.learn(8, 0)
    for r, ms, when in ((4, 10.0, 9), (6, 12.0, 5), (8, 30.0, 3), (12, 40.0, 2), (16, 50.0, 1)):
        s.cost[(4, r)], s.samples[(4, r)], s.measured[(4, r)] = ms / 1e3, 3, when
    s.steps = 10
    assert sum(s.choose(keys, [8] * 4)) == 4            # plain rows pay best
    s.steps = 19                                        # a re-measure step: the stalest total is 16,
    assert sum(s.choose(keys, [8] * 4)) == 6            # but only 6 is within half the best rate
    s.cost[(4, 4)], s.measured[(4, 6)] = 0.030, 10      # plain rows measured in a busy moment:
    s.steps = 29                                        # re-measured all the same (the stalest now)
    assert sum(s.choose(keys, [8] * 4)) == 4


def test_each_grant_adds_its_chance_to_the_expected_tokens():
    rng = random.Random(3)
    s = _sizer(["a"])
    for _ in range(20):
        n = rng.randint(1, 5)
        acc = [[rng.random() for _ in range(7)] for _ in range(n)]
        caps = [rng.randint(1, 8) for _ in range(n)]
        extra = rng.randint(0, 30)
        order, gains = BatchSizer.grants(acc, caps, extra)
        blocks = BatchSizer.allocate(acc, n + extra, caps)
        assert sum(blocks) == n + len(order) and all(1 <= b <= c for b, c in zip(blocks, caps))
        want = sum(s.blocks.expected_tokens(b, a) for b, a in zip(blocks, acc))
        assert abs(n + sum(gains) - want) < 1e-9
        assert gains == sorted(gains, reverse=True)     # the likeliest rows first


def _tree_sizer(keys, max_budget=16, **kw):
    from dflash_server.spec.tree_sizer import TreeSizer

    trees = TreeSizer(max_budget)
    for k in keys:
        trees.begin_request(key=k)
    return BatchSizer(trees, **kw)


def simulate_trees(sizer, keys, depth, cost, steps=300, seed=0):
    """Sequences whose tree of b nodes commits ``depth[key](b)`` tokens on average (a
    draw around it), on a machine where R rows cost ``cost(R)``; the chosen budgets."""
    rng = random.Random(seed)
    out = []
    for _ in range(steps):
        budgets = [b - 1 for b in sizer.choose(keys, [17] * len(keys))]
        for k, b in zip(keys, budgets):
            assert b in sizer.blocks.candidates          # rounded to a budget the sizer measures
            mean = depth[k](b)
            sizer.blocks.select(k)
            sizer.blocks.learn(b, max(1, round(mean + rng.uniform(-0.5, 0.5))))
        sizer.observe(sum(budgets) + len(keys), cost(sum(budgets) + len(keys)), len(keys))
        out.append(budgets)
    return out


def test_tree_budgets_in_a_batch():
    """With DDTrees the rows a sequence's tree adds are worth the slope of its TreeSizer
    estimate between budgets; budgets chosen are candidates. A good draft gets trees on a
    GPU-like machine (rows nearly free), a useless one decodes plainly on the CPU."""
    s = _tree_sizer(["a", "b"])
    s.blocks.select("a")
    gains = s.blocks.row_gains(17)
    assert len(gains) == 16 and all(g >= 0 for g in gains)
    assert s.blocks.snap(5) == 4 and s.blocks.snap(0) == 0 and s.blocks.snap(16) == 16
    assert s.blocks.row_gains(1) == []                       # no room for a node

    def good(b):
        return 1 + min(b, 6) * 0.6

    def useless(b):
        return 1.0
    keys = ["a", "b"]
    late = simulate_trees(_tree_sizer(keys), keys, {"a": good, "b": good}, gpu)[-50:]
    assert sum(sum(b) for b in late) / 50 > 8                 # trees of several nodes each
    late = simulate_trees(_tree_sizer(keys), keys, {"a": useless, "b": useless}, cpu)[-50:]
    assert sum(1 for b in late if b == [0, 0]) >= 40          # plain rows


def test_a_change_of_batch_size_does_not_carry_one_tables_errors_into_another():
    """Each sequence count keeps its own unit: 4 sequences' table (8 rows 1.5x 4 rows), then
    sequences leave and join again and again while the machine's speed jumps at each change
    (3 sequences' steps run in slow minutes, 4 sequences' in fast ones). The first step
    after a change is compared with nothing measured at its own batch size, so it is not a
    sample, and 4 sequences' ratio stays what the machine gives."""
    s = _sizer(["a"])
    for _ in range(5):
        s.observe(4, 0.010, 4)
    for _ in range(5):
        s.observe(8, 0.015, 4)
    for i in range(8):
        slow = 3.0 if i % 2 == 0 else 1.0
        for _ in range(4):
            s.observe(3, 0.009 * slow, 3)             # 3 sequences, in a slow (or fast) minute
        s.observe(8, 0.015 * (4 - slow), 4)           # back to 4: the speed has jumped
        s.observe(8, 0.015 * (4 - slow), 4)
        s.observe(4, 0.010 * (4 - slow), 4)           # a re-measure of plain rows, paired
        s.observe(8, 0.015 * (4 - slow), 4)
    assert abs(s.cost[(4, 8)] / s.cost[(4, 4)] - 1.5) < 0.1
