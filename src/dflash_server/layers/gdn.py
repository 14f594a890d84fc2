"""Gated DeltaNet token mixer (Qwen3.5 / Qwen3.6 linear-attention layers).

State per sequence: the conv window (last K-1 pre-conv inputs) and the fp32 recurrent
matrix S per value head. Neither can be cropped, so speculative rollback works by
checkpoint + replay: while ``ctx.record`` is set the layer keeps the block's pre-conv
inputs and (q, k, v, g, beta); ``rollback_to(n)`` recomputes the state after the first n
recorded tokens from the checkpoint, which costs a tiny fraction of the verify pass.

On a CPU with the native kernels, every block of one sequence (decode, verify, tree rows and
prefill chunks) runs the whole mixer between the two projections as one C++ op
(``dflash::gdn_step``): token by token, so a block's rows are bit-identical to one-row steps
(a chain verify then agrees with plain decoding exactly, as the attention layers' native
step does, and a prefix-cache hit, whose state came from decode steps and other chunks,
equals a miss); the replay after a rollback re-runs that op on the recorded projection rows,
so it lands on the very state plain decoding would have. The op runs a long chunk column
group by column group with the state's slice in L1 (``benchmarks/gdn_step.py``, Qwen3.5-0.8B's
mixer, 512 rows, 2 threads: 32.6 ms against 90.5 ms for the chunked form). The chunked (WY) form
remains for GPUs, ``--kernels aten``, lockstep batches and torch.compile.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from .context import ForwardContext, runs
from .gdn_ops import causal_conv1d, gated_delta_rule, l2norm
from .linear import Linear



@dataclass
class RecurrentState:
    conv: torch.Tensor  # (1, conv_dim, K-1), compute dtype
    ssm: torch.Tensor   # (1, Hv, Dk, Dv), fp32
    # checkpoint for speculative rollback: (conv, ssm) at checkpoint time + recorded block
    saved: tuple[torch.Tensor, torch.Tensor] | None = None
    records: list = field(default_factory=list)
    # DDTree verify: (conv, ssm) after each row of the tree, each from its parent's
    tree_nodes: list = field(default_factory=list)

    kind = "recurrent"

    def checkpoint(self) -> None:
        self.saved = (self.conv.clone(), self.ssm.clone())
        self.records = []

    def discard_checkpoint(self) -> None:
        self.saved, self.records, self.tree_nodes = None, [], []

    def take_tree_node(self, row: int) -> None:
        """Keep the state after tree row ``row`` (the deepest accepted node); ends the checkpoint."""
        if self.saved is None or not 0 <= row < len(self.tree_nodes):
            raise RuntimeError(f"no tree state for row {row}")
        self.conv, self.ssm = self.tree_nodes[row]
        self.discard_checkpoint()

    def recorded_tokens(self) -> int:
        return sum(r[1].shape[1] if r[0] == "native" else r[0].shape[-1] for r in self.records)

    def rollback_to(self, n: int) -> None:
        """Make the state equal to "checkpoint + first n recorded tokens"."""
        if self.saved is None:
            raise RuntimeError("rollback without a checkpoint")
        total = self.recorded_tokens()
        if not 0 <= n <= total:
            raise ValueError(f"cannot roll back to {n} of {total} recorded tokens")
        conv0, ssm0 = self.saved
        native = [r[0] == "native" for r in self.records]
        if any(native) and not all(native):
            raise RuntimeError("a recurrent checkpoint recorded both native and aten rows")
        if n < total and all(native):   # records (tag, mixed rows, replay fn)
            mixed = torch.cat([r[1] for r in self.records], dim=1)[:, :n]
            if n == 0:
                self.conv, self.ssm = conv0.clone(), ssm0.clone()
            else:
                self.conv, self.ssm = self.records[0][2](mixed, conv0, ssm0)
        elif n < total:
            qkv = torch.cat([r[0] for r in self.records], dim=-1)  # (1, C, total) pre-conv
            window = torch.cat([conv0, qkv], dim=-1)
            kw = conv0.shape[-1]
            self.conv = window[..., n:n + kw].contiguous()
            if n == 0:
                self.ssm = ssm0.clone()
            else:
                q, k, v, g, beta = (torch.cat([r[i] for r in self.records], dim=1)[:, :n] for i in range(1, 6))
                _, self.ssm = gated_delta_rule(q, k, v, g, beta, ssm0)
        self.discard_checkpoint()


class GatedDeltaNet(nn.Module):
    # the mixer members a stage reads of every layer (Attention sets its own): a recurrent
    # layer has no sliding window and shares no KV
    window: int | None = None
    kv_role: str = ""

    def __init__(self, *, in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv_weight, A_log, dt_bias,
                 norm_weight, out_proj, num_k_heads: int, num_v_heads: int, head_k_dim: int,
                 head_v_dim: int, eps: float):
        super().__init__()
        self.hk, self.hv, self.dk, self.dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        # one GEMM for all four input projections
        self.in_proj = Linear.fused([in_proj_qkv, in_proj_z, in_proj_b, in_proj_a])
        self.conv_weight = nn.Parameter(conv_weight.detach().reshape(self.conv_dim, -1), requires_grad=False)
        self.neg_A = nn.Parameter(-A_log.detach().float().exp(), requires_grad=False)
        self.dt_bias = nn.Parameter(dt_bias.detach().float(), requires_grad=False)
        self.norm_weight = nn.Parameter(norm_weight.detach().float(), requires_grad=False)
        self.out_proj = Linear(out_proj)
        self.eps = float(eps)
        self.native = self.neg_A.device.type == "cpu" and kernels.enabled() and kernels.load()
        self._fusable: bool | None = None  # residual_step's projections and norm on the native kernels

    def native_ok(self, x: torch.Tensor) -> bool:
        """Whether these rows take ``dflash::gdn_step``: one sequence, no gradient, outside
        torch.compile."""
        return (self.native and x.shape[0] == 1 and kernels.inference(x)
                and not torch.compiler.is_compiling())

    def residual_step(self, x: torch.Tensor, norm, ctx: ForwardContext, state: RecurrentState) -> torch.Tensor | None:
        """``x + forward(norm(x), ctx, state)`` with the norm inside the input projection's
        activation quantization and the add in the output projection's store (two
        ``dflash::qmm_fused`` calls, the bits of the ops one by one), where the native step
        runs (a plain step or block, recorded or not); None elsewhere (a tree, a CUDA graph,
        the aten path), for the caller's ops one by one."""
        ip, op = self.in_proj, self.out_proj
        if self._fusable is None:  # decided once, at the first forward (the stage quantizes before any)
            self._fusable = norm.native and ip.fusable and op.fusable
        if (not self._fusable or ctx.tree is not None or ctx.graph_pos is not None or x.device.type != "cpu"
                or not self.native_ok(x) or not kernels.inference(x, norm.weight)):
            return None
        mixed = torch.ops.dflash.qmm_fused(x, ip.weight, ip.qtype, ip.out_features, ip.in_features, norm.weight,
                                           norm.eps)
        if ctx.record:
            state.records.append(("native", mixed, self._replay))
        o, state.conv, state.ssm = self._native(mixed, state.conv, state.ssm)
        return torch.ops.dflash.qmm_fused(o, op.weight, op.qtype, op.out_features, op.in_features, residual=x)

    def _native(self, mixed: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor):
        """(out before out_proj, conv window, state) after ``mixed``'s rows from (conv, ssm)."""
        return torch.ops.dflash.gdn_step(mixed, conv, self.conv_weight, self.neg_A, self.dt_bias, self.norm_weight,
                                         self.eps, ssm, self.hk, self.hv, self.dk, self.dv)

    def _replay(self, mixed: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor):
        return self._native(mixed, conv, ssm)[1:]

    def new_state(self, max_ctx: int, device, dtype, batch: int = 1, kv_dtype: str = "auto") -> RecurrentState:
        k = self.conv_weight.shape[-1]
        return RecurrentState(torch.zeros(batch, self.conv_dim, k - 1, device=device, dtype=dtype),
                              torch.zeros(batch, self.hv, self.dk, self.dv, device=device, dtype=torch.float32))

    def forward_rows(self, x: torch.Tensor, ctx: ForwardContext, states: list[RecurrentState]) -> torch.Tensor:
        """Rows of several sequences, row b on ``states[b]``: each sequence's rows (one, or
        a verify block: adjacent rows on one state at consecutive positions) run as its own
        step or block (the recurrent update is per sequence anyway), recorded for a
        rollback where its state holds a checkpoint, or a DDTree verify (``ctx.row_trees``:
        its rows from that state, each node's state kept for ``take_tree_node``)."""
        outs, trees = [], ctx.row_trees or {}
        for b, e in runs([id(st) for st in states]):
            st, tree = states[b], trees.get(ctx.lanes[b])
            outs.append(self.forward(x[:, b:e], ForwardContext(ctx.positions[b], e - b, None, None, tree=tree,
                                                                record=st.saved is not None), st))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, state: RecurrentState) -> torch.Tensor:
        if ctx.tree is not None:
            return self._tree(x, ctx, state)
        mixed = self.in_proj(x)
        if ctx.graph_pos is None and self.native_ok(x):
            if ctx.record:
                state.records.append(("native", mixed, self._replay))
            o, state.conv, state.ssm = self._native(mixed, state.conv, state.ssm)
            return self.out_proj(o)
        qkv, z, b, a = mixed.split([self.conv_dim, self.value_dim, self.hv, self.hv], dim=-1)
        qkv_t = qkv.transpose(1, 2)  # (B, C, T)
        conv0, ssm0 = state.conv, state.ssm
        y, state.conv = causal_conv1d(qkv_t, state.conv, self.conv_weight)
        out = self._mix(x, y, z, b, a, ctx, state, qkv_t)
        if ctx.graph_pos is not None:  # a CUDA-graph step: the new state into the tensors it read
            conv0.copy_(state.conv)
            ssm0.copy_(state.ssm)
            state.conv, state.ssm = conv0, ssm0
        return self.out_proj(out)

    def _tree(self, x: torch.Tensor, ctx: ForwardContext, state: RecurrentState) -> torch.Tensor:
        """DDTree verify rows: each row is one decode step from its parent row's state (the
        conv window and the recurrent matrix follow the tree), computed as a plain step of
        that row would be; every row's state is kept for ``take_tree_node``."""
        mixed = self.in_proj(x)
        if self.native_ok(x):
            nodes, outs = [], []
            for t, p in enumerate(ctx.tree):
                conv, ssm = (state.conv, state.ssm) if p < 0 else nodes[p]
                o, conv, ssm = self._native(mixed[:, t:t + 1], conv, ssm)
                outs.append(o)
                nodes.append((conv, ssm))
            state.tree_nodes = nodes
            return self.out_proj(torch.cat(outs, dim=1))
        qkv, z, b, a = mixed.split([self.conv_dim, self.value_dim, self.hv, self.hv], dim=-1)
        qkv_t = qkv.transpose(1, 2)
        nodes, outs = [], []
        for t, p in enumerate(ctx.tree):
            conv, ssm = (state.conv, state.ssm) if p < 0 else nodes[p]
            node = RecurrentState(conv, ssm)
            y, node.conv = causal_conv1d(qkv_t[..., t:t + 1], node.conv, self.conv_weight)
            outs.append(self._mix(x[:, t:t + 1], y, z[:, t:t + 1], b[:, t:t + 1], a[:, t:t + 1],
                                  ForwardContext(ctx.start, 1, None, None), node, None))
            nodes.append((node.conv, node.ssm))
        state.tree_nodes = nodes
        return self.out_proj(torch.cat(outs, dim=1))

    def _mix(self, x, y, z, b, a, ctx: ForwardContext, state: RecurrentState, qkv_t) -> torch.Tensor:
        """Everything after the conv up to the output projection: q/k/v heads, gates, the
        delta rule on ``state``, the gated norm."""
        B, T, _ = x.shape
        q, k, v = y.transpose(1, 2).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(B, T, self.hk, self.dk).float()
        k = k.reshape(B, T, self.hk, self.dk).float()
        v = v.reshape(B, T, self.hv, self.dv).float()
        if self.hv != self.hk:  # value head h reads key head h // (hv / hk)
            q = q.repeat_interleave(self.hv // self.hk, dim=2)
            k = k.repeat_interleave(self.hv // self.hk, dim=2)
        q = l2norm(q) * (self.dk ** -0.5)
        k = l2norm(k)
        beta = torch.sigmoid(b.float())
        g = self.neg_A * F.softplus(a.float() + self.dt_bias)
        if ctx.record:
            state.records.append((qkv_t, q, k, v, g, beta))
        o, state.ssm = gated_delta_rule(q, k, v, g, beta, state.ssm)
        # gated RMSNorm over each head's value dim, in fp32
        o = F.rms_norm(o, (self.dv,), self.norm_weight, self.eps) * F.silu(z.reshape(B, T, self.hv, self.dv).float())
        return o.reshape(B, T, self.value_dim).to(x.dtype)
