"""Prefix cache in memory: a hit gives exactly the output of a fresh prefill (dense and
hybrid, with and without DFlash, 1 and 2 stages), prefills only the new part, and keeps
DFlash acceptance."""
import pytest

from dflash_server.engine.generate import Engine, GenerationRequest
from dflash_server.spec.proposer import DFlashProposer
from helpers.build import pipeline

from .test_dflash import random_draft

QUESTIONS = ["Tell me about the sea.", "Why is it salty?", "And the sky?", "Name three birds.", "Thanks!"]


def converse(engine, turns=4, max_tokens=6):
    tok = engine.tokenizer
    messages = [{"role": "system", "content": "You are terse."}]
    results = []
    for q in QUESTIONS[:turns]:
        messages.append({"role": "user", "content": q})
        ids = tok.encode_chat(messages)
        r = engine.generate(GenerationRequest(tuple(ids), max_tokens=max_tokens, ignore_eos=True))
        results.append(r)
        messages.append({"role": "assistant", "content": r.text})
    return results


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gemma3", "gemma4", "gemma4_e", "laguna"])
@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("draft", [False, True])
def test_hit_equals_miss(tiny_dir, family, stages, draft):
    def engine(slots):
        pipe = pipeline(tiny_dir(family), stages=stages)
        prop = DFlashProposer(random_draft(pipe, block_size=4, seed=1), pipe) if draft else None
        return Engine(pipe, proposer=prop, prefix_slots=slots)
    cached, fresh = converse(engine(8)), converse(engine(0))
    for i, (a, b) in enumerate(zip(cached, fresh)):
        assert a.token_ids == b.token_ids, i
        assert b.cached_tokens == 0
        if draft:  # same draft context after a hit: same drafts, same acceptance
            assert a.extra["spec"] == b.extra["spec"]
    assert cached[0].cached_tokens == 0
    for r in cached[1:]:
        assert 0 < r.cached_tokens < r.prompt_tokens


def test_turns_prefill_only_the_new_part(tiny_dir):
    pipe = pipeline(tiny_dir("llama"))
    eng = Engine(pipe, prefix_slots=4)
    prefilled = []
    orig = pipe.prefill_steps

    def spy(ids, start=0, *args, **kw):
        prefilled.append(len(ids))
        return orig(ids, start, *args, **kw)
    pipe.prefill_steps = spy
    messages = [{"role": "system", "content": "You are terse."}]
    for turn, q in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": q})
        ids = eng.tokenizer.encode_chat(messages)
        prefilled.clear()
        r = eng.generate(GenerationRequest(tuple(ids), max_tokens=4, ignore_eos=True))
        messages.append({"role": "assistant", "content": r.text})
        assert sum(prefilled) == r.prompt_tokens - r.cached_tokens
        if turn:
            # everything up to the end of the previous user turn came from the cache
            assert r.cached_tokens > 0 and sum(prefilled) < r.prompt_tokens
    assert eng.prefix_cache.stats()["memory"]["hits"] == len(QUESTIONS) - 1


def test_cancelled_request_keeps_no_snapshot(tiny_dir):
    pipe = pipeline(tiny_dir("llama"))
    eng = Engine(pipe, prefix_slots=4)
    ids = eng.tokenizer.encode_chat([{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}])
    eng.generate(GenerationRequest(tuple(ids), max_tokens=5, ignore_eos=True), cancelled=lambda: True)
    assert eng.prefix_cache.stats()["memory"]["slots"] == 0
    assert not pipe.stages[0]._snapshots
    eng.generate(GenerationRequest(tuple(ids), max_tokens=2, ignore_eos=True))
    assert eng.prefix_cache.stats()["memory"]["slots"] == 1


