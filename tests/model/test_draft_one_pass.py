"""A drafted step in one native call (``DFlashDraft.pass_block`` / ``dflash::draft_pass``):
the deferred context of the positions committed since the last pass, the block through every
layer and the draft's own LM head. Checked against the per-op path (``append_context`` then
``draft_hidden`` and the head): the same proposals, hidden states and logits to rounding, the
same context afterwards; and the guards around it."""
from __future__ import annotations

import pytest
import torch

from dflash_server import kernels
from dflash_server.engine.generate import Engine, GenerationRequest
from dflash_server.spec.config import DraftConfig
from dflash_server.spec.draft import DFlashDraft
from dflash_server.spec.proposer import ONE_PASS_CONTEXT_ROWS, DFlashProposer
from helpers.build import pipeline, prompt_ids

pytestmark = pytest.mark.skipif(not (kernels.enabled() and kernels.load()), reason="no native kernels here")


def _draft(pipe, dtype, vocab: bool = False, layers: int = 2):
    c = pipe.config
    cfg = DraftConfig(hidden_size=c.hidden_size, intermediate_size=96, num_layers=layers, num_heads=4, num_kv_heads=2,
                      head_dim=16, block_size=6, mask_token_id=5, target_layer_ids=(0, 1),
                      num_target_layers=c.num_layers)
    tensors = DFlashDraft.random_tensors(cfg, 3, 0.05)
    if vocab:   # a draft vocabulary: the proposer always gets its own head then
        tensors["vocab_ids"] = torch.arange(0, c.vocab_size, 3)
    return DFlashDraft(cfg, tensors, "cpu", dtype, pipe.max_ctx, quantize="int8")


def _pair(pipe, dtype, vocab=False):
    """(one-call proposer, per-op proposer) over drafts with the same weights; ``calls``
    counts the one-call passes that ran."""
    fused, per_op = DFlashProposer(_draft(pipe, dtype, vocab), pipe), DFlashProposer(_draft(pipe, dtype, vocab), pipe)
    per_op.draft.pass_block = lambda *a, **k: None
    calls = []
    real = fused.draft.pass_block

    def counted(*a, **k):
        got = real(*a, **k)
        calls.append((got is not None, k.get("head", a[4] if len(a) > 4 else None) is not None))
        return got
    fused.draft.pass_block = counted
    return fused, per_op, calls


def _feats(pipe, n, seed):
    g = torch.Generator().manual_seed(seed)
    return {t: torch.randn(1, n, pipe.config.hidden_size, generator=g) for t in (0, 1)}


def _context(prop):
    d = prop.draft
    return [k[:, :, :d.context.length] for k in d.context.k] + [v[:, :, :d.context.length] for v in d.context.v]


@pytest.mark.parametrize("dtype,vocab", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, True)])
def test_one_pass_equals_append_then_draft(tiny_dir, dtype, vocab):
    """Steps of deferred context (1-5 rows, over the rows the last block wrote) then a block
    of 2-6 rows: every step the one-call pass gives the per-op path's hidden states and logits
    to rounding (fp32: the same proposals too), and leaves the same context (length and
    K/V to rounding: its context K/V are normed and rotated in fp32 inside the attention op).
    A bf16 draft's head runs inside the pass (it reads bf16 rows, as the head does when
    called apart); an fp32 draft's head is called apart."""
    pipe = pipeline(tiny_dir("llama"), dtype=torch.bfloat16, quantize="int8", max_ctx=256)
    fused, per_op, calls = _pair(pipe, dtype, vocab)
    def close(a, b):
        a, b = a.float(), b.float()
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        else:   # bf16 rows quantized to int8 codes in the matmuls: a rounding may move a code
            assert (a - b).norm() <= 0.02 * b.norm(), ((a - b).norm(), b.norm())
    start = 20
    for p in (fused, per_op):
        p.add_context(_feats(pipe, start, 0), 0)
    for step, (n, block) in enumerate([(1, 4), (3, 2), (5, 6), (2, 3), (1, 5)]):
        feats = _feats(pipe, n, step + 1)
        for p in (fused, per_op):
            p.add_context(feats, start, n, defer=True)
        start += n
        (h0, l0), (h1, l1) = (p._draft_hidden_logits(11 + step, start, block) for p in (per_op, fused))
        assert h1.shape == h0.shape == (block - 1, pipe.config.hidden_size) and l1.shape == l0.shape
        close(h1, h0)
        close(l1, l0)
        assert fused.draft.context.length == per_op.draft.context.length == start
        for a, b in zip(_context(fused), _context(per_op)):
            close(a, b)
        if dtype == torch.float32:   # bf16 random drafts may hold near-ties the rounding flips
            assert fused.propose(11 + step, start, block) == per_op.propose(11 + step, start, block)
    assert calls and all(ran for ran, _ in calls)
    assert all(head == (dtype == torch.bfloat16) for _, head in calls)


