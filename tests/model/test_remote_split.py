"""Local + remote split (a spawned shard-worker process) == unsplit == local-only split:
greedy tokens, DFlash, prefix-cache hits and disk restore after restarting both sides."""
import pytest
import torch

from dflash_server.cache.disk import DiskCache
from dflash_server.engine.generate import Engine, GenerationRequest
from dflash_server.spec.proposer import DFlashProposer
from helpers.build import greedy, pipeline, prompt_ids

from .test_dflash import random_draft
from .test_disk_cache import chat_ids

PLACEMENTS = [["cpu", "remote:cpu"], ["cpu", "cpu", "remote:cpu"], ["cpu", "remote:cpu", "remote:cpu"]]


@pytest.fixture
def closing():
    pipes = []
    yield pipes.append
    for p in pipes:
        p.close()


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gemma3", "gemma4", "gemma4_e", "laguna"])
def test_remote_split_equals_unsplit_with_and_without_dflash(tiny_dir, family, closing):
    path = tiny_dir(family)
    ref_pipe = pipeline(path)
    ids = prompt_ids(ref_pipe, 40)
    ref = greedy(ref_pipe, ids, max_tokens=24, chunk=16)  # several prefill chunks cross the boundary
    n = ref_pipe.config.num_layers
    taps = (1, n - 2)  # one tap in the local group, one in the worker
    for devices in PLACEMENTS:
        pipe = pipeline(path, devices=devices)
        closing(pipe)
        assert type(pipe.stages[-1]).__name__ == "RemoteStage"
        assert greedy(pipe, ids, max_tokens=24, chunk=16) == ref, devices
        local = pipeline(path, stages=len(devices))
        assert greedy(local, ids, max_tokens=24, chunk=16) == ref
        for fast_head in (False, True):  # False: draft tokens projected by the worker's LM head
            prop = DFlashProposer(random_draft(pipe, block_size=4, taps=taps), pipe, fast_head=fast_head)
            eng = Engine(pipe, proposer=prop, chunk=16)
            res = eng.generate(GenerationRequest(tuple(ids), max_tokens=24, ignore_eos=True))
            assert res.token_ids == ref, (devices, fast_head)
            local_prop = DFlashProposer(random_draft(local, block_size=4, taps=taps), local, fast_head=fast_head)
            local_res = Engine(local, proposer=local_prop, chunk=16).generate(
                GenerationRequest(tuple(ids), max_tokens=24, ignore_eos=True))
            assert res.extra["spec"] == local_res.extra["spec"]  # same captures reach the draft


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gemma3", "gemma4", "gemma4_e", "laguna"])
def test_snapshots_stay_in_the_worker_and_round_trip(tiny_dir, family, closing):
    path = tiny_dir(family)
    pipe = pipeline(path, devices=["cpu", "remote:cpu"])
    closing(pipe)
    ids = prompt_ids(pipe, 30)
    pipe.prefill(ids[:20])
    pipe.snapshot_save(7)
    assert pipe.snapshot_nbytes(7) > 0
    exported = pipe.snapshot_export(7)
    assert any(k.startswith("ls1.") for k in exported) and any(k.startswith("ls0.") for k in exported)
    after = pipe.prefill(ids[20:], start=20).logits
    pipe.reset()
    pipe.snapshot_restore(7)
    assert pipe.length == 20
    assert (pipe.prefill(ids[20:], start=20).logits == after).all()
    pipe.snapshot_import(8, exported)  # as after a restart: export -> import -> restore
    pipe.reset()
    pipe.snapshot_restore(8)
    assert (pipe.prefill(ids[20:], start=20).logits == after).all()
    bad = dict(exported)
    bad.pop(next(k for k in bad if k.startswith("ls1.") and k != "ls1.length"))
    with pytest.raises(ValueError):
        pipe.snapshot_import(9, bad)
    # rollback across the split: verify-style forward, then keep only part of it
    pipe.reset()
    pipe.prefill(ids[:20])
    pipe.checkpoint()
    pipe.forward(ids[20:28], 20, logits="all")
    pipe.rollback(23)
    assert pipe.length == 23
    cont = pipe.prefill(ids[23:], start=23).logits
    pipe.reset()
    torch.testing.assert_close(pipe.prefill(ids).logits, cont, rtol=1e-4, atol=1e-4)  # other chunking


