"""A stage's decoder layers as one ``dflash::decoder_stack`` call: what a decode step or a
verify block spends in Python (a module call, ~20 attribute lookups and 25 boxed op
arguments per layer: ~30 us a layer on the dev CPU, ~0.9 ms a token for the default model's
30 layers) drops to one op call. The op runs ``decoder_layer`` (or ``decoder_layer_rows``)
layer after layer, so the result is bit-identical to the per-layer path it replaces.

Used only where every layer of the stage takes that fused path (Llama/Qwen3-style attention
and SwiGLU on the native kernels: ``DecoderLayer._native_layer``); hybrid stacks (Gated
DeltaNet) and sliding-window layers keep the per-layer loop."""
from __future__ import annotations

import torch

from .attention import keep_row_queries, pool_rows_args, pool_step_args
from .context import ForwardContext


class NativeStack:
    def __init__(self, layers):
        self.layers = list(layers)
        self.position = {layer.index: i for i, layer in enumerate(self.layers)}
        weights, ints, floats = [], [], []
        for layer in self.layers:
            m, f = layer.mixer, layer.mlp
            weights += [layer.input_norm.weight, m.qkv.weight, m.o.weight, layer.post_norm.weight,
                        f.gate_up.weight, f.down.weight]
            args = m.native_args
            if "q_norm" in args:
                weights += [args["q_norm"], args["k_norm"]]
            ints += [m.qkv.qtype, m.qkv.out_features, m.nh, m.nkv, m.o.qtype, f.gate_up.qtype, f.inter,
                     f.down.qtype, int(bool(args.get("gated", False)))]
            floats += [float(layer.input_norm.eps), float(m.scale), float(layer.post_norm.eps),
                       float(args.get("norm_eps", 1e-6))]
        self.weights, self.ints, self.floats = weights, ints, floats

    @classmethod
    def build(cls, layers) -> "NativeStack | None":
        """The stack of ``layers``, or None when one of them cannot run fused, their q/k
        norms differ in kind (the op takes 6 or 8 tensors a layer throughout) or there are
        fewer than two."""
        layers = list(layers)
        if len(layers) < 2 or not all(layer._native_layer() for layer in layers):   # (every layer: a DecoderLayer)
            return None
        if any(layer.mixer.local_rope for layer in layers):
            return None
        if len({"q_norm" in layer.mixer.native_args for layer in layers}) != 1:
            return None
        if any(set(layer.mixer.native_args) - {"q_norm", "k_norm", "norm_eps", "gated"} for layer in layers):
            return None  # (window / v_norm: not the fused layer's arguments)
        return cls(layers)

    def usable(self, h: torch.Tensor, ctx: ForwardContext, state) -> bool:
        """Whether this forward takes the fused path (the per-layer test of DecoderLayer.forward,
        asked of the first layer: its answer depends on the block, the context and the
        cache type, which all layers share)."""
        from .. import kernels

        return self.layers[0].mixer.native_step_ok(h, ctx, state) and kernels.inference(h)

    def rows_usable(self, h: torch.Tensor, bank) -> bool:
        from .. import kernels

        return bank is not None and self.layers[0].mixer.native_rows_ok(h, bank) and kernels.inference(h)

    def run(self, h: torch.Tensor, ctx: ForwardContext, states, capture) -> tuple[torch.Tensor, dict]:
        """The layers over ``h`` with ``states`` (one KV state or bank per layer); returns the
        last output and the captured layers' outputs by global layer index."""
        want = [i for i in capture if i in self.position]
        cos, sin = ctx.rope_f32(False)
        kw, queries = {}, None
        m = self.layers[0].mixer
        if ctx.lanes is not None:   # (with KV Flash's score policy: one queries tensor per layer)
            score, queries = pool_rows_args(ctx, m.nh, m.hd, h.dtype, layers=len(self.layers))
            kw = {"lanes": list(ctx.lanes), "positions": list(ctx.positions), **ctx.rows_args(), **score}
        elif ctx.slots is not None:   # a KV Flash pool (and its score policy: one queries tensor per layer)
            kw, queries = pool_step_args(ctx, h.shape[1], m.nh, m.hd, h.dtype, layers=len(self.layers))
        elif ctx.tree is not None:
            kw = {"tree": ctx.tree_parents}
        outs = torch.ops.dflash.decoder_stack(h, self.weights, [s.k for s in states], [s.v for s in states],
                                              self.ints, self.floats, cos, sin, ctx.start,
                                              [self.position[i] for i in want], **kw)
        if queries is not None and ctx.lanes is not None:
            for q in queries.unbind(0):
                keep_row_queries(ctx, q)
        elif queries is not None:
            ctx.last_q.extend(queries.unbind(0))
        return outs[0], dict(zip(want, outs[1:]))
