"""The native sampling ops (csrc/sample.cpp): ``softmax_t`` (a vocabulary's softmax at a
temperature) against an fp64 reference, masks and NaN as aten treats them, the vector path ==
the portable path bit for bit; ``draw`` (the inverse-CDF pick) exactly as its definition on
weights whose sums are exact, never a zero weight, degenerate weights handed back to aten;
and the sampler built on them still drawing from its distribution."""
import math
from fractions import Fraction

import pytest
import torch

from dflash_server import kernels
from dflash_server.engine.sampling import Sampler, SamplingParams

pytestmark = pytest.mark.skipif(not kernels.load(), reason="native kernels unavailable on this machine")
INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("n", [1, 7, 8, 9, 255, 4097, 49152])
@pytest.mark.parametrize("temperature", [1e-5, 0.3, 0.7, 1.0, 5.0])
def test_softmax_t_is_the_softmax(n, temperature):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * 4
    want = torch.softmax(x.double() / temperature, -1)
    got = kernels.softmax_t(x, temperature)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got.double(), want, rtol=3e-5, atol=1e-12)
    assert abs(float(got.double().sum()) - 1.0) < 1e-4
    # the AVX2 and the portable builds: the same bits
    assert torch.equal(torch.ops.dflash.softmax_t(x, 1.0 / temperature, False),
                       torch.ops.dflash.softmax_t(x, 1.0 / temperature, True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_softmax_t_reads_16_bit_logits_exactly(dtype):
    x = (torch.randn(3, 1000, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    assert torch.equal(kernels.softmax_t(x, 0.8), kernels.softmax_t(x.float(), 0.8))   # rows apart, widened exactly
    torch.testing.assert_close(kernels.softmax_t(x, 0.8).double(), torch.softmax(x.double() / 0.8, -1),
                               rtol=3e-5, atol=1e-12)


def test_softmax_t_masks_and_nan_as_aten():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    x[::3] = -INF                                  # a grammar's mask: probability 0, exactly
    p = kernels.softmax_t(x, 0.7)
    assert bool((p[::3] == 0).all()) and bool((p[1::3] > 0).all())
    x[5] = -1e30                                   # far below the rest: 0 too (underflow), no NaN
    assert float(kernels.softmax_t(x, 0.7)[5]) == 0.0
    for bad in ([1.0, NAN, 2.0], [-INF, -INF], [1.0, INF]):   # as torch.softmax: all NaN
        t = torch.tensor(bad)
        assert torch.isnan(torch.softmax(t, -1)).all() and torch.isnan(kernels.softmax_t(t, 1.0)).all()
    one = kernels.softmax_t(torch.tensor([3.0, 2.0, 3.0 - 1e-3]), 1e-5)   # near-greedy: no overflow
    assert torch.equal(one, torch.tensor([1.0, 0.0, 0.0]))


def _first_past(weights: list[int], u: float) -> int:
    """The definition: the first index whose running sum passes u x total (the target rounded
    once, as an fp64 product; integer weights' running sums are exact)."""
    target, run = u * float(sum(weights)), 0
    for i, w in enumerate(weights):
        run += w
        if run > target:
            return i
    raise AssertionError


@pytest.mark.parametrize("n", [1, 3, 255, 256, 257, 1000, 49152])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_draw_is_its_definition(n, dtype):
    g = torch.Generator().manual_seed(n)
    w = torch.randint(0, 5, (n,), generator=g)
    w[torch.rand(n, generator=g) < 0.5] = 0       # runs of zeros, whole empty blocks at large n
    w[-1] = max(int(w[-1]), 1) if int(w.sum()) == 0 else w[-1]
    weights = w.tolist()
    wt = w.to(dtype)
    us = [0.0, 1 - 2 ** -53] + torch.rand(300, generator=g, dtype=torch.float64).tolist()
    us += [float(Fraction(sum(weights[:i + 1]), sum(weights))) for i in range(0, n, max(1, n // 40))]  # exact edges
    for u in us:
        if u >= 1.0:
            continue
        want = _first_past(weights, u)
        for portable in (False, True):
            assert int(torch.ops.dflash.draw(wt, u, portable)) == want, (n, u, portable)
        assert weights[want] > 0


def test_draw_hands_degenerate_weights_back():
    for bad in (torch.zeros(10), torch.tensor([1.0, -0.5, 2.0]), torch.tensor([1.0, NAN]), torch.tensor([INF, 1.0])):
        assert kernels.draw(bad, 0.5) is None
    assert kernels.draw(torch.ones(2, 3), 0.5) is None           # not 1-D: aten's path
    assert kernels.draw(torch.ones(4, dtype=torch.float16), 0.5) is None
    with pytest.raises(RuntimeError, match="u must be in"):
        torch.ops.dflash.draw(torch.ones(4), 1.0)
    with pytest.raises(RuntimeError, match="inv_t must be positive"):
        torch.ops.dflash.softmax_t(torch.ones(4), 0.0)
    with pytest.raises(RuntimeError, match="non-empty"):
        torch.ops.dflash.softmax_t(torch.ones(0), 1.0)


def test_sampler_on_the_native_ops_draws_from_its_distribution():
    """Chi-square of 20,000 seeded draws against the exact distribution (temperature only: the
    path that takes both native ops), and a seed repeats its draws."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.1, -1.0, -3.0, -INF, 0.0])
    params = SamplingParams(temperature=0.8, seed=3)
    p = torch.softmax(logits.double() / 0.8, -1)
    s = Sampler(params, 8, "cpu")
    n = 20_000
    counts = torch.bincount(torch.tensor([s.sample(logits) for _ in range(n)]), minlength=8).double()
    assert counts[6] == 0                                          # a masked token is never drawn
    keep = p > 0
    chi2 = float((((counts - n * p) ** 2) / (n * p).clamp_min(1e-300))[keep].sum())
    assert chi2 < 24.3, chi2                                       # 6 degrees of freedom, p = 0.0005
    a, b = Sampler(params, 8, "cpu"), Sampler(params, 8, "cpu")
    assert [a.sample(logits) for _ in range(200)] == [b.sample(logits) for _ in range(200)]
    assert math.isclose(float(s.probs(logits).double().sum()), 1.0, rel_tol=1e-5)


@pytest.mark.parametrize("scale", [0.02, 0.5, 3.0, 12.0])      # nearly flat to peaked
@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.95, 0.99])
def test_top_p_candidates_hold_what_top_p_keeps(scale, top_p):
    """The candidates are sorted (most likely first, ties by id), and are a prefix of the fully
    sorted vocabulary that holds every token the top-p rule keeps and at least the margin's mass
    more; the sampler's distribution with them equals the one of its own top-k probes."""
    g = torch.Generator().manual_seed(int(scale * 100) + int(top_p * 1000))
    logits = torch.randn(49152, generator=g) * scale
    logits[torch.randperm(49152, generator=g)[:100]] = -INF       # masked tokens: probability 0
    probs = kernels.softmax_t(logits, 1.0)
    got = kernels.top_p_candidates(probs, top_p)
    assert got is not None
    vals, ids = got
    assert torch.equal(vals, probs[ids]) and bool((vals[1:] <= vals[:-1]).all())
    order = torch.argsort(-probs, stable=True)                      # the full sort, ties by id
    assert torch.equal(ids, order[:len(ids)])                       # a prefix of it
    full = probs[order]
    kept = int(((full.double().cumsum(0) - full.double()) < top_p).sum())
    assert len(ids) >= kept and float(vals.double().sum()) >= top_p + 1e-3 - 1e-5   # the rest: dropped by a margin
    params = SamplingParams(temperature=1.0, top_p=top_p, seed=1)
    native = Sampler(params, 49152, "cpu").probs(logits)
    saved = kernels.top_p_candidates
    try:
        kernels.top_p_candidates = lambda p, t: None                 # the sampler's own probes
        probed = Sampler(params, 49152, "cpu").probs(logits)
    finally:
        kernels.top_p_candidates = saved
    assert torch.equal(native > 0, probed > 0)
    torch.testing.assert_close(native, probed, rtol=1e-6, atol=0)


def test_top_p_candidates_hand_odd_inputs_back():
    p = torch.full((1000,), 1e-3)
    assert kernels.top_p_candidates(p, 0.9995) is None               # the margin takes everything
    bad = p.clone(); bad[3] = NAN
    assert kernels.top_p_candidates(bad, 0.5) is None
    bad = p.clone(); bad[3] = -1e-3
    assert kernels.top_p_candidates(bad, 0.5) is None
    assert kernels.top_p_candidates(p.double(), 0.5) is None and kernels.top_p_candidates(p, 1.0) is None
    with pytest.raises(RuntimeError, match="top_p must be in"):
        torch.ops.dflash.top_p_candidates(p, 0.0)
    ties = torch.tensor([0.25, 0.25, 0.25, 0.125, 0.125])
    vals, ids = kernels.top_p_candidates(ties, 0.5)
    assert ids.tolist()[:3] == [0, 1, 2]                             # ties by id
