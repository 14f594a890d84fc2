"""The CUDA path: the equivalences of the CPU suite, on a GPU (skipped where there is none;
run by benchmarks/gpu_check.sh on a machine lent one). A GPU's kernels are not row-invariant
(cuBLAS picks a kernel by shape), so logits are compared with a tolerance and token streams
exactly (float32, seeded tiny models: no near-ties in 40 greedy steps)."""
from __future__ import annotations

import pytest
import torch

from dflash_server.cache.disk import DiskCache
from dflash_server.engine.generate import Engine, GenerationRequest
from dflash_server.layers.linear import Linear
from dflash_server.runtime.kv_pager import KvFlashConfig
from dflash_server.runtime.pipeline import build_pipeline
from dflash_server.runtime.placement import plan_placement
from dflash_server.spec.draft import DFlashDraft
from dflash_server.spec.proposer import DFlashProposer
from dflash_server.weights.loader import open_model
from helpers.build import pipeline, prompt_ids, start_slots

from .test_dflash import random_draft

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
GPU = "cuda:0"


def gpu_draft(pipe, block_size=4, seed=1):
    d = random_draft(pipe, block_size=block_size, seed=seed)
    return DFlashDraft(d.cfg, DFlashDraft.random_tensors(d.cfg, seed, 0.05), GPU, torch.float32, pipe.max_ctx)


def gen(pipe, ids, n=40, proposer=None, **kw):
    return Engine(pipe, proposer=proposer, chunk=64, **kw).generate(
        GenerationRequest(tuple(ids), max_tokens=n, ignore_eos=True))


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5", "gemma3", "laguna"])
def test_forward_and_greedy_match_cpu(tiny_dir, family):
    cpu, gpu = pipeline(tiny_dir(family)), pipeline(tiny_dir(family), devices=[GPU])
    ids = prompt_ids(cpu, 50)
    for p in (cpu, gpu):
        p.reset()
    la = cpu.forward(ids, 0, logits="all").logits.float().cpu()
    lb = gpu.forward(ids, 0, logits="all").logits.float().cpu()
    assert (la - lb).abs().max() <= 1e-3 * la.abs().max()
    assert gen(gpu, ids).token_ids == gen(cpu, ids).token_ids


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_dflash_and_ddtree_lossless(tiny_dir, family):
    pipe = pipeline(tiny_dir(family), devices=[GPU])
    ids = prompt_ids(pipe, 30)
    ref = gen(pipe, ids).token_ids
    for block in (2, 4, 8):
        res = gen(pipe, ids, proposer=DFlashProposer(gpu_draft(pipe, 8), pipe, block_size=block))
        assert res.token_ids == ref and res.extra["spec"]["steps"] > 0, block
    tree = gen(pipe, ids, proposer=DFlashProposer(gpu_draft(pipe, 6), pipe, tree_budget=12))
    assert tree.token_ids == ref


