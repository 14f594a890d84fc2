"""RMSNorm in fp32.

Every family's norm is reduced to ``w * normalize(x)`` computed in fp32: the Qwen3.5
zero-centred ``(1 + w)`` form is folded into the weight once, at load time, so the hot path
has one implementation.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels


class RMSNorm(nn.Module):
    """``weight`` is kept in fp32; the output is cast back to the input dtype."""

    def __init__(self, weight: torch.Tensor, eps: float, zero_centred: bool = False):
        super().__init__()
        w = weight.detach().float()
        if zero_centred:
            w = w + 1.0
        self.weight = nn.Parameter(w, requires_grad=False)
        self.eps = float(eps)
        # the native one-pass kernel where the quantized linears use the native kernels too
        self.native = w.device.type == "cpu" and kernels.enabled() and kernels.load()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native and x.device.type == "cpu" and kernels.inference(x, self.weight):
            return torch.ops.dflash.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight, self.eps).to(x.dtype)
