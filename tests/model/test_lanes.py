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


def _pipe(path, lanes, quantize="int8", dtype=torch.bfloat16, stages=1):
    src = open_model(path)
    shards = plan_placement(src.config.num_layers, ["cpu"] * stages, None)
    return build_pipeline(src, shards, dtype=dtype, max_ctx=256, quantize=quantize, progress=False, lanes=lanes)


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
