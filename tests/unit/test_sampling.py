import pytest
import torch

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
