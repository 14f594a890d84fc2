"""Continuous batching: sequences that share the engine's steps give exactly what each
gives alone (the native kernels are row-invariant, so bit for bit in the default bf16 +
int8 configuration), whatever joins, leaves, stops or is cancelled next to them."""
from __future__ import annotations

import pytest
import torch

from dflash_server.engine.generate import Engine, GenerationRequest
from dflash_server.engine.sampling import SamplingParams
from dflash_server.runtime.pipeline import build_pipeline
from dflash_server.runtime.placement import plan_placement
from dflash_server.weights.loader import open_model
from helpers.build import prompt_ids


def _pipe(path, lanes, stages=1, max_ctx=512):
    """``stages``: a count of local stages, or "remote" (a local stage + a shard worker)."""
    src = open_model(path)
    devices = ["cpu", "remote:cpu"] if stages == "remote" else ["cpu"] * stages
    shards = plan_placement(src.config.num_layers, devices, None)
    return build_pipeline(src, shards, dtype=torch.bfloat16, max_ctx=max_ctx, quantize="int8", progress=False,
                          lanes=lanes)


def _req(ids, n=12, **kw):
    return GenerationRequest(tuple(ids), max_tokens=n, ignore_eos=True, **kw)


def _run_together(eng, reqs, when=None):
    """Submit ``reqs`` (``when[i]``: the step at which request i joins; default all at once)
    and step until all end; returns the sequences and, per sequence, the steps at which it
    emitted tokens."""
    when = when or [0] * len(reqs)
    seqs, steps = [None] * len(reqs), [[] for _ in reqs]
    k = 0
    while any(s is None for s in seqs) or eng.has_work:
        for i, r in enumerate(reqs):
            if seqs[i] is None and when[i] <= k:
                seqs[i] = eng.submit(r, on_event=lambda ev, i=i: steps[i].append(k) if ev.token_id >= 0 else None)
        eng.step()
        k += 1
    return seqs, steps


@pytest.mark.parametrize("family,stages", [("llama", 1), ("llama", 2), ("qwen3_5", 1), ("llama", "remote")])
def test_concurrent_equals_alone(tiny_dir, family, stages):
    """One stage, an in-process split, and a split onto a shard worker (which holds the
    slots of its layers)."""
    path = tiny_dir(family)
    alone = Engine(_pipe(path, 1, 2 if stages == "remote" else stages))  # remote == local split, bit for bit
    eng = Engine(_pipe(path, 3, stages))
    try:
        reqs = [_req(prompt_ids(alone.pipeline, n, seed=n), 10 + n % 5) for n in (7, 30, 12, 19, 5)]
        reqs.append(_req(prompt_ids(alone.pipeline, 9, seed=1), 14,
                         sampling=SamplingParams(temperature=0.9, top_p=0.9, seed=123)))  # sampled: its own RNG
        want = [alone.generate(r).token_ids for r in reqs]
        seqs, _ = _run_together(eng, reqs, when=[0, 0, 0, 2, 5, 6])  # more requests than slots, joining late
        assert [s.result.token_ids for s in seqs] == want
        assert max(eng.batch_sizes) == 3
    finally:
        eng.pipeline.close()


def test_long_prompt_prefills_between_running_steps(tiny_dir):
    path = tiny_dir("llama")
    alone = Engine(_pipe(path, 1))
    eng = Engine(_pipe(path, 3), step_tokens=24)
    short = [_req(prompt_ids(alone.pipeline, 6, seed=s), 30) for s in (1, 2)]
    long = _req(prompt_ids(alone.pipeline, 300, seed=3), 5)
    want = [alone.generate(r).token_ids for r in short + [long]]
    seqs, steps = _run_together(eng, short + [long], when=[0, 0, 3])
    assert [s.result.token_ids for s in seqs] == want
    # the long prompt took many steps (pieces of at most 24 - 2 tokens) and the short
    # streams emitted a token in each of them
    first_long = steps[2][0]
    assert first_long - 3 >= 300 // 22
    for k in range(4, first_long):
        assert k in steps[0] and k in steps[1]


def test_cancel_and_stop_string_next_to_others(tiny_dir):
    path = tiny_dir("llama")
    alone = Engine(_pipe(path, 1))
    eng = Engine(_pipe(path, 3))
    ids = [prompt_ids(alone.pipeline, n, seed=n) for n in (8, 11, 14)]
    free = alone.generate(_req(ids[1], 20))
    stop = alone.tokenizer.decode(free.token_ids[4:6])  # a stop string the output meets
    reqs = [_req(ids[0], 20), _req(ids[1], 20, stop=(stop,)), _req(ids[2], 20)]
    want = [alone.generate(r) for r in reqs]
    assert want[1].finish_reason == "stop" and len(want[1].token_ids) < 20
    flag = {"cancel": False}
    seqs = [eng.submit(reqs[0]), eng.submit(reqs[1]), eng.submit(reqs[2], cancelled=lambda: flag["cancel"])]
    while eng.has_work:
        eng.step()
        if len(seqs[2].out.tokens) >= 5:
            flag["cancel"] = True
    assert seqs[0].result.token_ids == want[0].token_ids
    assert (seqs[1].result.token_ids, seqs[1].result.text) == (want[1].token_ids, want[1].text)
    assert seqs[1].result.stop_reason == stop
    c = seqs[2].result
    assert c.finish_reason == "cancelled" and c.token_ids == want[2].token_ids[:len(c.token_ids)]
    assert eng.scheduler.free == [0, 1, 2]


