"""Gemma 4 E2B / E4B shape: per-layer inputs (PLE) and the last layers attending over earlier
layers' KV (with double-wide MLPs). transformers is the reference (test_parity_hf); here: an
in-process split carries the per-layer inputs, a boundary between a KV-shared layer and its
source or a shard worker is refused clearly, and the GGUF form loads as the safetensors one."""
import pytest
import torch

from helpers.build import greedy, pipeline, prompt_ids
from helpers.gguf_export import export_gguf
from helpers.qwen_tokenizer import gguf_tokenizer_metadata_from_hf


def test_split_before_the_shared_source_equals_unsplit(tiny_dir):
    path = tiny_dir("gemma4_e")
    ref_pipe = pipeline(path)
    ids = prompt_ids(ref_pipe, 40)
    ref = greedy(ref_pipe, ids, max_tokens=16)
    pipe = pipeline(path, stages=2, split=[1, 5])  # layers 3-5 read layers 1 and 2: 1-5 stay together
    assert greedy(pipe, ids, max_tokens=16) == ref
    assert pipe.stages[1].embed is None  # the per-layer inputs came from stage 0


@pytest.mark.parametrize("split,bounds", [([2, 4], (0, 1, 6)), ([3, 3], (0, 1, 6)), ([5, 1], (0, 1, 6))])
def test_placement_keeps_shared_layers_with_their_sources(split, bounds):
    """Layers 3-5 read layers 1 and 2: every boundary inside 1-5 moves out of it, and a
    placement with no room outside is refused."""
    from dflash_server.runtime.placement import plan_placement

    shards = plan_placement(6, ["cpu", "cpu"], split, together=((1, 5),))
    assert (shards[0].begin, shards[0].end, shards[1].end) == bounds
    assert [(s.begin, s.end) for s in plan_placement(8, ["cpu"] * 2, together=((1, 5),))] == [(0, 6), (6, 8)]
    with pytest.raises(ValueError, match="together"):
        plan_placement(6, ["cpu"] * 3, together=((1, 5),))


def test_stage_boundary_inside_the_shared_range_is_refused(tiny_dir):
    """A stage given layers whose KV source is on another stage (a hand-made placement, a
    shard worker's spec) refuses to build."""
    from dflash_server.runtime.pipeline import build_pipeline
    from dflash_server.runtime.placement import ShardSpec
    from dflash_server.weights.loader import open_model

    src = open_model(tiny_dir("gemma4_e"))
    with pytest.raises(ValueError, match="KV-shared layers"):
        build_pipeline(src, [ShardSpec("cpu", 0, 3), ShardSpec("cpu", 3, 6)], dtype=torch.float32, max_ctx=64,
                       progress=False)


def test_shard_worker_refused_for_per_layer_inputs(tiny_dir):
    with pytest.raises(ValueError, match="shard worker"):
        pipeline(tiny_dir("gemma4_e"), devices=["cpu", "remote:cpu"], split=[1, 5])


def test_shared_layers_hold_no_state(tiny_dir):
    pipe = pipeline(tiny_dir("gemma4_e"))
    st = pipe.stages[0]
    assert [s.kind for s in st.states] == ["kv", "kv", "kv", "none", "none", "none"]
    assert [l.mlp.inter for l in st.layers] == [128, 128, 128, 256, 256, 256]  # double-wide where shared
    pipe.prefill(prompt_ids(pipe, 30))
    pipe.snapshot_save(1)
    names = sorted(pipe.snapshot_export(1))
    layers = {int(k.rsplit(".", 1)[1]) for k in names if ".kv_" in k or k.split(".")[-2].startswith("kv_")}
    assert layers == {0, 1, 2}, names  # the shared layers' KV is their sources', stored once


def test_f32_gguf_equals_safetensors(tiny_dir, tmp_path):
    src = tiny_dir("gemma4_e")
    path = export_gguf(src, tmp_path / "e.gguf", "gemma4", gguf_tokenizer_metadata_from_hf(src, pre="smollm"))
    a, b = pipeline(path), pipeline(src)
    assert a.config.per_layer_input_size == 16 and a.config.num_kv_shared_layers == 3
    ids = prompt_ids(b, 100)
    diff = (a.forward(ids, 0, logits="all").logits - b.forward(ids, 0, logits="all").logits).abs().max().item()
    assert diff < 1e-4, diff