def test_eviction_frees_stage_snapshots(tiny_dir):
    pipe = pipeline(tiny_dir("llama"))
    eng = Engine(pipe, prefix_slots=2)
    for i in range(5):
        ids = eng.tokenizer.encode_chat([{"role": "system", "content": f"sys {i}"}, {"role": "user", "content": "q"}])
        eng.generate(GenerationRequest(tuple(ids), max_tokens=2, ignore_eos=True))
    assert eng.prefix_cache.stats()["memory"]["slots"] == 2
    assert len(pipe.stages[0]._snapshots) == 2 and len(eng.prefix_cache.extras) == 2


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gemma3", "gemma4", "gemma4_e", "laguna"])
def test_hit_equals_miss_with_adaptive_block_size(tiny_dir, family):
    """Plain steps of the adaptive block size defer the draft-context update; snapshots
    flush it, so a hit continues with the full draft context and the same output."""
    def engine(slots):
        pipe = pipeline(tiny_dir(family))
        prop = DFlashProposer(random_draft(pipe, block_size=4, seed=1), pipe, adaptive=True)
        return Engine(pipe, proposer=prop, prefix_slots=slots)
    plain = converse(Engine(pipeline(tiny_dir(family))))
    cached = converse(engine(8))
    for i, (a, b) in enumerate(zip(cached, plain)):
        assert a.token_ids == b.token_ids, i
    assert all(0 < r.cached_tokens for r in cached[1:])
    assert sum(r.extra["spec"]["plain_steps"] for r in cached) > 0


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_5"])
def test_hit_equals_miss_bit_for_bit_past_64_rows_with_native_kernels(tiny_dir, family, monkeypatch):
    """The serving configuration (bf16, quantized layers on the native kernels): turns whose
    prompts outgrow 64 tokens, so the fresh run prefills them in one long chunk while the
    cached run restores KV written by decode steps and short chunks. Every op is then
    row-count invariant (attention included: prefill chunks within NATIVE_PREFILL_CTX take
    the native step, whose rows are a decode step's bits; a Gated DeltaNet chunk of any length
    steps token by token natively), so the caches themselves (attention KV in fp16, the
    default cache type here, and the recurrent state) end bit-equal, not only the tokens."""
    import torch

    from dflash_server import kernels

    monkeypatch.setenv("DFLASH_KERNELS", "1")
    assert kernels.load()

    def engine(slots):
        return Engine(pipeline(tiny_dir(family), dtype=torch.bfloat16, quantize="int8"), prefix_slots=slots)

    long_questions = [q + " Please answer in detail, with examples and reasons." * 2 for q in QUESTIONS]
    engines = engine(8), engine(0)
    runs = []
    for eng in engines:
        tok = eng.tokenizer
        messages, results = [{"role": "system", "content": "You are terse."}], []
        for q in long_questions[:3]:
            messages.append({"role": "user", "content": q})
            results.append(eng.generate(GenerationRequest(tuple(tok.encode_chat(messages)), max_tokens=6,
                                                          ignore_eos=True)))
            messages.append({"role": "assistant", "content": results[-1].text})
        runs.append(results)
    cached, fresh = runs
    assert [r.token_ids for r in cached] == [r.token_ids for r in fresh]
    assert fresh[-1].prompt_tokens > 96 and cached[-1].cached_tokens > 64
    assert all(r.cached_tokens == 0 for r in fresh)
    (a,), (b,) = engines[0].pipeline.stages, engines[1].pipeline.stages
    assert a.length == b.length
    assert {bank.k.dtype for bank in a.banks if bank is not None} == {torch.float16}  # (--kv-dtype auto)
    compared = 0
    for sa, sb in zip(a.states, b.states):
        for name in ("k", "v", "conv", "ssm"):
            ta, tb = getattr(sa, name, None), getattr(sb, name, None)
            if ta is None:
                continue
            if name in ("k", "v"):
                ta, tb = ta[..., :a.length, :], tb[..., :b.length, :]
            assert torch.equal(ta, tb), name
            compared += 1
    assert compared >= 4
