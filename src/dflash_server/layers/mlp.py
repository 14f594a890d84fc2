"""Gated feed-forward (SwiGLU, or GeGLU with the tanh GELU: Gemma) with a fused gate+up projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from .linear import Linear


class SwiGLU(nn.Module):
    """``down(act(gate(x)) * up(x))``; ``act``: "silu" or "gelu_tanh"."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, act: str = "silu"):
        super().__init__()
        if act not in ("silu", "gelu_tanh"):
            raise ValueError(f"unsupported MLP activation {act!r}")
        self.inter, self.act = gate.shape[0], act
        self.gate_up = Linear.fused([gate, up])
        self.down = Linear(down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up(x)
        if self.act == "silu" and self.gate_up.mode == "native" and kernels.inference(h):
            # the fused native layer's activation (csrc/act.cpp), so that this path and
            # dflash::decoder_layer give the same bits
            return self.down(torch.ops.dflash.silu_mul(h, self.inter))
        g = h[..., :self.inter]
        g = F.silu(g) if self.act == "silu" else F.gelu(g, approximate="tanh")
        return self.down(g * h[..., self.inter:])
