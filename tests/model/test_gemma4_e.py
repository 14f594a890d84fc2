"""Gemma 4 E2B / E4B shape: per-layer inputs (PLE) and the last layers attending over earlier
layers' KV (with double-wide MLPs). transformers is the reference (test_parity_hf); here:
splits anywhere (inside the KV-shared range too, in-process and to a shard worker) equal one
stage, hostile carries are refused, and the GGUF form loads as the safetensors one."""
import pytest
import torch

from helpers.build import greedy, pipeline, prompt_ids
from helpers.gguf_export import export_gguf
from helpers.qwen_tokenizer import gguf_tokenizer_metadata_from_hf


@pytest.mark.parametrize("stages,split", [(2, [1, 5]), (2, [2, 4]), (2, [4, 2]), (3, [1, 2, 3]), (3, [3, 1, 2])])
def test_split_equals_unsplit(tiny_dir, stages, split):
    """Stage boundaries anywhere, inside the KV-shared range too: a later stage mirrors the
    source's KV from the rows the earlier one carries, with the per-layer inputs."""
    path = tiny_dir("gemma4_e")
    ref_pipe = pipeline(path)
    ids = prompt_ids(ref_pipe, 40)
    ref = greedy(ref_pipe, ids, max_tokens=16)
    pipe = pipeline(path, stages=stages, split=split)
    assert greedy(pipe, ids, max_tokens=16) == ref
    assert all(st.embed is None for st in pipe.stages[1:])  # the per-layer inputs came from stage 0
    roles = [l.mixer.kv_role for st in pipe.stages for l in st.layers]
    assert len(roles) == 6 and (split == [1, 5]) == ("mirror" not in roles)


def test_shard_worker_inside_the_shared_range(tiny_dir):
    """A shard worker holding KV-shared layers whose sources stay here (layers 4-5 of 6, reading
    layers 1 and 2): equal to one stage, prefix hits included."""
    from dflash_server.engine.generate import Engine, GenerationRequest

    path = tiny_dir("gemma4_e")
    ref_pipe = pipeline(path)
    ids = prompt_ids(ref_pipe, 40)
    ref = greedy(ref_pipe, ids, max_tokens=16)
    pipe = pipeline(path, devices=["cpu", "remote:cpu"], split=[4, 2])
    try:
        assert greedy(pipe, ids, max_tokens=16) == ref
        eng = Engine(pipe, prefix_slots=4)
        turn = [{"role": "system", "content": "You are terse. " * 6}, {"role": "user", "content": "Hi there"}]
        req = GenerationRequest(tuple(eng.tokenizer.encode_chat(turn)), max_tokens=8, ignore_eos=True)
        first, second = eng.generate(req), eng.generate(req)
        assert second.cached_tokens > 0 and first.token_ids == second.token_ids
        cold = Engine(pipeline(path)).generate(req)  # the worker's prefix-hit answer == one stage's
        assert cold.token_ids == first.token_ids
    finally:
        pipe.close()


@pytest.mark.parametrize("split,bounds", [([2, 4], (0, 1, 6)), ([3, 3], (0, 1, 6)), ([5, 1], (0, 1, 6))])
def test_automatic_placement_keeps_shared_layers_with_their_sources(split, bounds):
    """Layers 3-5 read layers 1 and 2: a boundary placed automatically moves out of 1-5 (no KV
    rows cross then) where every shard keeps a layer, else it stays (KV rows cross)."""
    from dflash_server.runtime.placement import plan_placement

    shards = plan_placement(6, ["cpu", "cpu"], split, together=((1, 5),))
    assert (shards[0].begin, shards[0].end, shards[1].end) == bounds
    assert [(s.begin, s.end) for s in plan_placement(8, ["cpu"] * 2, together=((1, 5),))] == [(0, 6), (6, 8)]
    assert [(s.begin, s.end) for s in plan_placement(6, ["cpu"] * 3, together=((1, 5),))] == [(0, 1), (1, 4), (4, 6)]


def test_hostile_carry_is_a_clear_error(tiny_dir):
    """A stage given wrongly shaped per-layer inputs or K/V rows (a confused or hostile peer)
    refuses them."""
    from dflash_server.runtime.carry import carry_from_tensors

    pipe = pipeline(tiny_dir("gemma4_e"), stages=2, split=[4, 2])
    first, second = pipe.stages
    out = first.forward(torch.tensor([[5, 6, 7]]), 0)
    with pytest.raises(ValueError, match="per-layer inputs"):
        second.forward(out.hidden, 0, carry={**out.carry, "per_layer": out.carry["per_layer"][:, :, :3]})
    bad = {key: (k[:, :1], v[:, :1]) for key, (k, v) in out.carry["kv"].items()}
    with pytest.raises(ValueError, match="carried K/V rows"):
        second.forward(out.hidden, 0, carry={**out.carry, "kv": bad})
    with pytest.raises(ValueError, match="carry tensor"):
        carry_from_tensors({"carry.k.full": torch.zeros(1)})
    with pytest.raises(ValueError, match="carry tensor"):
        carry_from_tensors({"carry.q.full": torch.zeros(1), "carry.v.full": torch.zeros(1)})


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


def test_kvflash_and_slots_across_the_shared_split(tiny_dir):
    """KV Flash pools on both sides of a boundary inside the KV-shared range (the mirror pages
    with its own stage's pool), and sequence slots batched across it: both == one stage."""
    from dflash_server.engine.generate import Engine, GenerationRequest
    from dflash_server.runtime.kv_pager import KvFlashConfig
    from dflash_server.runtime.pipeline import build_pipeline
    from dflash_server.runtime.placement import ShardSpec
    from dflash_server.weights.loader import open_model

    path = tiny_dir("gemma4_e")
    ref_pipe = pipeline(path)
    prompts = [prompt_ids(ref_pipe, 30 + 7 * k, seed=k) for k in range(3)]
    refs = [greedy(ref_pipe, p, max_tokens=12) for p in prompts]
    src = open_model(path)
    shards = [ShardSpec("cpu", 0, 4), ShardSpec("cpu", 4, 6)]
    pooled = build_pipeline(src, shards, dtype=torch.float32, max_ctx=512, progress=False,
                            kvflash=KvFlashConfig(256, chunk=16))
    assert [greedy(pooled, p, max_tokens=12) for p in prompts] == refs
    laned = build_pipeline(src, shards, dtype=torch.float32, max_ctx=512, progress=False, lanes=3)
    eng = Engine(laned)
    seqs = [eng.submit(GenerationRequest(tuple(p), max_tokens=12, ignore_eos=True)) for p in prompts]
    while eng.has_work:
        eng.step()
    assert [s.result.token_ids for s in seqs] == refs