def test_ddtree_with_a_draft_vocabulary(tiny_dir):
    """A draft with its own vocabulary (the shipped draft's kind) under DDTree: its token map
    stays on the CPU while the tree's ids come from the GPU (this crashed in the first GPU check)."""
    pipe = pipeline(tiny_dir("llama"), devices=[GPU])
    ids = prompt_ids(pipe, 30)
    ref = gen(pipe, ids).token_ids
    d = gpu_draft(pipe, 6)
    vocab = torch.unique(torch.cat([torch.arange(0, pipe.config.vocab_size, 3), torch.tensor(ref[:10])]))
    draft = DFlashDraft(d.cfg, {**d.zlab_state_dict(), "vocab_ids": vocab}, GPU, torch.float32, pipe.max_ctx)
    for kw in ({"tree_budget": 12}, {"block_size": 4}):
        res = gen(pipe, ids, proposer=DFlashProposer(draft, pipe, **kw))
        assert res.token_ids == ref and res.extra["spec"]["steps"] > 0, kw


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_cuda_graphs_equal_eager(tiny_dir, family):
    """Recorded decode steps (runtime.cuda_graph) against the eager step, fp32: logits close
    over 300 steps (spans 256 and 512, each recorded once), outputs not overwritten by later
    replays, the same greedy tokens, DFlash lossless with graphs for its plain steps and its
    verify blocks of 2, 4 and 8 rows (gemma3: sliding windows)."""
    path = tiny_dir(family)
    eager, graph = pipeline(path, devices=[GPU]), pipeline(path, devices=[GPU])
    st = graph.stages[0]
    assert st.use_cuda_graphs() is None
    ids = prompt_ids(eager, 30)
    for p in (eager, graph):
        p.reset()
        p.forward(ids, 0, logits="last")
    tok, kept = 7, []
    for i in range(300):
        a = eager.forward([tok], len(ids) + i, logits="last")
        b = graph.forward([tok], len(ids) + i, logits="last")
        assert st._graphs is not None, "recording failed (see the warning)"
        assert torch.allclose(a.logits, b.logits, atol=1e-3, rtol=1e-3), i
        kept.append((b.logits, b.logits.clone()))
        tok = int(a.logits[-1].argmax())
    assert all(torch.equal(x, y) for x, y in kept)
    assert st._graphs.recorded == 2 and st._graphs.replays == 300
    assert graph.cuda_graph_stats() == {GPU: {"recorded": 2, "replays": 300}} and eager.cuda_graph_stats() == {GPU: None}
    ref = gen(eager, ids).token_ids
    assert gen(graph, ids).token_ids == ref
    assert st._graphs.recorded == 2
    for block in (2, 4, 8):   # verify blocks: a graph per block size
        prop = DFlashProposer(gpu_draft(graph, 8), graph, block_size=block)
        res = gen(graph, ids, proposer=prop)
        assert res.token_ids == ref and res.extra["spec"]["steps"] > 0, block
    assert st._graphs is not None and {t for _, _, t in st._graphs.graphs} >= {1, 2, 4, 8}


def test_cuda_graphs_for_rows_of_several_slots(tiny_dir):
    """Decode rows of several slots (continuous batching) through recorded graphs, fp32: each
    row's logits as the eager rows forward's for changing sets and orders of slots, the KV
    banks equal after, outputs not overwritten by later replays."""
    path = tiny_dir("llama")
    eager, graph = pipeline(path, devices=[GPU], lanes=4), pipeline(path, devices=[GPU], lanes=4)
    st = graph.stages[0]
    assert st.use_cuda_graphs() is None
    prompts = [prompt_ids(eager, n, seed=n) for n in (5, 17, 9, 12)]
    pos, toks = start_slots((eager, graph), prompts)
    kept = []
    for step in range(40):
        active = ([0, 1, 2, 3], [2, 0], [1, 2], [3, 1, 0])[step % 4]
        a = eager.forward_rows([toks[i] for i in active], active, [pos[i] for i in active])
        b = graph.forward_rows([toks[i] for i in active], active, [pos[i] for i in active])
        assert st._graphs is not None, "recording failed (see the warning)"
        assert torch.allclose(a.logits, b.logits, atol=1e-3, rtol=1e-3), (step, active)
        kept.append((b.logits, b.logits.clone()))
        for r, i in enumerate(active):
            toks[i] = int(a.logits[r].argmax())
            pos[i] += 1
    assert all(torch.equal(x, y) for x, y in kept)
    for be, bg in zip(eager.stages[0].banks, st.banks):
        assert torch.allclose(be.k, bg.k, atol=1e-4) and torch.allclose(be.v, bg.v, atol=1e-4)
    assert st._graphs.recorded == 4 and st._graphs.replays == 40


