"""Rotary position embeddings (NeoX half-rotation form), full or partial.

cos/sin tables are precomputed once for the whole context on the stage's device, so a
forward only slices rows. Rotation is applied before the K write, so cached K rows are
position-final (KV Flash relies on that: chunks can move without re-rotation).
"""
from __future__ import annotations

import math

import torch


def _inv_freq(rotary_dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, the factor cos and sin are multiplied by) as transformers
    computes them for each supported ``rope_type``."""
    inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / float(scaling["factor"]), 1.0
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
        return torch.where(is_mid, mid, scaled), 1.0
    if kind == "yarn":
        return _yarn(rotary_dim, theta, scaling, inv)
    if kind == "proportional":  # Gemma 4's full layers: the whole head's pairs, the first ones turning
        angles = int(float(scaling.get("partial_rotary_factor", 1.0)) * rotary_dim // 2)
        turning = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.float64) / rotary_dim))
        inv = torch.cat([turning, torch.zeros(rotary_dim // 2 - angles, dtype=torch.float64)])
        return inv / float(scaling.get("factor", 1.0)), 1.0
    raise ValueError(f"rope scaling type {kind!r} is not supported")


def _yarn(dim: int, theta: float, p: dict, extrapolation: torch.Tensor) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): interpolate the low frequencies by ``factor``, keep the high
    ones, a linear ramp between (bounds from beta_fast / beta_slow rotations over the original
    context); cos and sin scaled by the attention factor (0.1 ln(factor) + 1 unless given)."""
    if p.get("factor") is None or p.get("original_max_position_embeddings") is None:
        raise ValueError("yarn RoPE needs factor and original_max_position_embeddings")
    factor, orig = float(p["factor"]), float(p["original_max_position_embeddings"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    attention = p.get("attention_factor")
    if attention is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the high frequencies), 0: interpolate
    return extrapolation / factor * (1 - keep) + extrapolation * keep, float(attention)


class RotaryTable:
    """cos/sin rows for positions ``[0, max_pos)``; ``rotary_dim <= head_dim``."""

    def __init__(self, head_dim: int, rotary_dim: int, theta: float, max_pos: int,
                 scaling: dict | None, device: torch.device, dtype: torch.dtype):
        if rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and <= head_dim {head_dim}")
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        inv, attention = _inv_freq(rotary_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv.float())
        emb = torch.cat([freqs, freqs], dim=-1)  # (max_pos, rotary_dim)
        cos, sin = emb.cos(), emb.sin()
        if attention != 1.0:  # YaRN: both scaled, as transformers does
            cos, sin = cos * attention, sin * attention
        self.cos = cos.to(device=device, dtype=dtype)
        # rotate_half(x) * sin == roll(x, half) * [-sin | sin]: one op instead of four
        half = rotary_dim // 2
        self.sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1).to(device=device, dtype=dtype)

    def rows(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[start:start + length], self.sin[start:start + length]


def rope_tables(cfg, max_pos: int, device, dtype) -> tuple[RotaryTable, RotaryTable | None]:
    """A model's RoPE rows: the main table, and the sliding layers' own one where the family
    gives them another base (Gemma, Laguna), with its own rotated width and scaling."""
    full_hd = cfg.head_dim_full or cfg.head_dim
    rot = full_hd if cfg.head_dim_full else cfg.rotary_dim
    main = RotaryTable(full_hd, rot, cfg.rope_theta, max_pos, cfg.rope_scaling, device, dtype)
    local = RotaryTable(cfg.head_dim, cfg.local_rotary_dim, cfg.rope_local_theta, max_pos, cfg.rope_local_scaling,
                        device, dtype) if cfg.rope_local_theta else None
    return main, local


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (..., T, H, D) or (..., H, T, D) with cos/sin broadcastable to it (rows of
    ``RotaryTable``; ``sin`` is the signed table). Rotates the first rotary_dim dims."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return x * cos + x.roll(rd // 2, dims=-1) * sin
    rot, rest = x[..., :rd], x[..., rd:]
    return torch.cat((rot * cos + rot.roll(rd // 2, dims=-1) * sin, rest), dim=-1)
