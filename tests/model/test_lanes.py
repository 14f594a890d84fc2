"""Sequence slots (lanes) in a stage: a decode row of several sequences in one forward
gives each exactly what its own single-row forward gives (native kernels: bit for bit)."""
from __future__ import annotations

import pytest
import torch

from dflash_server import kernels
from dflash_server.runtime.pipeline import build_pipeline
from dflash_server.runtime.placement import plan_placement
from dflash_server.weights.loader import open_model
from helpers.build import prompt_ids


def _pipe(path, lanes, quantize="int8", dtype=torch.bfloat16, stages=1, kvflash=None, batch=1):
    src = open_model(path)
    shards = plan_placement(src.config.num_layers, ["cpu"] * stages, None)
    return build_pipeline(src, shards, dtype=dtype, max_ctx=256, quantize=quantize, progress=False, lanes=lanes,
                          kvflash=kvflash, batch=batch)


TAPS = (0, 1)  # layers whose outputs a draft would take (captured alongside)


def _alone(path, prompt, steps, **kw):
    """Greedy continuation of one prompt by single-row forwards on a one-slot pipeline:
    the tokens and each step's (logits, captured layer outputs)."""
    pipe = _pipe(path, 1, **kw)
    logits = pipe.prefill(prompt).logits[-1]
    toks, rows = [], []
    for i in range(steps):
        tok = int(logits.argmax())
        toks.append(tok)
        out = pipe.forward([tok], len(prompt) + i, capture=TAPS)
        logits = out.logits[-1]
        rows.append((logits, out.captures))
    return toks, rows


@pytest.mark.parametrize("family,stages", [("llama", 1), ("llama", 2), ("qwen3_5", 1), ("gemma3", 1), ("gemma4", 1), ("gemma4_e", 1),
                                           ("laguna", 1)])
def test_rows_equal_alone(tiny_dir, family, stages):
    path = tiny_dir(family)
    pipe = _pipe(path, 3, stages=stages)
    assert pipe.lanes == 3
    prompts = [prompt_ids(pipe, n, seed=n) for n in (5, 17, 9)]
    want = [_alone(path, p, 6, stages=stages) for p in prompts]
    logits = []
    for lane, p in enumerate(prompts):  # prefill each slot on its own
        pipe.select(lane)
        pipe.reset()
        logits.append(pipe.prefill(p).logits[-1])
    pos = [len(p) for p in prompts]
    got = [[] for _ in prompts]
    for step in range(6):
        # the row set changes: slot 1 sits out step 2, the others run in another order
        active = [0, 2] if step == 2 else ([2, 0, 1] if step % 2 else [0, 1, 2])
        toks = [int(logits[i].argmax()) for i in active]
        out = pipe.forward_rows(toks, active, [pos[i] for i in active], capture=TAPS)
        assert sorted(out.captures) == list(TAPS)
        for r, i in enumerate(active):
            got[i].append((toks[r], out.logits[r], {c: out.captures[c][:, r:r + 1] for c in TAPS}))
            logits[i] = out.logits[r]
            pos[i] += 1
    exact = kernels.enabled() and kernels.load()  # native kernels: row-invariant, bit for bit
    for i, (toks, rows) in enumerate(want):
        n = len(got[i])
        assert [t for t, _, _ in got[i]] == toks[:n]
        for (_, g, caps), (w, wcaps) in zip(got[i], rows[:n]):
            for a, b in [(g, w)] + [(caps[c], wcaps[c]) for c in TAPS]:
                if exact:
                    assert torch.equal(a, b)
                else:
                    torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=2e-2)


def test_rows_validate(tiny_dir):
    pipe = _pipe(tiny_dir("llama"), 2)
    pipe.select(0)
    pipe.prefill([1, 2, 3])
    with pytest.raises(ValueError):
        pipe.forward_rows([4, 5], [0, 0], [3, 3])     # two rows in one slot
    with pytest.raises(ValueError):
        pipe.forward_rows([4], [1], [3])              # leaves a gap in slot 1 (length 0)
    with pytest.raises(ValueError):
        pipe.forward_rows([4], [2], [0])              # no such slot
    with pytest.raises(ValueError):
        pipe.select(5)
    pipe.forward_rows([4, 7], [0, 1], [3, 0])
    assert [st.length for st in pipe.stages[0].lanes] == [4, 1]


def _check():
    """Bit for bit with the native kernels (row-invariant), else to bf16 rounding."""
    if kernels.enabled() and kernels.load():
        return torch.equal
    return lambda a, b: torch.allclose(a.float(), b.float(), rtol=0, atol=2e-2)


