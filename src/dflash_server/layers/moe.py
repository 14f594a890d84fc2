"""Mixture-of-experts feed-forward (Laguna): a sigmoid router, top-k experts, a shared expert.

Per token: scores = sigmoid(router logits, optionally tanh-soft-capped), experts chosen by
top-k of ``scores + selection bias`` (the bias only picks; the weights are the plain scores
of the chosen experts, normalised to sum 1), output = scale * sum_k w_k expert_k(x) +
shared(x). Each expert is a SwiGLU with its own (quantizable) linears.

The router stays dense and runs in fp32 (as llama.cpp keeps ``ffn_gate_inp`` in F32): a
quantized router would move near-tied choices. A token's experts are summed in expert
order whatever else is in the batch, so with the row-invariant kernels a row's result does
not depend on the rows computed with it.
"""
from __future__ import annotations

import torch
from torch import nn

from .mlp import SwiGLU


class MoE(nn.Module):
    def __init__(self, router: torch.Tensor, experts: list[SwiGLU], top_k: int, *,
                 selection_bias: torch.Tensor | None = None, shared: SwiGLU | None = None,
                 routed_scale: float = 1.0, softcap: float = 0.0):
        super().__init__()
        if router.dim() != 2 or router.shape[0] != len(experts):
            raise ValueError(f"MoE: router of shape {tuple(router.shape)} for {len(experts)} experts")
        if not 0 < top_k <= len(experts):
            raise ValueError(f"MoE: top_k {top_k} for {len(experts)} experts")
        self.router = nn.Parameter(router.detach().float(), requires_grad=False)
        self.bias = None if selection_bias is None else nn.Parameter(selection_bias.detach().float(),
                                                                     requires_grad=False)
        self.experts = nn.ModuleList(experts)
        self.shared = shared
        self.top_k, self.routed_scale, self.softcap = int(top_k), float(routed_scale), float(softcap)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h (N, H) -> (expert ids (N, k), weights (N, k) fp32)."""
        logits = h.float() @ self.router.t()
        if self.softcap > 0:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        scores = torch.sigmoid(logits)
        pick = scores if self.bias is None else scores + self.bias
        ids = pick.topk(self.top_k, dim=-1).indices
        w = scores.gather(-1, ids)
        return ids, w / w.sum(dim=-1, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        ids, w = self.route(h)
        w = w.to(x.dtype)
        out = torch.zeros_like(h)
        if h.shape[0] == 1:  # a decode row: its k experts in expert order, no index bookkeeping
            order = ids[0].argsort()
            for e, wk in zip(ids[0][order].tolist(), w[0][order]):
                out = out + self.experts[e](h) * wk
        else:
            for e in torch.unique(ids).tolist():  # ascending: each row sums its experts in order
                rows, slot = (ids == e).nonzero(as_tuple=True)
                out.index_add_(0, rows, self.experts[e](h[rows]) * w[rows, slot, None])
        if self.routed_scale != 1.0:
            out = out * self.routed_scale
        if self.shared is not None:
            out = out + self.shared(h)
        return out.reshape(shape)
