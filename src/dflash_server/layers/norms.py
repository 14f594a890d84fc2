"""RMSNorm in fp32.

Every family's norm is reduced to ``w * normalize(x)`` computed in fp32: the Qwen3.5
zero-centred ``(1 + w)`` form is folded into the weight once, at load time, so the hot path
has one implementation.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """``weight`` is kept in fp32; the output is cast back to the input dtype."""

    def __init__(self, weight: torch.Tensor, eps: float, zero_centred: bool = False):
        super().__init__()
        w = weight.detach().float()
        if zero_centred:
            w = w + 1.0
        self.weight = nn.Parameter(w, requires_grad=False)
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight, self.eps).to(x.dtype)