def test_many_deferred_rows_are_appended_first(tiny_dir):
    """More deferred rows than a pass takes along (``ONE_PASS_CONTEXT_ROWS``) are appended on
    their own first, then the block drafts in one call: the same result as the per-op path."""
    pipe = pipeline(tiny_dir("llama"), dtype=torch.bfloat16, quantize="int8", max_ctx=256)
    fused, per_op, calls = _pair(pipe, torch.float32)
    n = ONE_PASS_CONTEXT_ROWS + 9
    for p in (fused, per_op):
        p.add_context(_feats(pipe, 10, 0), 0)
        for i in range(n):   # plain steps: one deferred row each
            p.add_context({t: f[:, i:i + 1] for t, f in _feats(pipe, n, 1).items()}, 10 + i, 1, defer=True)
    assert len(fused._pending) == n
    out = [p._draft_hidden_logits(7, 10 + n, 4) for p in (per_op, fused)]
    assert fused._pending == [] and fused.draft.context.length == 10 + n
    torch.testing.assert_close(out[1][0], out[0][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[1][1], out[0][1], rtol=1e-4, atol=1e-4)
    assert calls == [(True, False)]


def test_pass_block_refuses_a_context_it_cannot_continue(tiny_dir):
    """A block or context rows that do not continue the context are a ValueError before the
    op runs (the context unchanged); a block past the context cache is left to the per-op
    path (None), which refuses it as before."""
    pipe = pipeline(tiny_dir("llama"), dtype=torch.bfloat16, quantize="int8", max_ctx=64)
    prop = DFlashProposer(_draft(pipe, torch.bfloat16), pipe)
    d = prop.draft
    prop.add_context(_feats(pipe, 10, 0), 0)
    before = [t.clone() for t in _context(prop)]
    emb = prop.block_embeds(torch.tensor([[3, 5, 5]]))
    feats = torch.randn(1, 2, 2 * pipe.config.hidden_size)
    with pytest.raises(ValueError, match="cannot write"):
        d.pass_block(emb, 12, feats, 11)          # rows [11, 13) do not end at the block's start
    with pytest.raises(ValueError, match="cannot write"):
        d.pass_block(emb, 14, feats, 12)          # a gap after the context (10 positions)
    with pytest.raises(ValueError, match="cannot write"):
        d.pass_block(emb, 12)                     # the block does not start at the context's end
    assert d.context.length == 10 and all(torch.equal(a, b) for a, b in zip(_context(prop), before))
    assert d.pass_block(emb, d.max_ctx - 1) is None
    with pytest.raises(ValueError):
        prop.propose(3, d.max_ctx - 1, 3)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_dflash_with_the_one_call_pass_is_lossless(tiny_dir, family):
    """Greedy DFlash with a bf16 int8 draft (the serving configuration's kind: every drafted
    step one native call) writes exactly plain decoding's tokens, fixed and adaptive blocks."""
    pipe = pipeline(tiny_dir(family), dtype=torch.bfloat16, quantize="int8", max_ctx=256)
    plain = Engine(pipe)
    for adaptive in (False, True):
        prop = DFlashProposer(_draft(pipe, torch.bfloat16), pipe, 4, adaptive=adaptive)
        runs = []
        real = prop.draft.pass_block
        prop.draft.pass_block = lambda *a, **k: runs.append(1) or real(*a, **k)
        eng = Engine(pipe, proposer=prop)
        for n in (5, 13):
            req = GenerationRequest(tuple(prompt_ids(pipe, n, seed=n)), max_tokens=24, ignore_eos=True)
            assert eng.generate(req).token_ids == plain.generate(req).token_ids
        assert runs
