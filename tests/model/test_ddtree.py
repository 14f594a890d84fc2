"""DDTree: the best-first draft tree, the tree-masked verify forward (each row equal to a
plain step along its path, bit for bit in the serving configuration), the path commit
(KV moved down, Gated DeltaNet state of a side branch), and the engine's tree steps:
lossless against plain decoding, an oracle tree accepting its full depth, a best path that
is not the first branch."""
from __future__ import annotations

import math

import pytest
import torch

from dflash_server.engine.generate import Engine, GenerationRequest
from dflash_server.engine.sampling import SamplingParams
from dflash_server.spec.ddtree import build_tree
from dflash_server.spec.proposer import DFlashProposer
from helpers.build import pipeline, prompt_ids

from .test_dflash import random_draft, run

PARENTS = (-1, 0, 0, 1, 1, 2, 3, 3, 6, 4, 9)   # a tree whose rows are made parent-first


def test_best_first_tree():
    """The heap search of the DDTree paper: nodes by cumulative log-probability, siblings by
    rank, parents before children, within the budget and the depth."""
    logp = torch.tensor([[0.6, 0.3, 0.1], [0.9, 0.05, 0.05], [0.45, 0.35, 0.2]]).log()
    t = build_tree(logp, 5)
    # pops: .6 (d1 r0), .54 (d2 r0 under it), .3 (d1 r1), .27 (d2 r0 under that), .243 (d3 r0
    # under .54)
    assert t.tokens == [0, 0, 1, 0, 0] and t.parents == (-1, 0, 1, 0, 3, 2) and t.depth == 3
    assert all(p < r for r, p in enumerate(t.parents) if r)
    scores = []
    for r in range(1, len(t.parents)):   # each node's cumulative probability
        s, row = 1.0, r
        while row > 0:
            s *= math.exp(float(logp[_depth(t.parents, row) - 1, t.tokens[row - 1]]))
            row = t.parents[row]
        scores.append(s)
    assert scores == sorted(scores, reverse=True)   # best first
    # a budget past every path: all of them (3 + 9 + 27 nodes), never deeper than L
    full = build_tree(logp, 63)
    assert len(full.tokens) == 39 and full.depth == 3
    assert build_tree(logp, 1).parents == (-1, 0) and build_tree(logp[:0], 4).tokens == []
    ids = torch.tensor([7, 8, 9])
    assert build_tree(logp, 3, ids).tokens == [7, 7, 8]    # a draft vocabulary's ids


def _depth(parents, row):
    d = 0
    while parents[row] >= 0:
        row, d = parents[row], d + 1
    return d


def _path(parents, t):
    out = []
    while t >= 0:
        out.append(t)
        t = parents[t]
    return out[::-1]


def _tree_verify(pipe, ids, toks):
    """The tree PARENTS of ``toks`` verified after 20 prompt tokens: its (T, V) logits."""
    pipe.reset()
    pipe.forward(ids[:20], 0)
    pipe.checkpoint()
    return pipe.forward(toks, 20, logits="all", tree=PARENTS).logits


def _plain_along(pipe, ids, toks, t):
    """The logits of plain decoding's last step along tree row ``t``'s path."""
    pipe.reset()
    pipe.forward(ids[:20], 0)
    for i, r in enumerate(_path(PARENTS, t)):
        plain = pipe.forward([toks[r]], 20 + i, logits="all").logits[0]
    return plain


