"""Continuous batching: sequences that share the engine's steps give exactly what each
gives alone (the native kernels are row-invariant, so bit for bit in the default bf16 +
int8 configuration), whatever joins, leaves, stops or is cancelled next to them."""
from __future__ import annotations

import pytest
import torch

from dflash_server import kernels

from dflash_server.engine.generate import Engine, GenerationRequest
from dflash_server.engine.sampling import SamplingParams
from dflash_server.runtime.pipeline import build_pipeline
from dflash_server.runtime.placement import plan_placement
from dflash_server.spec.proposer import DFlashProposer
from dflash_server.weights.loader import open_model
from helpers.build import prompt_ids


def _pipe(path, lanes, stages=1, max_ctx=512):
    """``stages``: a count of local stages, "remote" (a local stage + a shard worker) or
    "pools" (one stage with KV Flash pools of 32 tokens in chunks of 4: prompts page)."""
    from dflash_server.runtime.kv_pager import KvFlashConfig

    src = open_model(path)
    devices = (["cpu", "remote:cpu"] if stages == "remote" else
               ["cpu"] if stages == "pools" else ["cpu"] * stages)
    shards = plan_placement(src.config.num_layers, devices, None)
    return build_pipeline(src, shards, dtype=torch.bfloat16, max_ctx=max_ctx, quantize="int8", progress=False,
                          lanes=lanes, kvflash=KvFlashConfig(32, chunk=4) if stages == "pools" else None)


def _req(ids, n=12, **kw):
    return GenerationRequest(tuple(ids), max_tokens=n, ignore_eos=True, **kw)


def _slots_of(eng) -> dict:
    """Record the slot each sequence prefilled in (a finished sequence's ``lane`` is None):
    {sequence id: slot}, filled as the engine runs."""
    got, started = {}, eng.scheduler.started

    def spy(seq):
        got[seq.id] = seq.lane
        started(seq)
    eng.scheduler.started = spy
    return got


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


@pytest.mark.parametrize("family,stages", [("llama", 1), ("llama", 2), ("qwen3_5", 1), ("gemma3", 1), ("gemma4_moe", 1), ("gemma4_e", 1), ("laguna", 1),
                                           ("llama", "remote")])
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


def test_a_burst_of_short_prompts_gets_first_tokens_in_one_step(tiny_dir):
    """Short prompts that arrive together are prefilled in the same step while its token
    budget lasts, the shortest first: every first token comes before anyone's next decode
    step (time to first token), a prompt past the budget continues in the next step, and
    outputs are as alone."""
    path = tiny_dir("llama")
    alone = Engine(_pipe(path, 1))
    eng = Engine(_pipe(path, 4), step_tokens=64)
    reqs = [_req(prompt_ids(alone.pipeline, 20, seed=s), 6) for s in (1, 2)] + \
        [_req(prompt_ids(alone.pipeline, 40, seed=3), 6), _req(prompt_ids(alone.pipeline, 10, seed=4), 6)]
    want = [alone.generate(r).token_ids for r in reqs]
    seqs, steps = _run_together(eng, reqs)
    assert [s.result.token_ids for s in seqs] == want
    # shortest first: step 0 forwards the 10-token prompt, the two of 20, then 14 tokens of the
    # 40-token one (the budget of 64); its rest in step 1, next to the others' decode rows
    assert steps[3][0] == steps[0][0] == steps[1][0] == 0 and steps[2][0] == 1
    assert steps[0][:2] == [0, 1] and eng.counters["prefill_tokens"] == 20 + 20 + 40 + 10


def test_a_short_prompt_does_not_wait_behind_a_long_one(tiny_dir):
    """A short prompt that arrives while a long one prefills (in pieces of the step budget,
    next to a running stream) gets its first token in the next step instead of after the
    whole long prompt; the long one is delayed by about that one forward; outputs as alone."""
    path = tiny_dir("llama")
    alone = Engine(_pipe(path, 1))
    eng = Engine(_pipe(path, 3), step_tokens=24)
    running = _req(prompt_ids(alone.pipeline, 6, seed=1), 40)
    long = _req(prompt_ids(alone.pipeline, 300, seed=3), 5)
    short = _req(prompt_ids(alone.pipeline, 9, seed=4), 5)
    want = [alone.generate(r).token_ids for r in (running, long, short)]
    seqs, steps = _run_together(eng, [running, long, short], when=[0, 1, 4])
    assert [s.result.token_ids for s in seqs] == want
    assert steps[2][0] == 4                   # the step it joined: no wait behind the long prompt
    assert steps[1][0] >= 1 + 300 // 23 and steps[1][0] <= 1 + 300 // 23 + 3
    assert all(k in steps[0] for k in range(1, steps[1][0]))   # the stream ran in every step


@pytest.mark.parametrize("draft", [None, "trees"])
def test_cancel_and_stop_string_next_to_others(tiny_dir, draft):
    """A cancelled sequence and one meeting a stop string beside a running one: each ends as
    alone, the others go on (``trees``: with DDTree verify of the batch)."""
    path = tiny_dir("llama")
    alone = Engine(_pipe(path, 1))
    pipe = _pipe(path, 3)
    eng = Engine(pipe, proposer=None if draft is None else
                 DFlashProposer(_draft_proposer(pipe).draft, pipe, tree_budget=6))
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
    if draft is not None:
        assert seqs[0].result.extra["spec"]["tree_steps"] > 0
        assert all(st.ckpt_length is None and st.tree is None for st in pipe.stages[0].lanes)


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


