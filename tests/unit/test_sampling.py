import pytest
import torch

from dflash_server import kernels
from dflash_server.engine.sampling import Sampler, SamplingParams


def test_greedy_is_argmax():
    s = Sampler(SamplingParams(), 10, "cpu")
    logits = torch.tensor([0.0, 3, 1, 2, 0, 0, 0, 0, 0, 0])
    assert s.sample(logits) == 1


def test_seed_reproducible_and_distinct():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, seed=42)
    a = [Sampler(p, 100, "cpu").sample(logits) for _ in range(3)]
    assert len(set(a)) == 1
    s1, s2 = Sampler(p, 100, "cpu"), Sampler(p, 100, "cpu")
    seq1 = [s1.sample(logits) for _ in range(20)]
    seq2 = [s2.sample(logits) for _ in range(20)]
    assert seq1 == seq2
    s3 = Sampler(SamplingParams(temperature=1.0, seed=43), 100, "cpu")
    assert [s3.sample(logits) for _ in range(20)] != seq1


def test_top_k_top_p_min_p_truncate():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = Sampler(SamplingParams(temperature=1.0, top_k=2), 4, "cpu").probs(logits)
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0, 0]))
    probs = Sampler(SamplingParams(temperature=1.0, top_p=0.7), 4, "cpu").probs(logits)
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0, 0]))
    probs = Sampler(SamplingParams(temperature=1.0, top_p=0.5), 4, "cpu").probs(logits)
    assert torch.allclose(probs, torch.tensor([1.0, 0, 0, 0]))
    probs = Sampler(SamplingParams(temperature=1.0, min_p=0.2), 4, "cpu").probs(logits)
    assert torch.allclose(probs, torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95)


def test_sampling_frequencies_match_distribution():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1]))
    s = Sampler(SamplingParams(temperature=1.0, seed=1), 3, "cpu")
    n = 6000
    counts = torch.bincount(torch.tensor([s.sample(logits) for _ in range(n)]), minlength=3).float() / n
    # 4 sigma of a binomial proportion at n=6000 is < 0.026
    assert torch.allclose(counts, torch.tensor([0.6, 0.3, 0.1]), atol=0.026)


def test_penalties():
    logits = torch.tensor([2.0, 1.0, -1.0, 0.5])
    s = Sampler(SamplingParams(repetition_penalty=2.0), 4, "cpu", prompt_ids=[0, 2])
    assert torch.allclose(s.process(logits), torch.tensor([1.0, 1.0, -2.0, 0.5]))
    s = Sampler(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), 4, "cpu")
    s.accept(1)
    s.accept(1)
    assert torch.allclose(s.process(logits), torch.tensor([2.0, 1.0 - 1.0 - 0.25, -1.0, 0.5]))
    # greedy still honours penalties
    s = Sampler(SamplingParams(repetition_penalty=10.0), 4, "cpu", prompt_ids=[0])
    assert s.sample(logits) == 1


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-1),
                                dict(min_p=2), dict(repetition_penalty=0), dict(frequency_penalty=3),
                                dict(seed=-1)])
def test_invalid_params(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def _reference_probs(logits, p):
    """Temperature, top-k mask, softmax, top-p over the fully sorted vocabulary, min-p. (The
    softmax without top-k is the sampler's own, kernels.softmax_t: what this compares is the
    truncation, and a token at the top-p boundary flips with the softmax's last bit.)"""
    if 0 < p.top_k < logits.shape[-1]:
        logits = logits.float() / p.temperature
        kth = torch.topk(logits, p.top_k).values[-1]
        probs = torch.softmax(logits.masked_fill(logits < kth, float("-inf")), -1)
    else:
        probs = kernels.softmax_t(logits.float(), p.temperature)
    if p.top_p < 1.0:
        sp, idx = probs.sort(descending=True)
        sp = sp.masked_fill((sp.cumsum(-1) - sp) >= p.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sp)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()


@pytest.mark.parametrize("kw", [dict(top_p=0.9), dict(top_p=0.999), dict(top_k=40, top_p=0.95, min_p=0.05),
                                dict(min_p=0.3), dict(top_k=7), dict()])
def test_candidate_sampling_equals_full_sort(kw):
    """Sampling only sorts candidates (top-k, or a widening top-n probe for top-p): the
    distribution equals the full-vocabulary one, also when top-p needs most of a flat
    vocabulary (the probe widens past its first 512)."""
    g = torch.Generator().manual_seed(0)
    for scale in (0.05, 3.0):      # nearly flat (top-p keeps thousands of tokens) and peaked
        logits = torch.randn(6000, generator=g) * scale
        params = SamplingParams(temperature=0.7, seed=5, **kw)
        got = Sampler(params, 6000, "cpu").probs(logits)
        torch.testing.assert_close(got, _reference_probs(logits, params), rtol=1e-5, atol=1e-7)


def test_sampling_matches_its_distribution_and_seed():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.1, -1.0, -3.0])
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=11)
    s = Sampler(params, 6, "cpu")
    draws = [s.sample(logits) for _ in range(20000)]
    freq = torch.bincount(torch.tensor(draws), minlength=6).float() / len(draws)
    torch.testing.assert_close(freq, s.probs(logits), atol=0.015, rtol=0)
    again = Sampler(params, 6, "cpu")
    assert [again.sample(logits) for _ in range(50)] == draws[:50]


@pytest.mark.parametrize("t", [1e-40, 1e-300, 5e-6])
@pytest.mark.parametrize("trunc", [dict(top_k=0, min_p=0.0, top_p=1.0), dict(top_k=40, min_p=0.05, top_p=0.95),
                                   dict(top_k=0, min_p=0.05, top_p=1.0)])
def test_a_vanishing_temperature_is_greedy(t, trunc):
    """Hostile review (2026-11-27): a positive temperature too small for fp32 (logits / T
    overflow) gave NaN probabilities: the last vocabulary id every step, or a crash (a 500
    over HTTP) with min_p. Below 1e-5 a temperature is greedy."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1000, generator=g) * 3
    s = Sampler(SamplingParams(temperature=t, seed=1, **trunc), 1000, "cpu")
    assert s.params.greedy and s.sample(logits) == int(logits.argmax())
    p = s.probs(logits)
    assert torch.isfinite(p).all() and abs(float(p.sum()) - 1.0) < 1e-4
    assert not SamplingParams(temperature=1e-4, **trunc).greedy
