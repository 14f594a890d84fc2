"""SwiGLU feed-forward with a fused gate+up projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import Linear


class SwiGLU(nn.Module):
    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
        super().__init__()
        self.inter = gate.shape[0]
        self.gate_up = Linear.fused([gate, up])
        self.down = Linear(down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up(x)
        return self.down(F.silu(h[..., :self.inter]) * h[..., self.inter:])
