"""The native kernels' inputs from hostile hands: a bad `--kernels` value, a GGUF whose
quantized rows are not whole blocks, K-quant blocks with garbage scales, stored blocks that
do not match the weight they claim to be. Each is a clear error or a working fallback,
never a crash, a hang or silently wrong shapes."""
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_server import kernels
from dflash_server.errors import ModelLoadError
from dflash_server.layers.linear import Linear
from dflash_server.weights.gguf_file import GGUFFile


def _gguf(path, name: str, ne: tuple[int, ...], ggml_type: int, data: bytes):
    """A minimal GGUF v3 file: general.architecture and one tensor (no writer checks)."""
    def s(x: str) -> bytes:
        b = x.encode()
        return struct.pack("<Q", len(b)) + b
    kv = s("general.architecture") + struct.pack("<I", 8) + s("llama")
    info = s(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne) + \
        struct.pack("<IQ", ggml_type, 0)
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, 1) + kv + info
    head += b"\0" * (-len(head) % 32)
    path.write_bytes(head + data)
    return path


def test_bad_kernels_flag_is_a_usage_error():
    r = subprocess.run([sys.executable, "-m", "dflash_server", "generate", "--kernels", "fast", "--prompt", "x"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "invalid choice: 'fast'" in r.stderr and "Traceback" not in r.stderr


def test_bad_cuda_graphs_flag_is_a_usage_error():
    r = subprocess.run([sys.executable, "-m", "dflash_server", "generate", "--cuda-graphs", "on", "--prompt", "x"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "invalid choice: 'on'" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("ne0", [100, 300, 257])
def test_rows_that_are_not_whole_blocks_are_refused(tmp_path, ne0):
    """Q4_K rows of 100 / 300 / 257 values: a clean load error naming the tensor (they used
    to be sized by flooring and read past what the kernels expect)."""
    path = _gguf(tmp_path / "bad.gguf", "blk.0.ffn_up.weight", (ne0, 4), 12, bytes(144 * 8))
    with pytest.raises(ModelLoadError, match="blk.0.ffn_up.weight.*whole Q4_K blocks of 256"):
        GGUFFile(path)


def test_garbage_k_quant_scales_give_nan_or_numbers_never_a_crash():
    """Every bit pattern is a K-quant block (inf / NaN fp16 scales included): the op runs,
    and rows whose scales are finite stay finite."""
    assert kernels.load()
    g = np.random.default_rng(0)
    rows = torch.from_numpy(g.integers(0, 256, size=(16, 144 * 2), dtype=np.uint8))
    good = rows.clone()
    good[:, 0:2] = good[:, 144:146] = torch.tensor([0x00, 0x10], dtype=torch.uint8)  # d = 2^-11: finite
    good[:, 2:4] = good[:, 146:148] = torch.tensor([0x00, 0x10], dtype=torch.uint8)
    rows[3, 0:2] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)  # +inf
    rows[5, 2:4] = torch.tensor([0x01, 0x7E], dtype=torch.uint8)  # NaN
    x = torch.randn(2, 512)
    for blocks in (good, rows):
        qt, packed = kernels.repack(kernels.PackedRows("Q4_K", blocks), 512)
        y = torch.ops.dflash.qmm(x, packed, qt, 16, 512)
        assert y.shape == (2, 16)
    assert torch.isfinite(torch.ops.dflash.qmm(x, kernels.repack(kernels.PackedRows("Q4_K", good), 512)[1],
                                               12, 16, 512)).all()


def test_stored_blocks_that_do_not_fit_the_weight_fall_back_to_aten(monkeypatch, caplog):
    """A loader handing over blocks of the wrong size for the matrix (a corrupt or lying
    file): the linear warns and keeps the aten path with the dequantized weight."""
    assert kernels.load()
    monkeypatch.setenv("DFLASH_KERNELS", "1")
    w = torch.randn(32, 512)
    w.packed = kernels.PackedRows("Q4_K", torch.zeros(32, 100, dtype=torch.uint8))  # not 2 x 144 bytes per row
    lin = Linear(w)
    with caplog.at_level("WARNING"):
        lin.quantize_("int4")
    assert lin.mode == "int4" and "keeps the aten path" in caplog.text
    x = torch.randn(3, 512)
    assert ((lin(x) - x @ w.T).norm() / (x @ w.T).norm()).item() < 0.1


def test_a_killed_build_does_not_block_the_next(tmp_path, monkeypatch):
    """torch's build lock file, left behind by a build that was killed (Ctrl-C at first
    start), is cleared under our own lock (which dies with its holder) instead of making
    every later start wait forever; a library built meanwhile by another process is loaded."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("DFLASH_KERNELS_CACHE", str(tmp_path))
    out = kernels.cache_dir() / kernels._build_key()
    out.mkdir(parents=True)
    (out / "lock").write_text("")  # a killed build's leftover
    seen = {}

    def fake_load(name, build_directory, **kw):
        seen["lock_left"] = (Path(build_directory) / "lock").exists()
        raise RuntimeError("stop here")  # the real build is tested by every other test

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    with pytest.raises(RuntimeError, match="stop here"):
        kernels._build()
    assert seen == {"lock_left": False}
