"""The KV cache's element type (``--kv-dtype``): auto's choice, memory, numerics on both
attention paths, and the snapshot fingerprint."""
import pytest
import torch

from dflash_server import kernels
from dflash_server.layers.attention import cache_dtype
from dflash_server.runtime.placement import plan_placement
from dflash_server.weights.loader import open_model
from helpers.build import greedy, pipeline, prompt_ids


def test_auto_chooses_f16_where_the_native_attention_reads_the_cache():
    assert cache_dtype("auto", "cpu", torch.bfloat16, True) == torch.float16
    assert cache_dtype("auto", "cpu", torch.float16, True) == torch.float16
    assert cache_dtype("auto", "cpu", torch.float32, True) == torch.float32     # fp32 runs stay fp32
    assert cache_dtype("auto", "cpu", torch.bfloat16, False) == torch.float32   # aten's CPU attention
    assert cache_dtype("auto", "cuda:0", torch.bfloat16, False) == torch.bfloat16
    assert cache_dtype("bf16", "cpu", torch.float32, True) == torch.bfloat16
    assert cache_dtype("f32", "cuda", torch.bfloat16, True) == torch.float32
    with pytest.raises(ValueError, match="KV cache dtype"):
        cache_dtype("f8", "cpu", torch.float32, True)


def test_16_bit_caches_halve_the_kv_and_the_estimate_agrees(tiny_dir):
    """Default serving dtype (bf16 activations, int8 layers): auto == f16; f16 and bf16 caches
    hold half the bytes of f32, and the memory estimate (``--parallel auto``'s and the GPU
    check's) counts exactly what the stages allocate."""
    from dflash_server.runtime.memory import estimate

    path = tiny_dir("llama")
    src = open_model(path)
    shards = plan_placement(src.config.num_layers, ["cpu"], None)
    sizes = {}
    for kv in ("auto", "f32", "f16", "bf16"):
        pipe = pipeline(path, dtype=torch.bfloat16, max_ctx=256, quantize="int8", lanes=2, kv_dtype=kv)
        (stage,) = pipe.stages
        banks = [b for b in stage.banks if b is not None]
        want = {"auto": torch.float16 if kernels.load() else torch.float32, "f32": torch.float32,
                "f16": torch.float16, "bf16": torch.bfloat16}[kv]
        assert banks and all(b.k.dtype == want and b.v.dtype == want for b in banks), kv
        sizes[kv] = pipe.kv_bytes()
        (need,) = estimate(src, shards, torch.bfloat16, 256, "int8", lanes=2, kv_dtype=kv)
        assert need.kv == sizes[kv], kv
    assert sizes["f32"] == 2 * sizes["f16"] == 2 * sizes["bf16"]


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("kv", ["f16", "bf16"])
def test_16_bit_caches_stay_close_to_fp32_on_both_attention_paths(tiny_dir, monkeypatch, native, kv):
    """fp32 activations, a 16-bit cache: keys and values rounded once at the write, attention
    in fp32 (the native step reads the 16-bit values; aten's path widens them), so the
    logits stay within the cache's rounding of the fp32 cache's, over a prefill and decode."""
    monkeypatch.setenv("DFLASH_KERNELS", "1" if native else "0")
    if native and not kernels.load():
        pytest.skip("native kernels unavailable: " + str(kernels.status()))
    path = tiny_dir("llama")
    ref, low = pipeline(path, max_ctx=256, kv_dtype="f32"), pipeline(path, max_ctx=256, kv_dtype=kv)
    assert low.stages[0].layers[0].mixer.native == native
    ids = prompt_ids(ref, 40)
    tol = {"f16": 5e-3, "bf16": 4e-2}[kv]
    def last(pipe, toks, start):
        return pipe.forward(torch.tensor([toks]), start).logits.float().reshape(-1)[-ref.config.vocab_size:]

    for pipe in (ref, low):
        pipe.reset()
    a, b = last(ref, ids, 0), last(low, ids, 0)
    scale = a.abs().max().item()
    assert (a - b).abs().max().item() < tol * scale
    for t in range(6):   # decode steps over the 16-bit cache
        tok = [int(a.argmax())]
        a, b = last(ref, tok, len(ids) + t), last(low, tok, len(ids) + t)
        assert (a - b).abs().max().item() < tol * scale, t
    assert low.stages[0].banks[0].k.dtype == {"f16": torch.float16, "bf16": torch.bfloat16}[kv]


