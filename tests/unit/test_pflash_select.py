"""PFlash chunk selection and policy on synthetic scores: no model."""
import numpy as np
import pytest

from dflash_server.pflash.policy import KeepRatioBandit, Override, PFlashPolicy, curve_ratio, parse_curve
from dflash_server.pflash.select import SelectParams, Selection, select, smooth, survived

P = SelectParams(chunk=4, head_chunks=1, tail_chunks=1, pool_kernel=1, query_tokens=8, ngram=3,
                 anchor_radius=0, max_anchor_hits=2)


def _ids(n, seed=0):
    return list(np.random.default_rng(seed).integers(1000, 2000, n))


def test_best_chunks_and_forced_head_tail_in_order():
    n = 40  # 10 chunks of 4
    scores = np.zeros(n)
    scores[12:16] = 5.0   # chunk 3
    scores[24:28] = 3.0   # chunk 6
    scores[20:24] = 1.0   # chunk 5
    sel = select(scores, _ids(n), 0.5, P)   # 5 chunks: head + tail (<= half) + the 3 best
    assert sel.total_chunks == 10 and sel.kept_chunks == 5
    assert sel.spans == [(0, 4), (12, 16), (20, 28), (36, 40)]
    ids = _ids(n)
    kept = Selection(sel.spans, 0, 0).take(ids)
    assert kept == ids[0:4] + ids[12:16] + ids[20:28] + ids[36:40]


def test_head_and_tail_take_at_most_half_the_budget():
    p = SelectParams(chunk=4, head_chunks=8, tail_chunks=24, pool_kernel=1)
    n = 4 * 100
    scores = np.zeros(n)
    scores[160:180] = 9.0   # chunks 40..44, far from head and tail
    sel = select(scores, _ids(n), 0.1, p)  # budget 10: head + tail 5 (1 + 4), 5 by score
    assert sel.kept_chunks == 10
    assert sel.spans == [(0, 4), (160, 180), (384, 400)]


def test_keep_ratio_one_keeps_everything_and_short_prompts_survive():
    ids = _ids(13)
    sel = select(np.random.default_rng(1).random(13), ids, 1.0, P)
    assert sel.spans == [(0, 13)] and sel.take(ids) == ids
    one = select(np.zeros(3), ids[:3], 0.01, P)
    assert one.take(ids[:3]) == ids[:3]


def test_anchor_forces_the_quoted_place_but_not_common_phrases():
    n = 80
    ids = _ids(n, 3)
    needle = [7, 8, 9]
    ids[28:31] = needle                 # chunk 7
    ids[73:76] = needle                 # in the query tail
    common = [4, 5, 6]
    for at in (8, 44, 56):              # 3 occurrences > max_anchor_hits 2: chunks 2, 11, 14
        ids[at:at + 3] = common
    ids[68:71] = common
    scores = np.zeros(n)
    scores[48:52] = 1.0                 # chunk 12 wins the one scored place
    sel = select(scores, ids, 0.2, P)   # 4 chunks: head, tail, the anchor, the best
    assert sel.spans == [(0, 4), (28, 32), (48, 52), (76, 80)]
    assert sel.anchor_chunks == 1


