"""Memory estimate before loading (runtime/memory.py): KV exactly what the stages
preallocate, weights close to what they hold in each mode, and a GPU share that does not
fit stops start-up with the numbers and the ways out."""
import pytest
import torch

from dflash_server.cli.common import check_memory
from dflash_server.errors import UserError
from dflash_server.runtime import memory
from dflash_server.runtime.placement import plan_placement
from dflash_server.weights.loader import open_model
from helpers.build import pipeline


def _held(stage) -> int:
    """Bytes of every weight a local stage holds (parameters of its modules, once each)."""
    mods = [m for m in (stage.embed, stage.final_norm, stage.lm_head, *stage.layers) if m is not None]
    seen, total = set(), 0
    for m in mods:
        for t in (*m.parameters(), *(b for b in m.buffers())):
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
        for lin in m.modules():
            if getattr(lin, "scales", None) is not None and id(lin.scales) not in seen:
                seen.add(id(lin.scales))
                total += lin.scales.numel() * lin.scales.element_size()
    return total


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
@pytest.mark.parametrize("dtype, quantize", [(torch.float32, "dense"), (torch.bfloat16, ("int8", "int8"))])
def test_estimate_matches_what_the_stages_hold(tiny_dir, monkeypatch, family, dtype, quantize):
    monkeypatch.setenv("DFLASH_KERNELS", "0")  # the aten int8 layout the estimate models
    path = tiny_dir(family)
    src = open_model(path)
    shards = plan_placement(src.config.num_layers, ["cpu", "cpu"])
    needs = memory.estimate(src, shards, dtype, 384, quantize)
    pipe = pipeline(path, stages=2, dtype=dtype, max_ctx=384, quantize=quantize)
    for need, stage in zip(needs, pipe.stages):
        assert need.kv == stage.kv_bytes()  # exact: the same rows, heads and fp32 on the CPU
        held = _held(stage)
        assert abs(need.weights - held) <= 0.1 * held, (need.weights, held)


def test_a_gpu_share_that_does_not_fit_stops_start_up(tiny_dir, monkeypatch):
    src = open_model(tiny_dir("llama"))
    shards = plan_placement(src.config.num_layers, ["cuda:0", "cpu"])
    needs = memory.estimate(src, shards, torch.bfloat16, 4096, "dense")
    gpu = needs[0]
    assert gpu.device == "cuda:0" and gpu.kv > 0
    memory.check_fits(needs, {"cuda:0": gpu.total + memory.GPU_RESERVE})  # just fits
    with pytest.raises(ValueError, match=r"does not fit on cuda:0.*--max-ctx.*--kvflash auto.*--quantize int4"):
        memory.check_fits(needs, {"cuda:0": gpu.total + memory.GPU_RESERVE - 1})
    memory.check_fits(needs, {})  # CPU shares are printed, never refused
    monkeypatch.setattr(memory, "gpu_free", lambda needs: {"cuda:0": 1 << 20})
    with pytest.raises(UserError, match="does not fit on cuda:0"):
        check_memory(src, shards, torch.bfloat16, 4096, "dense", None, progress=False)


def test_quantized_modes_shrink_the_estimate(tiny_dir):
    src = open_model(tiny_dir("llama"))
    shards = plan_placement(src.config.num_layers, ["cpu"])
    dense, int8, int4 = (memory.estimate(src, shards, torch.bfloat16, 256, q)[0].weights
                         for q in ("dense", ("int8", "int8"), ("int4", "int8")))
    assert int4 < int8 < dense


def test_a_quantized_gguf_stays_quantized_on_a_gpu():
    """`--quantize auto` on CUDA keeps a GGUF's weights quantized (they used to become bf16):
    4-bit layers -> int4 (aten's CUDA kernel), the head never below int8; the estimate
    shrinks accordingly. (The kernels themselves run in the GPU check.)"""
    from dflash_server.cli.common import quantize_plan
    from dflash_server.weights.default_model import default_model_path

    src = open_model(default_model_path())
    assert quantize_plan(src, "auto", False, cuda=True) == ("int4", "int8")
    assert quantize_plan(src, "auto", False) == ("dense", "dense")
    shards = plan_placement(src.config.num_layers, ["cuda:0"])
    dense = memory.estimate(src, shards, torch.bfloat16, 2048, "dense")[0]
    quant = memory.estimate(src, shards, torch.bfloat16, 2048, ("int4", "int8"))[0]
    assert quant.kv == dense.kv and quant.weights < 0.65 * dense.weights