@pytest.mark.parametrize("draft", [False, True])
def test_prefix_hit_and_disk_restart_through_remote_split(tiny_dir, tmp_path, draft):
    path = tiny_dir("qwen3_5")

    def engine(slots, disk=True):
        pipe = pipeline(path, devices=["cpu", "remote:cpu"])
        prop = DFlashProposer(random_draft(pipe, block_size=4, seed=2, taps=(1, 4)), pipe) if draft else None
        return Engine(pipe, proposer=prop, prefix_slots=slots,
                      disk_cache=DiskCache(tmp_path, "fp", 1 << 30, 0) if disk else None)

    def run(eng, ids):
        return eng.generate(GenerationRequest(ids, max_tokens=6, ignore_eos=True))

    a = engine(4)
    first = run(a, chat_ids(a, [("Hi there", None)]))
    turn2 = chat_ids(a, [("Hi there", first.text), ("And then?", None)])
    warm = run(a, turn2)
    assert warm.extra["cache"] == "memory" and warm.cached_tokens > 0
    miss_engine = engine(0, disk=False)
    miss = run(miss_engine, turn2)
    miss_engine.close()
    assert miss.cached_tokens == 0 and miss.token_ids == warm.token_ids
    a.close()  # server and worker stop; snapshots (remote parts included) go to disk
    assert a.pipeline.stages[-1].health()["status"] == "stopped"
    b = engine(4)  # both restarted
    cold = run(b, turn2)
    assert cold.extra["cache"] == "disk" and cold.cached_tokens >= warm.cached_tokens
    assert cold.token_ids == warm.token_ids
    if draft:
        assert cold.extra["spec"] == warm.extra["spec"]
    b.close()


@pytest.mark.parametrize("policy", ["lru", "score"])
def test_kvflash_across_the_remote_split(tiny_dir, closing, policy):
    """Every stage runs its own pool: local + remote == local-only split with KV Flash, also
    once chunks are paged out (and == full KV while the context fits)."""
    from dflash_server.runtime.kv_pager import KvFlashConfig
    from dflash_server.runtime.pipeline import build_pipeline
    from dflash_server.runtime.placement import plan_placement
    from dflash_server.weights.loader import open_model

    path = tiny_dir("qwen3_5")
    src = open_model(path)
    kv = KvFlashConfig(128, chunk=16, policy=policy)

    def build(devices):
        return build_pipeline(src, plan_placement(src.config.num_layers, devices), dtype=torch.float32,
                              max_ctx=512, progress=False, kvflash=kv)
    remote, local = build(["cpu", "remote:cpu"]), build(["cpu", "cpu"])
    closing(remote)
    ids = prompt_ids(local, 40)
    assert greedy(remote, ids, max_tokens=30) == greedy(pipeline(path), ids, max_tokens=30)  # fits: == full KV
    long_ref = greedy(local, ids, max_tokens=150)
    assert greedy(remote, ids, max_tokens=150) == long_ref  # 190 positions > the pool of 128
    stats = remote.kvflash_stats()
    assert len(stats) == 2 and all(s["page_outs"] > 0 for s in stats)
    assert stats[0]["pool_tokens"] == stats[1]["pool_tokens"] == 128
    # DFlash on the pools: remote == local split, and == AR under lru (deferred evictions)
    def spec(pipe):
        prop = DFlashProposer(random_draft(pipe, block_size=4, taps=(1, 4)), pipe)
        return Engine(pipe, proposer=prop).generate(GenerationRequest(tuple(ids), max_tokens=150, ignore_eos=True))
    a, b = spec(remote), spec(local)
    assert a.token_ids == b.token_ids and a.extra["spec"] == b.extra["spec"]
    if policy == "lru":
        assert a.token_ids == long_ref
    # DDTree on the pools (the worker verifies trees over its pool too)
    def tree(pipe):
        prop = DFlashProposer(random_draft(pipe, block_size=6, taps=(1, 4)), pipe, tree_budget=8)
        return Engine(pipe, proposer=prop).generate(GenerationRequest(tuple(ids), max_tokens=150, ignore_eos=True))
    a, b = tree(remote), tree(local)
    assert a.token_ids == b.token_ids and a.extra["spec"] == b.extra["spec"] and a.extra["spec"]["tree_steps"] > 0
    if policy == "lru":
        assert a.token_ids == long_ref
    # a paged snapshot (rows, page table, policy state) exported from both sides and imported
    # back continues like the uninterrupted sequence
    remote.snapshot_save(1)
    exported, length = remote.snapshot_export(1), remote.length
    for part in ("ls0.kvflash_policy.", "ls1.kvflash_policy.", "ls1.kvflash_counters.", "ls1.kvflash_q."):
        assert any(k.startswith(part) for k in exported), part
    ref = remote.forward(ids[:8], length, logits="all").logits
    remote.reset()
    remote.snapshot_import(2, exported)
    remote.snapshot_restore(2)
    torch.testing.assert_close(remote.forward(ids[:8], length, logits="all").logits, ref, rtol=1e-5, atol=1e-5)


