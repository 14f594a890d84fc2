"""KV Flash page table: allocation, protection, eviction order, page-in, truncation, integrity."""
import pytest

from dflash_server.runtime.kv_pager import KvPager, Move


def fill(p, upto, step=1):
    moves = []
    for pos in range(0, upto, step):
        moves += p.plan_write(pos, min(pos + step, upto))
        p.check_integrity()
    return moves


def test_identity_while_it_fits():
    p = KvPager((8 + 1) * 4, chunk=4, tail_chunks=2)
    assert fill(p, 32) == []
    assert p.is_identity() and p.slots(0, 32) == list(range(32))
    assert p.slot_positions() == list(range(32)) + [-1] * 4  # the spare chunk


def test_lru_evicts_oldest_unprotected_and_keeps_sink_and_tail():
    p = KvPager((6 + 1) * 4, chunk=4, sink_chunks=1, tail_chunks=2)
    moves = fill(p, 6 * 4 + 4)  # one chunk more than the pool
    assert moves == [Move("out", 1, 1)]  # chunk 0 is the sink: chunk 1 is the oldest
    assert p.slots(24, 28) == [4, 5, 6, 7]
    moves = fill_from(p, 28, 40)
    assert [m.logical for m in moves] == [2, 3, 4]
    assert 0 in p.resident and {8, 9}.issubset(p.resident)
    assert p.paged == {1, 2, 3, 4} and p.page_outs == 4
    pos = p.slot_positions()
    assert sorted(x for x in pos if x >= 0) == sorted(q for c in p.resident for q in range(c * 4, c * 4 + 4))


def fill_from(p, start, end):
    moves = []
    for pos in range(start, end):
        moves += p.plan_write(pos, pos + 1)
        p.check_integrity()
    return moves


def test_page_in_when_a_paged_chunk_is_written_again():
    p = KvPager((6 + 1) * 4, chunk=4, tail_chunks=2)
    fill(p, 40)
    p.truncate(6)  # rollback into paged chunk 1
    p.check_integrity()
    assert p.num_chunks == 2 and set(p.resident) | p.paged == {0, 1}
    moves = p.plan_write(6, 8)
    assert moves == [Move("in", 1, moves[0].physical)] and 1 in p.resident and p.page_ins == 1
    p.check_integrity()


def test_score_policy_keeps_attended_chunks():
    p = KvPager((6 + 1) * 4, chunk=4, tail_chunks=2, policy="score")
    fill(p, 24)
    p.policy.observe({1: 5.0, 2: 0.1, 3: 2.0, 4: 1.0})
    moves = fill_from(p, 24, 28)
    assert moves == [Move("out", 2, 2)]  # least attended, not the oldest (1)
    p.policy.observe({})  # scores decay but keep their order; chunk 5 (now out of the tail) has none
    assert [m.logical for m in fill_from(p, 28, 32)] == [5]


def test_protected_chunks_never_evicted_and_errors_are_clear():
    with pytest.raises(ValueError, match="too small"):
        KvPager(5 * 4, chunk=4, sink_chunks=1, tail_chunks=2)
    with pytest.raises(ValueError, match="multiple"):
        KvPager(30, chunk=4)
    with pytest.raises(ValueError, match="policy"):
        KvPager(32, chunk=4, policy="random")
    p = KvPager((6 + 1) * 4, chunk=4, tail_chunks=2)
    with pytest.raises(ValueError, match="does not fit"):
        p.plan_write(0, 24)
    for end in range(4, 200, 4):
        for m in p.plan_write(end - 4, end):
            assert m.logical != 0 and m.logical < end // 4 - 2
        p.check_integrity()


def test_reset_and_epochs():
    p = KvPager((6 + 1) * 4, chunk=4, tail_chunks=2)
    e0 = p.epoch
    p.plan_write(0, 3)
    e1 = p.epoch
    assert e1 > e0  # a new resident chunk changes the slot map
    p.plan_write(3, 4)
    assert p.epoch == e1  # same chunk: nothing to rebuild
    fill_from(p, 4, 30)
    assert p.epoch > e1
    p.reset()
    p.check_integrity()
    assert not p.resident and not p.paged and p.is_identity() and len(p.free) == 7
    p.adopt(3, [(0, 0), (1, 1), (2, 2)])
    p.check_integrity()
    assert p.is_identity() and p.slots(0, 10) == list(range(10)) and p.num_chunks == 3
    with pytest.raises(ValueError, match="does not fit"):
        p.adopt(7, [(c, c) for c in range(7)])