def test_anchors_take_at_most_a_quarter_of_the_budget_rarest_first():
    n = 400                              # 100 chunks of 4, budget 20: anchors at most 5 chunks
    ids = _ids(n, 7)
    rare, common = [11, 12, 13], [21, 22, 23]
    ids[100:103] = rare                  # once: chunk 25
    for at in (20, 180, 260):            # twice allowed by max_anchor_hits 2? no: 3 places, left out
        ids[at:at + 3] = common
    pairs = [[31, 32, 33], [41, 42, 43], [51, 52, 53]]
    for k, g in enumerate(pairs):        # each twice: 2 chunks per n-gram
        ids[40 + 80 * k:43 + 80 * k] = g
        ids[60 + 80 * k:63 + 80 * k] = g
    tail = rare + common + [t for g in pairs for t in g]
    ids[n - len(tail):] = tail
    scores = np.zeros(n)
    scores[320:384] = 1.0                # chunks 80..95 take what anchors leave
    p = SelectParams(chunk=4, head_chunks=1, tail_chunks=1, pool_kernel=1, query_tokens=16, ngram=3,
                     anchor_radius=0, max_anchor_hits=2)
    sel = select(scores, ids, 0.2, p)
    chunks = {c for a, b in sel.spans for c in range(a // 4, (b - 1) // 4 + 1)}
    assert sel.anchor_chunks == 5
    assert {25, 10, 15, 30, 35} <= chunks                # the rarest, then pairs in order, while they fit
    assert not {50, 55} & chunks                         # the third pair would pass the quarter
    assert not {5, 45, 65} & chunks                      # the common phrase never


def test_query_survival_forces_the_query_chunks():
    n = 200
    ids = _ids(n, 5)
    scores = np.zeros(n)
    scores[:120] = 1.0                    # the drafter looks everywhere but at the query
    q = (120, 180)                        # the query sits before a long template tail
    p = SelectParams(chunk=4, head_chunks=1, tail_chunks=1, pool_kernel=1, query_tokens=0)
    assert not select(scores, ids, 0.2, p, query=q).query_forced   # 60 tokens > the 40-token budget
    sel = select(scores, ids, 0.4, p, query=q)
    assert sel.query_forced
    assert survived(ids[120:180], sel.take(ids)) == 1.0
    big = SelectParams(chunk=4, head_chunks=1, tail_chunks=1, pool_kernel=1, query_tokens=0, survival_max_query=50)
    assert not select(scores, ids, 0.4, big, query=q).query_forced   # a long query is not re-added


def test_survived_is_an_in_order_fraction():
    assert survived([1, 2, 3, 4], [9, 1, 2, 9, 3, 4]) == 1.0
    assert survived([1, 2, 3, 4], [4, 3, 2, 1]) == 0.25
    assert survived([], [1]) == 1.0


def test_smooth_is_a_centred_mean():
    x = np.array([0, 0, 3.0, 0, 0])
    np.testing.assert_allclose(smooth(x, 3), [0, 1, 1, 1, 0])
    np.testing.assert_allclose(smooth(x, 1), x)


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5])
def test_bad_keep_ratio_and_mismatched_scores(bad):
    with pytest.raises(ValueError):
        select(np.zeros(8), _ids(8), bad, P)
    with pytest.raises(ValueError):
        select(np.zeros(7), _ids(8), 0.5, P)
    with pytest.raises(ValueError):
        select(np.zeros(8), _ids(8), 0.5, P, query=(4, 9))


def test_policy_modes_threshold_curve_override_and_continuations():
    pol = PFlashPolicy("auto", threshold=100, keep_ratio=0.2)
    assert pol.decide(99) is None and pol.decide(100) == 0.2
    assert pol.decide(500, continuation=True) is None
    assert pol.decide(50, Override("always")) == 0.2
    assert pol.decide(50, Override("always"), continuation=True) == 0.2   # asked for by the request
    assert pol.decide(500, Override("off")) is None
    assert pol.decide(500, Override(keep_ratio=0.5)) == 0.5
    assert pol.decide(500, session_ratio=0.07) == 0.07
    assert pol.decide(500, Override(threshold=1000)) is None
    assert PFlashPolicy("off").decide(10 ** 6) is None
    curved = PFlashPolicy("always", curve=parse_curve(["1000:0.5", "3000:0.1"]))
    assert curved.decide(500) == 0.5 and curved.decide(2000) == pytest.approx(0.3) and curved.decide(9000) == 0.1
    assert curve_ratio(((10, 0.4),), 5) == 0.4


@pytest.mark.parametrize("value", ["sometimes", 3, {"mode": "auto", "extra": 1}, {"keep_ratio": 0},
                                   {"keep_ratio": True}, {"threshold": 0}, {"threshold": "9"}, {"keep_ratio": 2}])
def test_override_rejects_bad_values(value):
    with pytest.raises(ValueError):
        Override.parse(value)


