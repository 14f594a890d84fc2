"""The pre-norm decoder block shared by the Llama, Qwen3, Qwen3.5 and Gemma 3 families."""
from __future__ import annotations

import torch
from torch import nn

from .. import kernels
from .attention import Attention, keep_row_queries, pool_rows_args, pool_step_args
from .context import ForwardContext
from .gdn import GatedDeltaNet
from .mlp import SwiGLU
from .norms import RMSNorm


class DecoderLayer(nn.Module):
    """``x += mixer(norm1(x)); x += mlp(norm2(x))``. ``mixer`` is attention or a recurrent
    (GDN) layer; its ``new_state`` decides the layer's state kind (``kv`` / ``recurrent``).
    ``mixer_out_norm`` / ``mlp_out_norm``: Gemma's "sandwich" norms, applied to the mixer's
    and the MLP's outputs before each residual add."""

    def __init__(self, index: int, input_norm: RMSNorm, mixer: nn.Module, post_norm: RMSNorm, mlp: nn.Module,
                 mixer_out_norm: RMSNorm | None = None, mlp_out_norm: RMSNorm | None = None):
        super().__init__()
        self.index = index
        self.mixer_out_norm, self.mlp_out_norm = mixer_out_norm, mlp_out_norm
        self.input_norm, self.mixer, self.post_norm, self.mlp = input_norm, mixer, post_norm, mlp
        self._fused: bool | None = None  # _native_layer(), decided at the first forward
        self._fused_mlp: bool | None = None  # _native_mlp(), likewise

    def new_state(self, max_ctx: int, device, dtype, batch: int = 1, kv_dtype: str = "auto"):
        return self.mixer.new_state(max_ctx, device, dtype, batch, kv_dtype=kv_dtype)

    def _native_layer(self) -> bool:
        """Whether the whole layer can run as one ``dflash::decoder_layer`` call: Llama- or
        Qwen3-style attention and SwiGLU, every linear on the native kernels without bias.
        Decided once, at the first forward (the stage quantizes its layers before any): the
        checks cost ~7 us per layer through nn.Module attribute lookups, 0.2 ms a token."""
        if self._fused is None:
            m, f = self.mixer, self.mlp
            self._fused = (isinstance(m, Attention) and m.native and m.window is None and m.g is None
                           and isinstance(f, SwiGLU)
                           and f.act == "silu"
                           and self.mixer_out_norm is None and self.mlp_out_norm is None and self.input_norm.native
                           and self.post_norm.native and all(lin.fusable for lin in (m.qkv, m.o, f.gate_up, f.down)))
        return self._fused

    def forward(self, x: torch.Tensor, ctx: ForwardContext, state) -> torch.Tensor:
        if ctx.lanes is not None:
            return self._forward_rows(x, ctx, state)
        if self._native_layer() and self.mixer.native_step_ok(x, ctx, state) and kernels.inference(x):
            # the ops below in one C++ call (bit-identical; ~12 fewer Python-level calls)
            m, f = self.mixer, self.mlp
            cos, sin = ctx.rope_f32(m.local_rope)
            kw, queries = ({"tree": ctx.tree_parents} if ctx.tree is not None else {}), None
            if ctx.slots is not None:   # a KV Flash pool (and its score policy)
                kw, queries = pool_step_args(ctx, x.shape[1], m.nh, m.hd, x.dtype)
            out = torch.ops.dflash.decoder_layer(
                x, self.input_norm.weight, self.input_norm.eps, m.qkv.weight, m.qkv.qtype, m.qkv.out_features,
                cos, sin, state.k, state.v, ctx.start, m.nh, m.nkv, m.scale, m.o.weight, m.o.qtype,
                self.post_norm.weight, self.post_norm.eps, f.gate_up.weight, f.gate_up.qtype, f.inter,
                f.down.weight, f.down.qtype, **m.native_args, **kw)
            if queries is not None:
                ctx.last_q.append(queries)
            return out
        if self.mixer_out_norm is None and isinstance(self.mixer, GatedDeltaNet) and \
                (h := self.mixer.residual_step(x, self.input_norm, ctx, state)) is not None:
            return self._mlp(h)  # (norm and residual add inside the projections, the same bits)
        return self._mlp(x + self._out(self.mixer(self.input_norm(x), ctx, state), self.mixer_out_norm))

    @staticmethod
    def _out(y: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
        return y if norm is None else norm(y)

    def _native_mlp(self) -> bool:
        """Whether the MLP half (norm, gate/up, SiLU, down, residual add) can run as two
        ``dflash::qmm_fused`` calls: what a layer outside ``decoder_layer`` (a Gated DeltaNet
        layer, a sliding-window or gated attention layer) saves is three Python-level op calls
        and two intermediate tensors; the bits are those of the ops one by one. Decided once,
        at the first forward, as ``_native_layer``."""
        if self._fused_mlp is None:
            f = self.mlp
            self._fused_mlp = (isinstance(f, SwiGLU) and f.act == "silu" and self.mlp_out_norm is None
                               and self.post_norm.native
                               and f.gate_up.fusable and f.down.fusable)
        return self._fused_mlp

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self._native_mlp() and x.device.type == "cpu" and kernels.inference(x, self.post_norm.weight):
            gu, down = self.mlp.gate_up, self.mlp.down
            h = torch.ops.dflash.qmm_fused(x, gu.weight, gu.qtype, gu.out_features, gu.in_features,
                                           self.post_norm.weight, self.post_norm.eps)
            return torch.ops.dflash.qmm_fused(h, down.weight, down.qtype, down.out_features, down.in_features,
                                              silu=True, residual=x)
        return x + self._out(self.mlp(self.post_norm(x)), self.mlp_out_norm)

    def _forward_rows(self, x: torch.Tensor, ctx: ForwardContext, state) -> torch.Tensor:
        """Decode rows of several sequences (``ctx.lanes``); ``state``: the KV bank of an
        attention layer, or the rows' recurrent states (a list)."""
        if self._native_layer() and self.mixer.native_rows_ok(x, state) and kernels.inference(x):
            m, f = self.mixer, self.mlp
            cos, sin = ctx.rope_f32(m.local_rope)
            score, queries = pool_rows_args(ctx, m.nh, m.hd, x.dtype)   # (KV Flash's score policy)
            out = torch.ops.dflash.decoder_layer_rows(
                x, self.input_norm.weight, self.input_norm.eps, m.qkv.weight, m.qkv.qtype, m.qkv.out_features,
                cos, sin, state.k, state.v, ctx.lanes, ctx.positions, m.nh, m.nkv, m.scale, m.o.weight, m.o.qtype,
                self.post_norm.weight, self.post_norm.eps, f.gate_up.weight, f.gate_up.qtype, f.inter,
                f.down.weight, f.down.qtype, **m.native_args, **ctx.rows_args(), **score)
            if queries is not None:
                keep_row_queries(ctx, queries)
            return out
        return self._mlp(x + self._out(self.mixer.forward_rows(self.input_norm(x), ctx, state), self.mixer_out_norm))
