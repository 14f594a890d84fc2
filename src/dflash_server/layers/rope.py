"""Rotary position embeddings (NeoX half-rotation form), full or partial.

cos/sin tables are precomputed once for the whole context on the stage's device, so a
forward only slices rows. Rotation is applied before the K write, so cached K rows are
position-final (KV Flash relies on that: chunks can move without re-rotation).
"""
from __future__ import annotations

import math

import torch


def _inv_freq(rotary_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wl, high_wl = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wl) & (wavelen <= low_wl)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"rope scaling type {kind!r} is not supported")


class RotaryTable:
    """cos/sin rows for positions ``[0, max_pos)``; ``rotary_dim <= head_dim``."""

    def __init__(self, head_dim: int, rotary_dim: int, theta: float, max_pos: int,
                 scaling: dict | None, device: torch.device, dtype: torch.dtype):
        if rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and <= head_dim {head_dim}")
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        inv = _inv_freq(rotary_dim, theta, scaling).float()
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
        emb = torch.cat([freqs, freqs], dim=-1)  # (max_pos, rotary_dim)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        # rotate_half(x) * sin == roll(x, half) * [-sin | sin]: one op instead of four
        half = rotary_dim // 2
        self.sin = torch.cat([-emb.sin()[:, :half], emb.sin()[:, half:]], dim=-1).to(device=device, dtype=dtype)

    def rows(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[start:start + length], self.sin[start:start + length]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (..., T, H, D) or (..., H, T, D) with cos/sin broadcastable to it (rows of
    ``RotaryTable``; ``sin`` is the signed table). Rotates the first rotary_dim dims."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return x * cos + x.roll(rd // 2, dims=-1) * sin
    rot, rest = x[..., :rd], x[..., rd:]
    return torch.cat((rot * cos + rot.roll(rd // 2, dims=-1) * sin, rest), dim=-1)