def _assert_slot_rows(out, want, blocks, check) -> None:
    """Each slot's rows of a rows forward (``blocks[i]`` rows of slot i, in order) give what
    ``want[i]`` = (logits, captures) of that slot's own forward gave."""
    row = 0
    for (logits, caps), blk in zip(want, blocks):
        n = len(blk)
        assert check(out.logits[row:row + n], logits)
        for c in TAPS:
            assert check(out.captures[c][:, row:row + n], caps[c])
        row += n


def _blocks(pipe, prompts, sizes):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(6, pipe.config.vocab_size, (n,), generator=g).tolist() for n in sizes]


def _score_states(pipe, lane: int) -> list:
    """Each stage's KV Flash score-policy state of slot ``lane`` once all its rows so far are
    committed (the last forward's rows observed one by one: their masses and queries): the
    policy's rows (chunk, last use, score) and the pool's latest queries."""
    out = []
    for st in pipe.stages:
        pool = st.lanes[lane].pool
        pool.commit(st.lanes[lane].length)
        out.append((pool.pager.policy.state(), [q.clone() for q in pool.last_q or ()]))
    return out


def _assert_same_scores(got: list, want: list) -> None:
    for (rows, queries), (rows2, queries2) in zip(got, want, strict=True):
        assert rows == rows2
        assert len(queries) == len(queries2) and all(torch.equal(a, b) for a, b in zip(queries, queries2))


@pytest.mark.parametrize("family,stages,pool,policy", [
    ("llama", 1, 0, "lru"), ("llama", 2, 0, "lru"), ("qwen3_5", 1, 0, "lru"), ("gemma3", 1, 0, "lru"),
    ("gemma4_e", 1, 0, "lru"), ("laguna", 1, 0, "lru"), ("llama", 1, 32, "lru"), ("llama", 2, 32, "lru"),
    ("qwen3_5", 1, 32, "lru"), ("gemma3", 1, 32, "lru"), ("llama", 1, 32, "score"), ("llama", 2, 32, "score"),
    ("qwen3_5", 1, 32, "score"), ("gemma3", 1, 32, "score")])
def test_verify_blocks_of_several_slots_in_one_forward(tiny_dir, family, stages, pool, policy):
    """Ragged rows: verify blocks of several slots (a slot's rows at consecutive positions,
    the slot checkpointed; a block of one next to them) in one ``forward_rows`` give each row
    what that slot's own verify forward gives; rolling each slot back crops it, and the next
    rows continue as after the slot's own rollback. With KV Flash pools (``pool`` tokens a
    slot, chunks of 4: the longer prompts page; Gemma 3's sliding layers: windows in the key
    lists) each slot's pool pages on its own and the rows run in one forward; with the score
    policy each slot's observed masses and latest queries are its own forward's, bit for bit."""
    from dflash_server.runtime.kv_pager import KvFlashConfig

    path = tiny_dir(family)
    kv = KvFlashConfig(pool=pool, chunk=4, policy=policy) if pool else None
    pipe, ref = _pipe(path, 3, stages=stages, kvflash=kv), _pipe(path, 1, stages=stages, kvflash=kv)
    assert pipe.supports_ragged
    prompts = [prompt_ids(pipe, n, seed=n) for n in ((11, 6, 20) if not pool else (56, 6, 64))]
    blocks = _blocks(pipe, prompts, (4, 1, 3))
    keep = (2, 1, 3)                                   # positions kept of each block
    want, after, scores = [], [], []
    for p, blk, k in zip(prompts, blocks, keep):       # each slot alone: verify, roll back, one more row
        ref.reset()
        ref.prefill(p)
        ref.checkpoint()
        out = ref.forward(blk, len(p), logits="all", capture=TAPS)
        want.append((out.logits, out.captures))
        if policy == "score":
            scores.append(_score_states(ref, 0))
        ref.rollback(len(p) + k)
        after.append(ref.forward([9], len(p) + k, capture=TAPS).logits[-1])
    for lane, p in enumerate(prompts):
        pipe.select(lane)
        pipe.reset()
        pipe.prefill(p)
        if len(blocks[lane]) > 1:
            pipe.checkpoint()
    lanes = [lane for lane, blk in enumerate(blocks) for _ in blk]
    positions = [len(prompts[lane]) + t for lane, blk in enumerate(blocks) for t in range(len(blk))]
    out = pipe.forward_rows([t for blk in blocks for t in blk], lanes, positions, capture=TAPS)
    assert [st.length for st in pipe.stages[-1].lanes] == [len(p) + len(b) for p, b in zip(prompts, blocks)]
    if pool:                                           # the long prompts' slots paged
        assert all(pipe.stages[0].lanes[lane].pool.pager.page_outs > 0 for lane in (0, 2))
    for lane, want_scores in enumerate(scores):
        _assert_same_scores(_score_states(pipe, lane), want_scores)
    check = _check()
    _assert_slot_rows(out, want, blocks, check)
    for lane, (p, blk, k) in enumerate(zip(prompts, blocks, keep)):
        pipe.select(lane)
        if len(blk) > 1:
            pipe.rollback(len(p) + k)
        assert pipe.length == len(p) + k
    nxt = pipe.forward_rows([9, 9, 9], [2, 0, 1], [len(p) + k for p, k in zip([prompts[2], prompts[0], prompts[1]],
                                                                              [keep[2], keep[0], keep[1]])])
    for r, lane in enumerate([2, 0, 1]):
        assert check(nxt.logits[r], after[lane])


