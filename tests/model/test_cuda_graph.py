"""The CUDA-graph decode step (runtime.cuda_graph), run here without recording: its position
tensor, KV writes, masks, RoPE rows and cache spans against the eager step. Recording itself
needs a GPU (tests/model/test_cuda.py)."""
import pytest
import torch

from dflash_server.engine.generate import Engine, GenerationRequest
from dflash_server.runtime.cuda_graph import unsupported
from dflash_server.runtime.kv_pager import KvFlashConfig
from dflash_server.runtime.pipeline import build_pipeline
from dflash_server.runtime.placement import plan_placement
from dflash_server.spec.proposer import DFlashProposer
from dflash_server.weights.loader import open_model
from helpers.build import greedy, pipeline, prompt_ids, start_slots

from .test_dflash import random_draft


def graphed(path, min_span=8, **kw):
    """A pipeline whose stages run the graphs' step (not recorded), with spans from
    ``min_span`` rows so that a short decode crosses several."""
    pipe = pipeline(path, **kw)
    for st in pipe.stages:
        assert st.use_cuda_graphs(record=False) is None
        st._graphs.min_span = min_span
    return pipe


def twins(path, n: int, **kw):
    """An eager pipeline and a graphed one (``graphed``), each with the same n-token prompt
    prefilled: (eager, graph, prompt ids)."""
    eager, graph = pipeline(path, **kw), graphed(path, **kw)
    ids = prompt_ids(eager, n)
    for p in (eager, graph):
        p.reset()
        p.forward(ids, 0, logits="last")
    return eager, graph, ids


def check_prefix_hit(path, eager):
    """A second chat turn through the graphs' step restores the first turn's snapshot (a
    prefix-cache hit) and gives what eager decoding of the whole conversation gives."""
    turns = [{"role": "system", "content": "You are terse. " * 6}, {"role": "user", "content": "The sea?"}]
    tok = eager.tokenizer
    more = tok.encode_chat(turns + [{"role": "assistant", "content": "It is wet."},
                                    {"role": "user", "content": "Why is it salty?"}])
    warm = Engine(graphed(path), prefix_slots=4)
    warm.generate(GenerationRequest(tuple(tok.encode_chat(turns)), max_tokens=8, ignore_eos=True))
    hit = warm.generate(GenerationRequest(tuple(more), max_tokens=16, ignore_eos=True))
    assert hit.cached_tokens > 0 and hit.token_ids == greedy(eager, more, max_tokens=16)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "qwen3_5"])
def test_graph_step_equals_eager_decode(tiny_dir, family):
    """Logits of each step close to the eager step's, and the same greedy tokens, over spans
    8..64 (gemma3: sliding-window layers with their own RoPE rows; qwen3_5: Gated DeltaNet
    layers updating their state in place, put back after each recording's warm-ups)."""
    path = tiny_dir(family)
    eager, graph, ids = twins(path, 5)
    tok = 7
    for i in range(40):
        a = eager.forward([tok], len(ids) + i, logits="last")
        b = graph.forward([tok], len(ids) + i, logits="last")
        assert torch.allclose(a.logits, b.logits, atol=1e-4, rtol=1e-4), i
        tok = int(a.logits[-1].argmax())
    g = graph.stages[0]._graphs
    assert sorted(g.graphs) == [(0, 8, 1), (0, 16, 1), (0, 32, 1), (0, 64, 1)]
    assert greedy(graph, ids, max_tokens=24) == greedy(eager, ids, max_tokens=24)


