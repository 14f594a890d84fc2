"""Native kernels (dflash::qmm): each GGUF block type against an fp64 reference, row
counts 1..64 and odd shapes, row-count invariance, every instruction-set path bit-equal,
torch.compile tracing, hostile arguments, and the fallback when nothing can be built."""
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from safetensors.torch import load_file

from dflash_server import kernels
from dflash_server.layers.linear import Linear

TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


@pytest.fixture(scope="module", autouse=True)
def built():
    assert kernels.load(), kernels.status()  # CI has a compiler: the kernels must build there
    os.environ["DFLASH_KERNELS"] = "1"  # quantized linears use them (opt-in)
    yield
    os.environ.pop("DFLASH_KERNELS")


K_TYPES = ("Q4_K", "Q5_K", "Q6_K")
D_AT = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # byte offsets of fp16 super-block scales


def kquant_blocks(qname: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random K-quant super-blocks (gguf has no K-quant quantizer): random codes, 6-bit
    scales and mins, int8 Q6_K scales, and sane fp16 d / dmin."""
    g = np.random.default_rng(seed)
    size = gguf.GGML_QUANT_SIZES[getattr(GGMLQuantizationType, qname)][1]
    b = g.integers(0, 256, size=(n, k // 256, size), dtype=np.uint8)
    for off in D_AT[qname]:
        b[..., off:off + 2] = (g.uniform(2e-4, 2e-3, size=(n, k // 256)).astype(np.float16)
                               .view(np.uint8).reshape(n, k // 256, 2))
    return b.reshape(n, -1)


def gguf_rows(qname: str, n: int, k: int, seed: int = 0):
    """Random weights quantized by gguf's reference quantizer (K-quants: random blocks):
    (dequantized fp64 by gguf's reference dequantizer, rows)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).numpy()
    qt = getattr(GGMLQuantizationType, qname)
    blocks = kquant_blocks(qname, n, k, seed) if qname in K_TYPES else gguf.quants.quantize(w, qt)
    deq = torch.from_numpy(gguf.quants.dequantize(blocks, qt).reshape(n, k)).double()
    return deq, kernels.PackedRows(qname, torch.from_numpy(np.ascontiguousarray(blocks).view(np.uint8)).reshape(n, -1))


def q8_reference(x: torch.Tensor, deq: torch.Tensor) -> torch.Tensor:
    """fp64 of what the op computes: activations rounded to int8 per block of 32."""
    xb = x.double().reshape(x.shape[0], -1, 32)
    d = (xb.abs().amax(-1, keepdim=True).float() / 127).double()
    q = torch.where(d > 0, torch.round(xb / d), torch.zeros_like(xb)).clamp(-127, 127)
    return (q * d).reshape(x.shape) @ deq.T


@pytest.mark.parametrize("qname, n, k", [(q, n, k) for q in TYPES for n, k in ((1, 32), (7, 96), (33, 576), (130, 1536))]
                         + [(q, n, k) for q in K_TYPES for n, k in ((1, 256), (7, 512), (33, 768), (130, 1536))])
def test_matches_fp64_reference(qname, n, k):
    deq, rows = gguf_rows(qname, n, k)
    qtype, packed = kernels.repack(rows, k)
    for m in (1, 2, 3, 5, 8, 17, 64):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        y = torch.ops.dflash.qmm(x, packed, qtype, n, k).double()
        ref = q8_reference(x, deq)
        scale = ref.abs().max().clamp(min=1e-6)
        # same arithmetic up to float rounding (a rare tie in the activation rounding aside)
        assert ((y - ref).abs().max() / scale).item() < 2e-3, (qname, n, k, m)
        mag = (x.double().abs() @ deq.abs().T).max()  # sum of |terms|: int8 rounding is ~1/254 of it
        assert ((y - x.double() @ deq.T).abs().max() / mag).item() < 1e-2  # int8 activations vs exact


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("qname, n, k", [("Q4_1", 96, 576), ("Q8_0", 64, 96), ("Q6_K", 40, 256), ("Q4_0", 13, 64)])
def test_fused_norm_activation_and_residual_are_the_separate_ops(dtype, qname, n, k):
    """qmm_fused(x, w, ..., residual=r) == r + qmm(x, w, ...) bit for bit (the product rounded to the
    dtype, then one rounded sum, as aten adds), for 1..64 rows, non-finite residuals included
    (NaN where aten gives NaN);
    an N that is no multiple of 8 (13) and a residual of another dtype take the unfused form."""
    _, rows = gguf_rows(qname, n, k, seed=n)
    qtype, packed = kernels.repack(rows, k)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for m in (1, 3, 8, 17, 64):
        g = torch.Generator().manual_seed(m)
        x = torch.randn(1, m, k, generator=g).to(dtype)
        r = (torch.randn(1, m, n, generator=g) * 30).to(dtype)
        r[0, 0, :3] = torch.tensor([float("inf"), float("nan"), -0.0]).to(dtype)
        got = torch.ops.dflash.qmm_fused(x, packed, qtype, n, k, residual=r)
        want = r + torch.ops.dflash.qmm(x, packed, qtype, n, k)
        assert got.shape == want.shape == (1, m, n) and got.dtype == dtype
        nan = torch.isnan(want)  # (aten's vectorized bf16 rounding writes NaN as 0xFFFF, c10's as 0x7FC0)
        assert torch.equal(torch.isnan(got), nan) and nan.any()
        assert torch.equal(got.view(bits)[~nan], want.view(bits)[~nan]), (qname, dtype, m)
        # the input's RMSNorm (x * 40: a scale the norm removes) and SwiGLU's activation of [g | u]
        nw = torch.rand(k, generator=g) + 0.5
        got = torch.ops.dflash.qmm_fused(x * 40, packed, qtype, n, k, nw, 1e-5)
        want = torch.ops.dflash.qmm(torch.ops.dflash.rms_norm(x * 40, nw, 1e-5), packed, qtype, n, k)
        assert torch.equal(got.view(bits), want.view(bits)), (qname, dtype, m, "norm")
        h = (torch.randn(1, m, 2 * k, generator=g) * 3).to(dtype)
        got = torch.ops.dflash.qmm_fused(h, packed, qtype, n, k, silu=True, residual=r)
        want = r + torch.ops.dflash.qmm(torch.ops.dflash.silu_mul(h, k), packed, qtype, n, k)
        assert torch.equal(got.view(bits)[~nan], want.view(bits)[~nan]), (qname, dtype, m, "silu")
    other = torch.float32 if dtype != torch.float32 else torch.bfloat16
    x = torch.randn(4, k).to(dtype)
    r = torch.randn(4, n).to(other)
    assert torch.equal(torch.ops.dflash.qmm_fused(x, packed, qtype, n, k, residual=r),
                       r + torch.ops.dflash.qmm(x, packed, qtype, n, k))
    with pytest.raises(RuntimeError):  # a residual of the wrong size
        torch.ops.dflash.qmm_fused(x, packed, qtype, n, k, residual=torch.randn(4, n + 1).to(dtype))
    with pytest.raises(RuntimeError):  # a norm weight of the wrong size
        torch.ops.dflash.qmm_fused(x, packed, qtype, n, k, torch.ones(k + 1))
    with pytest.raises(RuntimeError):  # [g | u] rows are 2k wide
        torch.ops.dflash.qmm_fused(x, packed, qtype, n, k, silu=True)
    with pytest.raises(RuntimeError):  # one prologue at a time
        torch.ops.dflash.qmm_fused(torch.randn(4, 2 * k).to(dtype), packed, qtype, n, k, torch.ones(k), silu=True)
    torch.library.opcheck(torch.ops.dflash.qmm_fused.default, (x, packed, qtype, n, k, torch.ones(k), 1e-6))


@pytest.mark.parametrize("qname", TYPES + K_TYPES)
def test_rows_are_invariant_and_paths_identical(qname):
    n, k = 67, 768
    _, rows = gguf_rows(qname, n, k, seed=1)
    qtype, packed = kernels.repack(rows, k)
    x = torch.randn(70, k) * torch.logspace(-3, 2, 70)[:, None]  # rows of very different scales
    x[5, 7] = 300.0  # an outlier channel
    full = torch.ops.dflash.qmm(x, packed, qtype, n, k)
    # AMX from 6 rows (chunks of 8; a short chunk's spare rows); the 256-bit vector path 4 rows a pass, then 1-3
    # in one; AVX-512 from 5 rows on two groups at once (8 rows a pass, then the last 1-7 in one; an odd last
    # group alone); rows in tiles of 64 (a second tile of 1-3 rows on the vector path under AMX)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 14, 15, 16, 21, 23, 33, 40, 64, 65, 67):
        part = torch.ops.dflash.qmm(x[:m], packed, qtype, n, k)
        assert torch.equal(part, full[:m]), m
    alone = torch.cat([torch.ops.dflash.qmm(x[i:i + 1], packed, qtype, n, k) for i in range(70)])
    assert torch.equal(alone, full)
    paths = [i for i in range(len(kernels.ISAS)) if torch.ops.dflash.isa_supported(i)]
    assert 0 in paths and len(paths) >= 2  # the portable path and at least one SIMD path here
    for isa in paths:
        assert torch.equal(torch.ops.dflash.qmm(x, packed, qtype, n, k, isa), full), kernels.ISAS[isa]
        for m in (2, 3, 5, 7, 9, 12, 15):  # every split of the rows into passes gives the same bits
            assert torch.equal(torch.ops.dflash.qmm(x[:m], packed, qtype, n, k, isa), full[:m]), (kernels.ISAS[isa], m)
    # the activation quantizer and the output rounding are vectorized too: bf16 / fp16 inputs,
    # all-zero blocks, ties, and blocks holding NaN / inf give the same bits on every path
    x[9, :32] = 0.0
    x[10, 64:96] = torch.arange(32) * 0.5 - 8  # many exact .5 ties after scaling
    x[11, 100] = float("nan")
    x[12, 300] = float("inf")
    x[13, 301] = float("-inf")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xd = x.clamp(-6e4, 6e4).to(dtype) if dtype == torch.float16 else x.to(dtype)
        xd[12, 300] = float("inf")
        ref = torch.ops.dflash.qmm(xd, packed, qtype, n, k, 0)
        assert ref[11].isnan().all() and ref[12].isnan().all() and not ref[14].isnan().any()
        for isa in paths[1:]:
            torch.testing.assert_close(torch.ops.dflash.qmm(xd, packed, qtype, n, k, isa), ref, rtol=0, atol=0,
                                       equal_nan=True, msg=f"{kernels.ISAS[isa]} {dtype}")


F16_AT = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), **D_AT}


