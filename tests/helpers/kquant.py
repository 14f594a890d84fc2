"""A plain K-quant quantizer (Q4_K, Q5_K, Q6_K) for test files: gguf-py dequantizes these
types but cannot write them. Simpler than ggml's (no search for the best scales), but it
writes the same bit layout; tests check it through gguf's own dequantizer."""
from __future__ import annotations

import numpy as np


def _round(x):
    return np.rint(x).astype(np.int64)


def _pack_scale_min_k4(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins (..., 8) -> ggml's 12 bytes."""
    out = np.zeros((*sc.shape[:-1], 12), dtype=np.uint8)
    out[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    out[..., 4:8] = (m[..., 0:4] & 63) | ((m[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:8] & 0xF) | ((m[..., 4:8] & 0xF) << 4)
    return out


def _affine(w: np.ndarray, levels: int):
    """w (..., 8, 32) -> codes, sc, m, d, dmin with w ~= d sc q - dmin m (ggml's Q4_K/Q5_K)."""
    lo = np.minimum(w.min(-1), 0.0)  # ggml keeps the min <= 0 (stored as a positive m)
    step = (w.max(-1) - lo) / levels
    d = step.max(-1) / 63
    dmin = (-lo).max(-1) / 63
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    d32, dmin32 = d16.astype(np.float32), dmin16.astype(np.float32)
    sc = np.clip(_round(step / np.where(d32 > 0, d32, 1)[..., None]), 0, 63)
    m = np.clip(_round(-lo / np.where(dmin32 > 0, dmin32, 1)[..., None]), 0, 63)
    scale = d32[..., None] * sc
    q = np.clip(_round((w + (dmin32[..., None] * m)[..., None]) / np.where(scale > 0, scale, 1)[..., None]), 0, levels)
    return q, sc, m, d16, dmin16


def quantize(w: np.ndarray, qtype: str) -> np.ndarray:
    """w (N, K) float, K a multiple of 256 -> GGUF rows (N, K/256 * block bytes) uint8."""
    n, k = w.shape
    sb = w.astype(np.float32).reshape(n, k // 256, 8, 32)
    if qtype in ("Q4_K", "Q5_K"):
        q, sc, m, d, dmin = _affine(sb, 15 if qtype == "Q4_K" else 31)
        low = (q & 0xF).reshape(n, k // 256, 4, 2, 32)  # sub-blocks 2t (low nibbles), 2t + 1 (high)
        qs = (low[:, :, :, 0] | (low[:, :, :, 1] << 4)).astype(np.uint8).reshape(n, k // 256, 128)
        head = [d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), _pack_scale_min_k4(sc, m)]
        if qtype == "Q5_K":  # bit s of qh[l]: bit 4 of value l of sub-block s
            hi = (q >> 4) & 1
            qh = sum((hi[:, :, s] << s) for s in range(8)).astype(np.uint8)
            head.append(qh)
        blk = np.concatenate([*head, qs], axis=-1)
        return blk.reshape(n, -1)
    if qtype == "Q6_K":
        halves = sb.reshape(n, k // 256, 16, 16)  # scales per 16 values
        amax = np.abs(halves).max(-1)
        step = amax / 31
        d = (step.max(-1) / 127).astype(np.float16)
        d32 = d.astype(np.float32)
        sc = np.clip(_round(step / np.where(d32 > 0, d32, 1)[..., None]), -128, 127)
        scale = d32[..., None] * sc
        q = np.clip(_round(halves / np.where(scale > 0, scale, 1)[..., None]) + 32, 0, 63)
        q = q.reshape(n, k // 256, 2, 4, 32)  # half, part, l (see ggml's dequantize_row_q6_K)
        ql = np.concatenate([(q[:, :, :, 0] & 0xF) | ((q[:, :, :, 2] & 0xF) << 4),
                             (q[:, :, :, 1] & 0xF) | ((q[:, :, :, 3] & 0xF) << 4)], axis=-1)  # (n, nsb, 2, 64)
        qh = sum(((q[:, :, :, p] >> 4) & 3) << (2 * p) for p in range(4))  # (n, nsb, 2, 32)
        blk = np.concatenate([ql.astype(np.uint8).reshape(n, k // 256, 128), qh.astype(np.uint8).reshape(n, k // 256, 64),
                              sc.astype(np.int8).view(np.uint8), d[..., None].view(np.uint8)], axis=-1)
        return blk.reshape(n, -1)
    raise ValueError(qtype)
