"""GGUF K-quant blocks (Q4_K, Q5_K, Q6_K) and 5-bit blocks (Q5_0, Q5_1) -> the group
layout ``dflash::qmm`` reads.

Q5_0 / Q5_1 blocks of 32 hold fp16 ``d`` (and ``m``), 32 fifth bits and 16 bytes of
nibbles: ``w = d (q - 16)`` / ``w = d q + m``; they become the Q4_0/Q4_1 layout plus a plane
of the fifth bits, with ``e = -16 d`` (exact in fp16, checked) / ``e = m``.

A K-quant super-block holds 256 values: 8 sub-blocks of 32 with 6-bit scales (and mins)
packed in 12 bytes under an fp16 ``d`` (and ``dmin``) for Q4_K/Q5_K, or 16 int8 scales (one
per 16 values) under an fp16 ``d`` for Q6_K. The kernels work per block of 32, so the
sub-block fields are unpacked here once at load, exactly (no value is rounded): per block
the 8 rows' codes (low 4 bits as nibbles, then one 32-byte plane per higher bit), the
super-block's fp16 ``d`` (and ``dmin``) repeated, and the sub-block's integer scale (and
min). The field order per block of a group is documented in ``csrc/qmm.cpp`` (``Kind``).
The unpacking follows ggml's ``dequantize_row_q{4,5,6}_K``; the tests check it against the
``gguf`` package's dequantizer.
"""
from __future__ import annotations

import torch

QK_K = 256
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "Q5_0": 22, "Q5_1": 24}
NR = 8  # output rows per group


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 packed bytes (..., 12) -> 8 six-bit scales and 8 six-bit mins (..., 8) (ggml's
    ``get_scale_min_k4``)."""
    s = s.to(torch.int32)
    lo_sc, lo_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    hi_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return torch.cat([lo_sc, hi_sc], -1), torch.cat([lo_m, hi_m], -1)


def unpack(qtype: str, rows: torch.Tensor, k: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(codes (N, K) uint8 unsigned, per-block fields [(N, K/32, width) uint8, ...]) of GGUF
    K-quant rows (N, K/256 * block bytes)."""
    n = rows.shape[0]
    if qtype in ("Q5_0", "Q5_1"):
        return _unpack_q5(qtype, rows, k)
    if k % QK_K:
        raise ValueError(f"{qtype} rows must hold a multiple of 256 values, got {k}")
    nsb = k // QK_K
    blk = rows.reshape(n, nsb, BLOCK_BYTES[qtype])
    rep = lambda t: t.repeat_interleave(8, dim=1)  # noqa: E731 - per super-block -> per block of 32
    if qtype in ("Q4_K", "Q5_K"):
        d, dmin = blk[..., 0:2], blk[..., 2:4]
        sc, mn = _scale_min_k4(blk[..., 4:16])
        qs = blk[..., -128:].reshape(n, nsb, 4, 32)
        nib = torch.stack([qs & 0xF, qs >> 4], dim=3).reshape(n, nsb, 8, 32)  # sub-block 2t, 2t+1
        if qtype == "Q5_K":
            qh = blk[..., 16:48]  # bit s of byte l: bit 4 of value l of sub-block s
            hi = torch.stack([(qh >> s) & 1 for s in range(8)], dim=2)  # (n, nsb, 8, 32)
            nib = nib | (hi << 4)
        codes = nib.reshape(n, k)
        fields = [rep(d), rep(dmin), sc.reshape(n, -1, 1).to(torch.uint8), mn.reshape(n, -1, 1).to(torch.uint8)]
        return codes, fields
    if qtype == "Q6_K":
        ql, qh = blk[..., 0:128].reshape(n, nsb, 2, 64), blk[..., 128:192].reshape(n, nsb, 2, 32)
        sc, d = blk[..., 192:208], blk[..., 208:210]
        parts = [(ql[..., :32] & 0xF) | ((qh & 3) << 4),          # values 0..31 of each half
                 (ql[..., 32:] & 0xF) | (((qh >> 2) & 3) << 4),   # 32..63
                 (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4),    # 64..95
                 (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4)]    # 96..127
        codes = torch.stack(parts, dim=3).reshape(n, k)  # (n, nsb, half, 4, 32): value order
        sc = sc.reshape(n, nsb * 8, 2)  # sub-block s: scales 2s (values 0..15), 2s + 1 (16..31)
        return codes, [rep(d), sc[..., :1].contiguous(), sc[..., 1:].contiguous()]
    raise ValueError(f"not a K-quant type: {qtype}")