@pytest.mark.parametrize("trees", [False, True])
def test_prefix_cache_hits_with_a_draft_in_the_batch(tiny_dir, trees):
    """With a draft: a hit restores the draft context into the request's slot too; outputs
    equal those of plain decoding on an engine with the same cache (a hit prefills only the
    new turn, in smaller pieces than a miss would, so it is compared with a hit), and the
    cached tokens too; chains, and DDTrees verified in the batch."""
    path = tiny_dir("llama")
    plain, serial_pipe, pipe = Engine(_pipe(path, 1), prefix_slots=8), _pipe(path, 1), _pipe(path, 3)

    def proposer(p):
        return DFlashProposer(_draft_proposer(p).draft, p, tree_budget=6) if trees else _draft_proposer(p)
    serial = Engine(serial_pipe, prefix_slots=8, proposer=proposer(serial_pipe))
    eng = Engine(pipe, prefix_slots=8, proposer=proposer(pipe))
    tok = plain.tokenizer
    turn = [{"role": "system", "content": "You are a terse assistant who answers in one line. " * 3},
            {"role": "user", "content": "Hello there"}]
    warm = _req(tok.encode_chat(turn), 4)
    for e in (plain, serial, eng):
        answer = e.generate(warm).text
    turn.append({"role": "assistant", "content": answer})
    reqs = [_req(tok.encode_chat(turn + [{"role": "user", "content": q}]), 14)
            for q in ("What is two plus two?", "Name a color.", "Say hi.")]
    want = [serial.generate(r) for r in reqs]
    assert all(w.cached_tokens > 0 for w in want)
    assert [w.token_ids for w in want] == [plain.generate(r).token_ids for r in reqs]  # draft == no draft
    seqs, _ = _run_together(eng, reqs, when=[0, 1, 5])
    got = [s.result for s in seqs]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.cached_tokens for g in got] == [w.cached_tokens for w in want]
    assert any(g.extra["spec"]["steps"] > 0 for g in got)
    if trees:
        assert any(g.extra["spec"]["tree_steps"] > 0 for g in got)