def test_speculative_step_defers_the_eviction_until_commit():
    """A verify block entering a new chunk takes the spare; the victim (the one plain
    decoding would evict) stays visible before the new chunk's first position and leaves
    only if that position is committed."""
    def fresh():
        p = KvPager((6 + 1) * 4, chunk=4, tail_chunks=2)
        fill(p, 24)  # 6 chunks: the pool is at capacity, one chunk spare
        return p
    plain = fresh()
    assert plain.plan_write(24, 25) == [Move("out", 1, 1)]  # plain decoding evicts chunk 1 at 24
    for keep, evicted in ((23, False), (24, False), (25, True), (26, True)):
        p = fresh()
        assert p.plan_write(22, 26, speculative=True) == []  # block 22..25 crosses into chunk 6
        until = p.slot_until()
        assert until[4:8] == [24] * 4 and until[0] > 1 << 40  # chunk 1 (slots 4-7) leaves at 24
        assert len(p.resident) == 7 and not p.free
        moves = p.settle(keep)
        p.truncate(keep)
        p.check_integrity()
        assert (moves == [Move("out", 1, 1)]) == evicted and (1 in p.paged) == evicted
        assert p.slot_until() is None and len(p.resident) == 6


@pytest.mark.parametrize("policy", ["lru", "score"])
def test_forward_splits_do_not_change_what_each_position_sees(policy):
    """With forwards cut by ``piece``, the resident chunks visible to every position are
    the same however the positions were split (prompt chunk size, a snapshot boundary)."""
    def visible(splits, total=120):
        p, pos, seen = KvPager((8 + 1) * 4, chunk=4, tail_chunks=2, policy=policy), 0, {}
        for want in splits:
            while want > 0 and pos < total:
                n = p.piece(pos, min(want, total - pos, p.max_new_chunks * 4))  # as TargetPipeline.prefill
                p.plan_write(pos, pos + n)
                p.check_integrity()
                for q in range(pos, pos + n):
                    seen[q] = frozenset(c for c in p.resident if c * 4 <= q)  # chunks holding positions <= q
                pos, want = pos + n, want - n
        return seen
    ref = visible([1] * 120)  # decoding, one position at a time
    for splits in ([7] * 20, [13] * 10, [30, 1, 50, 3, 40], [120]):
        assert visible(splits) == ref, splits


def test_chunk_scores_follow_the_retrieving_head_and_its_next_chunk():
    """Re-selection scores: one head of one layer that looks at chunk 3 outweighs many heads
    spread over the sink and the recent chunks; chunk 4, right after it, inherits half of
    its score; a paged-out chunk is scored from host memory like a resident one."""
    from types import SimpleNamespace

    import torch

    from dflash_server.runtime.kv_pool import SCORE_NEXT, KvPool

    C, hd, nh, layers, n_chunks = 4, 8, 4, 6, 10
    pager = KvPager((6 + 1) * C, chunk=C, sink_chunks=1, tail_chunks=2, policy="score")
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(layers, n_chunks * C, hd, generator=gen) * 0.1   # logical K rows, near-uniform attention
    probe = torch.zeros(hd)
    probe[0] = 1.0
    keys[1, 3 * C + 2] = 8 * probe             # layer 1: one token of chunk 3 answers the probe
    keys[:, 0] += 10 * probe                   # every layer: the sink takes much of every head's mass
    states = [SimpleNamespace(kind="kv", k=torch.zeros(1, 1, pager.pool_tokens, hd),
                              v=torch.zeros(1, 1, pager.pool_tokens, hd)) for _ in range(layers)]
    pool = KvPool(pager, states, torch.device("cpu"))
    for pos in range(n_chunks * C):
        pool.apply(pager.plan_write(pos, pos + 1))
        slot = pager.slots(pos, pos + 1)[0]
        for j, s in enumerate(states):
            s.k[0, 0, slot] = keys[j, pos]
    assert {3, 4} <= pager.paged and 0 in pager.resident  # scored from host memory
    q = torch.zeros(layers, 1, 2, nh, hd)      # (layer, B, R, nh, hd)
    q[:, :, :, :, 0] = 1.0                     # every head of every layer asks for the probe
    pool.last_q = list(q)
    scores = pool.chunk_scores(n_chunks * C)
    assert set(scores) == set(range(n_chunks))
    rest = sorted((c for c in scores if c not in (0, 8, 9)), key=lambda c: -scores[c])
    assert rest[:2] == [3, 4], scores
    assert scores[4] >= SCORE_NEXT * scores[3] - 1e-6
    assert pool.reselect(n_chunks * C) and {3, 4} <= pager.resident.keys()
    pager.check_integrity()
