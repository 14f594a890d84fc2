"""Scaled dot-product attention with the backends named explicitly on a GPU.

On an H100 (torch 2.11, bf16, grouped-query heads, one query over a cache that grows by a
row every call), PyTorch's default backend selection cost 35.7 ms per call; naming the
backends (flash, memory-efficient, math: flash runs) 26 us; cuDNN alone 30 us. So the time
went into the default selection for each new shape, not into a kernel. A SmolLM2-135M-shaped
decode step went from 48.5 to 11.1 ms (benchmarks/gpu_sdpa.py,
benchmarks/results/gpu_sdpa.json). On CUDA the backends are therefore flash,
memory-efficient and math, in that order; elsewhere nothing changes."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

GPU_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
         scale: float | None = None, gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)``."""
    if q.is_cuda:
        with sdpa_kernel(GPU_BACKENDS):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
