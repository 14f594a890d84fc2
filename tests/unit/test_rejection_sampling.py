"""Speculative (rejection) sampling, Sequence.commit_draft, on synthetic distributions: the
committed tokens follow the target's p exactly whatever the draft's q (far, close, equal,
disjoint), and the kept fraction is sum(min(p, q)). Chi-square thresholds are the 99.9th
percentile for 5 degrees of freedom (20.5); every draw is seeded, so the test is fixed."""
from __future__ import annotations

import pytest
import torch

from dflash_server.engine.generate import GenerationRequest
from dflash_server.engine.sampling import SamplingParams
from dflash_server.engine.sequence import Sequence

SUPPORT = [10, 11, 12, 13, 14, 15]
P = torch.tensor([0.35, 0.25, 0.15, 0.12, 0.08, 0.05], dtype=torch.float64)


class _Tokenizer:
    """What a Sequence's output builder needs: 32 tokens, each one letter."""
    vocab_size = 32
    eos_token_ids = ()

    @staticmethod
    def decode(ids, skip_special_tokens=False):
        return "".join(chr(65 + i % 26) for i in ids)


@pytest.fixture(scope="module")
def tokenizer():
    return _Tokenizer()


def _run(tokenizer, q_small: torch.Tensor, n: int = 8000, seed: int = 0, temperature: float = 1.0):
    V = tokenizer.vocab_size
    logits = torch.full((V,), -1e9)
    logits[SUPPORT] = (P.log() * temperature).float()      # p = P after the temperature
    q = torch.zeros(V, dtype=torch.float64)
    q[[*SUPPORT, 20]] = q_small / q_small.sum()            # token 20: a draft token p never picks
    req = GenerationRequest((1, 2, 3), SamplingParams(temperature=temperature, seed=seed), max_tokens=10**7,
                            ignore_eos=True)
    seq = Sequence(0, req, tokenizer, V, "cpu")
    g = torch.Generator().manual_seed(seed + 1)
    draws = torch.multinomial(q.float(), n, replacement=True, generator=g).tolist()
    counts = torch.zeros(V, dtype=torch.float64)
    kept = 0
    for x in draws:
        _, k = seq.commit_draft(logits, x, q)
        counts[seq.last] += 1
        kept += k
    return counts, kept / n, q


@pytest.mark.parametrize("name,q_small", [
    ("far", torch.tensor([0.02, 0.03, 0.05, 0.1, 0.3, 0.3, 0.2], dtype=torch.float64)),
    ("close", torch.tensor([0.33, 0.27, 0.14, 0.13, 0.07, 0.06, 0.0], dtype=torch.float64)),
    ("equal", torch.cat([P, torch.zeros(1, dtype=torch.float64)])),
    ("disjoint", torch.tensor([0, 0, 0, 0, 0, 0, 1.0], dtype=torch.float64)),
])
def test_committed_tokens_follow_the_target(tokenizer, name, q_small):
    n = 8000
    counts, kept, q = _run(tokenizer, q_small, n)
    assert counts.sum() == n and counts[SUPPORT].sum() == n        # nothing outside p's support
    expected = P * n
    chi2 = float(((counts[SUPPORT] - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, (name, chi2, counts[SUPPORT].tolist())
    overlap = float(torch.minimum(P, q[SUPPORT]).sum())
    assert kept == pytest.approx(overlap, abs=0.02), name
    if name == "equal":
        assert kept == 1.0
    if name == "disjoint":
        assert kept == 0.0


def test_temperature_and_seeded_repeatability(tokenizer):
    q_small = torch.tensor([0.1, 0.1, 0.2, 0.2, 0.2, 0.1, 0.1], dtype=torch.float64)
    a = _run(tokenizer, q_small, 2000, seed=5, temperature=0.7)
    b = _run(tokenizer, q_small, 2000, seed=5, temperature=0.7)
    assert torch.equal(a[0], b[0]) and a[1] == b[1]
    counts = a[0][SUPPORT]
    # logits were P.log() * T, so after dividing by T the target is P again
    chi2 = float(((counts - P * 2000) ** 2 / (P * 2000)).sum())
    assert chi2 < 20.5


def test_draft_truncation_matches_the_sampler():
    """The draft's q is cut as Sampler cuts p (top-k, top-p, min-p), renormalized."""
    from dflash_server.engine.sampling import Sampler
    from dflash_server.spec.proposer import truncate

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.1, -1.0, -3.0], [0.0, 0.3, 0.2, 0.1, 2.5, 1.0]])
    for kw in ({"top_k": 3}, {"top_p": 0.7}, {"min_p": 0.2}, {"top_k": 4, "top_p": 0.8, "min_p": 0.1}):
        params = SamplingParams(temperature=0.8, **kw)
        q = truncate(torch.softmax(logits / 0.8, -1), params.top_k, params.top_p, params.min_p)
        for row, lg in zip(q, logits):
            torch.testing.assert_close(row, Sampler(params, 6, "cpu").probs(lg).float(), rtol=1e-5, atol=1e-6)
