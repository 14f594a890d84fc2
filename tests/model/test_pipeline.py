"""Staged pipeline: split == unsplit, snapshots, checkpoint/rollback."""
import pytest
import torch

from helpers.build import greedy, pipeline, prompt_ids

FAMILIES = ["llama", "qwen3_5", "gemma3", "gemma4", "gemma4_moe", "gemma4_e", "laguna"]


@pytest.mark.parametrize("family", FAMILIES)
def test_split_equals_unsplit(tiny_dir, family):
    path = tiny_dir(family)
    ref_pipe = pipeline(path)
    ids = prompt_ids(ref_pipe, 40)
    ref = greedy(ref_pipe, ids, max_tokens=20)
    for stages, split in ((2, None), (2, [1, 2]), (3, None), (3, [2, 1, 3])):
        pipe = pipeline(path, stages=stages, split=split)
        assert len(pipe.stages) == stages
        assert greedy(pipe, ids, max_tokens=20) == ref, (stages, split)


@pytest.mark.parametrize("family", FAMILIES)
def test_stage_loads_only_its_layers(tiny_dir, family):
    pipe = pipeline(tiny_dir(family), stages=2)
    a, b = pipe.stages
    assert [l.index for l in a.layers] == list(range(a.begin, a.end))
    assert [l.index for l in b.layers] == list(range(b.begin, b.end))
    assert a.embed is not None and a.lm_head is None
    assert b.embed is None and b.lm_head is not None


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_snapshot_restore_equals_uninterrupted(tiny_dir, family, stages):
    pipe = pipeline(tiny_dir(family), stages=stages)
    ids = prompt_ids(pipe, 60)
    pipe.reset()
    pipe.prefill(ids[:40])
    pipe.snapshot_save(7)
    uninterrupted = pipe.prefill(ids[40:], start=40).logits
    # clobber the live state, then restore and continue
    pipe.reset()
    pipe.prefill(prompt_ids(pipe, 50, seed=3))
    pipe.snapshot_restore(7)
    assert pipe.length == 40
    resumed = pipe.prefill(ids[40:], start=40).logits
    assert torch.equal(resumed, uninterrupted)
    # export/import round trip into a fresh pipeline
    exported = pipe.snapshot_export(7)
    assert all(k.startswith("ls") for k in exported)
    other = pipeline(tiny_dir(family), stages=stages)
    other.snapshot_import(1, exported)
    other.snapshot_restore(1)
    assert torch.equal(other.prefill(ids[40:], start=40).logits, uninterrupted)
    pipe.snapshot_free(7)
    with pytest.raises(KeyError):
        pipe.snapshot_restore(7)


@pytest.mark.parametrize("family", FAMILIES)
def test_snapshot_import_rejects_mismatch(tiny_dir, family):
    pipe = pipeline(tiny_dir(family))
    pipe.reset()
    pipe.prefill(prompt_ids(pipe, 10))
    pipe.snapshot_save(0)
    good = pipe.snapshot_export(0)
    name = next(k for k in good if k != "ls0.length")
    bad = dict(good)
    bad[name] = torch.zeros(3, 3)
    with pytest.raises(ValueError):
        pipe.snapshot_import(1, bad)
    missing = dict(good)
    del missing[name]
    with pytest.raises(ValueError):
        pipe.snapshot_import(1, missing)


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_rollback_then_continue_equals_fresh(tiny_dir, family, stages):
    pipe = pipeline(tiny_dir(family), stages=stages)
    ids = prompt_ids(pipe, 50)
    p, k = 30, 8  # committed prefix, speculative block
    for j in (0, 1, 5, 8):
        pipe.reset()
        pipe.prefill(ids[:p])
        pipe.checkpoint()
        junk = prompt_ids(pipe, k, seed=11 + j)
        pipe.forward(junk[:3], p)  # the block may arrive in more than one forward
        pipe.forward(junk[3:], p + 3)
        # keep the first j block tokens only if they are the real ones
        if j:
            pipe.rollback(p)
            pipe.checkpoint()
            pipe.forward(ids[p:p + k], p)
        pipe.rollback(p + j)
        assert pipe.length == p + j
        cont = pipe.prefill(ids[p + j:], start=p + j).logits
        pipe.reset()
        fresh = pipe.prefill(ids).logits
        assert (cont - fresh).abs().max().item() < 1e-4, j


def test_rollback_requires_checkpoint(tiny_dir):
    pipe = pipeline(tiny_dir("qwen3_5"))
    pipe.reset()
    pipe.prefill([1, 2, 3])
    with pytest.raises(RuntimeError):
        pipe.rollback(2)
    pipe.checkpoint()
    pipe.forward([4, 5], 3)
    with pytest.raises(ValueError):
        pipe.rollback(1)  # before the checkpoint


def test_forward_beyond_context_rejected(tiny_dir):
    pipe = pipeline(tiny_dir("llama"), max_ctx=16)
    pipe.reset()
    with pytest.raises(ValueError):
        pipe.prefill(list(range(20)))


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_lockstep_equals_single(tiny_dir, family):
    """batch > 1 (used to sample training data): each row equals its own batch-1 run."""
    from dflash_server.runtime.pipeline import build_pipeline
    from dflash_server.runtime.placement import plan_placement
    from dflash_server.weights.loader import open_model

    src = open_model(tiny_dir(family))
    batched = build_pipeline(src, plan_placement(src.config.num_layers, ["cpu", "cpu"]), dtype=torch.float32,
                             max_ctx=128, progress=False, batch=3)
    single = pipeline(tiny_dir(family), stages=2, max_ctx=128)
    ids = prompt_ids(single, 20)
    conts = [[11, 12, 13], [21, 22, 23], [31, 32, 33]]
    batched.reset()
    batched.prefill(ids)
    rows = []
    for j in range(3):
        rows.append(batched.forward(torch.tensor([[c[j]] for c in conts]), 20 + j, logits="last").logits)
    for b, cont in enumerate(conts):
        single.reset()
        single.prefill(ids)
        for j, t in enumerate(cont):
            ref = single.forward([t], 20 + j).logits[-1]
            assert (rows[j][b, -1] - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["gemma3", "laguna"])
def test_sliding_layers_snapshot_only_their_window(tiny_dir, family):
    """A snapshot keeps a sliding-window layer's last ``window`` KV rows (all a continuation
    reads), full layers all of theirs; restoring it continues exactly (the test above)."""
    pipe = pipeline(tiny_dir(family))
    cfg = pipe.config
    pipe.prefill(prompt_ids(pipe, 60))
    pipe.snapshot_save(2)
    tensors = pipe.snapshot_export(2)
    for i, kind in enumerate(cfg.layer_types):
        k = next(v for name, v in tensors.items() if name.endswith(f"kv_k.{i}"))
        assert k.shape[2] == (cfg.sliding_window if kind == "sliding_attention" else 60), (i, kind, k.shape)