def test_cuda_graphs_on_a_gated_deltanet_model(tiny_dir):
    """Qwen3.5 on the GPU with graphs, fp32: single-token steps recorded with the recurrent
    state updated in place (the warm-ups' updates put back), the same greedy tokens as without
    graphs; with DFlash (verify blocks eager, the state rebound, then copied back onto the
    pinned tensors) still lossless."""
    path = tiny_dir("qwen3_5")
    eager, graph = pipeline(path, devices=[GPU]), pipeline(path, devices=[GPU])
    assert graph.use_cuda_graphs() == {GPU: None}
    ids = prompt_ids(eager, 30)
    ref = gen(eager, ids).token_ids
    assert gen(graph, ids).token_ids == ref
    st = graph.stages[0]
    assert st._graphs is not None and st._graphs.replays > 0, "recording failed (see the warning)"
    res = gen(graph, ids, proposer=DFlashProposer(gpu_draft(graph, 8), graph, block_size=4))
    assert res.token_ids == ref and res.extra["spec"]["steps"] > 0


def test_cuda_graphs_in_a_shard_worker_on_the_gpu(tiny_dir):
    """A GPU stage here and one in a shard worker on the same GPU, both with graphs: the same
    greedy tokens as the unsplit pipeline without graphs."""
    path = tiny_dir("llama")
    whole = pipeline(path, devices=[GPU])
    split = pipeline(path, devices=[GPU, "remote:" + GPU])
    try:
        assert split.use_cuda_graphs() == {GPU: None, "remote:" + GPU: None}
        ids = prompt_ids(whole, 30)
        assert gen(split, ids).token_ids == gen(whole, ids).token_ids
        assert split.cuda_graph_stats()[GPU]["replays"] > 0
    finally:
        split.close()


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_split_gpu_cpu_equals_unsplit(tiny_dir, family):
    whole = pipeline(tiny_dir(family), devices=[GPU])
    split = pipeline(tiny_dir(family), devices=[GPU, "cpu"])
    ids = prompt_ids(whole, 30)
    assert gen(split, ids).token_ids == gen(whole, ids).token_ids
    prop = DFlashProposer(gpu_draft(split), split)
    assert gen(split, ids, proposer=prop).token_ids == gen(whole, ids).token_ids


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_prefix_hit_and_disk_restore_equal_miss(tiny_dir, family, tmp_path):
    tok = pipeline(tiny_dir(family)).tokenizer
    turns = [{"role": "system", "content": "You are terse. " * 6},
             {"role": "user", "content": "Tell me about the sea."}]
    ids = tok.encode_chat(turns)
    more = tok.encode_chat(turns + [{"role": "assistant", "content": "It is wet."},
                                    {"role": "user", "content": "Why is it salty?"}])

    def engine(slots, disk=None):
        return Engine(pipeline(tiny_dir(family), devices=[GPU]), chunk=64, prefix_slots=slots, disk_cache=disk)

    def ask(eng, x):
        return eng.generate(GenerationRequest(tuple(x), max_tokens=12, ignore_eos=True))

    fresh = ask(engine(0), more)
    warm = engine(4, DiskCache(tmp_path, "fp", 1 << 30, 0))
    ask(warm, ids)
    hit = ask(warm, more)
    assert hit.token_ids == fresh.token_ids and hit.cached_tokens > 0
    restarted = engine(4, DiskCache(tmp_path, "fp", 1 << 30, 0))   # a new process's view of the folder
    again = ask(restarted, more)
    assert again.token_ids == fresh.token_ids and again.cached_tokens > 0


