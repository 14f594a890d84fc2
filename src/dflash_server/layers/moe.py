"""Mixture-of-experts feed-forward: a router (Laguna's sigmoid one, Gemma 4's softmax one),
top-k experts, optionally a shared expert. Each expert is a gated MLP (``SwiGLU``) with its
own (quantizable) linears.

The router stays dense and runs in fp32 (as llama.cpp keeps ``ffn_gate_inp`` in F32): a
quantized router would move near-tied choices. A token's experts are summed in expert
order whatever else is in the batch, so with the row-invariant kernels a row's result does
not depend on the rows computed with it.
"""
from __future__ import annotations

import torch
from torch import nn

from .mlp import SwiGLU


class SigmoidRouter(nn.Module):
    """Laguna: scores = sigmoid(logits, optionally tanh-soft-capped); experts by top-k of
    ``scores + selection bias``; weights the chosen scores normalised to sum 1."""

    def __init__(self, weight: torch.Tensor, top_k: int, selection_bias: torch.Tensor | None = None,
                 softcap: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().float(), requires_grad=False)
        self.bias = None if selection_bias is None else nn.Parameter(selection_bias.detach().float(),
                                                                     requires_grad=False)
        self.top_k, self.softcap = int(top_k), float(softcap)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = h.float() @ self.weight.t()
        if self.softcap > 0:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        scores = torch.sigmoid(logits)
        pick = scores if self.bias is None else scores + self.bias
        ids = pick.topk(self.top_k, dim=-1).indices
        w = scores.gather(-1, ids)
        return ids, w / w.sum(dim=-1, keepdim=True)


class SoftmaxRouter(nn.Module):
    """Gemma 4: the input RMS-normalised (no weight), times ``scale`` and hidden ** -0.5,
    projected, softmax in fp32, top-k renormalised to sum 1, times each chosen expert's scale."""

    def __init__(self, weight: torch.Tensor, top_k: int, scale: torch.Tensor, per_expert_scale: torch.Tensor,
                 eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().float(), requires_grad=False)
        self.scale = nn.Parameter(scale.detach().float() * weight.shape[1] ** -0.5, requires_grad=False)
        self.per_expert = nn.Parameter(per_expert_scale.detach().float(), requires_grad=False)
        self.top_k, self.eps = int(top_k), float(eps)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = h.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale
        probs = torch.softmax(x @ self.weight.t(), dim=-1)
        w, ids = probs.topk(self.top_k, dim=-1)
        return ids, w / w.sum(dim=-1, keepdim=True) * self.per_expert[ids]


class MoE(nn.Module):
    """``scale * sum_k w_k expert_k(x) (+ shared(x))`` with experts chosen by ``router`` from
    ``route_x`` (default ``x``: Gemma 4 routes on the un-normalised residual)."""

    def __init__(self, router: nn.Module, experts: list[SwiGLU], *, shared: SwiGLU | None = None,
                 routed_scale: float = 1.0):
        super().__init__()
        n = router.weight.shape[0]
        if router.weight.dim() != 2 or n != len(experts):
            raise ValueError(f"MoE: router of shape {tuple(router.weight.shape)} for {len(experts)} experts")
        if not 0 < router.top_k <= n:
            raise ValueError(f"MoE: top_k {router.top_k} for {n} experts")
        self.router = router
        self.experts = nn.ModuleList(experts)
        self.shared = shared
        self.routed_scale = float(routed_scale)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h (N, H) -> (expert ids (N, k), weights (N, k) fp32)."""
        return self.router(h)

    def forward(self, x: torch.Tensor, route_x: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        ids, w = self.route(h if route_x is None else route_x.reshape(-1, route_x.shape[-1]))
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
