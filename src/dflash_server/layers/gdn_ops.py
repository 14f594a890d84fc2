"""Gated DeltaNet (Qwen3.5 linear attention) core ops: causal conv + gated delta rule.

Pure functions, batch-first, device-agnostic (CPU and CUDA). Numerically they follow the reference
torch paths in transformers' ``modeling_qwen3_5`` (``causal_conv1d_fn/update``,
``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule``), with two differences of
contract: q/k normalisation and the ``Dk**-0.5`` query scale are the caller's job, and the conv
state holds K-1 columns (HF's cache keeps K; only the last K-1 ever matter).

Recurrence per value head, state ``S`` in R^{Dk x Dv} (fp32)::

    S <- exp(g_t) * S;  u_t = beta_t * (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T q_t
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# Sequences up to this length (decode, speculative verify blocks) use the token loop. Tuning knob: on a
# CPU (32 heads of 128x128) the loop costs ~0.3 ms/token and the chunk form, which shrinks its chunk for
# short inputs, is already cheaper from T ~ 2; on GPU the loop is ~6 kernel launches per token.
RECURRENT_MAX_T = 1  # measured on CPU: the chunk form is cheaper from T~2 (0.3 ms/token loop)


def l2norm(x: Tensor, dim: int = -1, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(sum(x^2) + eps)`` exactly as HF/FLA (eps inside the sqrt). Call it on fp32 input
    to match HF, which normalises after casting q/k to fp32."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def causal_conv1d(x: Tensor, conv_state: Tensor | None, weight: Tensor) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv over time followed by SiLU.

    x: (B, C, T) pre-conv activations; conv_state: (B, C, K-1) the previous K-1 inputs, or None for a
    fresh sequence (zeros); weight: (C, K). Returns ``(y, new_conv_state)``: y (B, C, T) in x.dtype and
    the last K-1 columns of ``cat(conv_state, x)`` (B, C, K-1) in x.dtype. Like HF, the conv itself runs
    in weight.dtype. Works for any T >= 1, including T < K-1.
    """
    B, C, T = x.shape
    K = weight.shape[-1]
    if conv_state is None:
        conv_state = x.new_zeros(B, C, K - 1)
    xc = torch.cat([conv_state.to(x.dtype), x], dim=-1)  # (B, C, K-1+T): left context makes it causal
    # contiguous(): copy the small tail so the state doesn't pin the whole (B, C, K-1+T) buffer
    new_state = xc[:, :, xc.shape[-1] - (K - 1):].contiguous()
    y = F.conv1d(xc.to(weight.dtype), weight.unsqueeze(1), groups=C)  # no padding: exactly T outputs
    return F.silu(y).to(x.dtype), new_state


def _init_state(initial_state: Tensor | None, B: int, H: int, Dk: int, Dv: int, like: Tensor) -> Tensor:
    """fp32 (B*H, Dk, Dv) working copy of the state (zeros when None); the caller's tensor is never written."""
    if initial_state is None:
        return like.new_zeros(B * H, Dk, Dv, dtype=torch.float32)
    return initial_state.to(device=like.device, dtype=torch.float32).reshape(B * H, Dk, Dv)


def recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                               initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Gated delta rule, one token at a time (the decode / short-block path).

    q, k: (B, T, Hk, Dk), already l2-normalised, q already scaled by Dk**-0.5; v: (B, T, H, Dv);
    g: (B, T, H) log decay (<= 0); beta: (B, T, H). Hk must divide H: value head h reads q/k head
    h // (H // Hk), as in HF (Hk == H is the plain case). initial_state: (B, H, Dk, Dv) or None
    (zeros); never modified. All math in fp32.
    Returns (o (B, T, H, Dv) fp32, final_state (B, H, Dk, Dv) fp32).
    """
    B, T, H, Dv = v.shape
    Hk, Dk = k.shape[2], k.shape[3]
    if Hk != H:  # grouped heads: consecutive value heads share one q/k head
        q, k = q.repeat_interleave(H // Hk, dim=2), k.repeat_interleave(H // Hk, dim=2)
    S = _init_state(initial_state, B, H, Dk, Dv, v)
    # (B, T, H, D) -> (B*H, T, D); for T == 1 this is a pure view (plus a cast if not fp32)
    q = q.float().transpose(1, 2).reshape(B * H, T, Dk)
    k = k.float().transpose(1, 2).reshape(B * H, T, Dk)
    v = v.float().transpose(1, 2).reshape(B * H, T, Dv)
    decay = g.float().exp().transpose(1, 2).reshape(B * H, T, 1, 1)
    beta = beta.float().transpose(1, 2).reshape(B * H, T, 1)
    outs = []
    for t in range(T):
        k_t = k[:, t:t + 1]  # (BH, 1, Dk) row vector
        S = S * decay[:, t]
        u = torch.baddbmm(v[:, t:t + 1], k_t, S, alpha=-1.0) * beta[:, t:t + 1]  # (BH, 1, Dv) beta (v - S^T k)
        S = torch.baddbmm(S, k_t.transpose(1, 2), u)  # S + k u^T
        outs.append(torch.bmm(q[:, t:t + 1], S))  # (BH, 1, Dv): S^T q
    o = outs[0] if T == 1 else torch.cat(outs, dim=1)
    # (B*H, T, Dv) -> (B, T, H, Dv)
    o = o.reshape(B, H, T, Dv).transpose(1, 2).contiguous()
    return o, S.reshape(B, H, Dk, Dv)


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                           initial_state: Tensor | None = None,
                           chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """Gated delta rule in chunked (WY / UT-transform) form, for prefill.

    Same contract as :func:`recurrent_gated_delta_rule`; any T >= 1 (padded internally to a multiple
    of the chunk size; inputs shorter than chunk_size use a smaller power-of-two chunk). Intra-chunk work is batched over all chunks (each (C, C) temporary is
    B*H*T*chunk_size*4 bytes: feed very long prompts in pieces, carrying the state); only the
    inter-chunk state scan is a Python loop.
    """
    B, T, H, Dv = v.shape
    Dk = k.shape[3]
    # Short inputs use the smallest power-of-two chunk that holds them: padding 17 tokens to 64 would
    # quadruple the intra-chunk work for nothing (the result is exact for any chunk size).
    C, BH = min(chunk_size, 1 << max(T - 1, 1).bit_length()), B * H
    N = -(-T // C)
    S = _init_state(initial_state, B, H, Dk, Dv, v)

    def chunked(x: Tensor) -> Tensor:
        # (B, T, Hx, D) -> (N, B*H, C, D) fp32 in one copy, chunk-major so that x[i] in the scan is one
        # contiguous block; grouped q/k heads are expanded here for free (HF layout: head h reads h // r).
        # Zero padding tokens (k = v = beta = g = 0) leave the state untouched (decay 1, no update).
        if N * C != T:
            x = torch.cat([x, x.new_zeros((B, N * C - T) + x.shape[2:])], dim=1)
        Hx, D = x.shape[2], x.shape[3]
        x = x.reshape(B, N, C, Hx, 1, D).expand(B, N, C, Hx, H // Hx, D)
        x = x.permute(1, 0, 3, 4, 2, 5)  # (N, B, Hx, r, C, D)
        return x.to(torch.float32, memory_format=torch.contiguous_format).reshape(N, BH, C, D)

    q, k, v = chunked(q), chunked(k), chunked(v)
    g, beta = (chunked(x.unsqueeze(-1)).squeeze(-1) for x in (g, beta))  # (N, BH, C)
    # Intra-chunk work runs as 3-D bmm over (N*BH, C, .) views: a 4-D matmul with a transposed operand
    # would materialise the transpose (slow strided copies on CPU).
    flat = lambda x: x.reshape(N * BH, C, x.shape[-1])  # noqa: E731
    gc = g.cumsum(-1)  # log decay from the chunk start through position i (inclusive)
    eg = gc.exp()
    # decay[i, j] = exp(gc_i - gc_j) for j <= i; the upper triangle is masked before exp (it could overflow)
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    decay = flat((gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill_(upper, float("-inf")).exp_())
    kf, bf = flat(k), beta.reshape(N * BH, C, 1)

    # UT transform, with beta and exp(gc) folded into the (C, C) matrices instead of the (C, D) operands:
    #   Tm = (I + strict_tril(diag(beta) K K^T * decay))^-1   (unitriangular: A's diagonal is ignored)
    #   u = Tm diag(beta) V             the pseudo-values as if the chunk started from a zero state
    #   w = Tm diag(beta exp(gc)) K     what the state carried in predicts, to subtract from u
    # Inverting against I then multiplying is ~2x faster on CPU than solving against the (C, D) right-hand
    # sides, which LAPACK would first transpose-copy.
    A = torch.bmm(kf, kf.transpose(1, 2)).mul_(decay).mul_(bf)
    eye = torch.eye(C, dtype=A.dtype, device=A.device).expand_as(A)
    Tm = torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True)
    u = torch.bmm(Tm * bf.transpose(1, 2), flat(v)).view(N, BH, C, Dv)
    w = torch.bmm(Tm.mul_((bf * flat(eg.unsqueeze(-1))).transpose(1, 2)), kf).view(N, BH, C, Dk)

    attn = torch.bmm(flat(q), kf.transpose(1, 2)).mul_(decay).view(N, BH, C, C)  # causal, diag included
    # Decays applied inside the scan to (C, Dv) rows rather than as extra full passes over q and k:
    eq = eg.unsqueeze(-1)  # reading the carried-in state from position i: exp(gc_i)
    ek = (gc[..., -1:] - gc).exp().unsqueeze(-1)  # a write at position i, seen at the chunk end
    chunk_decay = eg[..., -1:].unsqueeze(-1)  # (N, BH, 1, 1) total decay over the chunk

    # Output written straight into its final (B, T, H, Dv) layout, viewed per chunk as (B, C, H, Dv)
    o = q.new_empty(B, N * C, H, Dv)
    o_chunks = o.view(B, N, C, H, Dv)
    for i in range(N):
        v_new = torch.baddbmm(u[i], w[i], S, alpha=-1.0)  # (BH, C, Dv) = u - w @ S
        o_i = torch.addcmul(torch.bmm(attn[i], v_new), torch.bmm(q[i], S), eq[i])  # intra + inter chunk
        o_chunks[:, i] = o_i.view(B, H, C, Dv).transpose(1, 2)
        S = torch.baddbmm(S * chunk_decay[i], k[i].transpose(1, 2), v_new * ek[i])
    return o[:, :T].contiguous(), S.reshape(B, H, Dk, Dv)  # contiguous(): a no-op unless B > 1 and padded


def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                     initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Dispatch on length: token loop for T <= RECURRENT_MAX_T (decode, verify blocks), chunked otherwise."""
    if q.shape[1] <= RECURRENT_MAX_T:
        return recurrent_gated_delta_rule(q, k, v, g, beta, initial_state)
    return chunk_gated_delta_rule(q, k, v, g, beta, initial_state)
