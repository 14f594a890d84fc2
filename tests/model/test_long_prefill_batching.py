"""Hostile review (2026-11-27): a prompt past 2048 tokens prefilled in --step-tokens pieces
next to a decoding stream gave another output than the same request alone (seeded sampling:
other tokens; greedy: other logprobs): alone it is prefilled in --chunk pieces (512), in a
batch in pieces of step_tokens - decode rows, and pieces over 64 rows past 2048 ran aten's
attention, whose rounding depends on the piece. The native attention step now takes them
(NATIVE_PREFILL_CTX 16384; it is the faster one there too)."""
from __future__ import annotations

import random

import pytest
import torch

from dflash_server import kernels
from dflash_server.engine.generate import Engine, GenerationRequest
from dflash_server.engine.sampling import SamplingParams
from dflash_server.runtime.pipeline import build_pipeline
from dflash_server.runtime.placement import plan_placement
from dflash_server.weights.loader import open_model
from helpers.build import prompt_ids


def _pipe(path, lanes):
    src = open_model(path)
    return build_pipeline(src, plan_placement(src.config.num_layers, ["cpu"], None), dtype=torch.bfloat16,
                          max_ctx=4096, quantize="int8", progress=False, lanes=lanes)


def _run_together(eng, reqs, when):
    seqs, k = [None] * len(reqs), 0
    while any(s is None for s in seqs) or eng.has_work:
        for i, r in enumerate(reqs):
            if seqs[i] is None and when[i] <= k:
                seqs[i] = eng.submit(r)
        eng.step()
        k += 1
    return seqs


@pytest.mark.parametrize("seed", [2, 3])
def test_long_prompt_prefilled_next_to_a_stream_equals_alone(tiny_dir, seed):
    if not (kernels.enabled() and kernels.load()):
        pytest.skip("needs the native kernels (row-invariant bf16 + int8)")
    path = tiny_dir("llama")
    alone = Engine(_pipe(path, 1))
    eng = Engine(_pipe(path, 2), step_tokens=256)          # the defaults: chunk 512, step tokens 256
    rnd = random.Random(5)
    long_ids = tuple(rnd.randrange(1000, 40000) for _ in range(2600))
    stream = GenerationRequest(tuple(prompt_ids(alone.pipeline, 8, seed=1)), max_tokens=60, ignore_eos=True)
    long = GenerationRequest(long_ids, max_tokens=40, ignore_eos=True, logprobs=2,
                             sampling=SamplingParams(temperature=1.0, seed=seed))
    want = [alone.generate(r) for r in (stream, long)]
    seqs = _run_together(eng, [stream, long], when=[0, 1])   # the long one joins while the stream decodes
    got = [s.result for s in seqs]
    assert got[0].token_ids == want[0].token_ids
    assert got[1].token_ids == want[1].token_ids             # seeded: repeats exactly (fails: other draws)
    assert [e.logprob for e in got[1].logprobs] == [e.logprob for e in want[1].logprobs]