def test_prefix_cache_hits_in_the_batch(tiny_dir):
    """Requests restoring a cached system prompt into their slots while others decode give
    what they give one at a time on an engine with the same cache."""
    path = tiny_dir("llama")
    serial = Engine(_pipe(path, 1), prefix_slots=8)
    eng = Engine(_pipe(path, 3), prefix_slots=8)
    tok = serial.tokenizer
    turn = [{"role": "system", "content": "You are a terse assistant who answers in one line. " * 3},
            {"role": "user", "content": "Hello there"}]
    warm = _req(tok.encode_chat(turn), 4)
    for e in (serial, eng):  # caches the state at the end of the first user turn
        answer = e.generate(warm).text
    turn.append({"role": "assistant", "content": answer})
    reqs = [_req(tok.encode_chat(turn + [{"role": "user", "content": q}]), 12)
            for q in ("What is two plus two?", "Name a color.", "Say hi.", "Count to three.")]
    want = [serial.generate(r) for r in reqs]
    assert all(w.cached_tokens > 0 for w in want)
    seqs, _ = _run_together(eng, reqs, when=[0, 0, 1, 4])
    got = [s.result for s in seqs]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.cached_tokens for g in got] == [w.cached_tokens for w in want]


def test_kvflash_pools_per_slot(tiny_dir):
    """KV Flash with several slots: each has its own pool and page table; prompts longer
    than the pool page chunks in and out next to each other and give each one's solo output."""
    from dflash_server.runtime.kv_pager import KvFlashConfig

    path = tiny_dir("llama")

    def kv_pipe(lanes):
        src = open_model(path)
        return build_pipeline(src, plan_placement(src.config.num_layers, ["cpu"]), dtype=torch.float32,
                              max_ctx=512, progress=False, lanes=lanes, kvflash=KvFlashConfig(96, chunk=16))
    alone, eng = Engine(kv_pipe(1), chunk=64), Engine(kv_pipe(3), chunk=64)
    reqs = [_req(prompt_ids(alone.pipeline, n, seed=n), 30) for n in (150, 40, 210)]
    want = [alone.generate(r) for r in reqs]
    seqs, _ = _run_together(eng, reqs, when=[0, 1, 1])
    got = [s.result for s in seqs]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert got[2].extra["kvflash"]["page_outs"] > 0       # its own pool paged
    st = eng.pipeline.stages[0]
    assert len({id(lane.pool) for lane in st.lanes}) == 3 and st.kv_bytes() == 3 * alone.pipeline.stages[0].kv_bytes()


def test_hundred_requests_on_four_slots(tiny_dir):
    path = tiny_dir("llama")
    alone = Engine(_pipe(path, 1, max_ctx=64))
    eng = Engine(_pipe(path, 4, max_ctx=64))
    reqs = [_req(prompt_ids(alone.pipeline, 3 + i % 7, seed=i), 1 + i % 4) for i in range(100)]
    want = [alone.generate(r).token_ids for r in reqs]
    seqs = [eng.submit(r) for r in reqs]
    while eng.has_work:
        eng.step()
        assert len(eng.scheduler.active) <= 4
    assert [s.result.token_ids for s in seqs] == want
    st = eng.stats()
    assert st["slots_busy"] == 0 and st["waiting"] == 0 and max(st["batch_sizes"]) >= 2


def test_a_failing_forward_ends_only_its_rows(tiny_dir, monkeypatch):
    path = tiny_dir("llama")
    eng = Engine(_pipe(path, 2))
    a = eng.submit(_req(prompt_ids(eng.pipeline, 6, seed=1), 30))
    while a.phase != "decode":
        eng.step()
    orig = eng.pipeline.forward_rows
    calls = {"n": 0}

    def flaky(*args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected")
        return orig(*args)
    monkeypatch.setattr(eng.pipeline, "forward_rows", flaky)
    b = eng.submit(_req(prompt_ids(eng.pipeline, 6, seed=2), 3))
    while eng.has_work:
        eng.step()
    assert isinstance(a.error, RuntimeError) and isinstance(b.error, RuntimeError)
    c = eng.submit(_req(prompt_ids(eng.pipeline, 6, seed=3), 3))  # the engine goes on
    while eng.has_work:
        eng.step()
    assert c.error is None and len(c.result.token_ids) == 3 and eng.scheduler.free == [0, 1]


def test_parallel_flag(tiny_dir, monkeypatch):
    from dflash_server.cli import common
    from dflash_server.errors import UserError
    from dflash_server.runtime import memory
    from dflash_server.runtime.placement import ShardSpec

    src = open_model(tiny_dir("llama"))
    local, remote = [ShardSpec("cpu", 0, src.config.num_layers)], [ShardSpec("remote:cpu", 0, src.config.num_layers)]

    def lanes(flag, shards=local, single=False):
        return common.choose_lanes(flag, src, shards, torch.bfloat16, 512, "int8", single)
    assert lanes("3") == 3 and lanes("auto") == common.AUTO_LANES and lanes("2", remote) == 2
    assert lanes("auto", single=True) == 1 and lanes("auto", remote) == common.AUTO_LANES
    for bad, why in (("0", ">= 1"), ("many", "number of sequence slots"), ("-2", ">= 1")):
        with pytest.raises(UserError, match=why):
            lanes(bad)
    with pytest.raises(UserError, match="does not combine"):
        lanes("2", single=True)
    pooled = common.choose_lanes("auto", src, local, torch.bfloat16, 512, "int8", False, kv_tokens=128)
    assert pooled == common.AUTO_LANES
    kv = memory.estimate(src, local, torch.bfloat16, 512, "int8")[0].kv
    monkeypatch.setattr(memory, "host_available", lambda: 4 * kv * 2)  # room for two slots' KV in a quarter
    assert lanes("auto") == 2
    monkeypatch.setattr(memory, "host_available", lambda: kv)
    assert lanes("auto") == 1