def test_draft_in_its_own_worker(tiny_dir, tmp_path, closing):
    """--draft-device remote:cpu: the draft runs in a shard worker; same tokens and
    acceptance as the in-process draft, with the target local or split across a worker;
    prefix-cache hits restore the draft context; a killed draft worker fails one request."""
    import json
    import os
    import signal

    from safetensors.torch import save_file

    from dflash_server.errors import ShardError
    from dflash_server.runtime.worker_link import RemoteOptions
    from dflash_server.spec.draft import DFlashDraft
    from dflash_server.spec.remote_draft import RemoteDraft

    path = tiny_dir("qwen3_5")
    local = pipeline(path)
    draft = random_draft(local, block_size=4, taps=(1, 4), seed=3)
    (tmp_path / "config.json").write_text(json.dumps(draft.cfg.to_dict()))
    # with a draft vocabulary: the worker hands it over and the proposer projects onto it locally
    vocab = torch.randperm(local.config.vocab_size, generator=torch.Generator().manual_seed(0))[:50].sort().values
    save_file({**draft.zlab_state_dict(), "vocab_ids": vocab}, str(tmp_path / "model.safetensors"))
    ids = prompt_ids(local, 30)

    def run(pipe, d, slots=0, prompt=ids):
        return Engine(pipe, proposer=DFlashProposer(d, pipe), prefix_slots=slots).generate(
            GenerationRequest(tuple(prompt), max_tokens=24, ignore_eos=True))
    ref = run(local, DFlashDraft.load(tmp_path, "cpu", torch.float32, local.max_ctx))
    for target in (local, pipeline(path, devices=["cpu", "remote:cpu"])):
        closing(target)
        rd = RemoteDraft(tmp_path, device="cpu", home="cpu", dtype=torch.float32, max_ctx=target.max_ctx,
                         options=RemoteOptions(timeout_s=5))
        closing(rd)
        assert torch.equal(rd.vocab_ids, vocab)
        got = run(target, rd)
        assert got.token_ids == ref.token_ids and got.extra["spec"] == ref.extra["spec"]
    # prefix cache: the draft context is exported from the worker and imported back on a hit
    eng = Engine(local, proposer=DFlashProposer(rd, local), prefix_slots=4)
    tok = eng.tokenizer
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    first = eng.generate(GenerationRequest(tuple(tok.encode_chat(msgs)), max_tokens=6, ignore_eos=True))
    msgs += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "More?"}]
    turn2 = tuple(tok.encode_chat(msgs))
    hit = eng.generate(GenerationRequest(turn2, max_tokens=6, ignore_eos=True))
    miss = run(pipeline(path), DFlashDraft.load(tmp_path, "cpu", torch.float32, local.max_ctx), prompt=turn2)
    assert hit.cached_tokens > 0 and hit.token_ids == miss.token_ids[:6] and hit.extra["spec"]["steps"] > 0
    os.kill(rd.link.proc.proc.pid, signal.SIGKILL)
    with pytest.raises(ShardError, match="draft"):
        eng.generate(GenerationRequest(tuple(ids), max_tokens=8, ignore_eos=True))
    assert eng.health()["status"] == "degraded" and eng.health()["stage"] == "draft"
    again = Engine(local, proposer=DFlashProposer(rd, local)).generate(
        GenerationRequest(tuple(ids), max_tokens=24, ignore_eos=True))
    assert again.token_ids == ref.token_ids and rd.link.restarts == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_remote_logits_are_bit_identical_to_local(tiny_dir, closing, dtype):
    """The worker sends the LM head's output in its own dtype (half the bytes in bf16) and
    the client widens it to fp32 exactly as a local last stage does. (fp32: to 1e-5, not bit
    for bit: aten's fp32 matmul of a few rows may block its sums differently from one process
    to the other when the machine is busy; seen once on an AMD Zen 4 VM under the parallel
    test run, never alone.)"""
    same = torch.equal if dtype == torch.bfloat16 else (lambda x, y: torch.allclose(x, y, rtol=0, atol=1e-5))
    path = tiny_dir("llama")
    ids = prompt_ids(pipeline(path), 20)
    local, remote = pipeline(path, stages=2, dtype=dtype), pipeline(path, devices=["cpu", "remote:cpu"], dtype=dtype)
    closing(remote)
    for pipe in (local, remote):
        pipe.reset()
    a, b = local.prefill(ids).logits, remote.prefill(ids).logits
    assert a.dtype == b.dtype == torch.float32 and same(a, b)
    a, b = local.forward(ids[:6], 20, logits="all").logits, remote.forward(ids[:6], 20, logits="all").logits
    assert a.shape == b.shape == (6, local.config.vocab_size) and same(a, b)