def _unpack_q5(qtype: str, rows: torch.Tensor, k: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    n, nb = rows.shape[0], k // 32
    blk = rows.reshape(n, nb, BLOCK_BYTES[qtype])
    d = blk[..., 0:2]
    at = 2 if qtype == "Q5_0" else 4
    qh = blk[..., at:at + 4].to(torch.int64)
    bits = qh[..., 0] | (qh[..., 1] << 8) | (qh[..., 2] << 16) | (qh[..., 3] << 24)  # bit j: value j's bit 4
    hi = ((bits[..., None] >> torch.arange(32)) & 1).to(torch.uint8)
    qs = blk[..., at + 4:at + 20]
    codes = (torch.cat([qs & 0xF, qs >> 4], dim=-1) | (hi << 4)).reshape(n, k)
    if qtype == "Q5_1":
        return codes, [d, blk[..., 2:4]]
    d16 = d.contiguous().view(torch.float16)  # (n, nb, 1)
    e = (d16.float() * -16).to(torch.float16)
    if not torch.equal(e.float(), d16.float() * -16):
        raise RuntimeError("a Q5_0 scale does not fit the fp16 offset")
    return codes, [d, e.view(torch.uint8)]


def _planes(codes: torch.Tensor, bit: int) -> torch.Tensor:
    """(G, 8, nb, 32) codes -> (G, nb, 32) plane: byte (r, i) holds bit ``bit`` of value
    4c + i of row r in its bit c."""
    b = ((codes >> bit) & 1).reshape(*codes.shape[:3], 8, 4)  # (G, 8 rows, nb, chunk c, i)
    weights = (1 << torch.arange(8, dtype=torch.uint8)).reshape(1, 1, 1, 8, 1)
    plane = (b * weights).sum(dim=3, dtype=torch.int32).to(torch.uint8)  # (G, 8, nb, 4)
    return plane.permute(0, 2, 1, 3).reshape(codes.shape[0], codes.shape[2], 32)


def repack(qtype: str, rows: torch.Tensor, k: int) -> torch.Tensor:
    """GGUF Q5_0 / Q5_1 / K-quant rows (N, bytes per row) -> the group layout (groups, K/32 * group block bytes)."""
    codes, fields = unpack(qtype, rows, k)
    n = codes.shape[0]
    pad = (-n) % NR
    if pad:  # zero rows: zero scales, so the padded outputs are 0
        codes = torch.cat([codes, codes.new_zeros(pad, k)])
        fields = [torch.cat([f, f.new_zeros(pad, *f.shape[1:])]) for f in fields]
    g, nb = (n + pad) // NR, k // 32
    c = codes.reshape(g, NR, nb, 32)
    low = c & 0xF
    nib = (low[..., :16] | (low[..., 16:] << 4)).reshape(g, NR, nb, 4, 4)  # chunk c < 4: values 4c.., 16+4c..
    out = [nib.permute(0, 2, 3, 1, 4).reshape(g, nb, 128)]
    if qtype in ("Q5_0", "Q5_1", "Q5_K", "Q6_K"):
        out.append(_planes(c, 4))
    if qtype == "Q6_K":
        out.append(_planes(c, 5))
    for f in fields:  # (N, nb, w) -> per block the 8 rows' fields side by side
        out.append(f.reshape(g, NR, nb, -1).permute(0, 2, 1, 3).reshape(g, nb, -1))
    return torch.cat(out, dim=-1).reshape(g, -1).contiguous()