SERVING = dict(dtype=torch.bfloat16, quantize="int8")   # native kernels: bf16, int8 weights


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5", "gemma3", "gemma4", "laguna"])
@pytest.mark.parametrize("config", ["serving", "fp32"])
def test_tree_rows_equal_plain_steps(tiny_dir, family, config):
    """Row t of a tree verify == the last step of plain decoding along t's path: bit-equal in
    the serving configuration (the native attention step reads the row's ancestors as the
    contiguous keys of a plain step; Gated DeltaNet rows step from their parent's state),
    to rounding in fp32 (aten attention under a tree mask)."""
    pipe = pipeline(tiny_dir(family), **(SERVING if config == "serving" else {}))
    ids = prompt_ids(pipe, 24)
    toks = [ids[20]] + [(37 * i) % 400 + 3 for i in range(1, len(PARENTS))]
    tree = _tree_verify(pipe, ids, toks)
    pipe.rollback_tree([0])
    for t in range(len(PARENTS)):
        plain = _plain_along(pipe, ids, toks, t)
        if config == "serving":
            assert torch.equal(plain, tree[t]), (family, t)
        else:
            torch.testing.assert_close(plain, tree[t], atol=2e-5, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_commit_of_a_side_branch(tiny_dir, family):
    """Keeping a path through the second branch: the KV of its rows moves down to their
    positions and the recurrent state is its last row's, so decoding on equals plain
    decoding of that path (and the cache length is the path's)."""
    pipe = pipeline(tiny_dir(family), **SERVING)
    ids = prompt_ids(pipe, 24)
    toks = [ids[20]] + [(53 * i) % 400 + 3 for i in range(1, len(PARENTS))]
    path = _path(PARENTS, 8)                      # 0 -> 1 -> 3 -> 6 -> 8: rows move down
    pipe.reset()
    pipe.forward(ids[:20], 0)
    pipe.checkpoint()
    pipe.forward(toks, 20, logits="all", tree=PARENTS)
    pipe.rollback_tree(path)
    assert pipe.length == 20 + len(path)
    after = [pipe.forward([t], pipe.length, logits="all").logits[0] for t in (11, 12)]
    pipe.reset()
    pipe.forward(ids[:20], 0)
    for i, r in enumerate(path):
        pipe.forward([toks[r]], 20 + i)
    plain = [pipe.forward([t], pipe.length, logits="all").logits[0] for t in (11, 12)]
    assert all(torch.equal(a, b) for a, b in zip(after, plain))
    with pytest.raises(ValueError):               # not a path of the rows
        pipe.checkpoint()
        pipe.forward(toks[:3], pipe.length, tree=(-1, 0, 0))
        pipe.rollback_tree([0, 2, 1])


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5"])
@pytest.mark.parametrize("stages", [1, 2])
def test_tree_decoding_is_lossless(tiny_dir, family, stages):
    """Greedy and seeded sampling with tree steps == plain decoding, serving configuration,
    one stage and an in-process split; the trees are real (random draft, budget 12)."""
    pipe = pipeline(tiny_dir(family), stages=stages, **SERVING)
    ids = prompt_ids(pipe, 20)
    draft = random_draft(pipe, block_size=6)
    for sampling in (SamplingParams(), SamplingParams(temperature=1.0, top_p=0.9, seed=4)):
        ref = run(pipe, ids, sampling=sampling, max_tokens=40)
        res = run(pipe, ids, DFlashProposer(draft, pipe, tree_budget=12), sampling=sampling, max_tokens=40)
        assert res.token_ids == ref.token_ids, (family, stages, sampling)
        spec = res.extra["spec"]
        assert spec["tree_steps"] > 0 and spec["mean_tree_nodes"] > 5


def test_adaptive_budget_is_lossless(tiny_dir):
    """--ddtree with the adaptive sizer (the CLI default, --block-size auto): each step's
    budget (0 = a plain step) is the sizer's choice; output == plain decoding."""
    from dflash_server.spec.block_sizer import BlockSizer
    from dflash_server.spec.tree_sizer import TreeSizer

    from .test_kvflash import kv_pipeline

    pipe = pipeline(tiny_dir("qwen3_5"), **SERVING)
    ids = prompt_ids(pipe, 20)
    prop = DFlashProposer(random_draft(pipe, block_size=6), pipe, tree_budget=12, adaptive=True)
    assert isinstance(prop.sizer, TreeSizer) and prop.sizer.candidates == (0, 1, 2, 4, 8, 12)
    for sampling in (SamplingParams(), SamplingParams(temperature=1.0, seed=2)):
        res = run(pipe, ids, prop, sampling=sampling, max_tokens=60)
        assert res.token_ids == run(pipe, ids, sampling=sampling, max_tokens=60).token_ids
        spec = res.extra["spec"]
        assert spec["tree_steps"] > 0 and spec["plain_steps"] > 0   # both tried while exploring
    # budgets measured from the smallest up, as far as larger trees may pay (a random draft:
    # they cannot, so the largest are left unmeasured)
    measured = sorted(prop.sizer.cost)
    assert len(measured) >= 2 and measured == list(prop.sizer.candidates[:len(measured)])
    kv = kv_pipeline(tiny_dir("llama"), 128)   # KV Flash pools verify trees too
    assert isinstance(DFlashProposer(random_draft(kv), kv, tree_budget=12, adaptive=True).sizer, TreeSizer)
    assert isinstance(DFlashProposer(random_draft(kv), kv, tree_budget=0, adaptive=True).sizer, BlockSizer)


class OracleTree(DFlashProposer):
    """Draft logits that put the target's own continuation at ``rank`` of each position
    (``rank`` 1 at depth 1: the first branch is wrong, its sibling right)."""

    def __init__(self, draft, pipe, prompt, continuation, wrong_first=False, **kw):
        super().__init__(draft, pipe, **kw)
        self.seq, self.wrong_first = list(prompt) + list(continuation), wrong_first

    def _draft_logits(self, anchor, start, block):
        V = self.pipeline.config.vocab_size
        out = torch.full((block - 1, V), -30.0)
        for i in range(block - 1):
            j = start + 1 + i
            right = self.seq[j] if j < len(self.seq) else 0
            out[i, right] = 10.0
            if i == 0 and self.wrong_first:
                out[i, right] = 4.9
                out[i, (right + 1) % V] = 5.0
        return out


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_oracle_tree_accepts_full_depth_and_finds_a_later_branch(tiny_dir, family):
    pipe = pipeline(tiny_dir(family), **SERVING)
    ids = prompt_ids(pipe, 20)
    ref = run(pipe, ids, max_tokens=33).token_ids
    draft = random_draft(pipe, block_size=8)
    res = run(pipe, ids, OracleTree(draft, pipe, ids, ref, tree_budget=7), max_tokens=33)
    spec = res.extra["spec"]
    # 1 token from prefill + 4 trees accepting all 7 nodes of depth 7 (+ the bonus token)
    assert res.token_ids == ref and spec["steps"] == 4 and spec["acceptance_length"] == 8
    # the argmax chain starts on a wrong token and accepts nothing; a tree of 14 nodes holds
    # the right path behind the wrong first branch and accepts all 7 of it
    chain = run(pipe, ids, OracleTree(draft, pipe, ids, ref, wrong_first=True), max_tokens=33)
    tree = run(pipe, ids, OracleTree(draft, pipe, ids, ref, wrong_first=True, tree_budget=14), max_tokens=33)
    assert chain.token_ids == tree.token_ids == ref
    assert chain.extra["spec"]["acceptance_length"] == 1.0
    assert tree.extra["spec"]["acceptance_length"] == 8 and tree.extra["spec"]["steps"] == 4


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_trees_over_kv_flash_pools(tiny_dir, family):
    """With a KV Flash pool each tree row reads the cache's visible slots and then its
    ancestors' slots in logical order, and a path commit moves pool slots: rows == plain
    steps along their paths, a side branch kept == plain decoding of it, and tree decoding
    with a pool that pages during the run == plain decoding with that pool, bit for bit in
    the serving configuration. Refused: a tree forward without a checkpoint, a budget past
    the native step's rows."""
    from .test_kvflash import kv_pipeline

    pipe = kv_pipeline(tiny_dir(family), 128, chunk=16, **SERVING)
    assert pipe.supports_tree
    ids = prompt_ids(pipe, 24)
    toks = [ids[20]] + [(41 * i) % 400 + 3 for i in range(1, len(PARENTS))]
    tree = _tree_verify(pipe, ids, toks)
    path = _path(PARENTS, 8)
    pipe.rollback_tree(path)
    after = [pipe.forward([t], pipe.length, logits="all").logits[0] for t in (11, 12)]
    for t in range(len(PARENTS)):
        assert torch.equal(_plain_along(pipe, ids, toks, t), tree[t]), (family, t)
    pipe.reset()
    pipe.forward(ids[:20], 0)
    for i, r in enumerate(path):
        pipe.forward([toks[r]], 20 + i)
    plain = [pipe.forward([t], pipe.length, logits="all").logits[0] for t in (11, 12)]
    assert all(torch.equal(a, b) for a, b in zip(after, plain))

    draft = random_draft(pipe, block_size=6)
    ref = run(pipe, ids, max_tokens=150)
    res = run(pipe, ids, DFlashProposer(draft, pipe, tree_budget=12), max_tokens=150)
    assert res.token_ids == ref.token_ids
    assert res.extra["spec"]["tree_steps"] > 0
    assert pipe.stages[0].pool.pager.page_outs > 0          # the pool paged while trees ran
    # a budget past the chunk: trees are capped at one chunk of rows (the anchor + 15 nodes)
    assert pipe.max_spec_rows == 16
    wide = run(pipe, ids, DFlashProposer(draft, pipe, tree_budget=40), max_tokens=150)
    assert wide.token_ids == ref.token_ids and 12 < wide.extra["spec"]["mean_tree_nodes"] <= 15
    with pytest.raises(ValueError, match="tree budget"):
        DFlashProposer(random_draft(pipe), pipe, tree_budget=64)
    pipe.commit()
    with pytest.raises(ValueError, match="tree forward"):
        pipe.forward([1, 2], pipe.length, tree=(-1, 0))


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gemma4_e"])
def test_trees_across_a_shard_worker(tiny_dir, family):
    """A pipeline whose last layers run in a shard worker verifies trees too (the worker
    takes the tree and the path commit): tree decoding == plain decoding == the same trees
    in one process, with the same statistics."""
    pipe = pipeline(tiny_dir(family), devices=["cpu", "remote:cpu"], **SERVING)
    try:
        assert pipe.supports_tree
        ids = prompt_ids(pipe, 20)
        n = pipe.config.num_layers
        draft = random_draft(pipe, block_size=6, taps=(1, n - 2))   # one tap on each side
        ref = run(pipe, ids, max_tokens=30)
        res = run(pipe, ids, DFlashProposer(draft, pipe, tree_budget=10), max_tokens=30)
        assert res.token_ids == ref.token_ids and res.extra["spec"]["tree_steps"] > 0
        local = pipeline(tiny_dir(family), stages=2, **SERVING)
        loc = run(local, ids, DFlashProposer(random_draft(local, block_size=6, taps=(1, n - 2)), local,
                                             tree_budget=10), max_tokens=30)
        assert loc.token_ids == ref.token_ids and loc.extra["spec"] == res.extra["spec"]
    finally:
        pipe.close()


def test_trees_in_sequence_slots_and_with_the_prefix_cache(tiny_dir):
    """Sequences in slots, with tree steps when one runs alone: each one's output equals
    running alone; a second turn restored from the prefix cache decodes as a cold one."""
    from .test_batching import _pipe, _run_together

    path = tiny_dir("qwen3_5")
    alone = _pipe(path, 1)
    together = _pipe(path, 3)
    draft = random_draft(alone, block_size=5)
    reqs = [GenerationRequest(tuple(prompt_ids(alone, 10 + 3 * i, seed=i)), max_tokens=16 + 16 * (i == 2),
                              ignore_eos=True,
                              sampling=SamplingParams() if i != 1 else SamplingParams(temperature=0.8, seed=9))
            for i in range(3)]
    want = [Engine(alone, proposer=DFlashProposer(draft, alone, tree_budget=8)).generate(r).token_ids for r in reqs]
    eng = Engine(together, proposer=DFlashProposer(random_draft(together, block_size=5), together, tree_budget=8))
    seqs, _ = _run_together(eng, reqs, when=[0, 0, 2])
    assert [s.result.token_ids for s in seqs] == want
    # (several running sequences verify their trees in one forward, and one running alone
    # verifies its own: the last one here)
    assert seqs[2].result.extra["spec"]["tree_steps"] > 0

    from .test_prefix_cache import converse

    def engine(slots):
        return Engine(alone, proposer=DFlashProposer(draft, alone, tree_budget=8), prefix_slots=slots)
    cached, fresh = converse(engine(8)), converse(engine(0))
    assert [a.token_ids for a in cached] == [b.token_ids for b in fresh]
    assert [a.extra["spec"] for a in cached] == [b.extra["spec"] for b in fresh]
    assert all(r.cached_tokens > 0 for r in cached[1:])


class SpreadTree(DFlashProposer):
    """Draft logits equal over ``spread[d]`` at depth d + 1: trees full of alternatives,
    some on the target's sampled path, others not."""

    def __init__(self, draft, pipe, spread, **kw):
        super().__init__(draft, pipe, **kw)
        self.spread = [list(s) for s in spread]

    def _draft_logits(self, anchor, start, block):
        out = torch.full((block - 1, self.pipeline.config.vocab_size), -30.0)
        for d in range(block - 1):
            out[d, self.spread[min(d, len(self.spread) - 1)]] = 0.0
        return out


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_sampled_tree_decoding_matches_the_target_distribution(tiny_dir, family):
    """Sampled tree steps (the walk keeps a child where it equals the target's own draw):
    the joint distribution of the 2nd and 3rd tokens, which tree steps decide, is the
    target's exact one over 600 runs (chi-square at the 99.9th percentile), with tree nodes
    both kept and not."""
    from .test_dflash import _chi2_of_runs, _exact_joint_23, chi2_999

    pipe = pipeline(tiny_dir(family))
    ids = prompt_ids(pipe, 10)
    params = dict(temperature=1.5, top_k=3)
    exact, _ = _exact_joint_23(pipe, ids, params)
    spread = [sorted({a for a, _ in exact}), sorted({b for _, b in exact})]   # 2nd tokens, 3rd tokens
    prop = SpreadTree(random_draft(pipe, block_size=4), pipe, spread, tree_budget=6)
    chi2, dof, proposed, accepted, counts = _chi2_of_runs(pipe, ids, prop, params, exact)
    assert chi2 < chi2_999(dof), (chi2, dof, counts)
    assert 0 < accepted < proposed


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_chain_verify_blocks_equal_plain_steps(tiny_dir, family):
    """In the serving configuration a chain verify block of 8 rows gives each row's logits
    bit-equal to one-row steps (Qwen3.5's Gated DeltaNet too, through the native step), a
    rollback into the block replays to the very state plain decoding reaches, and DFlash
    with a random draft == plain decoding, greedy and seeded."""
    pipe = pipeline(tiny_dir(family), **SERVING)
    ids = prompt_ids(pipe, 30)
    pipe.reset()
    pipe.forward(ids[:20], 0)
    pipe.checkpoint()
    block = pipe.forward(ids[20:28], 20, logits="all").logits
    pipe.rollback(23)                                            # keep 3 of the 8 rows
    after = pipe.forward([ids[29]], 23, logits="all").logits[0]
    pipe.reset()
    pipe.forward(ids[:20], 0)
    steps = [pipe.forward([t], 20 + i, logits="all").logits[0] for i, t in enumerate(ids[20:28])]
    assert all(torch.equal(a, b) for a, b in zip(block, steps))
    pipe.reset()
    pipe.forward(ids[:23], 0)
    assert torch.equal(pipe.forward([ids[29]], 23, logits="all").logits[0], after)
    draft = random_draft(pipe, block_size=6)
    for sampling in (SamplingParams(), SamplingParams(temperature=1.0, seed=5)):
        ref = run(pipe, ids[:20], sampling=sampling, max_tokens=40)
        assert run(pipe, ids[:20], DFlashProposer(draft, pipe, block_size=6), sampling=sampling,
                   max_tokens=40).token_ids == ref.token_ids