# two trees: slot 0's accepted path leaves by its root's second child (not the first branch),
# slot 2's is the whole first chain; slot 1 decodes a plain row beside them
TREES = {0: ((-1, 0, 0, 1, 2, 2, 4), [0, 2, 5]), 2: ((-1, 0, 1, 0, 2), [0, 1, 2, 4])}


@pytest.mark.parametrize("family,stages,pool,policy", [
    ("llama", 1, 0, "lru"), ("llama", 2, 0, "lru"), ("qwen3_5", 1, 0, "lru"), ("gemma3", 1, 0, "lru"),
    ("gemma4_e", 1, 0, "lru"), ("llama", 1, 32, "lru"), ("qwen3_5", 1, 32, "lru"), ("gemma3", 1, 32, "lru"),
    ("llama", 1, 32, "score"), ("qwen3_5", 1, 32, "score")])
def test_tree_verifies_of_several_slots_in_one_forward(tiny_dir, family, stages, pool, policy):
    """DDTree verifies of several slots among other slots' rows in one ``forward_rows``
    (``trees``) give each row what that slot's own tree forward gives (native kernels: bit for
    bit); ``rollback_tree`` per slot keeps its path (KV moved down, recurrent state of the
    path's last node) and the next rows continue as after the slot's own rollback. With KV
    Flash pools a tree row's key list is its path (and the score policy observes each slot's
    own tree forward)."""
    from dflash_server.runtime.kv_pager import KvFlashConfig

    path = tiny_dir(family)
    kv = KvFlashConfig(pool=pool, chunk=8, policy=policy) if pool else None
    pipe, ref = _pipe(path, 3, stages=stages, kvflash=kv), _pipe(path, 1, stages=stages, kvflash=kv)
    assert pipe.supports_tree_rows
    prompts = [prompt_ids(pipe, n, seed=n) for n in ((11, 6, 20) if not pool else (72, 6, 80))]
    blocks = _blocks(pipe, prompts, [len(TREES[lane][0]) if lane in TREES else 1 for lane in range(3)])
    want, after, scores = [], [], []
    for lane, (p, blk) in enumerate(zip(prompts, blocks)):   # each slot alone
        ref.reset()
        ref.prefill(p)
        if lane in TREES:
            parents, keep = TREES[lane]
            ref.checkpoint()
            out = ref.forward(blk, len(p), logits="all", capture=TAPS, tree=parents)
            scores.append(_score_states(ref, 0) if policy == "score" else None)
            ref.rollback_tree(keep)
        else:
            out, keep = ref.forward(blk, len(p), logits="all", capture=TAPS), [0]
            scores.append(_score_states(ref, 0) if policy == "score" else None)
        want.append((out.logits, out.captures))
        after.append(ref.forward([9], len(p) + len(keep), capture=TAPS).logits[-1])
    for lane, p in enumerate(prompts):
        pipe.select(lane)
        pipe.reset()
        pipe.prefill(p)
        if lane in TREES:
            pipe.checkpoint()
    lanes = [lane for lane, blk in enumerate(blocks) for _ in blk]
    positions = [len(prompts[lane]) + t for lane, blk in enumerate(blocks) for t in range(len(blk))]
    out = pipe.forward_rows([t for blk in blocks for t in blk], lanes, positions, capture=TAPS,
                            trees={lane: parents for lane, (parents, _) in TREES.items()})
    if pool:                                           # the long prompts' slots paged
        assert all(pipe.stages[0].lanes[lane].pool.pager.page_outs > 0 for lane in (0, 2))
    for lane, want_scores in enumerate(scores):
        if want_scores is not None:
            _assert_same_scores(_score_states(pipe, lane), want_scores)
    check = _check()
    _assert_slot_rows(out, want, blocks, check)
    for lane in TREES:
        pipe.select(lane)
        pipe.rollback_tree(TREES[lane][1])
    ends = [len(p) + (len(TREES[lane][1]) if lane in TREES else 1) for lane, p in enumerate(prompts)]
    assert [st.length for st in pipe.stages[-1].lanes] == ends
    nxt = pipe.forward_rows([9, 9, 9], [2, 0, 1], [ends[2], ends[0], ends[1]])
    for r, lane in enumerate([2, 0, 1]):
        assert check(nxt.logits[r], after[lane])


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_pools_in_rows_on_aten(tiny_dir, family, monkeypatch):
    """KV Flash pools in a rows forward without the native kernels: each slot's rows attend
    as its own block forward over its pool (aten), verify blocks and trees alike, LRU and the
    score policy."""
    monkeypatch.setenv("DFLASH_KERNELS", "0")
    for policy in ("lru", "score"):
        test_verify_blocks_of_several_slots_in_one_forward(tiny_dir, family, 1, 32, policy)
        test_tree_verifies_of_several_slots_in_one_forward(tiny_dir, family, 1, 32, policy)