@pytest.mark.parametrize("qname", TYPES + K_TYPES)
def test_extreme_codes_do_not_overflow(qname):
    """Every code at its largest magnitude (15 / 31 / 63, Q8_0's -128) against activations all
    at +-127: the int16 partial sums of the AVX2 path (and the VNNI paths' int32 dots) are at
    their worst case, and every path must still give the portable path's bits and the fp64
    result."""
    n, k = 16, 512
    size = gguf.GGML_QUANT_SIZES[getattr(GGMLQuantizationType, qname)][1]
    b = np.full((n, k // (256 if qname in K_TYPES else 32), size), 0x80 if qname == "Q8_0" else 0xFF, np.uint8)
    for off in F16_AT[qname]:
        b[..., off:off + 2] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
    qt = getattr(GGMLQuantizationType, qname)
    deq = torch.from_numpy(gguf.quants.dequantize(b.reshape(n, -1), qt).reshape(n, k)).double()
    qtype, packed = kernels.repack(kernels.PackedRows(qname, torch.from_numpy(b.reshape(n, -1))), k)
    x = torch.ones(9, k)
    x[1::2] = -1.0  # rows of +1 and -1: every activation code +-127
    ref = q8_reference(x, deq)
    paths = [i for i in range(len(kernels.ISAS)) if torch.ops.dflash.isa_supported(i)]
    portable = torch.ops.dflash.qmm(x, packed, qtype, n, k, 0)
    assert ((portable.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    for isa in paths:
        for m in (1, 2, 3, 4, 5, 8, 9):
            assert torch.equal(torch.ops.dflash.qmm(x[:m], packed, qtype, n, k, isa), portable[:m]), (kernels.ISAS[isa], m)


def test_zero_blocks_bf16_and_batch_dims():
    _, rows = gguf_rows("Q4_1", 16, 64)
    qtype, packed = kernels.repack(rows, 64)
    x = torch.zeros(2, 3, 64)
    x[1, 2, 40:] = 1.5
    y = torch.ops.dflash.qmm(x, packed, qtype, 16, 64)
    assert y.shape == (2, 3, 16) and torch.equal(y[0], torch.zeros(3, 16))
    yb = torch.ops.dflash.qmm(x.bfloat16(), packed, qtype, 16, 64)
    assert yb.dtype == torch.bfloat16 and torch.allclose(yb.float(), y, rtol=1e-2, atol=1e-2)


def test_hostile_arguments_are_errors_not_crashes():
    _, rows = gguf_rows("Q8_0", 8, 64)
    qtype, packed = kernels.repack(rows, 64)
    x = torch.randn(1, 64)
    for args in ((x, packed, 99, 8, 64), (x, packed, qtype, 9, 64), (x, packed, qtype, 8, 96),
                 (x, packed, qtype, 8, 63), (x, packed.float(), qtype, 8, 64), (x, packed[:, :10], qtype, 8, 64),
                 (x, packed, qtype, 17, 64), (x, packed, qtype, 0, 64),
                 (torch.randn(1, 32), packed, qtype, 8, 64), (x.int(), packed, qtype, 8, 64)):
        with pytest.raises(RuntimeError):
            torch.ops.dflash.qmm(*args)
    with pytest.raises(RuntimeError):
        torch.ops.dflash.qmm(x, packed, qtype, 8, 64, 7)  # no such instruction set
    with pytest.raises(RuntimeError):
        torch.ops.dflash.repack(torch.zeros(10, dtype=torch.uint8), qtype, 8, 64)


def test_fake_tensor_and_compile():
    _, rows = gguf_rows("Q4_0", 32, 128)
    qtype, packed = kernels.repack(rows, 128)
    x = torch.randn(3, 128)
    torch.library.opcheck(torch.ops.dflash.qmm.default, (x, packed, qtype, 32, 128))
    compiled = torch.compile(lambda a: torch.ops.dflash.qmm(a, packed, qtype, 32, 128) * 2, fullgraph=True)
    assert torch.equal(compiled(x), torch.ops.dflash.qmm(x, packed, qtype, 32, 128) * 2)


@pytest.mark.parametrize("mode, qname", [("int4", "Q4_1"), ("int8", "Q8_0")])
def test_own_quantization_of_float_weights(mode, qname):
    """HF weights quantized by the project (int4 -> Q4_1, int8 -> Q8_0 blocks) decode to
    what gguf's reference dequantizer reads from the same bytes."""
    w = torch.randn(48, 256)
    rows = (kernels.blocks_q4_1 if mode == "int4" else kernels.blocks_q8_0)(w)
    deq = gguf.quants.dequantize(rows.rows.numpy(), getattr(GGMLQuantizationType, qname)).reshape(48, 256)
    blocks = w.reshape(48, 8, 32)
    levels = 15 if mode == "int4" else 254  # steps across a block's range
    span = (blocks.amax(-1) - blocks.amin(-1)) if mode == "int4" else 2 * blocks.abs().amax(-1)
    half_step = (span / levels / 2).repeat_interleave(32, dim=1).numpy()
    assert (np.abs(deq - w.numpy()) <= half_step * 1.01 + 2e-3).all()  # rounding to the nearest code
    lin = Linear(w.clone())
    lin.quantize_(mode)
    assert lin.mode == "native"
    x = torch.randn(4, 256)
    ref = q8_reference(x, torch.from_numpy(deq).double())
    assert ((lin(x).double() - ref).abs().max() / ref.abs().max()).item() < 2e-3


def test_fused_linear_keeps_the_stored_blocks():
    deqs, parts = zip(*(gguf_rows("Q4_1", n, 96, seed=n) for n in (8, 4, 4)))
    ws = []
    for deq, p in zip(deqs, parts):
        t = deq.float()
        t.packed = p
        ws.append(t)
    lin = Linear.fused(ws)
    lin.quantize_("int4")
    x = torch.randn(2, 96)
    ref = q8_reference(x, torch.cat(deqs))
    assert ((lin(x).double() - ref).abs().max() / ref.abs().max()).item() < 2e-3


def test_no_compiler_means_the_aten_fallback(tmp_path):
    """No compiler and an empty cache: the package imports, warns once, and a quantized
    linear runs on the aten kernels with the same results as before the kernels existed."""
    code = (
        "import torch, warnings\n"
        "from dflash_server import kernels\n"
        "from dflash_server.layers.linear import Linear\n"
        "assert kernels.load() is False and kernels.load() is False\n"
        "w = torch.randn(64, 128)\n"
        "lin = Linear(w.clone()); lin.quantize_('int4')\n"
        "assert lin.mode == 'int4', lin.mode\n"
        "x = torch.randn(3, 128)\n"
        "assert ((lin(x) - x @ w.T).norm() / (x @ w.T).norm()) < 0.1\n"
        "print('status', kernels.status())\n")
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "DFLASH_KERNELS_CACHE": str(tmp_path / "cache"),
           "DFLASH_KERNELS": "1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("native kernels unavailable") == 1 and "no C++ compiler" in r.stderr
    assert "'native': False" in r.stdout


def test_isa_cap_from_the_environment():
    """DFLASH_KERNELS_ISA caps the path the ops pick (benchmarks compare paths with it; a user
    can step around a misbehaving one); a name it does not know leaves the best path."""
    best = torch.ops.dflash.isa()
    code = "from dflash_server import kernels\nassert kernels.load()\nprint(kernels.status()['isa'])\n"
    for want, expect in (("portable", "portable"), ("avx2", "avx2" if best >= 1 else "portable"),
                         ("nonsense", kernels.ISAS[best])):
        env = {**os.environ, "DFLASH_KERNELS_ISA": want, "DFLASH_KERNELS": "1"}
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split()[-1] == expect, (want, r.stdout)


def test_prefetch_hint_from_the_environment_changes_no_bits(tmp_path):
    """The weight prefetch hint is chosen per CPU maker (NTA on AMD, into L2 elsewhere);
    DFLASH_KERNELS_PREFETCH=nta|l2 overrides it, an unknown value leaves the default, and the
    hint never changes a result (it only moves memory earlier)."""
    code = ("import sys, torch\nfrom safetensors.torch import save_file\nfrom dflash_server import kernels\n"
            "assert kernels.load()\n"
            "torch.manual_seed(0)\nw = torch.randn(200, 256)\n"
            "outs = []\n"
            "for fn in (kernels.blocks_q4_1, kernels.blocks_q8_0):\n"
            "    qt, packed = kernels.repack(fn(w), 256)\n"
            "    for m in (1, 2, 9):\n"
            "        outs.append(torch.ops.dflash.qmm(torch.randn(m, 256), packed, qt, 200, 256))\n"
            "save_file({str(i): o for i, o in enumerate(outs)}, sys.argv[1])\n"
            "print(kernels.status()['prefetch'])\n")
    got = {}
    for want in ("nta", "l2", "nonsense"):
        out = str(tmp_path / f"{want}.safetensors")
        env = {**os.environ, "DFLASH_KERNELS_PREFETCH": want, "DFLASH_KERNELS": "1"}
        r = subprocess.run([sys.executable, "-c", code, out], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr
        got[want] = (r.stdout.split()[-1], load_file(out))
    assert got["nta"][0] == "nta" and got["l2"][0] == "l2"
    assert got["nonsense"][0] == torch.ops.dflash.prefetch() == kernels.status()["prefetch"]
    assert len(got["nta"][1]) == 6
    for key, a in got["nta"][1].items():
        assert torch.equal(a, got["l2"][1][key]) and torch.equal(a, got["nonsense"][1][key])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_matches_and_is_row_invariant(dtype):
    h = 576
    w = torch.rand(h) + 0.5
    x = (torch.randn(37, h) * torch.logspace(-2, 2, 37)[:, None]).to(dtype)
    y = torch.ops.dflash.rms_norm(x, w, 1e-5)
    ref = torch.nn.functional.rms_norm(x.double(), (h,), w.double(), 1e-5)
    assert y.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert ((y.double() - ref).abs() / ref.abs().clamp(min=1e-3)).max().item() < tol
    assert torch.equal(torch.cat([torch.ops.dflash.rms_norm(x[i:i + 1], w, 1e-5) for i in range(37)]), y)
    assert torch.ops.dflash.rms_norm(x.reshape(1, 37, h), w, 1e-5).shape == (1, 37, h)
    torch.library.opcheck(torch.ops.dflash.rms_norm.default, (x, w, 1e-5))
    with pytest.raises(RuntimeError):
        torch.ops.dflash.rms_norm(x, w[:10], 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h", [576, 64, 100, 7, 2048 + 13])
def test_rms_norm_paths_give_the_same_bits(dtype, h):
    """The vector path's 16 lanes and their reduction tree are the portable path's: same bits
    for every width (a tail shorter than a vector, a row narrower than the lanes), and the
    one-row calls equal a many-row call."""
    g = torch.Generator().manual_seed(h)
    w = torch.rand(h, generator=g) + 0.5
    x = (torch.randn(9, h, generator=g) * torch.logspace(-3, 3, 9)[:, None]).to(dtype)
    x[3, h // 2] = float("nan")
    y = torch.ops.dflash.rms_norm(x, w, 1e-6)
    assert torch.equal(y.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       torch.ops.dflash.rms_norm(x, w, 1e-6, portable=True).view(
                           torch.int16 if dtype != torch.float32 else torch.int32))
    assert torch.isnan(y[3]).all() and not torch.isnan(y[[0, 1, 2, 4, 5, 6, 7, 8]]).any()
    assert torch.equal(torch.cat([torch.ops.dflash.rms_norm(x[i:i + 1], w, 1e-6) for i in range(9)])[[0, 8]],
                       y[[0, 8]])
    ref = torch.nn.functional.rms_norm(x[[0, 8]].double(), (h,), w.double(), 1e-6)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert ((y[[0, 8]].double() - ref).abs() / ref.abs().clamp(min=1e-3)).max().item() < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inter", [1536, 64, 13])
def test_silu_mul_matches_and_paths_give_the_same_bits(dtype, inter):
    """SwiGLU's activation over [g | u]: against fp64 (its exp ~1 ulp; one rounding to the
    dtype), the vector and portable paths bit-equal, rows as alone, the extremes of exp's
    range (+-100, +-inf) and NaN as a float computation gives them."""
    g = torch.Generator().manual_seed(inter)
    h = (torch.randn(5, 2 * inter, generator=g) * torch.tensor([0.1, 1.0, 4.0, 20.0, 90.0])[:, None]).to(dtype)
    h[0, :6] = torch.tensor([100.0, -100.0, float("inf"), 0.0, -0.0, float("nan")]).to(dtype)
    y = torch.ops.dflash.silu_mul(h, inter)
    assert y.shape == (5, inter) and y.dtype == dtype and y.is_contiguous()
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(y.view(bits), torch.ops.dflash.silu_mul(h, inter, portable=True).view(bits))
    assert torch.equal(torch.cat([torch.ops.dflash.silu_mul(h[i:i + 1], inter) for i in range(5)]).view(bits),
                       y.view(bits))
    many = h.repeat(4, 1)  # 20 rows: chunks over threads (as a long prefill's), each row as alone
    assert torch.equal(torch.ops.dflash.silu_mul(many, inter).view(bits), y.repeat(4, 1).view(bits))
    gd, ud = h[:, :inter].double(), h[:, inter:].double()
    ref = torch.nn.functional.silu(gd) * ud
    ok = torch.isfinite(ref)
    err = ((y.double() - ref).abs() / ref.abs().clamp(min=1e-6 if dtype == torch.float32 else 1e-3))[ok]
    assert err.max().item() < (1e-6 if dtype == torch.float32 else 1e-2)
    assert torch.isnan(y[0, 5]) and abs(y[0, 1].item()) < 1e-30 and y[0, 3] == 0
    y3 = torch.ops.dflash.silu_mul(h.reshape(1, 5, 2 * inter), inter)
    assert y3.shape == (1, 5, inter)
    torch.library.opcheck(torch.ops.dflash.silu_mul.default, (h[1:], inter))  # (NaN != NaN in its comparison)
    with pytest.raises(RuntimeError):
        torch.ops.dflash.silu_mul(h, inter + 1)


def _attention_reference(qkv, cos, sin, kc, vc, start, nh, nkv, scale, written=None):
    """fp64: rotate, write (keys and values rounded to the caches' dtype, as the op stores
    them), causal grouped-query attention. ``written``: the (keys, values) caches the op wrote,
    whose new rows then replace the reference's own roundings (a key rotated in fp32 by the
    op and in fp64 here may round to neighbouring 16-bit values: ~1% of random cases moved
    an fp32 output past 1e-5)."""
    from dflash_server.layers.rope import apply_rope

    T, hd = qkv.shape[1], kc.shape[-1]
    x = qkv.double()[0]
    q = x[:, :nh * hd].reshape(T, nh, hd)
    k = x[:, nh * hd:(nh + nkv) * hd].reshape(T, nkv, hd)
    v = x[:, (nh + nkv) * hd:].reshape(T, nkv, hd)
    q, k = apply_rope(q, cos.double()[:, None], sin.double()[:, None]), apply_rope(k, cos.double()[:, None],
                                                                                  sin.double()[:, None])
    cache = kc.dtype
    kc, vc = kc.double().clone(), vc.double().clone()
    kc[0, :, start:start + T] = k.transpose(0, 1).to(cache).double()
    vc[0, :, start:start + T] = v.transpose(0, 1).to(cache).double()
    if written is not None:
        kc[0, :, start:start + T] = written[0][0, :, start:start + T].double()
        vc[0, :, start:start + T] = written[1][0, :, start:start + T].double()
    keys, values = kc[0, :, :start + T].repeat_interleave(nh // nkv, 0), vc[0, :, :start + T].repeat_interleave(nh // nkv, 0)
    s = torch.einsum("thd,hld->htl", q, keys) * scale
    causal = torch.arange(start + T)[None, :] <= (start + torch.arange(T))[:, None]
    p = s.masked_fill(~causal[None], float("-inf")).softmax(-1)
    return torch.einsum("htl,hld->thd", p, values).reshape(1, T, nh * hd), kc, vc


@pytest.mark.parametrize("dtype, cache", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                          (torch.float32, torch.float16), (torch.bfloat16, torch.float16),
                                          (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("nh, nkv, hd, rot", [(9, 3, 64, 64), (4, 4, 32, 16), (8, 1, 16, 16), (2, 1, 128, 64)])
@pytest.mark.parametrize("start, T", [(37, 8), (301, 21)])   # (keys in several of the grouped path's blocks)
def test_attention_step_matches_and_is_row_invariant(dtype, cache, nh, nkv, hd, rot, start, T):
    """Against fp64 for each activation dtype and KV cache dtype (the cache holds keys and
    values rounded once, at the write)."""
    from dflash_server.layers.rope import RotaryTable

    max_ctx = start + T + 51
    table = RotaryTable(hd, rot, 10000.0, max_ctx, None, torch.device("cpu"), torch.float32)
    cos, sin = table.rows(start, T)
    gen = torch.Generator().manual_seed(start * 1000 + nh * 10 + hd)
    qkv = torch.randn(1, T, (nh + 2 * nkv) * hd, generator=gen).to(dtype)
    kc, vc = (torch.randn(1, nkv, max_ctx, hd, generator=gen).to(cache),
              torch.randn(1, nkv, max_ctx, hd, generator=gen).to(cache))
    ref, rk, rv = _attention_reference(qkv, cos, sin, kc, vc, start, nh, nkv, hd ** -0.5)
    k1, v1 = kc.clone(), vc.clone()
    out = torch.ops.dflash.attention_step(qkv, cos, sin, k1, v1, start, nh, nkv, hd ** -0.5)
    assert out.dtype == dtype and out.shape == (1, T, nh * hd) and k1.dtype == cache
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    ref_written = _attention_reference(qkv, cos, sin, kc, vc, start, nh, nkv, hd ** -0.5, (k1, v1))[0]
    assert (out.double() - ref_written).abs().max().item() < tol
    # the cache's own rounding of the key (rotated in fp32 by the op, in fp64 here): one unit
    # in its last place at most
    ulp = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[cache]
    assert (k1.double() - rk).abs().max().item() < max(tol, ulp) and (v1.double() - rv).abs().max().item() < tol
    # one row at a time (start + t) == the block; the portable build == the vectorized one
    k2, v2 = kc.clone(), vc.clone()
    rows = [torch.ops.dflash.attention_step(qkv[:, t:t + 1], cos[t:t + 1], sin[t:t + 1], k2, v2, start + t, nh, nkv,
                                            hd ** -0.5) for t in range(T)]
    assert torch.equal(torch.cat(rows, dim=1), out) and torch.equal(k2, k1) and torch.equal(v2, v1)
    k3, v3 = kc.clone(), vc.clone()
    assert torch.equal(torch.ops.dflash.attention_step(qkv, cos, sin, k3, v3, start, nh, nkv, hd ** -0.5, True), out)
    assert torch.equal(k3, k1) and torch.equal(v3, v1)   # the caches' bits too (the writes' roundings)
    torch.library.opcheck(torch.ops.dflash.attention_step.default,
                          (qkv, cos, sin, kc.clone(), vc.clone(), start, nh, nkv, hd ** -0.5))
    with pytest.raises(RuntimeError):  # rows past the cache
        torch.ops.dflash.attention_step(qkv, cos, sin, kc, vc, max_ctx - 2, nh, nkv, hd ** -0.5)


ATTN_CASES = [(hd, nh, nkv, cache, start, T, gated, qk)
              for hd, nh, nkv in ((64, 9, 3), (128, 8, 2), (64, 5, 5))
              for cache in ("float32", "float16", "bfloat16")
              for start, T in ((0, 3), (37, 8), (301, 21), (2047, 1))
              for gated, qk in ((False, False), (True, True))]
ATTN_CODE = """
import sys, torch
from safetensors.torch import save_file
from dflash_server import kernels
assert kernels.load()
out = {}
for i, (hd, nh, nkv, cache, start, T, gated, qk) in enumerate(CASES):
    g = torch.Generator().manual_seed(i)
    qkv = torch.randn(1, T, ((2 if gated else 1) * nh + 2 * nkv) * hd, generator=g).bfloat16()
    kc = torch.randn(1, nkv, start + T + 5, hd, generator=g).to(getattr(torch, cache))
    vc = torch.randn(1, nkv, start + T + 5, hd, generator=g).to(getattr(torch, cache))
    cos, sin = torch.randn(T, hd, generator=g), torch.randn(T, hd, generator=g)
    qn = (torch.randn(hd, generator=g), torch.randn(hd, generator=g)) if qk else (None, None)
    args = (start, nh, nkv, hd ** -0.5, False, qn[0], qn[1], 1e-6, gated)
    out[str(i)] = torch.ops.dflash.attention_step(qkv, cos, sin, kc.clone(), vc.clone(), *args)
    if T > 1:   # a DDTree block (each row's parent (t - 1) // 2), and KV Flash key lists (rows scattered)
        out[f"{i}t"] = torch.ops.dflash.attention_step(qkv, cos, sin, kc.clone(), vc.clone(), *args,
                                                       tree=torch.tensor([-1] + [(t - 1) // 2 for t in range(1, T)]))
        perm = torch.randperm(start + T + 5, generator=g)
        keys = torch.stack([torch.cat([perm[:start + t + 1], perm[:T - 1 - t]]) for t in range(T)])
        out[f"{i}k"] = torch.ops.dflash.attention_step(qkv, cos, sin, kc.clone(), vc.clone(), *args,
                                                       write_rows=perm[start:start + T], key_rows=keys,
                                                       key_counts=torch.arange(start + 1, start + T + 1))
save_file(out, sys.argv[1])
"""


def test_attention_avx512_and_avx2_forms_give_the_same_bits(tmp_path):
    """The grouped attention's AVX-512 form (this CPU's path where it has AVX-512) against its
    AVX2 form (DFLASH_KERNELS_ISA=avx2 keeps it), in two processes, on blocks, decode rows,
    long contexts, head sizes 64 / 128, every cache type, gated heads and q/k norms, DDTree
    blocks and KV Flash key lists. (On a CPU
    without AVX-512 both processes run the AVX2 form.)"""
    from safetensors.torch import load_file

    code = f"CASES = {ATTN_CASES!r}\n" + ATTN_CODE
    outs = {}
    for cap in ("avx2", "amx"):
        env = {**os.environ, "DFLASH_KERNELS_ISA": cap, "DFLASH_KERNELS": "1"}
        r = subprocess.run([sys.executable, "-c", code, str(tmp_path / f"{cap}.safetensors")], capture_output=True,
                           text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr
        outs[cap] = load_file(tmp_path / f"{cap}.safetensors")
    assert len(outs["avx2"]) == len(ATTN_CASES) + 2 * sum(case[5] > 1 for case in ATTN_CASES)
    assert outs["avx2"].keys() == outs["amx"].keys()
    for key in outs["avx2"]:
        assert torch.equal(outs["avx2"][key], outs["amx"][key]), ATTN_CASES[int(key.rstrip("tk"))]


@pytest.mark.parametrize("cache", [torch.float16, torch.bfloat16])
def test_cache_writes_round_as_torch_does(cache):
    """Values at the edges of a 16-bit cache (ties, overflow, subnormals, infinities) are stored
    as ``.to(cache)`` stores them, and NaNs of either sign as NaNs (torch's own NaN bits differ
    between its scalar and vector conversions), by the vectorized and the portable writes with
    the same bits."""
    nh = nkv = 1
    hd, T = 16, 3
    special = torch.tensor([2049.0, 2051.0, 65519.0, 65520.0, 1e6, -1e6, 1e-6, -3e-8, 6e-8, 1e-40, float("inf"),
                            -float("inf"), float("nan"), -float("nan"), 0.0, -0.0])
    qkv = torch.randn(1, T, (nh + 2 * nkv) * hd)
    qkv[0, :, 2 * hd:] = special            # the value rows (written as they are)
    cos, sin = torch.empty(T, 0), torch.empty(T, 0)     # a rotary width of 0: the key rows as they are too
    qkv[0, 1, hd:2 * hd] = special.flip(0)
    out = {}
    for portable in (False, True):
        kc, vc = torch.zeros(1, nkv, 8, hd, dtype=cache), torch.zeros(1, nkv, 8, hd, dtype=cache)
        torch.ops.dflash.attention_step(qkv, cos, sin, kc, vc, 0, nh, nkv, 1.0, portable)
        out[portable] = kc, vc
        nan = special.isnan()
        for got, want in ((vc[0, 0, :T], special.expand(T, hd)), (kc[0, 0, 1], special.flip(0))):
            m = want.isnan()
            assert torch.equal(got.isnan(), m), portable
            assert torch.equal(got[~m].view(torch.int16), want[~m].to(cache).view(torch.int16)), portable
        assert nan.sum() == 2
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(out[False], out[True]))


def test_attention_window_matches_masked_reference():
    """A sliding window (Gemma): each row sees keys (p - window, p]; rows stay invariant and
    the portable build equals the vectorized one."""
    from dflash_server.layers.rope import RotaryTable

    nh, nkv, hd, max_ctx, start, T, window = 4, 2, 32, 96, 40, 6, 9
    table = RotaryTable(hd, hd, 10000.0, max_ctx, None, torch.device("cpu"), torch.float32)
    cos, sin = table.rows(start, T)
    qkv = torch.randn(1, T, (nh + 2 * nkv) * hd)
    kc, vc = torch.randn(1, nkv, max_ctx, hd), torch.randn(1, nkv, max_ctx, hd)
    _, rk, rv = _attention_reference(qkv, cos, sin, kc, vc, start, nh, nkv, hd ** -0.5)
    q = qkv[0, :, :nh * hd].view(T, nh, hd)
    q = q * cos[:, None] + q.roll(hd // 2, -1) * sin[:, None]
    keys, values = rk[0].repeat_interleave(nh // nkv, 0), rv[0].repeat_interleave(nh // nkv, 0)
    s = torch.einsum("thd,hld->htl", q.double(), keys[:, :start + T]) * hd ** -0.5
    qp, kp = start + torch.arange(T)[:, None], torch.arange(start + T)[None, :]
    s = s.masked_fill(~((kp <= qp) & (kp > qp - window))[None], float("-inf"))
    ref = torch.einsum("htl,hld->thd", s.softmax(-1), values[:, :start + T]).reshape(1, T, nh * hd)
    k1, v1 = kc.clone(), vc.clone()
    out = torch.ops.dflash.attention_step(qkv, cos, sin, k1, v1, start, nh, nkv, hd ** -0.5, window=window)
    assert (out.double() - ref).abs().max().item() < 1e-5
    k2, v2 = kc.clone(), vc.clone()
    rows = [torch.ops.dflash.attention_step(qkv[:, t:t + 1], cos[t:t + 1], sin[t:t + 1], k2, v2, start + t, nh, nkv,
                                            hd ** -0.5, window=window) for t in range(T)]
    assert torch.equal(torch.cat(rows, dim=1), out)
    assert torch.equal(torch.ops.dflash.attention_step(qkv, cos, sin, kc.clone(), vc.clone(), start, nh, nkv,
                                                       hd ** -0.5, True, window=window), out)
    with pytest.raises(RuntimeError):
        torch.ops.dflash.attention_step(qkv, cos, sin, kc, vc, start, nh, nkv, hd ** -0.5, window=-1)


def test_non_finite_activations_give_nan_not_numbers():
    _, rows = gguf_rows("Q4_1", 16, 64)
    qtype, packed = kernels.repack(rows, 64)
    x = torch.randn(3, 64)
    x[1, 5] = float("nan")
    x[2, 40] = float("inf")
    y = torch.ops.dflash.qmm(x, packed, qtype, 16, 64)
    assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all() and torch.isnan(y[2]).all()


def test_no_gradient_path_through_the_ops():
    """Training (a draft's norms) needs a backward: with gradients wanted, RMSNorm stays on
    aten even when the native kernels are on."""
    from dflash_server.layers.norms import RMSNorm

    norm = RMSNorm(torch.ones(64), 1e-6)
    assert norm.native
    x = torch.randn(2, 64, requires_grad=True)
    norm(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    with torch.no_grad():
        assert torch.equal(norm(x), torch.ops.dflash.rms_norm(x, norm.weight, 1e-6))


def test_attention_step_refuses_positions_past_the_cache():
    kc, vc = torch.zeros(1, 1, 16, 8), torch.zeros(1, 1, 16, 8)
    qkv, cs = torch.zeros(1, 2, 24), torch.zeros(2, 8)
    for start in (15, -1, 2**63 - 1):
        with pytest.raises(RuntimeError):
            torch.ops.dflash.attention_step(qkv, cs, cs, kc, vc, start, 1, 1, 1.0)


def test_fused_decoder_layer_equals_the_per_op_layers(tiny_dir, monkeypatch):
    """dflash::decoder_layer (a whole Llama layer in one call) gives bit-identical logits to
    the same layers run op by op, for prefill, verify blocks and one-row steps; qwen3's
    q/k norms and qwen3_5's gated attention layers go through it too (its Gated DeltaNet
    layers keep the per-op path)."""
    from dflash_server.layers.decoder import DecoderLayer

    from helpers.build import pipeline, prompt_ids

    calls = {"fused": 0}
    real = DecoderLayer._native_layer

    def counting(self):
        ok = real(self)
        calls["fused"] += ok
        return ok

    def run(pipe, ids):
        pipe.reset()
        out = [pipe.forward(ids[:40], 0, logits="all").logits]             # a prefill chunk (<= 64 rows)
        out.append(pipe.forward(ids[40:48], 40, logits="all").logits)      # a verify block
        out += [pipe.forward([t], 48 + i, logits="all").logits for i, t in enumerate(ids[48:52])]
        return torch.cat(out)

    for family, fused in (("llama", True), ("qwen3", True), ("qwen3_5", True)):
        pipe = pipeline(tiny_dir(family), dtype=torch.bfloat16, quantize="int4")
        ids = prompt_ids(pipe, 52)
        monkeypatch.setattr(DecoderLayer, "_native_layer", counting)
        calls["fused"] = 0
        a = run(pipe, ids)
        assert (calls["fused"] > 0) == fused, (family, calls)
        monkeypatch.setattr(DecoderLayer, "_native_layer", lambda self: False)
        b = run(pipe, ids)
        assert torch.equal(a, b), family


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hd", [32, 64])   # 64: the grouped (shared key blocks) path
def test_attention_step_with_qk_norms(dtype, hd):
    """Qwen3's per-head q/k RMSNorm before RoPE, inside the fused step: equal to normalizing
    q and k first, row-invariant, and refused half-given or of the wrong width."""
    from dflash_server.layers.rope import RotaryTable

    nh, nkv, max_ctx, start, T, eps = 4, 2, 64, 11, 6, 1e-6
    table = RotaryTable(hd, hd, 10000.0, max_ctx, None, torch.device("cpu"), torch.float32)
    cos, sin = table.rows(start, T)
    qkv = (torch.randn(1, T, (nh + 2 * nkv) * hd) * 3).to(dtype)
    qn, kn = torch.rand(hd) + 0.5, torch.rand(hd) + 0.5
    kc, vc = torch.randn(1, nkv, max_ctx, hd), torch.randn(1, nkv, max_ctx, hd)
    heads = qkv.double().view(1, T, nh + 2 * nkv, hd)
    normed = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + eps)
    normed[:, :, :nh] *= qn.double()
    normed[:, :, nh:nh + nkv] *= kn.double()
    normed[:, :, nh + nkv:] = heads[:, :, nh + nkv:]
    ref, rk, _ = _attention_reference(normed.reshape(1, T, -1), cos, sin, kc, vc, start, nh, nkv, hd ** -0.5)
    k1, v1 = kc.clone(), vc.clone()
    out = torch.ops.dflash.attention_step(qkv, cos, sin, k1, v1, start, nh, nkv, hd ** -0.5, q_norm=qn, k_norm=kn,
                                          norm_eps=eps)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert (out.double() - ref).abs().max().item() < tol and (k1.double() - rk).abs().max().item() < tol
    k2, v2 = kc.clone(), vc.clone()
    rows = [torch.ops.dflash.attention_step(qkv[:, t:t + 1], cos[t:t + 1], sin[t:t + 1], k2, v2, start + t, nh, nkv,
                                            hd ** -0.5, q_norm=qn, k_norm=kn, norm_eps=eps) for t in range(T)]
    assert torch.equal(torch.cat(rows, dim=1), out) and torch.equal(k2, k1)
    assert torch.equal(torch.ops.dflash.attention_step(qkv, cos, sin, kc.clone(), vc.clone(), start, nh, nkv,
                                                       hd ** -0.5, True, q_norm=qn, k_norm=kn, norm_eps=eps), out)
    for bad in ({"q_norm": qn}, {"q_norm": qn, "k_norm": kn[:16]}):
        with pytest.raises(RuntimeError):
            torch.ops.dflash.attention_step(qkv, cos, sin, kc.clone(), vc.clone(), start, nh, nkv, hd ** -0.5, **bad)



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hd", [32, 64])   # 64: the grouped (shared key blocks) path
def test_attention_step_with_output_gate(dtype, hd):
    """Qwen3.5's gated attention inside the fused step: each query head is [q | gate], the
    output is attention * sigmoid(gate); with q/k norms and partial rotary, as Qwen3.5 has.
    Equal to the fp64 reference and row-invariant."""
    from dflash_server.layers.rope import RotaryTable

    nh, nkv, rot, max_ctx, start, T, eps = 4, 2, 8, 64, 9, 5, 1e-6
    table = RotaryTable(hd, rot, 10000.0, max_ctx, None, torch.device("cpu"), torch.float32)
    cos, sin = table.rows(start, T)
    qkv = (torch.randn(1, T, (2 * nh + 2 * nkv) * hd) * 2).to(dtype)
    qn, kn = torch.rand(hd) + 0.5, torch.rand(hd) + 0.5
    kc, vc = torch.randn(1, nkv, max_ctx, hd), torch.randn(1, nkv, max_ctx, hd)
    x = qkv.double()
    qg = x[..., :2 * nh * hd].reshape(1, T, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(1, T, nh * hd)
    k = x[..., 2 * nh * hd:(2 * nh + nkv) * hd].reshape(1, T, nkv, hd)
    v = x[..., (2 * nh + nkv) * hd:]
    rms = lambda t, w: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w.double()  # noqa: E731
    plain = torch.cat([rms(q, qn).reshape(1, T, -1), rms(k, kn).reshape(1, T, -1), v], dim=-1)
    ref, rk, _ = _attention_reference(plain, cos, sin, kc, vc, start, nh, nkv, hd ** -0.5)
    ref = ref * torch.sigmoid(gate)
    k1, v1 = kc.clone(), vc.clone()
    args = dict(q_norm=qn, k_norm=kn, norm_eps=eps, gated=True)
    out = torch.ops.dflash.attention_step(qkv, cos, sin, k1, v1, start, nh, nkv, hd ** -0.5, **args)
    assert out.shape == (1, T, nh * hd)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert (out.double() - ref).abs().max().item() < tol and (k1.double() - rk).abs().max().item() < tol
    k2, v2 = kc.clone(), vc.clone()
    rows = [torch.ops.dflash.attention_step(qkv[:, t:t + 1], cos[t:t + 1], sin[t:t + 1], k2, v2, start + t, nh, nkv,
                                            hd ** -0.5, **args) for t in range(T)]
    assert torch.equal(torch.cat(rows, dim=1), out) and torch.equal(k2, k1)
    k3, v3 = kc.clone(), vc.clone()
    assert torch.equal(torch.ops.dflash.attention_step(qkv, cos, sin, k3, v3, start, nh, nkv, hd ** -0.5, True,
                                                       **args), out)  # the portable build
    with pytest.raises(RuntimeError, match="width"):  # an ungated qkv read as gated
        torch.ops.dflash.attention_step(qkv[..., :(nh + 2 * nkv) * hd].contiguous(), cos, sin, kc.clone(),
                                        vc.clone(), start, nh, nkv, hd ** -0.5, **args)


_DEEP_TREE = (-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 12, 13, 2, 15, 16, 17, 18, 19, 20, 21, 22, 11, 24, 9, 26)


@pytest.mark.parametrize("window,hd,cache,start,parents", [
    (0, 64, torch.float32, 30, (-1, 0, 0, 1, 1, 2, 3, 3, 6)),
    (5, 64, torch.float32, 30, (-1, 0, 0, 1, 1, 2, 3, 3, 6)),
    # the grouped paths' tree form: 16-bit caches, keys over several blocks, a path of 13
    # rows beside side branches (ancestor lists longer than a group of 8 keys)
    (0, 64, torch.float16, 301, _DEEP_TREE),
    (0, 128, torch.bfloat16, 77, _DEEP_TREE),
])
def test_attention_tree_rows_equal_their_paths(window, hd, cache, start, parents):
    """A tree of rows (DDTree verify): row t at position start + depth(t) sees the cache and
    its ancestors; it equals, bit for bit, the one-row step of a cache that holds its path
    contiguously; portable == vectorized; bad parents are refused."""
    from dflash_server.layers.rope import RotaryTable

    nh, nkv, max_ctx = 4, 2, start + 66
    depth = [0]
    for p in parents[1:]:
        depth.append(depth[p] + 1)
    T = len(parents)
    table = RotaryTable(hd, hd, 10000.0, max_ctx, None, torch.device("cpu"), torch.float32)
    pos = torch.tensor(depth) + start
    cos, sin = table.cos[pos], table.sin[pos]
    qkv = torch.randn(1, T, (nh + 2 * nkv) * hd).to(torch.bfloat16)
    kc, vc = torch.randn(1, nkv, max_ctx, hd).to(cache), torch.randn(1, nkv, max_ctx, hd).to(cache)
    tree = torch.tensor(parents)
    k1, v1 = kc.clone(), vc.clone()
    out = torch.ops.dflash.attention_step(qkv, cos, sin, k1, v1, start, nh, nkv, hd ** -0.5, window=window, tree=tree)
    assert torch.equal(torch.ops.dflash.attention_step(qkv, cos, sin, kc.clone(), vc.clone(), start, nh, nkv,
                                                       hd ** -0.5, True, window=window, tree=tree), out)
    for t in range(T):
        path, r = [], t
        while r >= 0:
            path.append(r)
            r = parents[r]
        path = path[::-1]
        k2, v2 = kc.clone(), vc.clone()
        for i, r in enumerate(path):
            row = torch.ops.dflash.attention_step(qkv[:, r:r + 1], cos[r:r + 1], sin[r:r + 1], k2, v2, start + i,
                                                  nh, nkv, hd ** -0.5, window=window)
        assert torch.equal(row[0, 0], out[0, t]), t
    for bad in ((0, 0, 0, 1, 1, 2, 3, 3, 6), (-1, 0, 2, 1, 1, 2, 3, 3, 6), (-1, 0)):
        with pytest.raises(RuntimeError, match="tree|parent"):
            torch.ops.dflash.attention_step(qkv, cos, sin, kc.clone(), vc.clone(), start, nh, nkv, hd ** -0.5,
                                            tree=torch.tensor(bad))


@pytest.mark.parametrize("portable", [False, True])
def test_attention_rows_take_trees_among_other_rows(portable):
    """``attention_rows(tree=...)``: a lane whose rows have parents runs them as that lane's
    own tree step (bit-equal to ``attention_step(tree=...)`` on its cache), beside a plain
    row and a chain block of other lanes (bit-equal to their own steps); malformed trees are
    refused and leave the banks as they were."""
    from dflash_server.layers.rope import RotaryTable

    nh, nkv, hd, max_ctx = 4, 2, 64, 96
    table = RotaryTable(hd, hd, 10000.0, max_ctx, None, torch.device("cpu"), torch.float32)
    kb, vb = torch.randn(3, nkv, max_ctx, hd), torch.randn(3, nkv, max_ctx, hd)
    tree = (-1, 0, 0, 1, 2)
    depth = [0, 1, 1, 2, 2]
    # lane 2: a tree of 5 rows at 20..24; lane 0: one row at 11; lane 1: a chain of 3 at 7..9
    lanes = [2] * 5 + [0] + [1] * 3
    positions = list(range(20, 25)) + [11] + [7, 8, 9]
    rope_at = [20 + d for d in depth] + [11, 7, 8, 9]
    parents = list(tree) + [-1] * 4
    qkv = torch.randn(1, len(lanes), (nh + 2 * nkv) * hd).to(torch.bfloat16)
    cos, sin = table.cos[rope_at], table.sin[rope_at]
    k1, v1 = kb.clone(), vb.clone()
    out = torch.ops.dflash.attention_rows(qkv, cos, sin, k1, v1, lanes, positions, nh, nkv, hd ** -0.5, portable,
                                          tree=torch.tensor(parents))
    k2, v2 = kb[2:3].clone(), vb[2:3].clone()
    want = torch.ops.dflash.attention_step(qkv[:, :5], cos[:5], sin[:5], k2, v2, 20, nh, nkv, hd ** -0.5, portable,
                                           tree=torch.tensor(tree))
    assert torch.equal(out[:, :5], want) and torch.equal(k1[2:3], k2) and torch.equal(v1[2:3], v2)
    k0, v0 = kb[0:1].clone(), vb[0:1].clone()
    assert torch.equal(out[:, 5], torch.ops.dflash.attention_step(qkv[:, 5:6], cos[5:6], sin[5:6], k0, v0, 11, nh, nkv,
                                                                  hd ** -0.5, portable)[:, 0])
    k3, v3 = kb[1:2].clone(), vb[1:2].clone()
    for i in range(3):   # a chain block's rows: each as its own one-row step after the earlier ones
        row = torch.ops.dflash.attention_step(qkv[:, 6 + i:7 + i], cos[6 + i:7 + i], sin[6 + i:7 + i], k3, v3, 7 + i,
                                              nh, nkv, hd ** -0.5, portable)
        assert torch.equal(out[:, 6 + i], row[:, 0])
    for bad in ([-1, 0, 0, 1, 5] + [-1] * 4,        # a parent after its row
                [-1, 0, 0, 1, 2, 0, -1, -1, -1],    # a parent in another lane
                [-1, 0, 0, 1, 2, -1, -1, -1]):      # a parent short
        k4, v4 = kb.clone(), vb.clone()
        with pytest.raises(RuntimeError, match="tree|parent"):
            torch.ops.dflash.attention_rows(qkv, cos, sin, k4, v4, lanes, positions, nh, nkv, hd ** -0.5, portable,
                                            tree=torch.tensor(bad))
        assert torch.equal(k4, kb) and torch.equal(v4, vb)
    with pytest.raises(RuntimeError, match="tree|adjacent"):
        torch.ops.dflash.attention_rows(qkv[:, :6], cos[:6], sin[:6], kb.clone(), vb.clone(), [2, 2, 0, 2, 2, 2],
                                        [20, 21, 11, 22, 23, 24], nh, nkv, hd ** -0.5, portable,
                                        tree=torch.tensor([-1, 0, -1, 1, 3, 4]))   # the tree's rows apart


@pytest.mark.parametrize("cache,hd", [(torch.float16, 64), (torch.float32, 128)])
def test_attention_rows_long_and_short_rows_equal_their_steps(cache, hd):
    """Rows past the grouped threshold (single rows from 512 keys, blocks always) and short
    ones in one ``attention_rows`` call: each lane's rows bit-equal to its own step."""
    from dflash_server.layers.rope import RotaryTable

    nh, nkv, max_ctx = 6, 2, 800
    table = RotaryTable(hd, hd, 10000.0, max_ctx, None, torch.device("cpu"), torch.float32)
    kb, vb = torch.randn(3, nkv, max_ctx, hd).to(cache), torch.randn(3, nkv, max_ctx, hd).to(cache)
    lanes, positions = [0, 1, 1, 2], [600, 700, 701, 10]
    qkv = torch.randn(1, 4, (nh + 2 * nkv) * hd).to(torch.bfloat16)
    cos, sin = table.cos[positions], table.sin[positions]
    k1, v1 = kb.clone(), vb.clone()
    out = torch.ops.dflash.attention_rows(qkv, cos, sin, k1, v1, lanes, positions, nh, nkv, hd ** -0.5)
    for lane, b, e in ((0, 0, 1), (1, 1, 3), (2, 3, 4)):
        k2, v2 = kb[lane:lane + 1].clone(), vb[lane:lane + 1].clone()
        for r in range(b, e):   # one-row steps (the block's rows: the same bits as its block step)
            want = torch.ops.dflash.attention_step(qkv[:, r:r + 1], cos[r:r + 1], sin[r:r + 1], k2, v2, positions[r],
                                                   nh, nkv, hd ** -0.5)
            assert torch.equal(out[:, r], want[:, 0]), (lane, r)
        assert torch.equal(k1[lane:lane + 1], k2) and torch.equal(v1[lane:lane + 1], v2)


@pytest.mark.parametrize("portable", [False, True])
def test_attention_rows_over_pools_equal_each_lanes_step(portable):
    """``attention_rows`` with key lists (KV Flash: a pool per lane): row b writes lane row
    ``write_rows[b]`` and attends to its listed rows, bit-equal to that lane's own
    ``attention_step`` over the same lists (a decode row whose position is past the lane's
    rows, a causal block of 3, a tree of 4 given as its rows' paths); hostile lists are
    refused and leave the banks as they were."""
    from dflash_server.layers.rope import RotaryTable

    nh, nkv, hd, P = 4, 2, 64, 64
    table = RotaryTable(hd, hd, 10000.0, 256, None, torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(3)
    kb = torch.randn(3, nkv, P, hd, generator=g).to(torch.float16)
    vb = torch.randn(3, nkv, P, hd, generator=g).to(torch.float16)
    perms = [torch.randperm(P, generator=g) for _ in range(3)]
    # (lane, first position, rows, parents or None, resident prefix keys)
    spans = [(0, 150, 1, None, 40), (1, 90, 3, None, 30), (2, 30, 4, (-1, 0, 0, 1), 25)]
    lanes, positions, rope_at, write, lists = [], [], [], [], []
    for lane, start, T, tree, prefix in spans:
        perm = perms[lane]
        depth = [0] * T
        for t in range(T):
            depth[t] = 0 if tree is None or tree[t] < 0 else depth[tree[t]] + 1
        for t in range(T):
            path, r = [], t
            while r >= 0:
                path.insert(0, r)
                r = -1 if tree is None else tree[r]
            own = [prefix + r for r in (path if tree is not None else range(t + 1))]
            lanes.append(lane)
            positions.append(start + t)
            rope_at.append(start + (depth[t] if tree is not None else t))
            write.append(int(perm[prefix + t]))
            lists.append(perm[list(range(prefix)) + own].tolist())
    width = max(map(len, lists))
    key_rows = torch.tensor([k + [0] * (width - len(k)) for k in lists])
    key_counts = torch.tensor([len(k) for k in lists])
    write_rows = torch.tensor(write)
    qkv = torch.randn(1, len(lanes), (nh + 2 * nkv) * hd, generator=g).to(torch.bfloat16)
    cos, sin = table.cos[rope_at], table.sin[rope_at]
    k1, v1 = kb.clone(), vb.clone()
    pools = dict(write_rows=write_rows, key_rows=key_rows, key_counts=key_counts)
    out = torch.ops.dflash.attention_rows(qkv, cos, sin, k1, v1, lanes, positions, nh, nkv, hd ** -0.5, portable,
                                          **pools)
    b = 0
    for lane, start, T, _, _ in spans:
        k2, v2 = kb[lane:lane + 1].clone(), vb[lane:lane + 1].clone()
        want = torch.ops.dflash.attention_step(qkv[:, b:b + T], cos[b:b + T], sin[b:b + T], k2, v2, start, nh, nkv,
                                               hd ** -0.5, portable, write_rows=write_rows[b:b + T],
                                               key_rows=key_rows[b:b + T], key_counts=key_counts[b:b + T])
        assert torch.equal(out[:, b:b + T], want), lane
        assert torch.equal(k1[lane:lane + 1], k2) and torch.equal(v1[lane:lane + 1], v2), lane
        b += T
    # KV Flash's score policy: every row's masses (here one bucket per lane row: mass_keys = the
    # key rows) and rotated queries, the same bits as the lane's own step gives (lane 0's decode
    # row runs per-row here, grouped alone)
    mass, q_out = _masses(len(lanes), P), torch.empty(len(lanes), nh, hd, dtype=torch.bfloat16)
    scored = torch.ops.dflash.attention_rows(qkv, cos, sin, kb.clone(), vb.clone(), lanes, positions, nh, nkv,
                                             hd ** -0.5, portable, **pools, mass=mass, q_out=q_out,
                                             mass_keys=key_rows)
    assert torch.equal(scored, out)
    b = 0
    for lane, start, T, _, _ in spans:
        m2, q2 = _masses(T, P), torch.empty(1, T, nh, hd, dtype=torch.bfloat16)
        torch.ops.dflash.attention_step(qkv[:, b:b + T], cos[b:b + T], sin[b:b + T], kb[lane:lane + 1].clone(),
                                        vb[lane:lane + 1].clone(), start, nh, nkv, hd ** -0.5, portable,
                                        write_rows=write_rows[b:b + T], key_rows=key_rows[b:b + T],
                                        key_counts=key_counts[b:b + T], mass=m2, q_out=q2,
                                        mass_keys=key_rows[b:b + T])
        assert torch.equal(mass[b:b + T], m2) and torch.equal(q_out[b:b + T], q2[0]), lane
        _assert_rows_sum_to(m2, nh)
        b += T
    one = key_counts.clone()
    one[0] = positions[0] + 2
    bad = [dict(pools, write_rows=torch.where(write_rows == write[1], P, write_rows)),   # a write past the lane
           dict(pools, key_counts=one),                                          # more keys than its position allows
           dict(pools, key_counts=torch.zeros_like(key_counts)),
           dict(pools, key_rows=key_rows + P),                                   # key rows past the lane
           dict(write_rows=write_rows, key_rows=key_rows),                       # not together
           dict(pools, key_rows=key_rows[:-1]),
           dict(pools, tree=torch.tensor([-1] * len(lanes))),                    # trees are in the lists
           dict(pools, window=4),
           dict(pools, mass=_masses(2, P), mass_keys=key_rows),                   # masses: (rows, buckets)
           dict(pools, mass=torch.zeros(len(lanes), P), mass_keys=key_rows),      # ... int64
           dict(pools, mass=_masses(len(lanes), P)),                              # ... with their keys
           dict(pools, mass=_masses(len(lanes), P), mass_keys=key_rows[:, :-1]),
           dict(pools, mass=_masses(len(lanes), 8), mass_keys=key_rows),          # a key past the buckets
           dict(mass=_masses(len(lanes), P), mass_keys=key_rows),                 # masses need key lists
           dict(pools, q_out=torch.empty(len(lanes) - 1, nh, hd, dtype=torch.bfloat16)),
           dict(pools, q_out=torch.empty(len(lanes), nh, hd))]                  # qkv's type
    for kw in bad:
        k4, v4 = kb.clone(), vb.clone()
        with pytest.raises(RuntimeError, match="attention_rows"):
            torch.ops.dflash.attention_rows(qkv, cos, sin, k4, v4, lanes, positions, nh, nkv, hd ** -0.5, portable,
                                            **kw)
        assert torch.equal(k4, kb) and torch.equal(v4, vb)


def _masses(rows: int, buckets: int) -> torch.Tensor:
    """The score policy's (rows, buckets) int64 masses, zeroed (the ops add to them)."""
    return torch.zeros(rows, buckets, dtype=torch.int64)


def _assert_rows_sum_to(mass: torch.Tensor, nh: int) -> None:
    """Each row's masses (fixed point, 2^32 a probability of 1) add up to one per head."""
    got = mass.sum(1).double() / 2 ** 32
    assert torch.allclose(got, torch.full_like(got, float(nh)), atol=1e-6), got


def _slot_step_inputs(hd: int, cache: torch.dtype, start: int, T: int) -> tuple:
    """(nh, nkv, max_ctx, cos, sin, qkv, k cache, v cache) of a T-row attention step at
    ``start``: 4 / 2 heads, random bf16 rows and ``cache``-typed caches 40 rows longer."""
    from dflash_server.layers.rope import RotaryTable

    nh, nkv = 4, 2
    max_ctx = start + T + 40
    table = RotaryTable(hd, hd, 10000.0, max_ctx, None, torch.device("cpu"), torch.float32)
    cos, sin = table.rows(start, T)
    qkv = torch.randn(1, T, (nh + 2 * nkv) * hd).to(torch.bfloat16)
    kc, vc = torch.randn(1, nkv, max_ctx, hd).to(cache), torch.randn(1, nkv, max_ctx, hd).to(cache)
    return nh, nkv, max_ctx, cos, sin, qkv, kc, vc


@pytest.mark.parametrize("hd,cache,start,T", [(64, torch.float32, 20, 3), (64, torch.float16, 301, 1),
                                               (128, torch.bfloat16, 77, 9), (64, torch.float32, 40, 16)])
def test_attention_over_slots_equals_positions(hd, cache, start, T):
    """Slot-addressed KV (KV Flash pools): rows written to given cache rows and attending to
    given key rows in logical order give, bit for bit, what position-addressed KV gives for
    the same keys (the grouped paths take lists that are prefixes of the longest one; others
    go row by row, the same bits: a draft block's shared list, lists that are not prefixes);
    hostile slot arguments are refused."""
    nh, nkv, max_ctx, cos, sin, qkv, kc, vc = _slot_step_inputs(hd, cache, start, T)
    k1, v1 = kc.clone(), vc.clone()
    ref = torch.ops.dflash.attention_step(qkv, cos, sin, k1, v1, start, nh, nkv, hd ** -0.5)
    # the same keys scattered: position p lives at slot perm[p]
    perm = torch.randperm(max_ctx)
    k2, v2 = torch.zeros_like(kc), torch.zeros_like(vc)
    k2[:, :, perm], v2[:, :, perm] = kc, vc
    keys = torch.stack([torch.cat([perm[:start + t + 1], perm[:T - 1 - t]]) for t in range(T)])  # padded
    counts = torch.tensor([start + t + 1 for t in range(T)])
    out = torch.ops.dflash.attention_step(qkv, cos, sin, k2, v2, start, nh, nkv, hd ** -0.5,
                                          write_rows=perm[start:start + T], key_rows=keys, key_counts=counts)
    assert torch.equal(out, ref)
    assert torch.equal(k2[:, :, perm[:start + T]], k1[:, :, :start + T])
    # every row sees the whole block (a draft block), and rows whose lists are not prefixes of one
    # another (odd rows see every other key): the vectorized paths == the portable per-row path
    seen = perm[:start + T]
    every = torch.stack([seen] * T)
    odd = torch.stack([seen if t % 2 == 0 else torch.cat([seen[::2], seen[:start + T - len(seen[::2])]])
                       for t in range(T)])
    odd_counts = torch.tensor([start + T if t % 2 == 0 else len(seen[::2]) for t in range(T)])
    for keys_t, counts_t in ((every, torch.full((T,), start + T)), (odd, odd_counts)):
        outs = [torch.ops.dflash.attention_step(qkv, cos, sin, k2.clone(), v2.clone(), start, nh, nkv, hd ** -0.5,
                                                portable, write_rows=perm[start:start + T], key_rows=keys_t,
                                                key_counts=counts_t) for portable in (False, True)]
        assert torch.equal(outs[0], outs[1])
    assert torch.equal(torch.ops.dflash.attention_step(qkv, cos, sin, k2.clone(), v2.clone(), start, nh, nkv,
                                                       hd ** -0.5, True, write_rows=perm[start:start + T],
                                                       key_rows=keys, key_counts=counts), ref)
    bad = [dict(write_rows=torch.tensor([0, 1, max_ctx]), key_rows=keys, key_counts=counts),
           dict(write_rows=perm[:T], key_rows=keys, key_counts=counts + 100),
           dict(write_rows=perm[:T], key_rows=keys, key_counts=torch.zeros(T, dtype=torch.long)),
           dict(write_rows=perm[:T], key_rows=keys.clamp(min=max_ctx), key_counts=counts),
           dict(write_rows=perm[:T], key_rows=keys),
           dict(write_rows=perm[:T], key_rows=keys, key_counts=counts, window=4)]
    for kw in bad:
        with pytest.raises(RuntimeError, match="attention_step"):
            torch.ops.dflash.attention_step(qkv, cos, sin, k2.clone(), v2.clone(), start, nh, nkv, hd ** -0.5, **kw)


@pytest.mark.parametrize("hd,cache,start", [(64, torch.float16, 150), (128, torch.float32, 40),
                                           (64, torch.bfloat16, 600)])
def test_tree_over_key_lists_equals_the_position_tree(hd, cache, start):
    """A DDTree block over a KV Flash pool (row t's key list: the pool keys before the block, then
    its path's slots root first) runs on the group paths' tree form (tree_lists), bit-equal to the
    same tree over position-addressed KV and to the portable per-row path over the lists (K/V at
    the same slots); the score policy's masses (a bucket per list place of each row: each row's
    probabilities in its list's order) match an fp64 reference and ``attention_rows``'s;
    lists that are not a tree's (a path's slot swapped) still give the per-row path's bits."""
    from dflash_server.layers.rope import RotaryTable

    nh, nkv, T = 4, 2, 7
    parents = (-1, 0, 0, 1, 1, 2, 5)
    depth = [0] * T
    for t in range(1, T):
        depth[t] = depth[parents[t]] + 1
    max_ctx = start + T + 40
    g = torch.Generator().manual_seed(11)
    table = RotaryTable(hd, hd, 10000.0, max_ctx, None, torch.device("cpu"), torch.float32)
    at = torch.tensor([start + d for d in depth])
    cos, sin = table.cos[at], table.sin[at]
    qkv = torch.randn(1, T, (nh + 2 * nkv) * hd, generator=g).to(torch.bfloat16)
    kc = torch.randn(1, nkv, max_ctx, hd, generator=g).to(cache)
    vc = torch.randn(1, nkv, max_ctx, hd, generator=g).to(cache)
    ref = torch.ops.dflash.attention_step(qkv, cos, sin, kc.clone(), vc.clone(), start, nh, nkv, hd ** -0.5,
                                          tree=torch.tensor(parents))
    perm = torch.randperm(max_ctx, generator=g)
    k2, v2 = torch.zeros_like(kc), torch.zeros_like(vc)
    k2[:, :, perm], v2[:, :, perm] = kc, vc
    paths = []
    for t in range(T):
        path, r = [], t
        while r >= 0:
            path.insert(0, r)
            r = parents[r]
        paths.append(path)
    lists = [perm[:start].tolist() + [int(perm[start + r]) for r in path] for path in paths]
    width = max(map(len, lists))
    keys = torch.tensor([k + [0] * (width - len(k)) for k in lists])
    counts = torch.tensor([len(k) for k in lists])
    pool = dict(write_rows=perm[start:start + T], key_rows=keys, key_counts=counts)
    places = torch.arange(width).expand(T, -1).contiguous()   # bucket j: key j of the row's list
    outs, masses = [], []
    for portable in (False, True):
        m = _masses(T, width)
        outs.append(torch.ops.dflash.attention_step(qkv, cos, sin, k2.clone(), v2.clone(), start, nh, nkv,
                                                    hd ** -0.5, portable, mass=m, mass_keys=places, **pool))
        masses.append(m)
    assert torch.equal(outs[0], ref)
    if cache != torch.bfloat16:
        assert torch.equal(outs[1], outs[0])
    # fp64 reference: each row's softmax over its own list, with the cache's block keys as written
    from dflash_server.layers.rope import apply_rope

    written = k2.clone()
    torch.ops.dflash.attention_step(qkv, cos, sin, written, v2.clone(), start, nh, nkv, hd ** -0.5, **pool)
    qd = apply_rope(qkv.double()[0, :, :nh * hd].reshape(T, nh, hd), cos.double()[:, None], sin.double()[:, None])
    kd, want = written[0].double(), torch.zeros(T, width, dtype=torch.float64)
    for t in range(T):
        rows = torch.tensor(lists[t])
        for h in range(nh):
            want[t, :len(rows)] += (kd[h // (nh // nkv), rows] @ qd[t, h] * hd ** -0.5).softmax(0)
    torch.testing.assert_close(masses[0].double() / 2 ** 32, want, rtol=1e-4, atol=1e-5)
    assert torch.equal(masses[0], masses[1]) or cache == torch.bfloat16
    rows_mass = _masses(T, width)
    rows_out = torch.ops.dflash.attention_rows(qkv, cos, sin, k2.clone(), v2.clone(), [0] * T,
                                               list(range(start, start + T)), nh, nkv, hd ** -0.5, mass=rows_mass,
                                               mass_keys=places, **pool)
    assert torch.equal(rows_out, outs[0]) and torch.equal(rows_mass, masses[0])
    bent = keys.clone()   # row 3's path with its parent's slot swapped for a prefix key: no tree
    bent[3, start] = perm[0]
    got = [torch.ops.dflash.attention_step(qkv, cos, sin, k2.clone(), v2.clone(), start, nh, nkv, hd ** -0.5,
                                           portable, write_rows=perm[start:start + T], key_rows=bent,
                                           key_counts=counts) for portable in (False, True)]
    if cache != torch.bfloat16:
        assert torch.equal(got[0], got[1])
    assert not torch.equal(got[0][:, 3], outs[0][:, 3]) and torch.equal(got[0][:, :3], outs[0][:, :3])


@pytest.mark.parametrize("hd,cache,start,T", [(64, torch.bfloat16, 301, 1), (64, torch.float32, 40, 5),
                                               (128, torch.float16, 77, 3), (16, torch.float32, 20, 2)])
def test_attention_step_reports_masses_and_queries(hd, cache, start, T):
    """KV Flash's score policy on the native step: ``mass`` receives each row's attention per
    bucket (``mass_keys``: here 5-row buckets of cache rows) summed over heads, in fixed point,
    ``q_out`` the rotated queries of the last rows, on the grouped paths (head_dim 64 / 128) and
    the per-row one (16, and ``portable``), against fp64; the output is the same as without
    them; bad arguments are refused."""
    from dflash_server.layers.rope import apply_rope

    nh, nkv, max_ctx, cos, sin, qkv, kc, vc = _slot_step_inputs(hd, cache, start, T)
    perm = torch.randperm(max_ctx)
    keys = torch.stack([torch.cat([perm[:start + t + 1], perm[:T - 1 - t]]) for t in range(T)])
    slots = dict(write_rows=perm[start:start + T], key_rows=keys, key_counts=torch.arange(start + 1, start + T + 1))
    args = (cos, sin)
    plain = torch.ops.dflash.attention_step(qkv, *args, kc.clone(), vc.clone(), start, nh, nkv, hd ** -0.5, **slots)
    q = apply_rope(qkv.double()[0, :, :nh * hd].reshape(T, nh, hd), cos.double()[:, None], sin.double()[:, None])
    R = min(T, 2)
    buckets = -(-max_ctx // 5)
    for portable in (False, True):
        k2, v2 = kc.clone(), vc.clone()
        mass, q_out = _masses(T, buckets), torch.empty(1, R, nh, hd, dtype=torch.bfloat16)
        out = torch.ops.dflash.attention_step(qkv, *args, k2, v2, start, nh, nkv, hd ** -0.5, portable, mass=mass,
                                              q_out=q_out, mass_keys=keys // 5, **slots)
        assert torch.equal(out, plain) if not portable else torch.allclose(out.float(), plain.float(), atol=1e-2)
        ref = torch.zeros(T, buckets, dtype=torch.float64)
        kd = k2[0].double()
        for t in range(T):
            rows = keys[t, :start + t + 1]
            for h in range(nh):
                p = (kd[h // (nh // nkv), rows] @ q[t, h] * hd ** -0.5).softmax(0)
                ref[t].index_add_(0, rows // 5, p)
        torch.testing.assert_close(mass.double() / 2 ** 32, ref, rtol=1e-4, atol=1e-5)
        _assert_rows_sum_to(mass, nh)
        torch.testing.assert_close(q_out[0].double(), q[T - R:], rtol=0, atol=2e-2)
    mk = keys // 5
    for bad in (dict(mass=_masses(T - 1 or 2, buckets), mass_keys=mk), dict(mass=torch.zeros(T, buckets), mass_keys=mk),
                dict(mass=_masses(T, buckets)), dict(mass=_masses(T, buckets), mass_keys=mk[:, 1:]),
                dict(mass=_masses(T, 3), mass_keys=mk),
                dict(q_out=torch.empty(1, T + 1, nh, hd, dtype=torch.bfloat16)),
                dict(q_out=torch.empty(1, T, nh, hd, dtype=torch.float32))):
        with pytest.raises(RuntimeError, match="attention_step"):
            torch.ops.dflash.attention_step(qkv, *args, kc.clone(), vc.clone(), start, nh, nkv, hd ** -0.5, **bad,
                                            **slots)
    with pytest.raises(RuntimeError, match="key lists"):   # masses are for KV Flash pools
        torch.ops.dflash.attention_step(qkv, *args, kc.clone(), vc.clone(), start, nh, nkv, hd ** -0.5,
                                        mass=_masses(T, buckets), mass_keys=mk)


@pytest.mark.parametrize("nh,nkv,T", [(4, 2, 5), (16, 1, 12)])
def test_masses_do_not_depend_on_threads_or_the_call(nh, nkv, T):
    """The score policy's masses are exact fixed-point sums: a row's are the same bits on 1 and 2
    threads, for a lane inside ``attention_rows`` beside another lane as alone, and as the
    one-row step at its position gives (what plain decoding would have observed); 16 query heads
    on one kv head x 12 rows is more than one grouped work item (128 queries)."""
    from dflash_server.layers.rope import RotaryTable

    hd, P, start = 64, 96, 60
    g = torch.Generator().manual_seed(5)
    table = RotaryTable(hd, hd, 10000.0, 256, None, torch.device("cpu"), torch.float32)
    kb = torch.randn(2, nkv, P, hd, generator=g).to(torch.float16)
    vb = torch.randn(2, nkv, P, hd, generator=g).to(torch.float16)
    perm = torch.randperm(P, generator=g)
    lists = [perm[:start + t + 1].tolist() for t in range(T)]
    key_rows = torch.tensor([k + [0] * (start + T - len(k)) for k in lists])
    key_counts = torch.tensor([len(k) for k in lists])
    pool = dict(write_rows=perm[start:start + T], key_rows=key_rows, key_counts=key_counts)
    qkv = torch.randn(1, T + 1, (nh + 2 * nkv) * hd, generator=g).to(torch.bfloat16)
    cos, sin = table.cos[start:start + T + 1], table.sin[start:start + T + 1]
    chunk = 8
    keys = key_rows // chunk   # buckets: 8-row chunks of the lane
    keep = torch.get_num_threads()
    masses = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            m, k1 = _masses(T, P // chunk), kb[:1].clone()
            torch.ops.dflash.attention_step(qkv[:, :T], cos[:T], sin[:T], k1, vb[:1].clone(), start, nh,
                                            nkv, hd ** -0.5, mass=m, mass_keys=keys, **pool)
            masses.append(m)
            rows = _masses(T + 1, P // chunk)   # lane 1 takes a decode row after lane 0's block
            other = torch.tensor([[int(perm[0])] + [0] * (start + T - 1)])
            torch.ops.dflash.attention_rows(qkv, cos, sin, kb.clone(), vb.clone(), [0] * T + [1],
                                            list(range(start, start + T)) + [start], nh, nkv, hd ** -0.5,
                                            write_rows=torch.cat([pool["write_rows"], perm[1:2]]),
                                            key_rows=torch.cat([key_rows, other]),
                                            key_counts=torch.cat([key_counts, torch.tensor([1])]), mass=rows,
                                            mass_keys=torch.cat([keys, other // chunk]))
            masses.append(rows[:T])
            if threads == 2:   # each row alone, at its position, over the cache the block wrote
                alone = _masses(T, P // chunk)
                for t in range(T):
                    torch.ops.dflash.attention_step(qkv[:, t:t + 1], cos[t:t + 1], sin[t:t + 1], k1.clone(),
                                                    vb[:1].clone(), start + t, nh, nkv, hd ** -0.5,
                                                    mass=alone[t:t + 1], mass_keys=keys[t:t + 1],
                                                    write_rows=pool["write_rows"][t:t + 1],
                                                    key_rows=key_rows[t:t + 1], key_counts=key_counts[t:t + 1])
                masses.append(alone)
    finally:
        torch.set_num_threads(keep)
    for m in masses[1:]:
        assert torch.equal(m, masses[0])
    _assert_rows_sum_to(masses[0], nh)


def test_argmax_is_torchs():
    """``dflash::argmax`` gives ``torch.argmax``'s indices: the first of equal maxima, a NaN
    as the largest (the first NaN), -inf rows, short rows, bf16 / fp16, several rows, both
    the vector and the portable path; ``kernels.argmax`` falls back to aten off the CPU path."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(49152, generator=g), torch.randn(15048, generator=g), torch.randn(7, generator=g),
            torch.full((40,), float("-inf")), torch.zeros(33), torch.tensor([-0.0, 0.0, -0.0] * 11)]
    tie = torch.randn(1000, generator=g)
    tie[[17, 500, 999]] = tie.max() + 1.0
    nan = torch.randn(1000, generator=g)
    nan[[300, 700]] = float("nan")
    late = torch.randn(1001, generator=g)
    late[1000] = 50.0                                   # in the scalar tail after the vector lanes
    rows += [tie, nan, late]
    for x in rows:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            xd = x.to(dtype)
            want = int(xd.float().argmax())
            for portable in (False, True):
                assert int(torch.ops.dflash.argmax(xd, portable)) == want, (x.shape, dtype, portable)
    batch = torch.randn(3, 5, 301, generator=g)
    batch[1, 2, 77] = 9.0
    assert torch.equal(torch.ops.dflash.argmax(batch), batch.argmax(-1))
    assert torch.equal(kernels.argmax(batch.bfloat16()), batch.bfloat16().argmax(-1))
    with pytest.raises(RuntimeError):
        torch.ops.dflash.argmax(torch.zeros(4, 0))
    with pytest.raises(RuntimeError):
        torch.ops.dflash.argmax(torch.zeros(4, 3, dtype=torch.int32))