def test_graph_step_captures_split_and_rewrite(tiny_dir):
    """Two stages (the second's input a hidden state), captured layer outputs as eager's, and
    a step repeated at the same position (DFlash rewrites rows) equal to the first time."""
    path = tiny_dir("llama")
    eager, graph, ids = twins(path, 9, stages=2)
    for i, tok in enumerate((5, 17, 3, 99)):
        capture = (1, 2) if i % 2 else ()
        a = eager.forward([tok], len(ids) + i, logits="last", capture=capture)
        other = graph.forward([tok], len(ids) + i, logits="last", capture=(1, 2))
        b = graph.forward([tok], len(ids) + i, logits="last", capture=capture)
        assert torch.equal(b.logits, other.logits)
        assert torch.allclose(a.logits, b.logits, atol=1e-4, rtol=1e-4)
        assert sorted(b.captures) == list(capture)
        for k in capture:
            assert torch.allclose(a.captures[k], b.captures[k], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_graph_verify_blocks_equal_eager(tiny_dir, family):
    """Verify blocks under a checkpoint (DFlash): each row's logits and captures as eager's,
    across span boundaries and block sizes, then a rollback keeping part of the block; blocks
    over ``max_rows`` run eagerly. The kept rows equal what eager kept (the next step agrees)."""
    path = tiny_dir(family)
    eager, graph = pipeline(path), graphed(path)
    graph.stages[0]._graphs.max_rows = 6
    ids = prompt_ids(eager, 5)
    for p in (eager, graph):
        p.reset()
        p.forward(ids, 0, logits="last")
    pos, g = len(ids), torch.Generator().manual_seed(0)
    for block in (2, 3, 4, 8, 5, 6, 2, 7):
        toks = torch.randint(0, 500, (block,), generator=g).tolist()
        out = []
        for p in (eager, graph):
            p.checkpoint()
            out.append(p.forward(toks, pos, logits="all", capture=(1,)))
        a, b = out
        assert b.logits.shape == a.logits.shape == (block, a.logits.shape[1])
        assert torch.allclose(a.logits, b.logits, atol=1e-4, rtol=1e-4), block
        assert torch.allclose(a.captures[1], b.captures[1], atol=1e-4, rtol=1e-4)
        keep = pos + 1 + block // 2
        for p in (eager, graph):
            p.rollback(keep)
        pos = keep
    a, b = eager.forward([9], pos, logits="last"), graph.forward([9], pos, logits="last")
    assert torch.allclose(a.logits, b.logits, atol=1e-4, rtol=1e-4)
    rows = {t for _, _, t in graph.stages[0]._graphs.graphs}
    assert rows == {1, 2, 3, 4, 5, 6}   # 7 and 8 rows: over max_rows, eager


def test_graphs_with_dflash_prefix_cache_and_slots(tiny_dir):
    """What runs around the graph step: DFlash (plain steps with taps, verify blocks eager,
    rollbacks) == plain decoding; a prefix-cache hit (restored state) == a miss; two sequence
    slots decoded in turn keep one graph each and their own tokens."""
    path = tiny_dir("llama")
    eager = pipeline(path)
    ids = prompt_ids(eager, 20)
    ref = greedy(eager, ids, max_tokens=30)
    graph = graphed(path)
    prop = DFlashProposer(random_draft(graph, block_size=4), graph, block_size=4)
    res = Engine(graph, proposer=prop).generate(GenerationRequest(tuple(ids), max_tokens=30, ignore_eos=True))
    assert res.token_ids == ref and res.extra["spec"]["steps"] > 0
    check_prefix_hit(path, eager)
    two = graphed(path, lanes=2)
    st = two.stages[0]
    other = prompt_ids(two, 12, seed=3)
    out = {0: [], 1: []}
    for lane, prompt in ((0, ids), (1, other)):
        st.select(lane)
        st.reset()
        out[lane].append(int(two.forward(prompt, 0, logits="last").logits[-1].argmax()))
    for i in range(12):
        for lane, prompt in ((0, ids), (1, other)):
            st.select(lane)
            nxt = two.forward([out[lane][-1]], len(prompt) + i, logits="last")
            out[lane].append(int(nxt.logits[-1].argmax()))
    assert out[0] == ref[:13] and out[1] == greedy(eager, other, max_tokens=13)
    assert {lane for lane, _, _ in st._graphs.graphs} == {0, 1}


def test_graphs_on_a_gated_deltanet_model_around_dflash_snapshots_and_trees(tiny_dir):
    """Qwen3.5 (Gated DeltaNet + attention): plain steps through the graphs' step, while DFlash
    verify blocks, rollbacks, DDTree trees and a prefix-cache restore run eagerly and rebind
    the recurrent state (copied back onto the pinned tensors before the next step): the same
    tokens as plain decoding; batched rows of several slots stay eager."""
    path = tiny_dir("qwen3_5")
    eager = pipeline(path)
    ids = prompt_ids(eager, 20)
    ref = greedy(eager, ids, max_tokens=24)
    graph = graphed(path)
    st = graph.stages[0]
    assert st._graphs.recurrent and st._graphs.max_rows == 1
    assert greedy(graph, ids, max_tokens=24) == ref
    for kw in ({"block_size": 4}, {"tree_budget": 6}):
        prop = DFlashProposer(random_draft(graph, block_size=4), graph, **kw)
        res = Engine(graph, proposer=prop).generate(GenerationRequest(tuple(ids), max_tokens=24, ignore_eos=True))
        assert res.token_ids == ref and res.extra["spec"]["steps"] > 0, kw
    assert {t for _, _, t in st._graphs.graphs} == {1}
    check_prefix_hit(path, eager)
    two = graphed(path, lanes=2)
    assert two.stages[0]._graphs.step_rows(torch.tensor([[1, 2]]), [0, 1], [3, 3]) is None


def test_stages_the_graphs_do_not_take(tiny_dir):
    assert "mixture-of-experts" in unsupported(pipeline(tiny_dir("laguna")).stages[0])
    src = open_model(tiny_dir("llama"))
    shards = plan_placement(src.config.num_layers, ["cpu"], together=src.config.kv_groups())
    kv = build_pipeline(src, shards, dtype=torch.float32, max_ctx=256, progress=False,
                        kvflash=KvFlashConfig(64, chunk=16, policy="lru", tau=64))
    assert unsupported(kv.stages[0]) == "KV Flash pools"
    # recording needs a GPU; the stage says so and keeps its eager step
    plain = pipeline(tiny_dir("llama"))
    assert plain.stages[0].use_cuda_graphs() == "device cpu" and plain.stages[0]._graphs is None
    plain.compile_decode()
    assert plain.stages[0].use_cuda_graphs(record=False) == "--compile"


def test_graph_step_refuses_what_the_eager_step_refuses(tiny_dir):
    """A position past the cached length or the context is the same clear error with graphs
    on, and leaves the state as it was (the next valid step still equals eager)."""
    path = tiny_dir("llama")
    eager, graph, ids = twins(path, 14, max_ctx=16)
    with pytest.raises(ValueError, match="gap"):
        graph.forward([3], 15, logits="last")
    for pos in (14, 15):
        a, b = eager.forward([3], pos, logits="last"), graph.forward([3], pos, logits="last")
        assert torch.allclose(a.logits, b.logits, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="exceed the context"):
        graph.forward([3], 16, logits="last")
    assert graph.stages[0].length == 16


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_graph_rows_of_several_slots_equal_eager(tiny_dir, family):
    """Decode rows of several slots (continuous batching) through the graphs' step: the
    rows in any order and any set of slots (consecutive slots read the bank as a view, others
    gather), each row's logits and captures as the eager rows forward's, the banks equal after
    (no write into a slot that sat out), and a set past the graphs' limit runs eagerly."""
    path = tiny_dir(family)
    eager, graph = pipeline(path, lanes=4), graphed(path, lanes=4)
    prompts = [prompt_ids(eager, n, seed=n) for n in (5, 17, 9, 12)]
    pos, toks = start_slots((eager, graph), prompts)
    sets = ([0, 1, 2, 3], [2, 0], [1, 2], [3, 1, 0], [0, 1, 2, 3], [3, 2], [1, 3, 2])
    st = graph.stages[0]
    for step, active in enumerate(sets):
        if step == 5:
            st._graphs.graphs = {k: g for k, g in st._graphs.graphs.items() if k[0] != "rows"}
            import dflash_server.runtime.cuda_graph as cg
            limit, cg.MAX_ROW_SETS = cg.MAX_ROW_SETS, 0   # no room: eager
        try:
            a = eager.forward_rows([toks[i] for i in active], active, [pos[i] for i in active], capture=(1,))
            b = graph.forward_rows([toks[i] for i in active], active, [pos[i] for i in active], capture=(1,))
        finally:
            if step == 5:
                cg.MAX_ROW_SETS = limit
        assert torch.allclose(a.logits, b.logits, atol=1e-4, rtol=1e-4), (step, active)
        assert torch.allclose(a.captures[1], b.captures[1], atol=1e-4, rtol=1e-4)
        for r, i in enumerate(active):
            toks[i] = int(a.logits[r].argmax())
            pos[i] += 1
    for be, bg in zip(eager.stages[0].banks, st.banks):
        assert torch.allclose(be.k, bg.k, atol=1e-5) and torch.allclose(be.v, bg.v, atol=1e-5)
    assert [s.length for s in st.lanes] == pos
    rows = sorted(k[1] for k in st._graphs.graphs if k[0] == "rows")
    assert rows == [(1, 2, 3)]   # the sets were cleared at step 5 (then eager), then one recorded


def test_a_failed_recording_turns_graphs_off_and_the_step_runs_eagerly(tiny_dir, monkeypatch, caplog):
    path = tiny_dir("llama")
    eager, graph, ids = twins(path, 7, lanes=2)
    st = graph.stages[0]

    def broken(*a, **k):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")
    monkeypatch.setattr(st._graphs, "step", broken)
    with caplog.at_level("WARNING", logger="dflash_server"):
        b = graph.forward([5], len(ids), logits="last")
    a = eager.forward([5], len(ids), logits="last")
    assert torch.allclose(a.logits, b.logits, atol=1e-4, rtol=1e-4) and st._graphs is None
    assert "CUDA graphs off on cpu: operation not permitted" in caplog.text
    assert graph.stages[0].length == len(ids) + 1


def test_graphs_kept_are_bounded_least_recently_used_first(tiny_dir, monkeypatch):
    """Past MAX_GRAPHS the least recently used graph is dropped (a key used again moves to
    the back), and a dropped key is simply recorded again when needed: results unchanged."""
    import dflash_server.runtime.cuda_graph as cg

    monkeypatch.setattr(cg, "MAX_GRAPHS", 3)
    path = tiny_dir("llama")
    eager, graph, ids = twins(path, 5)
    g = graph.stages[0]._graphs
    pos = len(ids)
    for block in (2, 3, 1, 2, 4, 1, 3):   # rows 1..4 at span 8, then 16
        toks = list(range(7, 7 + block))
        for p in (eager, graph):
            p.checkpoint()
        a, b = eager.forward(toks, pos, logits="all"), graph.forward(toks, pos, logits="all")
        assert torch.allclose(a.logits, b.logits, atol=1e-4, rtol=1e-4)
        assert len(g.graphs) <= 3
        for p in (eager, graph):
            p.rollback(pos + 1)
        pos += 1
    assert list(g.graphs) == [(0, 16, 4), (0, 16, 1), (0, 16, 3)]


def test_shard_worker_answers_for_its_stages(tiny_dir):
    """A split into a shard worker: the pipeline asks the worker too (its op is kept for a
    restart); a CPU worker's stages take no graphs, and decoding is unchanged."""
    path = tiny_dir("llama")
    pipe = pipeline(path, devices=["cpu", "remote:cpu"])
    try:
        assert pipe.use_cuda_graphs() == {}
        assert ("cuda_graphs", {}) in pipe.stages[-1].link.setup
        ids = prompt_ids(pipe, 12)
        assert greedy(pipe, ids, max_tokens=8) == greedy(pipeline(path), ids, max_tokens=8)
    finally:
        pipe.close()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_graph_rows_with_verify_blocks_of_several_slots_equal_eager(tiny_dir, family):
    """Verify blocks of several slots in one ``forward_rows`` (a slot's rows at consecutive
    positions, the slot checkpointed, rolled back after) through the graphs' step: each row's
    logits and captures as the eager forward's, a graph per multiset of slots, the banks and
    lengths equal after the rollbacks."""
    path = tiny_dir(family)
    eager, graph = pipeline(path, lanes=3), graphed(path, lanes=3)
    prompts = [prompt_ids(eager, n, seed=n) for n in (5, 17, 9)]
    pos, toks = start_slots((eager, graph), prompts)
    st = graph.stages[0]
    for step, blocks in enumerate(([3, 1, 2], [1, 4, 1], [2, 2, 2], [3, 1, 2])):
        lanes = [i for i, b in enumerate(blocks) for _ in range(b)]
        rows = [pos[i] + t for i, b in enumerate(blocks) for t in range(b)]
        ids = [toks[i] if t == 0 else (toks[i] * 7 + t) % 97 + 3 for i, b in enumerate(blocks) for t in range(b)]
        outs = []
        for p in (eager, graph):
            for i, b in enumerate(blocks):
                if b > 1:
                    p.select(i)
                    p.checkpoint()
            outs.append(p.forward_rows(ids, lanes, rows, capture=(1,)))
        a, b = outs
        assert torch.allclose(a.logits, b.logits, atol=1e-4, rtol=1e-4), step
        assert torch.allclose(a.captures[1], b.captures[1], atol=1e-4, rtol=1e-4)
        for i, blk in enumerate(blocks):          # keep the block's first row and one more if any
            keep = min(2, blk)
            r = lanes.index(i)
            toks[i] = int(a.logits[r + keep - 1].argmax())
            for p in (eager, graph):
                p.select(i)
                if blk > 1:
                    p.rollback(pos[i] + keep)
            pos[i] += keep
    assert [s.length for s in st.lanes] == [s.length for s in eager.stages[0].lanes] == pos
    for be, bg in zip(eager.stages[0].banks, st.banks):
        for i, n in enumerate(pos):
            assert torch.allclose(be.k[i, :, :n], bg.k[i, :, :n], atol=1e-5)
            assert torch.allclose(be.v[i, :, :n], bg.v[i, :, :n], atol=1e-5)
    keys = sorted(k[1] for k in st._graphs.graphs if k[0] == "rows")
    assert keys == [(0, 0, 0, 1, 2, 2), (0, 0, 1, 1, 2, 2), (0, 1, 1, 1, 1, 2)]   # the first one used twice


def test_graphs_with_several_sequences_speculating_together(tiny_dir):
    """The engine with a draft and three sequences at once on the graphs' step: their verify
    blocks go through one graphed forward_rows, outputs == plain decoding alone."""
    path = tiny_dir("llama")
    eager = pipeline(path)
    prompts = [prompt_ids(eager, n, seed=n) for n in (9, 20, 14)]
    want = [greedy(eager, p, max_tokens=n) for p, n in zip(prompts, (14, 18, 11))]
    graph = graphed(path, lanes=3)
    eng = Engine(graph, proposer=DFlashProposer(random_draft(graph, block_size=4), graph, block_size=4))
    seqs = [eng.submit(GenerationRequest(tuple(p), max_tokens=n, ignore_eos=True))
            for p, n in zip(prompts, (14, 18, 11))]
    while eng.has_work:
        eng.step()
    assert [s.result.token_ids for s in seqs] == want
    keys = [k[1] for k in graph.stages[0]._graphs.graphs if k[0] == "rows"]
    assert any(len(set(k)) > 1 and len(k) > len(set(k)) for k in keys)   # several slots' blocks in one graph