def test_tree_rows_validate(tiny_dir):
    """A slot's tree in ``forward_rows``: one parent per row of that slot, the first row the
    root, each parent an earlier row, the slot checkpointed at its first row; a refused forward
    leaves every slot as it was."""
    pipe = _pipe(tiny_dir("llama"), 2)
    for lane in (0, 1):
        pipe.select(lane)
        pipe.prefill([1, 2, 3])
    pipe.select(0)
    pipe.checkpoint()
    rows = dict(tokens=[4, 5, 6, 7], lanes=[0, 0, 0, 1], positions=[3, 4, 5, 3])
    for trees in ({0: (-1, 0)},            # a parent short
                  {0: (0, 0, 1)},           # the first row not the root
                  {0: (-1, 2, 0)},          # a parent after its child
                  {0: (-1, 0, 0), 3: (-1,)},   # a slot with no rows here
                  {1: (-1,)}):              # slot 1 holds no checkpoint
        with pytest.raises(ValueError):
            pipe.forward_rows(rows["tokens"], rows["lanes"], rows["positions"], trees=trees)
    assert [st.length for st in pipe.stages[0].lanes] == [3, 3]
    out = pipe.forward_rows(rows["tokens"], rows["lanes"], rows["positions"], trees={0: (-1, 0, 0)})
    assert out.logits.shape[0] == 4
    with pytest.raises(ValueError):
        pipe.rollback(5)                    # after a tree: keep a path
    pipe.rollback_tree([0, 2])
    assert [st.length for st in pipe.stages[0].lanes] == [5, 4]


def test_ragged_rows_validate(tiny_dir):
    """Several rows of a slot: adjacent, at consecutive positions from at most its length; a
    lockstep batch stage takes no such rows."""
    pipe = _pipe(tiny_dir("llama"), 2)
    pipe.select(0)
    pipe.prefill([1, 2, 3])
    for toks, lanes, pos in (([4, 5], [0, 0], [3, 5]),      # a gap inside the slot's rows
                             ([4, 5], [0, 0], [4, 3]),      # out of order
                             ([4, 5, 6], [0, 1, 0], [3, 0, 4]),  # the slot's rows apart
                             ([4, 5, 6], [0, 1, 0], [3, 0, 3]),  # the same position twice
                             ([4, 5], [0, 0], [4, 5])):     # starts past the slot's length
        with pytest.raises(ValueError):
            pipe.forward_rows(toks, lanes, pos)
    assert [st.length for st in pipe.stages[0].lanes] == [3, 0]
    pipe.forward_rows([4, 5, 6], [0, 0, 1], [3, 4, 0])
    assert [st.length for st in pipe.stages[0].lanes] == [5, 1]
    if kernels.enabled() and kernels.load():               # the op itself refuses a slot's rows out of order
        bank = torch.zeros(2, 2, 16, 8)
        qkv = torch.zeros(1, 2, (4 + 4) * 8)
        cs = torch.zeros(2, 8)
        with pytest.raises(RuntimeError, match="increasing positions"):
            torch.ops.dflash.attention_rows(qkv, cs, cs, bank, bank.clone(), [0, 0], [3, 3], 4, 2, 1.0)
    lockstep = _pipe(tiny_dir("llama"), 1, batch=2)      # a lockstep batch (draft-training sampling)
    assert not lockstep.supports_ragged
