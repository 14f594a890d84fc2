"""The pre-norm decoder block shared by the Llama, Qwen3 and Qwen3.5 families."""
from __future__ import annotations

import torch
from torch import nn

from .context import ForwardContext
from .norms import RMSNorm


class DecoderLayer(nn.Module):
    """``x += mixer(norm1(x)); x += mlp(norm2(x))``. ``mixer`` is attention or a recurrent
    (GDN) layer; its ``new_state`` decides the layer's state kind (``kv`` / ``recurrent``)."""

    def __init__(self, index: int, input_norm: RMSNorm, mixer: nn.Module, post_norm: RMSNorm, mlp: nn.Module):
        super().__init__()
        self.index = index
        self.input_norm, self.mixer, self.post_norm, self.mlp = input_norm, mixer, post_norm, mlp

    def new_state(self, max_ctx: int, device, dtype, batch: int = 1):
        return self.mixer.new_state(max_ctx, device, dtype, batch)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, state) -> torch.Tensor:
        x = x + self.mixer(self.input_norm(x), ctx, state)
        return x + self.mlp(self.post_norm(x))