@pytest.mark.parametrize("policy", ["lru", "score"])
def test_kvflash_pools_per_slot(tiny_dir, policy):
    """KV Flash with several slots: each has its own pool and page table; prompts longer
    than the pool page chunks in and out next to each other and give each one's solo output
    (the score policy: re-selecting every 8 tokens by what each slot's rows attended to)."""
    from dflash_server.runtime.kv_pager import KvFlashConfig

    path = tiny_dir("llama")

    def kv_pipe(lanes):
        src = open_model(path)
        return build_pipeline(src, plan_placement(src.config.num_layers, ["cpu"]), dtype=torch.float32,
                              max_ctx=512, progress=False, lanes=lanes,
                              kvflash=KvFlashConfig(96, chunk=16, policy=policy, tau=8))
    alone, eng = Engine(kv_pipe(1), chunk=64), Engine(kv_pipe(3), chunk=64)
    reqs = [_req(prompt_ids(alone.pipeline, n, seed=n), 30) for n in (150, 40, 210)]
    want = [alone.generate(r) for r in reqs]
    seqs, _ = _run_together(eng, reqs, when=[0, 1, 1])
    got = [s.result for s in seqs]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert got[2].extra["kvflash"]["page_outs"] > 0       # its own pool paged
    if policy == "score":
        assert got[2].extra["kvflash"]["reselects"] > 0
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

    def flaky(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected")
        return orig(*args, **kw)
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
    import argparse

    from dflash_server.cli import common
    from dflash_server.engine.config import EngineConfig
    from dflash_server.errors import UserError
    from dflash_server.runtime import memory
    from dflash_server.runtime.placement import ShardSpec

    src = open_model(tiny_dir("llama"))
    local, remote = [ShardSpec("cpu", 0, src.config.num_layers)], [ShardSpec("remote:cpu", 0, src.config.num_layers)]

    def lanes(flag, shards=local):
        return common.choose_lanes(flag, src, shards, torch.bfloat16, 512, "int8")
    assert lanes("3") == 3 and lanes("auto") == common.AUTO_LANES and lanes("2", remote) == 2
    assert lanes("auto", remote) == common.AUTO_LANES
    for bad, why in (("0", ">= 1"), ("many", "number of sequence slots"), ("-2", ">= 1")):
        with pytest.raises(ValueError, match=why):  # (the config parses --parallel; the CLI makes it a UserError)
            EngineConfig(parallel=bad)
        with pytest.raises(UserError, match=why):
            common.engine_config(argparse.Namespace(parallel=bad))
    pooled = common.choose_lanes("auto", src, local, torch.bfloat16, 512, "int8", kv_tokens=128)
    assert pooled == common.AUTO_LANES
    kv = memory.estimate(src, local, torch.bfloat16, 512, "int8")[0].kv
    monkeypatch.setattr(memory, "host_available", lambda: 4 * kv * 2)  # room for two slots' KV in a quarter
    assert lanes("auto") == 2
    monkeypatch.setattr(memory, "host_available", lambda: kv)
    assert lanes("auto") == 1


def _same_draft_contexts(eng, seqs, slots, contexts, late) -> int:
    """Each sequence's slot's draft context equals ``contexts[i]`` (what the sequence builds
    alone; to rounding: the fp32 draft's projections take other row counts when positions
    come in other pieces), except a slot the ``late`` sequence took over; returns how many
    were compared."""
    compared = 0
    for s, ctx in zip(seqs, contexts):
        if slots[s.id] == slots[late.id]:
            continue
        eng.proposer.select(slots[s.id])
        eng.proposer.flush()
        got = eng.proposer.draft.context_export()
        assert int(got["length"]) == int(ctx["length"])
        for k in ctx:
            if k != "length":
                torch.testing.assert_close(got[k], ctx[k], rtol=1e-4, atol=1e-5)
        compared += 1
    return compared


def _draft_proposer(pipe, adaptive=False, block=4):
    from dflash_server.spec.proposer import DFlashProposer
    from helpers.build import random_draft

    return DFlashProposer(random_draft(pipe, block=block), pipe, adaptive=adaptive)


@pytest.mark.parametrize("family,stages", [("llama", 1), ("llama", 2), ("qwen3_5", 1), ("llama", "remote")])
def test_draft_in_the_batch(tiny_dir, family, stages):
    """With a draft and several slots: a sequence decoding alone speculates, several decode
    in one batched forward that feeds each one's own draft context. Outputs equal plain
    decoding alone (greedy and sampled), and each slot's draft context holds what that
    sequence's context holds when it runs alone with the draft (to rounding: the fp32 draft's
    projections of context positions are not row-count invariant, and the positions come in
    other pieces in a batch)."""
    path = tiny_dir(family)
    plain = Engine(_pipe(path, 1, 2 if stages == "remote" else stages))
    solo_pipe = _pipe(path, 1, 2 if stages == "remote" else stages)
    solo = Engine(solo_pipe, proposer=_draft_proposer(solo_pipe))
    pipe = _pipe(path, 3, stages)
    eng = Engine(pipe, proposer=_draft_proposer(pipe, adaptive=True))
    try:
        reqs = [_req(prompt_ids(plain.pipeline, n, seed=n), m) for n, m in ((7, 6), (30, 26), (12, 9))]
        reqs.append(_req(prompt_ids(plain.pipeline, 9, seed=1), 8,
                         sampling=SamplingParams(temperature=0.9, top_p=0.9, seed=123)))
        want = [plain.generate(r).token_ids for r in reqs]
        contexts = []
        for r in reqs[:3]:
            assert solo.generate(r).token_ids == want[len(contexts)]
            solo.proposer.flush()
            contexts.append(solo.proposer.draft.context_export())
        slots = _slots_of(eng)
        seqs, _ = _run_together(eng, reqs, when=[0, 0, 0, 4])
        assert [s.result.token_ids for s in seqs] == want
        spec = seqs[1].result.extra["spec"]  # the longest: alone at its end, so it speculated
        assert spec["steps"] > 0 and spec["plain_steps"] > 0
        assert max(eng.batch_sizes) == 3
        assert _same_draft_contexts(eng, seqs[:3], slots, contexts, late=seqs[3]) == 2
        assert eng.proposer.sizer.requests.keys() <= {None}  # ended requests leave the sizer
    finally:
        eng.pipeline.close()
        eng.proposer.draft.close() if hasattr(eng.proposer.draft, "close") else None


def test_draft_in_a_worker_with_slots(tiny_dir, tmp_path):
    """A draft in its own worker process keeps one context per slot there (the slot travels
    with every draft operation)."""
    import json

    from safetensors.torch import save_file

    from dflash_server.runtime.worker_link import RemoteOptions
    from dflash_server.spec.proposer import DFlashProposer
    from dflash_server.spec.remote_draft import RemoteDraft

    path = tiny_dir("llama")
    plain = Engine(_pipe(path, 1))
    pipe = _pipe(path, 2)
    local = _draft_proposer(pipe).draft
    (tmp_path / "config.json").write_text(json.dumps(local.cfg.to_dict()))
    save_file(local.zlab_state_dict(), str(tmp_path / "model.safetensors"))
    rd = RemoteDraft(tmp_path, device="cpu", home="cpu", dtype=torch.float32, max_ctx=pipe.max_ctx,
                     options=RemoteOptions(timeout_s=10))
    try:
        eng = Engine(pipe, proposer=DFlashProposer(rd, pipe))
        reqs = [_req(prompt_ids(pipe, n, seed=n), m) for n, m in ((8, 5), (21, 16), (13, 11))]
        want = [plain.generate(r).token_ids for r in reqs]
        seqs, _ = _run_together(eng, reqs, when=[0, 0, 1])
        assert [s.result.token_ids for s in seqs] == want
        assert seqs[1].result.extra["spec"]["steps"] > 0
        lengths = {}
        for lane in (0, 1):
            rd.select(lane)
            eng.proposer.select(lane)
            eng.proposer.flush()
            lengths[lane] = rd.context.length
        # the two last sequences' slots: every position but the last token's (never forwarded)
        assert sorted(lengths.values()) == sorted(len(s.prompt) + len(s.result.token_ids) - 1 for s in seqs[1:])
    finally:
        rd.close()


class _LaneOracle:
    """Draft proposals per slot: slot 0 the target's own continuation (whole blocks accepted),
    slot 1 the same with its second draft wrong (one accepted), others the draft's own."""

    def __init__(self, proposer, texts: dict[int, list[int]]):
        self.p, self.texts, self.lane = proposer, texts, 0
        self._propose, self._select = proposer.propose, proposer.select
        proposer.propose, proposer.select = self.propose, self.select

    def select(self, lane):
        self.lane = lane
        self._select(lane)

    def propose(self, anchor, start, block):
        seq = self.texts.get(self.lane)
        if seq is None:
            return self._propose(anchor, start, block)
        out = [seq[start + 1 + i] if start + 1 + i < len(seq) else 0 for i in range(block - 1)]
        if self.lane == 1 and len(out) > 1:
            out[1] = (out[1] + 1) % self.p.pipeline.config.vocab_size
        return out


@pytest.mark.parametrize("family,stages", [("llama", 1), ("llama", 2), ("llama", "remote"), ("qwen3_5", 1),
                                           ("qwen3_5", "remote"), ("llama", "pools"), ("qwen3_5", "pools")])
def test_verify_blocks_of_several_sequences_in_one_forward(tiny_dir, family, stages):
    """With a draft, the running sequences' verify blocks go through one forward (a slot's
    rows at consecutive positions, each slot rolled back on its own: KV cropped, Gated
    DeltaNet state replayed; with KV Flash pools each slot's block is its own forward and a
    rollback gives back what the block paged): outputs equal plain decoding alone (greedy,
    and a seeded sampled request, whose drafts are kept where they equal its own draws),
    whole blocks are accepted where the draft is right, and each slot's draft context holds
    what the sequence's does alone."""
    path = tiny_dir(family)
    plain = Engine(_pipe(path, 1, 2 if stages == "remote" else stages))
    solo_pipe = _pipe(path, 1, 2 if stages == "remote" else stages)
    solo = Engine(solo_pipe, proposer=_draft_proposer(solo_pipe))
    pipe = _pipe(path, 3, stages)
    assert pipe.supports_ragged
    eng = Engine(pipe, proposer=_draft_proposer(pipe))            # a fixed block of 4
    reqs = [_req(prompt_ids(plain.pipeline, n, seed=n), m) for n, m in ((7, 18), (30, 15), (12, 9))]
    reqs.append(_req(prompt_ids(plain.pipeline, 9, seed=1), 12,
                     sampling=SamplingParams(temperature=0.9, top_p=0.9, seed=123)))
    want = [plain.generate(r).token_ids for r in reqs]
    _LaneOracle(eng.proposer, {lane: list(reqs[lane].prompt_ids) + want[lane] for lane in (0, 1)})
    calls = []
    forward_rows = pipe.forward_rows
    pipe.forward_rows = lambda toks, lanes, pos, **kw: calls.append(list(lanes)) or forward_rows(toks, lanes, pos, **kw)
    contexts = []
    for r in reqs[:3]:
        assert solo.generate(r).token_ids == want[len(contexts)]
        solo.proposer.flush()
        contexts.append(solo.proposer.draft.context_export())
    try:
        slots = _slots_of(eng)
        seqs, _ = _run_together(eng, reqs, when=[0, 0, 0, 4])
        assert [slots[s.id] for s in seqs[:3]] == [0, 1, 2]   # the oracle's slots
        assert [s.result.token_ids for s in seqs] == want
        # several slots' blocks in one forward
        assert any(len(set(c)) > 1 and len(c) > len(set(c)) for c in calls)
        s0, s1 = (s.result.extra["spec"] for s in seqs[:2])
        assert s0["accept_histogram"][3] >= 3 and s0["accept_histogram"][3] == s0["steps"] - sum(
            s0["accept_histogram"][:3])
        assert s1["accept_histogram"][1] >= 3 and s1["accept_histogram"][2:] == [0, 0]
        assert _same_draft_contexts(eng, seqs[:3], slots, contexts, late=seqs[3]) == 2
        assert [st.ckpt_length for st in pipe.stages[0].lanes] == [None] * 3
        if stages == "pools":
            assert seqs[1].result.extra["kvflash"]["page_outs"] > 0
    finally:
        pipe.close()
        solo_pipe.close()


class _LaneOracleTrees(DFlashProposer):
    """Tree drafts per slot: slots in ``texts`` put the target's own continuation first at
    every depth (slot 1: behind a likelier wrong first branch, so its best path is not the
    first branch); other slots the random draft's own."""

    def __init__(self, draft, pipe, texts, **kw):
        super().__init__(draft, pipe, **kw)
        self.texts = texts

    def _draft_logits(self, anchor, start, block):
        seq = self.texts.get(self._lane)
        if seq is None:
            return super()._draft_logits(anchor, start, block)
        V = self.pipeline.config.vocab_size
        out = torch.full((block - 1, V), -30.0)
        for i in range(block - 1):
            right = seq[start + 1 + i] if start + 1 + i < len(seq) else 0
            out[i, right] = 10.0
            if i == 0 and self._lane == 1:
                out[i, right], out[i, (right + 1) % V] = 4.9, 5.0
        return out


@pytest.mark.parametrize("family,stages", [("llama", 1), ("llama", 2), ("llama", "remote"), ("qwen3_5", 1),
                                           ("qwen3_5", "remote"), ("llama", "pools"), ("qwen3_5", "pools")])
def test_trees_of_several_sequences_in_one_forward(tiny_dir, family, stages):
    """With DDTree verify, the running sequences' trees go through one forward (a slot's tree
    rows beside other slots' rows, each slot keeping its own path: KV moved down, Gated
    DeltaNet state of the path's last node; with KV Flash pools each slot's tree is its own
    forward): outputs equal plain decoding alone (greedy, and a seeded sampled request whose
    tree keeps the children equal to its own draws), an oracle slot accepts its trees' full
    depth, and one whose right path sits behind a likelier wrong first branch does too."""
    path = tiny_dir(family)
    plain = Engine(_pipe(path, 1, 2 if stages == "remote" else stages))
    pipe = _pipe(path, 3, stages)
    assert pipe.supports_tree_rows
    reqs = [_req(prompt_ids(plain.pipeline, n, seed=n), m) for n, m in ((7, 18), (30, 15), (12, 9))]
    reqs.append(_req(prompt_ids(plain.pipeline, 9, seed=1), 12,
                     sampling=SamplingParams(temperature=0.9, top_p=0.9, seed=123)))
    want = [plain.generate(r).token_ids for r in reqs]
    draft = _draft_proposer(pipe).draft
    eng = Engine(pipe, proposer=_LaneOracleTrees(draft, pipe, {lane: list(reqs[lane].prompt_ids) + want[lane]
                                                               for lane in (0, 1)}, tree_budget=8))
    assert eng.proposer.uses_tree(pipe)
    trees = []
    forward_rows = pipe.forward_rows
    pipe.forward_rows = lambda toks, lanes, pos, **kw: trees.append(kw.get("trees") or {}) or forward_rows(
        toks, lanes, pos, **kw)
    try:
        slots = _slots_of(eng)
        seqs, _ = _run_together(eng, reqs, when=[0, 0, 0, 4])
        assert [slots[s.id] for s in seqs[:3]] == [0, 1, 2]
        assert [s.result.token_ids for s in seqs] == want
        assert any(len(t) >= 2 for t in trees)              # several slots' trees in one forward
        for s in seqs[:2]:
            spec = s.result.extra["spec"]
            assert spec["tree_steps"] > 0
            if stages != "pools":   # (a pool's chunk of 4 rows caps a tree at 3 nodes)
                assert spec["accept_histogram"][3] >= 3      # all 3 levels of a tree accepted
        assert [st.ckpt_length for st in pipe.stages[0].lanes] == [None] * 3
        assert all(st.tree is None for st in pipe.stages[0].lanes)
        if stages == "pools":
            assert seqs[1].result.extra["kvflash"]["page_outs"] > 0
    finally:
        pipe.close()
        plain.pipeline.close()


def test_no_trees_in_the_batch_for_a_worker_that_does_not_say_so(tiny_dir):
    """A shard worker reports ``can_tree_rows`` at load; one that does not (an older worker)
    gets no trees in a rows forward: with --ddtree its sequences decode plain rows together
    (and a sequence alone still verifies its tree), with the same outputs."""
    path = tiny_dir("llama")
    plain = Engine(_pipe(path, 1, 2))
    pipe = _pipe(path, 3, "remote")
    try:
        remote = pipe.stages[-1]
        assert remote.can_tree_rows and pipe.supports_tree_rows
        remote.link.setup_results[0].pop("can_tree_rows")
        assert not pipe.supports_tree_rows and pipe.supports_tree
        eng = Engine(pipe, proposer=DFlashProposer(_draft_proposer(pipe).draft, pipe, tree_budget=6))
        assert not eng.proposer.batch_verify(pipe)
        trees = []
        forward_rows = pipe.forward_rows
        pipe.forward_rows = lambda toks, lanes, pos, **kw: trees.append(kw.get("trees")) or forward_rows(
            toks, lanes, pos, **kw)
        reqs = [_req(prompt_ids(plain.pipeline, n, seed=n), m) for n, m in ((7, 10), (12, 24))]
        seqs, _ = _run_together(eng, reqs)
        assert [s.result.token_ids for s in seqs] == [plain.generate(r).token_ids for r in reqs]
        assert trees and not any(trees)                    # rows forwards, never with trees
        assert seqs[1].result.extra["spec"]["tree_steps"] > 0   # alone after the first ended
    finally:
        pipe.close()


def test_adaptive_tree_budgets_in_the_batch(tiny_dir):
    """--ddtree with the adaptive sizer and several sequences: the batch sizer chooses each
    step's trees together (budgets the TreeSizer measures, 0 a plain row), outputs equal
    plain decoding alone."""
    path = tiny_dir("qwen3_5")
    plain = Engine(_pipe(path, 1))
    pipe = _pipe(path, 3)
    eng = Engine(pipe, proposer=DFlashProposer(_draft_proposer(pipe, block=5).draft, pipe, tree_budget=8,
                                               adaptive=True))
    assert eng.proposer.batch_sizer is not None and eng.proposer.batch_sizer.blocks is eng.proposer.sizer
    reqs = [_req(prompt_ids(plain.pipeline, n, seed=n), 30) for n in (7, 19, 12)]
    reqs.append(_req(prompt_ids(plain.pipeline, 9, seed=1), 20,
                     sampling=SamplingParams(temperature=1.0, seed=5)))
    want = [plain.generate(r).token_ids for r in reqs]
    seqs, _ = _run_together(eng, reqs, when=[0, 0, 0, 3])
    assert [s.result.token_ids for s in seqs] == want
    assert len(eng.proposer.batch_sizer.cost) >= 2          # totals measured: plain rows and more
    assert sum(s.result.extra["spec"]["tree_steps"] for s in seqs) > 0


@pytest.mark.parametrize("sliding,quantize", [(False, "dense"), (True, "dense"), (False, "int8")])
def test_one_draft_pass_for_several_sequences(tiny_dir, sliding, quantize):
    """``draft_ahead``: the blocks of several slots (contexts of different lengths) drafted
    in one pass give each what its own pass gives (hidden states and logits, to fp32
    rounding: the projections take other row counts; with int8 linears the native pass, bit
    for bit), a causal sliding-window layer included; ``propose`` takes the result once, and
    what is left is dropped."""
    from dflash_server.spec.config import DraftConfig
    from dflash_server.spec.draft import DFlashDraft
    from dflash_server.spec.proposer import DFlashProposer

    pipe = _pipe(tiny_dir("llama"), 3)
    c = pipe.config
    cfg = DraftConfig(hidden_size=c.hidden_size, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, block_size=6, mask_token_id=5, target_layer_ids=(0, 1),
                      num_target_layers=c.num_layers,
                      layer_attention=((True, 5), (False, None)) if sliding else ())
    draft = DFlashDraft(cfg, DFlashDraft.random_tensors(cfg, 3, 0.05), "cpu", torch.float32, pipe.max_ctx,
                        quantize=quantize)
    prop = DFlashProposer(draft, pipe)
    native = quantize == "int8" and kernels.enabled() and kernels.load()
    g = torch.Generator().manual_seed(0)
    items = [(0, 17, 9, 6), (2, 40, 23, 3), (1, 8, 4, 5)]     # (slot, anchor, start, block)
    for lane, _, start, _ in items:
        prop.select(lane)
        prop.add_context({t: torch.randn(1, start, c.hidden_size, generator=g) for t in (0, 1)}, 0)
    alone = {}
    for lane, anchor, start, block in items:
        prop.select(lane)
        alone[lane] = prop._draft_hidden_logits(anchor, start, block)
    prop.draft_ahead(items)
    assert prop._lane == 1 and draft.context is draft.contexts[1]
    for lane, anchor, start, block in items:
        prop.select(lane)
        h, lg = prop._ahead[(lane, anchor, start, block)]
        assert h.shape == (block - 1, c.hidden_size)
        if native:
            assert torch.equal(h, alone[lane][0]) and torch.equal(lg, alone[lane][1])
        torch.testing.assert_close(h, alone[lane][0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(lg, alone[lane][1], rtol=1e-4, atol=1e-4)
        assert prop.propose(anchor, start, block) == lg.float().argmax(-1).tolist()
        assert (lane, anchor, start, block) not in prop._ahead           # taken once
    prop.draft_ahead(items[:2])
    prop.draft_ahead([])
    assert prop._ahead == {}
    assert draft._native_layers is native


def _two_layer_draft(c):
    """A seeded 2-layer draft (config, tensors) tapping layers 0 and 1 of the target config ``c``."""
    from dflash_server.spec.config import DraftConfig
    from dflash_server.spec.draft import DFlashDraft

    cfg = DraftConfig(hidden_size=c.hidden_size, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, block_size=6, mask_token_id=5, target_layer_ids=(0, 1), num_target_layers=c.num_layers)
    return cfg, DFlashDraft.random_tensors(cfg, 3, 0.05)


@pytest.mark.parametrize("quantize", ["dense", "int8"])
def test_deferred_contexts_of_several_slots_append_in_one_call(tiny_dir, quantize):
    """``draft_ahead`` first appends every drafting slot's deferred context (features of
    plain rows, each slot's own positions) in one ``append_contexts`` call: each slot's
    context K/V equal what its own ``append_context`` writes (bit for bit with native int8
    linears, to fp32 rounding dense), lengths follow, slots without pending features are
    untouched, the selected slot stays selected; and hostile starts are refused."""
    from dflash_server.spec.draft import DFlashDraft
    from dflash_server.spec.proposer import DFlashProposer

    pipe = _pipe(tiny_dir("llama"), 4)
    c = pipe.config
    cfg, tensors = _two_layer_draft(c)
    g = torch.Generator().manual_seed(2)
    feats = {lane: {t: torch.randn(1, n, c.hidden_size, generator=g) for t in (0, 1)}
             for lane, n in ((0, 12), (1, 7), (2, 20), (3, 5))}
    split = {0: 9, 1: 3, 2: 20, 3: 2}     # positions appended at once; the rest deferred one row at a time
    drafts = []
    for batched in (False, True):
        draft = DFlashDraft(cfg, tensors, "cpu", torch.float32, pipe.max_ctx, quantize=quantize)
        prop = DFlashProposer(draft, pipe)
        for lane, f in feats.items():
            prop.select(lane)
            prop.add_context({t: x[:, :split[lane]] for t, x in f.items()}, 0)
            for p in range(split[lane], f[0].shape[1]):
                prop.add_context({t: x[:, p:p + 1] for t, x in f.items()}, p, defer=True)
        prop.select(3)
        if batched:
            prop.flush_lanes([0, 1, 2])
            assert prop._lane == 3 and draft.context is draft.contexts[3] and prop._pendings[3]
        else:
            for lane in (0, 1, 2):
                prop.select(lane)
                prop.flush()
        drafts.append(draft)
    for lane in (0, 1, 2):
        a, b = drafts[0].contexts[lane], drafts[1].contexts[lane]
        assert a.length == b.length == feats[lane][0].shape[1]
        for x, y in zip(a.k + a.v, b.k + b.v):
            if quantize == "int8" and kernels.enabled() and kernels.load():
                assert torch.equal(x[:, :, :a.length], y[:, :, :a.length])
            torch.testing.assert_close(x[:, :, :a.length], y[:, :, :a.length], rtol=1e-5, atol=1e-6)
    assert drafts[1].contexts[3].length == split[3]              # its pending rows wait
    draft = drafts[1]
    bad = torch.zeros(1, 2, 2 * c.hidden_size)
    for items in ([(0, bad, 13)], [(0, bad, 2), (1, bad, 99)], [(1, bad, pipe.max_ctx - 1), (0, bad, 0)]):
        with pytest.raises(ValueError, match="draft context"):
            draft.append_contexts(items)


def test_a_batched_steps_rows_defer_as_each_slots_own_adds(tiny_dir):
    """``add_rows`` (a batched plain step's rows handed over in one call) leaves each slot's
    deferred rows and, once flushed, its draft context exactly as one ``add_context(...,
    defer=True)`` per row does; a row that does not continue its slot's pending ones (a slot
    whose context moved) is appended at once as there; the selected slot is unchanged."""
    from dflash_server.spec.draft import DFlashDraft
    from dflash_server.spec.proposer import DFlashProposer

    pipe = _pipe(tiny_dir("llama"), 3)
    c = pipe.config
    cfg, tensors = _two_layer_draft(c)
    g = torch.Generator().manual_seed(5)
    steps = [{t: torch.randn(1, 3, c.hidden_size, generator=g) for t in (0, 1)} for _ in range(6)]
    lanes = [0, 1, 2]
    positions = [[4 + i, 9 + i, 2 + i if i < 3 else i] for i in range(6)]   # slot 2 rolled back at step 3
    props = []
    for batched in (False, True):
        draft = DFlashDraft(cfg, tensors, "cpu", torch.float32, pipe.max_ctx)
        prop = DFlashProposer(draft, pipe)
        for lane, n in zip(lanes, (4, 9, 2)):
            prop.select(lane)
            prop.add_context({t: torch.ones(1, n, c.hidden_size) * (lane + t) for t in (0, 1)}, 0)
        prop.select(1)
        for caps, pos in zip(steps, positions):
            if batched:
                prop.add_rows(caps, lanes, pos)
            else:
                for b, lane in enumerate(lanes):
                    prop.select(lane)
                    prop.add_context({t: x[:, b:b + 1] for t, x in caps.items()}, pos[b], 1, defer=True)
                prop.select(1)
        assert prop._lane == 1 and draft.context is draft.contexts[1]
        props.append(prop)
    a, b = props
    for lane in lanes:
        pa, pb = a._pendings[lane], b._pendings[lane]
        assert [s for s, _ in pa] == [s for s, _ in pb] and len(pa) == (6 if lane < 2 else 2)
        assert all(torch.equal(x, y) for (_, x), (_, y) in zip(pa, pb))
        for p in props:
            p.select(lane)
            p.flush()
        ca, cb = a.draft.contexts[lane], b.draft.contexts[lane]
        assert ca.length == cb.length
        assert all(torch.equal(x[:, :, :ca.length], y[:, :, :ca.length]) for x, y in zip(ca.k + ca.v, cb.k + cb.v))


def test_native_draft_pass_matches_the_torch_pass(tiny_dir):
    """A draft with native linears drafts through ``DraftLayer.forward_native`` (one QKV
    matmul, the block's K/V written after the context in its cache, bidirectional attention
    in ``dflash::attention_step``): the same hidden states and logits as the per-op pass to
    rounding, the same proposals; the context's length is unchanged and a longer context
    appended over the rows the block wrote gives what a fresh draft gives."""
    from dflash_server.spec.draft import DFlashDraft
    from dflash_server.spec.proposer import DFlashProposer

    if not (kernels.enabled() and kernels.load()):
        pytest.skip("no native kernels on this machine")
    pipe = _pipe(tiny_dir("llama"), 1)
    c = pipe.config
    cfg, tensors = _two_layer_draft(c)
    g = torch.Generator().manual_seed(1)
    feats = {t: torch.randn(1, 30, c.hidden_size, generator=g) for t in (0, 1)}
    props = []
    for native in (False, True):
        draft = DFlashDraft(cfg, tensors, "cpu", torch.float32, pipe.max_ctx, quantize="int8")
        draft._native_layers = None if native else False     # None: decided (native here) at the first pass
        prop = DFlashProposer(draft, pipe)
        prop.add_context({t: f[:, :20] for t, f in feats.items()}, 0)
        out = [prop._draft_hidden_logits(17, 20, 6), prop.propose(17, 20, 6)]
        assert draft.context.length == 20
        prop.add_context({t: f[:, 20:] for t, f in feats.items()}, 20)   # over the block's rows
        out.append(prop._draft_hidden_logits(9, 30, 4))
        assert draft._native_layers is native
        props.append(out)
    (h0, l0), p0, (h2, l2) = props[0]
    (h1, l1), p1, (h3, l3) = props[1]
    torch.testing.assert_close(h1, h0, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(l1, l0, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(h3, h2, rtol=2e-3, atol=2e-3)
    assert p1 == p0


@pytest.mark.parametrize("where", ["forward", "draft", "commit"])
@pytest.mark.parametrize("family,trees", [("llama", False), ("qwen3_5", True)])
def test_a_failure_in_a_batched_verify_ends_only_its_sequences(tiny_dir, monkeypatch, where, family, trees):
    """Several sequences verifying their blocks (or DDTrees) in one forward: a failing forward
    fails them all, a failing draft pass or commit only its own sequence; every checkpoint
    they held is dropped, and the slots then serve new requests exactly as plain decoding
    alone."""
    path = tiny_dir(family)
    plain = Engine(_pipe(path, 1))
    pipe = _pipe(path, 3)
    eng = Engine(pipe, proposer=DFlashProposer(_draft_proposer(pipe).draft, pipe, tree_budget=6 if trees else 0))
    assert eng.proposer.uses_tree(pipe) == trees
    reqs = [_req(prompt_ids(pipe, n, seed=n), 12) for n in (6, 9, 11)]
    seqs = [eng.submit(r) for r in reqs]
    while any(s.phase != "decode" for s in seqs):
        eng.step()
    victim = seqs[1]
    if where == "forward":
        orig = pipe.forward_rows
        monkeypatch.setattr(pipe, "forward_rows", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected")))
    elif where == "draft":
        name = "propose_tree" if trees else "propose"
        orig = getattr(eng.proposer, name)

        def propose(anchor, start, *a):
            if eng.proposer._lane == victim.lane:
                raise RuntimeError("injected")
            return orig(anchor, start, *a)
        monkeypatch.setattr(eng.proposer, name, propose)
        monkeypatch.setattr(eng.proposer, "draft_ahead", lambda items: None)   # each drafts on its own
    else:
        orig = victim.commit

        def commit(logits):
            raise RuntimeError("injected")
        monkeypatch.setattr(victim, "commit", commit)
    eng.step()
    failed = [s for s in seqs if isinstance(s.error, RuntimeError)]
    assert failed == (seqs if where == "forward" else [victim])
    assert all(st.ckpt_length is None and st.tree is None for st in pipe.stages[0].lanes)
    monkeypatch.undo()
    while eng.has_work:
        eng.step()
    for s, r in zip(seqs, reqs):
        if s not in failed:
            assert s.result.token_ids == plain.generate(r).token_ids
    more = [_req(prompt_ids(pipe, n, seed=n + 40), 10) for n in (7, 13, 8)]
    again = [eng.submit(r) for r in more]
    while eng.has_work:
        eng.step()
    assert [s.result.token_ids for s in again] == [plain.generate(r).token_ids for r in more]
    assert eng.scheduler.free == [0, 1, 2]


def test_a_request_may_turn_the_draft_off(tiny_dir):
    """``speculate=False``: the sequence decodes plainly (no verify step), alone and as a row
    of a batch where the others verify their blocks; every output as plain decoding alone."""
    path = tiny_dir("llama")
    plain = Engine(_pipe(path, 1))
    pipe = _pipe(path, 3)
    eng = Engine(pipe, proposer=_draft_proposer(pipe))                  # a fixed block of 4
    ids = [prompt_ids(pipe, n, seed=n) for n in (8, 12, 10)]
    alone = eng.generate(_req(ids[0], 10, speculate=False))
    assert alone.token_ids == plain.generate(_req(ids[0], 10)).token_ids
    assert alone.extra["spec"]["steps"] == 0 and alone.extra["spec"]["plain_steps"] > 0
    reqs = [_req(ids[0], 14, speculate=False), _req(ids[1], 14), _req(ids[2], 14)]
    seqs, _ = _run_together(eng, reqs)
    assert [s.result.token_ids for s in seqs] == [plain.generate(r).token_ids for r in reqs]
    spec = [s.result.extra["spec"] for s in seqs]
    assert spec[0]["steps"] == 0 and spec[1]["steps"] > 0 and spec[2]["steps"] > 0