def test_native_and_aten_read_a_16_bit_cache_alike(tiny_dir, monkeypatch):
    """The same 16-bit cache values through the native step and through aten's attention: the
    same greedy tokens (a cache written by one path is read correctly by the other)."""
    path = tiny_dir("llama")
    monkeypatch.setenv("DFLASH_KERNELS", "1")
    if not kernels.load():
        pytest.skip("native kernels unavailable")
    nat = pipeline(path, max_ctx=256, kv_dtype="f16")
    monkeypatch.setenv("DFLASH_KERNELS", "0")
    ate = pipeline(path, max_ctx=256, kv_dtype="f16")
    ids = prompt_ids(nat, 30)
    assert greedy(nat, ids, 12) == greedy(ate, ids, 12)


def test_the_snapshot_fingerprint_names_a_16_bit_cache(tiny_dir, tmp_path):
    """A disk snapshot restores only into caches of its own type: the fingerprint (its cache
    directory) differs between f16 and f32 caches, and is unchanged for fp32 caches (so the
    caches written before the option stay valid)."""
    from dflash_server.cli.common import load_engine
    from dflash_server.engine.config import EngineConfig

    prints = {}
    for kv in ("f32", "f16", "bf16"):
        cfg = EngineConfig(model=str(tiny_dir("llama")), device="cpu", dtype="bf16", max_ctx=64, kv_dtype=kv,
                           kv_cache_dir=str(tmp_path / "kv"))
        _, _, engine = load_engine(cfg, progress=False)
        prints[kv] = engine.fingerprint
        engine.close()
    assert len(set(prints.values())) == 3


def test_compile_keeps_an_fp32_cache_under_auto(tiny_dir):
    """``--compile``'s graphs attend with aten, which reads fp32 fastest on a CPU: there auto
    keeps the cache fp32 (an explicit --kv-dtype still wins)."""
    from dflash_server.cli.common import load_engine
    from dflash_server.engine.config import EngineConfig

    for kv, want in (("auto", torch.float32), ("f16", torch.float16)):
        cfg = EngineConfig(model=str(tiny_dir("llama")), device="cpu", dtype="bf16", max_ctx=64, compile=True,
                           kv_dtype=kv)
        _, pipeline, engine = load_engine(cfg, progress=False)
        try:
            assert {b.k.dtype for b in pipeline.stages[0].banks if b is not None} == {want}, kv
        finally:
            engine.close()



@pytest.mark.parametrize("a,b", [
    ({"kernels": "aten"}, {"kernels": "native"}),
    ({"kvflash": "32", "kvflash_chunk": 8, "kvflash_policy": "lru"},
     {"kvflash": "32", "kvflash_chunk": 8, "kvflash_policy": "score"}),
    ({"kvflash": "32", "kvflash_chunk": 8, "kvflash_policy": "score", "kvflash_tau": 4},
     {"kvflash": "32", "kvflash_chunk": 8, "kvflash_policy": "score", "kvflash_tau": 64}),
])
def test_the_snapshot_fingerprint_names_kernels_and_kvflash_policy(tiny_dir, tmp_path, monkeypatch, a, b):
    """Hostile review (2026-11-27): a snapshot written with the aten kernels and restored into
    the native ones (or across KV Flash residency policies) continued differently from a fresh
    prefill; the fingerprint (its cache directory) now names both."""
    from dflash_server.cli.common import load_engine
    from dflash_server.engine.config import EngineConfig

    monkeypatch.setenv("DFLASH_KERNELS", "1")     # load_engine sets it from cfg.kernels
    prints = []
    for extra in (a, b):
        cfg = EngineConfig(model=str(tiny_dir("llama")), device="cpu", dtype="bf16", max_ctx=64, kv_dtype="f32",
                           kv_cache_dir=str(tmp_path / "kv"), **extra)
        _, _, engine = load_engine(cfg, progress=False)
        prints.append(engine.fingerprint)
        engine.close()
    assert prints[0] != prints[1]
