"""Linear layers with optional weight-only int8.

Batch-1 decode reads every weight once per token, so it is bound by memory bandwidth:
int8 weights with per-output-channel scales halve the bytes read versus bf16, and
``aten._weight_int8pack_mm`` is the fused CPU kernel for that (about 2x a bf16 GEMV on
the reference 2-core machine). Fused projections (QKV, gate+up) are built by
concatenating weights along the output dimension before quantizing.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: returns (int8 (N, K), fp32 scales (N,))."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


class Linear(nn.Module):
    """``y = x @ W.T (+ b)``; ``W`` is (out, in) in the compute dtype, or int8 + scales."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.scales: torch.Tensor | None = None
        self.out_features, self.in_features = weight.shape

    @classmethod
    def fused(cls, weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None = None) -> "Linear":
        bias = None
        if biases is not None and any(b is not None for b in biases):
            bias = torch.cat([b if b is not None else torch.zeros(w.shape[0], dtype=w.dtype)
                              for w, b in zip(weights, biases)])
        return cls(torch.cat(weights, dim=0), bias)

    def quantize_(self) -> None:
        """Convert in place to weight-only int8 (no-op if already quantized)."""
        if self.scales is not None:
            return
        dtype = self.weight.dtype
        q, s = quantize_int8(self.weight)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.scales = s.to(dtype)  # the kernel wants scales in the activation dtype
        self._compute_dtype = dtype

    @property
    def is_int8(self) -> bool:
        return self.scales is not None

    def nbytes(self) -> int:
        n = self.weight.numel() * self.weight.element_size()
        return n + (0 if self.scales is None else self.scales.numel() * self.scales.element_size())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scales is None:
            return F.linear(x, self.weight, self.bias)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.device.type == "cpu":
            y = torch.ops.aten._weight_int8pack_mm(x2, self.weight, self.scales)
        else:  # no fused kernel assumed elsewhere: dequantize on the fly
            y = F.linear(x2, self.weight.to(x2.dtype)) * self.scales
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)