@pytest.mark.parametrize("pool", [512, 48])
def test_kvflash_pool_on_gpu(tiny_dir, pool):
    """A pool that holds everything equals plain decoding; a small one (paging) keeps the
    device KV at the pool's size and still decodes."""
    path = tiny_dir("llama")
    plain = pipeline(path, devices=[GPU])
    ids = prompt_ids(plain, 70)
    src = open_model(path)
    shards = plan_placement(src.config.num_layers, [GPU], together=src.config.kv_groups())
    kv = build_pipeline(src, shards, dtype=torch.float32, max_ctx=512, progress=False,
                        kvflash=KvFlashConfig(pool, chunk=16, policy="lru", tau=64))
    got = gen(kv, ids, n=60)
    if pool >= 512:
        assert got.token_ids == gen(plain, ids, n=60).token_ids
        assert gen(kv, ids, n=40, proposer=DFlashProposer(gpu_draft(kv), kv)).token_ids == \
            gen(plain, ids, n=40).token_ids
    else:
        assert len(got.token_ids) == 60
        assert kv.stages[0].pager is not None and kv.stages[0].kv_bytes() <= plain.stages[0].kv_bytes()


def test_int4_gguf_layers_on_gpu(tmp_path):
    """The GGUF's 4-bit layers through aten's int4 kernel (bf16) agree with the same layers
    dequantized (bf16 dense) on the first greedy tokens and closely in logits."""
    from helpers.tiny import smollm2_gguf_path

    path = smollm2_gguf_path()
    dense = pipeline(path, devices=[GPU], dtype=torch.bfloat16, quantize="dense")
    q4 = pipeline(path, devices=[GPU], dtype=torch.bfloat16, quantize="int4")
    modes = {m.mode for layer in q4.stages[0].layers for m in layer.modules() if isinstance(m, Linear)}
    assert "int4-cuda" in modes, modes
    ids = prompt_ids(dense, 40)
    for p in (dense, q4):
        p.reset()
    a, b = (p.forward(ids, 0, logits="all").logits.float() for p in (dense, q4))
    assert int(a.argmax(-1)[-1]) == int(b.argmax(-1)[-1])
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.98


def test_attention_backend_choice_matches_math():
    """layers.sdpa on CUDA (cuDNN left out, see its docstring) against the math backend:
    one query over growing caches, grouped heads, bf16 and fp32, with and without a mask."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from dflash_server.layers.sdpa import sdpa

    g = torch.Generator(GPU).manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for T, L in ((1, 100), (1, 101), (5, 140)):
            q = torch.randn(1, 9, T, 64, device=GPU, dtype=dtype, generator=g)
            k, v = (torch.randn(1, 3, L, 64, device=GPU, dtype=dtype, generator=g) for _ in range(2))
            mask = torch.ones(T, L, dtype=torch.bool, device=GPU).tril(L - T) if T > 1 else None
            with sdpa_kernel([SDPBackend.MATH]):
                ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                                       attn_mask=mask, enable_gqa=True)
            got = sdpa(q, k, v, mask, gqa=True)
            assert got.dtype == dtype and (got.float() - ref).abs().max() < (2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_cuda_graphs_for_verify_blocks_of_several_slots(tiny_dir):
    """Three sequences with a draft on the GPU, fp32, graphs recorded: their verify blocks go
    through one recorded forward_rows per multiset of slots; every output equals plain
    decoding alone."""
    path = tiny_dir("llama")
    eager = pipeline(path, devices=[GPU])
    prompts = [prompt_ids(eager, n, seed=n) for n in (9, 20, 14)]
    want = [gen(eager, p, n).token_ids for p, n in zip(prompts, (24, 30, 20))]
    graph = pipeline(path, devices=[GPU], lanes=3)
    st = graph.stages[0]
    assert st.use_cuda_graphs() is None
    eng = Engine(graph, proposer=DFlashProposer(gpu_draft(graph, 4), graph, block_size=4))
    seqs = [eng.submit(GenerationRequest(tuple(p), max_tokens=n, ignore_eos=True))
            for p, n in zip(prompts, (24, 30, 20))]
    while eng.has_work:
        eng.step()
    assert st._graphs is not None, "recording failed (see the warning)"
    assert [s.result.token_ids for s in seqs] == want
    ragged = [k[1] for k in st._graphs.graphs if k[0] == "rows" and len(set(k[1])) < len(k[1])]
    assert ragged and st._graphs.replays > 0