@pytest.mark.parametrize("curve", [["1000"], ["a:0.1"], ["10:0"], ["10:0.2", "10:0.3"], ["0:0.5"]])
def test_bad_curves(curve):
    with pytest.raises(ValueError):
        parse_curve(curve)


def test_bandit_moves_within_bounds_and_forgets_old_sessions():
    b = KeepRatioBandit(max_sessions=3)
    assert b.ratio("s") == 0.10
    r = [b.observe("s", 0.2) for _ in range(30)]        # poor acceptance: keep more, up to the cap
    assert r[0] == pytest.approx(0.11) and r[-1] == 0.20
    r = [b.observe("t", 1.0) for _ in range(40)]        # excellent: keep less, down to the floor
    assert r[0] == pytest.approx(0.095) and r[-1] == 0.025
    before = b.ratio("u")
    b.observe("u", 0.8)                                  # inside the target: unchanged
    assert b.ratio("u") == before
    for s in ("v", "w", "x"):
        b.observe(s, 0.5)
    assert len(b) == 3 and b.ratio("s") == 0.10          # "s" was forgotten
    with pytest.raises(ValueError):
        b.observe("s", 1.5)


def test_service_feeds_acceptance_to_the_session_bandit():
    """Service.keep_ratio / observe: a session's answers with poor DFlash acceptance make
    its next prompt keep more; sessions without compression or a draft are left alone."""
    from types import SimpleNamespace

    from dflash_server.engine.generate import GenerationResult
    from dflash_server.server.config import ServerConfig
    from dflash_server.server.generation import GenOptions, Service
    from dflash_server.server.prompt import Prompt

    engine = SimpleNamespace(compressor=object(), compress_policy=PFlashPolicy("auto", threshold=10, keep_ratio=0.3))
    svc = Service(ServerConfig(), None, SimpleNamespace(engine=engine), None, None, 4096)
    prompt = Prompt(list(range(50)), query="q")
    opts = GenOptions(session_id="s")
    assert svc.keep_ratio(prompt, opts) == 0.10                 # a session starts at the bandit's ratio
    assert svc.keep_ratio(prompt, GenOptions()) == 0.3          # no session: the server's
    res = GenerationResult([1], "x", "stop", 50, extra={"pflash": {"compressed_tokens": 5},
                                                         "spec": {"accepted": 1, "proposed": 10}})
    svc.observe(opts, res)
    assert svc.keep_ratio(prompt, opts) == pytest.approx(0.11)
    svc.observe(GenOptions(session_id="t"), GenerationResult([1], "x", "stop", 50, extra={"spec": {
        "accepted": 0, "proposed": 10}}))                        # not compressed: nothing learnt
    assert len(svc.bandit) == 1
    no_drafter = Service(ServerConfig(), None, SimpleNamespace(engine=SimpleNamespace(compressor=None, compress_policy=None)),
                         None, None, 4096)
    assert no_drafter.keep_ratio(prompt, opts) is None
    with pytest.raises(Exception, match="no prefill drafter"):
        no_drafter.keep_ratio(prompt, GenOptions(compression=Override("always")))


def test_anchor_surroundings_when_they_fit_else_the_bare_place():
    n = 80
    ids = _ids(n, 3)
    ids[28:31] = [7, 8, 9]              # chunk 7; with 4 tokens either side chunks 6..8
    ids[73:76] = [7, 8, 9]
    p = SelectParams(chunk=4, head_chunks=1, tail_chunks=1, pool_kernel=1, query_tokens=8, ngram=3,
                     anchor_radius=4, max_anchor_hits=2)
    scores = np.zeros(n)
    scores[48:52] = 1.0
    small = select(scores, ids, 0.2, p)    # budget 4, anchors at most 2 chunks: the bare chunk
    assert small.anchor_chunks == 1 and (28, 32) in small.spans
    big = select(scores, ids, 0.6, p)      # budget 12, anchors up to 3: with the surroundings
    kept = {c for a, b in big.spans for c in range(a // 4, (b - 1) // 4 + 1)}
    assert big.anchor_chunks == 3 and {6, 7, 8} <= kept
