"""Gemma 4 text (``Gemma4ForCausalLM``, the text part of ``Gemma4ForConditionalGeneration``).

Differences from Gemma 3: the full-attention layers have their own head size and KV head
count (``per_layer_config`` / ``global_head_dim``, ``num_global_key_value_heads``), and with
``attention_k_eq_v`` their values are the key projection (no ``v_proj``); values are
RMS-normalised per head without a weight; attention is unscaled (the q/k norms set the
scale); the full layers use "proportional" RoPE (all of the head's pairs, the first quarter
turning, frequencies over the whole head); norms are plain ``w * x`` (not ``1 + w``); every
layer ends with a learned ``layer_scalar``; logits may be tanh-soft-capped; and the MoE
variant (26B-A4B) adds, beside the dense MLP, routed experts: a softmax router on the
normalised residual (its own scale and per-expert scales), GELU experts, and norms that
combine the two branches.

GGUF (llama.cpp's ``gemma4`` arch, names from gguf-py's map): norms stored as they are; the
router's scale at ``ffn_gate_inp.scale``, the per-expert scales at ``ffn_down_exps.scale``;
experts stacked per layer (``ffn_gate_up_exps`` or ``ffn_gate_exps`` + ``ffn_up_exps``), read
matrix by matrix; full layers without ``attn_v`` take their values from the keys; per-layer
KV head counts and the sliding pattern as arrays; ``rope_freqs`` marks the proportional
RoPE's turning pairs (1) and still ones (1e30).

The E2B / E4B kind: per-layer input embeddings (PLE: a second token table of
``layers x hidden_size_per_layer_input`` per token plus a projection of the embeddings, mixed
into each layer's output through a gate and a projection) and the last
``num_kv_shared_layers`` layers attending over the KV of the last earlier layer of their kind
(no K/V projections of their own; a double-wide MLP where ``use_double_wide_mlp``). Both run
in one process: one stage, or stages split in-process, the per-layer inputs travelling with
the hidden state and placement keeping the KV-shared layers on their sources' stage; a shard
worker refuses such a model.

Not supported (a clear error at load): bidirectional attention.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.attention import Attention
from ..layers.decoder import DecoderLayer
from ..layers.linear import Linear, slice_rows
from ..layers.mlp import SwiGLU
from ..layers.moe import MoE, SoftmaxRouter
from ..layers.norms import RMSNorm
from .base import Embedding, Slab, Weights
from .config import ModelConfig, eos_ids
from .gemma3 import Gemma3Family
from .llama import gguf_meta

DEFAULT_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1_000_000.0}}


class PerLayerEmbedding(Embedding):
    """The token embedding (times sqrt(hidden)) plus the per-layer inputs of the E2B / E4B
    models: ``(norm(project(h) / sqrt(hidden)) + table[ids] * sqrt(size)) / sqrt(2)``, one
    ``size`` vector per layer and token."""

    def __init__(self, weight: torch.Tensor, scale, table: torch.Tensor, projection: torch.Tensor,
                 norm: RMSNorm, layers: int):
        super().__init__(weight, scale)
        self.table = nn.Parameter(table.detach(), requires_grad=False)
        self.size = table.shape[1] // layers
        self.table_scale = torch.tensor(self.size ** 0.5, dtype=table.dtype)
        self.projection = Linear(projection)
        self.norm, self.layers = norm, layers

    def per_layer_inputs(self, ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        tok = (F.embedding(ids, self.table) * self.table_scale).unflatten(-1, (self.layers, self.size))
        proj = (self.projection(h) * h.shape[-1] ** -0.5).unflatten(-1, (self.layers, self.size))
        return (self.norm(proj) + tok.to(proj.dtype)) * 2 ** -0.5


class Gemma4Layer(DecoderLayer):
    """Gemma 3's sandwich layer, plus the MoE branch, the per-layer input (E2B / E4B) and the
    closing ``layer_scalar``."""

    def __init__(self, *args, moe: MoE | None = None, moe_norms: tuple[RMSNorm, RMSNorm, RMSNorm] | None = None,
                 scalar: torch.Tensor | None = None, per_layer: tuple[torch.Tensor, torch.Tensor, RMSNorm] | None = None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.moe = moe
        self.moe_in, self.moe_out_dense, self.moe_out = moe_norms if moe_norms else (None, None, None)
        self.register_buffer("scalar", None if scalar is None else scalar.detach().reshape(()).clone())
        self.ple_gate = self.ple_proj = self.ple_norm = None
        if per_layer is not None:
            gate, proj, self.ple_norm = per_layer
            self.ple_gate, self.ple_proj = Linear(gate), Linear(proj)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        a = self.mlp(self.post_norm(x))
        if self.moe is not None:  # dense and routed branches, each normed, then summed
            a = self.moe_out_dense(a) + self.moe_out(self.moe(self.moe_in(x), route_x=x))
        return x + self.mlp_out_norm(a)

    def forward(self, x: torch.Tensor, ctx, state) -> torch.Tensor:
        h = super().forward(x, ctx, state)
        if self.ple_gate is not None:
            if ctx.per_layer is None:
                raise RuntimeError("a Gemma 4 per-layer-input layer ran without its inputs")
            p = ctx.per_layer[..., self.index, :]
            h = h + self.ple_norm(self.ple_proj(F.gelu(self.ple_gate(h), approximate="tanh") * p.to(h.dtype)))
        return h if self.scalar is None else h * self.scalar.to(h.dtype)


class Gemma4Family(Gemma3Family):
    name = "gemma4"
    hf_architectures = ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration")
    hf_model_types = ("gemma4_text", "gemma4")
    gguf_archs = ("gemma4",)

    def config_from_hf(self, cfg: dict) -> ModelConfig:
        text = dict(cfg.get("text_config") or cfg)
        if text.get("use_bidirectional_attention") == "all":
            raise ValueError("gemma4: bidirectional attention (an embedding model) is not a generator")
        if text.get("attention_bias"):
            raise ValueError("gemma4: attention_bias (q/k/v/o projection biases) is not supported")
        act = text.get("hidden_activation") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"gemma4: unsupported activation {act!r}")
        n = int(text["num_hidden_layers"])
        layer_types = list(text.get("layer_types") or ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                                        for i in range(n)])
        layer_types[-1] = "full_attention"  # as transformers forces it
        rope = text.get("rope_parameters") or DEFAULT_ROPE
        full, sliding = rope.get("full_attention") or DEFAULT_ROPE["full_attention"], \
            rope.get("sliding_attention") or DEFAULT_ROPE["sliding_attention"]
        if sliding.get("rope_type", "default") != "default":
            raise ValueError("gemma4: scaled RoPE on the sliding layers is not supported")
        hd = int(text.get("head_dim", 256))
        nkv = int(text.get("num_key_value_heads") or text["num_attention_heads"])
        full_hd, full_kv = text.get("global_head_dim"), text.get("num_global_key_value_heads")
        for i, over in (text.get("per_layer_config") or {}).items():  # the form transformers saves
            if layer_types[int(i)] == "full_attention":
                full_hd = over.get("head_dim", full_hd)
                full_kv = over.get("num_key_value_heads", full_kv)
        full_hd = int(full_hd or 512)
        k_eq_v = bool(text.get("attention_k_eq_v", False))
        full_kv = int(full_kv) if full_kv and k_eq_v else nkv
        experts = int(text.get("num_experts") or 0) if text.get("enable_moe_block") else 0
        return ModelConfig(
            family=self.name, vocab_size=int(text["vocab_size"]), hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text["intermediate_size"]), num_layers=n, num_heads=int(text["num_attention_heads"]),
            num_kv_heads=nkv, head_dim=hd, rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(full.get("rope_theta", 1_000_000.0)),
            rope_scaling=full if full.get("rope_type", "default") != "default" else None,
            rope_local_theta=float(sliding.get("rope_theta", 10_000.0)),
            # transformers' default RoPE (the sliding layers') rotates the whole head, whatever
            # partial_rotary_factor says (a GGUF's rope.dimension_count_swa is honoured, as llama.cpp does)
            local_partial_rotary_factor=1.0 if sliding.get("rope_type", "default") == "default"
            else float(sliding.get("partial_rotary_factor", 1.0)),
            max_position_embeddings=int(text.get("max_position_embeddings", 131072)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", True))),
            attention_bias=bool(text.get("attention_bias", False)), qk_norm=True, zero_centred_norm=False,
            layer_types=tuple(layer_types), sliding_window=int(text.get("sliding_window") or 512),
            query_pre_attn_scalar=1.0, hidden_act="gelu_tanh", embed_scale=True, sandwich_norms=True,
            final_logit_softcapping=float(text["final_logit_softcapping"]) if text.get("final_logit_softcapping")
            else None,
            head_dim_full=full_hd, num_kv_heads_full=full_kv, attention_k_eq_v=k_eq_v,
            mlp_layer_types=tuple("sparse" if experts else "dense" for _ in range(n)),
            num_experts=experts, num_experts_per_tok=int(text.get("top_k_experts") or 0) if experts else 0,
            moe_intermediate_size=int(text.get("moe_intermediate_size") or 0) if experts else 0,
            per_layer_input_size=int(text.get("hidden_size_per_layer_input") or 0),
            per_layer_vocab_size=int(text.get("vocab_size_per_layer_input") or text["vocab_size"]),
            num_kv_shared_layers=int(text.get("num_kv_shared_layers") or 0),
            bos_token_id=text.get("bos_token_id"), eos_token_ids=eos_ids(text.get("eos_token_id")),
        )

    def config_from_gguf(self, meta: dict, arch: str) -> ModelConfig:
        def g(key, default=None):
            return gguf_meta(meta, arch, key, default)
        n = int(g("block_count"))
        pattern = g("attention.sliding_window_pattern")
        if not isinstance(pattern, (list, tuple)) or len(pattern) < n:
            raise ValueError("gemma4 GGUF: attention.sliding_window_pattern must list every layer")
        layer_types = tuple("sliding_attention" if p else "full_attention" for p in pattern[:n])

        def per_layer(key, default=None) -> list[int]:
            v = g(key, default)
            return [int(x) for x in v] if isinstance(v, (list, tuple)) else [int(v)] * n
        heads, kv = per_layer("attention.head_count"), per_layer("attention.head_count_kv")
        ff = per_layer("feed_forward_length")  # double-wide on the KV-shared layers: read from the weights
        if len(set(heads)) != 1:
            raise ValueError("gemma4 GGUF: per-layer query head counts are not supported")
        sliding = [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
        full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
        nkv = kv[sliding[0]] if sliding else kv[0]
        full_kv = kv[full[0]] if full else nkv
        hd_full = int(g("attention.key_length"))
        hd = int(g("attention.key_length_swa") or hd_full)
        experts = int(g("expert_count", 0) or 0)
        cap = g("final_logit_softcapping")
        return ModelConfig(
            family=self.name, vocab_size=int(g("vocab_size") or len(meta["tokenizer.ggml.tokens"])),
            hidden_size=int(g("embedding_length")), intermediate_size=ff[0], num_layers=n, num_heads=heads[0],
            num_kv_heads=nkv, head_dim=hd, rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(g("rope.freq_base", 1_000_000.0)),
            # the turning share is checked against the file's rope_freqs when the layers are built
            rope_scaling={"rope_type": "proportional", "partial_rotary_factor": 0.25},
            rope_local_theta=float(g("rope.freq_base_swa", 10_000.0)),
            local_partial_rotary_factor=int(g("rope.dimension_count_swa") or hd) / hd,
            max_position_embeddings=int(g("context_length", 131072)), tie_word_embeddings=True, qk_norm=True,
            layer_types=layer_types, sliding_window=int(g("attention.sliding_window", 512)),
            query_pre_attn_scalar=1.0, hidden_act="gelu_tanh", embed_scale=True, sandwich_norms=True,
            final_logit_softcapping=float(cap) if cap else None, head_dim_full=hd_full, num_kv_heads_full=full_kv,
            mlp_layer_types=tuple("sparse" if experts else "dense" for _ in range(n)), num_experts=experts,
            num_experts_per_tok=int(g("expert_used_count", 0) or 0),
            moe_intermediate_size=int(g("expert_feed_forward_length", 0) or 0),
            per_layer_input_size=int(g("embedding_length_per_layer_input", 0) or 0),
            per_layer_vocab_size=int(g("vocab_size") or len(meta["tokenizer.ggml.tokens"])),
            num_kv_shared_layers=int(g("attention.shared_kv_layers", 0) or 0),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos_ids(meta.get("tokenizer.ggml.eos_token_id")), extra={"gguf_arch": arch},
        )

    def gguf_tensor(self, hf_name: str, cfg: ModelConfig):
        import gguf

        if hf_name == "model.rope_freqs":
            return "rope_freqs.weight", None
        if hf_name in ("model.per_layer_model_projection.weight", "model.per_layer_projection_norm.weight"):
            return hf_name.removeprefix("model.").replace("per_layer_model_projection", "per_layer_model_proj") \
                .replace("per_layer_projection_norm", "per_layer_proj_norm"), None
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
        if m is not None:
            i, inner = m.groups()
            e = re.fullmatch(r"experts\.(\d+)\.(gate_up|gate|up|down)_proj", inner)
            if e is not None:
                return f"blk.{i}.ffn_{e.group(2)}_exps.weight", Slab(int(e.group(1)))
            special = {"router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale",
                       "layer_scalar": "layer_output_scale.weight"}
            if inner in special:
                return f"blk.{i}.{special[inner]}", None
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, cfg.num_layers)
        base, _, kind = hf_name.rpartition(".")
        name = names.get_name(base)
        if name is None or kind not in ("weight", "bias"):
            raise KeyError(hf_name)
        return f"{name}.{kind}", None

    def expected_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        shapes = super().expected_shapes(cfg)
        # head sizes differ between sliding and full layers: build_attention checks them per layer
        for key in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "q_norm.weight",
                    "k_norm.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight"):
            shapes.pop(key)  # (and the KV-shared layers' MLPs may be double-wide)
        return shapes

    def build_embedding(self, cfg: ModelConfig, w: Weights) -> Embedding:
        base = super().build_embedding(cfg, w)
        if not cfg.per_layer_input_size:
            return base
        L, P, H = cfg.num_layers, cfg.per_layer_input_size, cfg.hidden_size
        table = w.get("model.embed_tokens_per_layer.weight")
        proj = w.get("model.per_layer_model_projection.weight")
        if tuple(table.shape) != (cfg.per_layer_vocab_size, L * P) or tuple(proj.shape) != (L * P, H):
            raise ValueError(f"gemma4: per-layer embeddings {tuple(table.shape)} / projection {tuple(proj.shape)} "
                             f"do not fit {L} layers of {P}")
        return PerLayerEmbedding(base.weight, base.scale, table, proj,
                                 RMSNorm(w.get("model.per_layer_projection_norm.weight"), cfg.rms_norm_eps), L)

    def build_attention(self, cfg: ModelConfig, p: str, w: Weights, index: int = 0) -> Attention:
        a = p + "self_attn."
        nh, hd, nkv, H = cfg.num_heads, cfg.layer_head_dim(index), cfg.layer_kv_heads(index), cfg.hidden_size
        sliding = cfg.layer_types[index] == "sliding_attention"
        eps = cfg.rms_norm_eps
        window = cfg.sliding_window if sliding else None
        if cfg.kv_source(index) is not None:  # KV-shared: queries only, over its source layer's KV
            q, o = w.get(a + "q_proj.weight"), w.get(a + "o_proj.weight")
            if tuple(q.shape) != (nh * hd, H) or tuple(o.shape) != (H, nh * hd):
                raise ValueError(f"gemma4 layer {index}: q_proj {tuple(q.shape)} / o_proj {tuple(o.shape)} do not fit "
                                 f"{nh} heads of {hd}")
            return Attention(q=q, k=None, v=None, o=o, num_heads=nh, num_kv_heads=nkv, head_dim=hd,
                             q_norm=RMSNorm(w.get(a + "q_norm.weight"), eps), scale=1.0, window=window,
                             local_rope=sliding, kv_role="reuse")
        store = cfg.num_kv_shared_layers and index in {cfg.kv_source(i) for i in range(cfg.num_layers)}
        q, k, o = w.get(a + "q_proj.weight"), w.get(a + "k_proj.weight"), w.get(a + "o_proj.weight")
        # the values are the key projection (normed apart); a GGUF says so by having no attn_v
        k_eq_v = not sliding and (cfg.attention_k_eq_v or not w.has(a + "v_proj.weight"))
        v = k if k_eq_v else w.get(a + "v_proj.weight")
        if not sliding and w.has("model.rope_freqs"):
            self._check_rope_freqs(cfg, w.get("model.rope_freqs"))
        want = {"q_proj": (nh * hd, H), "k_proj": (nkv * hd, H), "v_proj": (nkv * hd, H), "o_proj": (H, nh * hd)}
        for name, t in (("q_proj", q), ("k_proj", k), ("v_proj", v), ("o_proj", o)):
            if tuple(t.shape) != want[name]:
                raise ValueError(f"gemma4 layer {index}: {name} has shape {tuple(t.shape)} but the config implies "
                                 f"{want[name]}")
        return Attention(q=q, k=k, v=v, o=o, num_heads=nh, num_kv_heads=nkv, head_dim=hd,
                         q_norm=RMSNorm(w.get(a + "q_norm.weight"), eps), k_norm=RMSNorm(w.get(a + "k_norm.weight"), eps),
                         v_norm=True, scale=1.0, window=window, local_rope=sliding, kv_role="store" if store else "")

    @staticmethod
    def _check_rope_freqs(cfg: ModelConfig, freqs: torch.Tensor) -> None:
        """llama.cpp's converter marks the proportional RoPE's turning pairs 1 and the still ones
        1e30: the count must be what the config's partial factor gives."""
        half = (cfg.head_dim_full or cfg.head_dim) // 2
        turning = int(float(cfg.rope_scaling["partial_rotary_factor"]) * half * 2 // 2)
        want = torch.tensor([1.0] * turning + [1e30] * (half - turning))
        if freqs.shape != want.shape or not torch.allclose(freqs.float(), want, rtol=1e-3):
            raise ValueError(f"gemma4 GGUF: rope_freqs does not mark the first {turning} of {half} pairs as turning")

    def _moe(self, cfg: ModelConfig, p: str, w: Weights) -> tuple[MoE, tuple[RMSNorm, RMSNorm, RMSNorm]]:
        E, inter, eps, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.rms_norm_eps, cfg.hidden_size
        if w.has(p + "experts.0.down_proj"):  # a GGUF: matrix by matrix, their stored blocks kept
            def expert(e: int) -> SwiGLU:
                x = f"{p}experts.{e}."
                if w.has(x + "gate_up_proj"):
                    gu = w.get(x + "gate_up_proj")
                    gate, up = slice_rows(gu, 0, inter), slice_rows(gu, inter, 2 * inter)
                else:
                    gate, up = w.get(x + "gate_proj"), w.get(x + "up_proj")
                return SwiGLU(gate, up, w.get(x + "down_proj"), act="gelu_tanh")
            experts = [expert(e) for e in range(E)]
        else:
            gu, down = w.get(p + "experts.gate_up_proj"), w.get(p + "experts.down_proj")
            if tuple(gu.shape) != (E, 2 * inter, H) or tuple(down.shape) != (E, H, inter):
                raise ValueError(f"gemma4: experts of shape {tuple(gu.shape)} / {tuple(down.shape)} but the config "
                                 f"implies {E} experts of {inter}")
            experts = [SwiGLU(gu[e, :inter], gu[e, inter:], down[e], act="gelu_tanh") for e in range(E)]
        for e, ex in enumerate(experts):
            if (ex.inter, ex.gate_up.in_features, ex.down.out_features) != (inter, H, H):
                raise ValueError(f"gemma4: expert {e} has shape {ex.inter} x {ex.gate_up.in_features} but the config "
                                 f"implies {inter} x {H}")
        router = SoftmaxRouter(w.get(p + "router.proj.weight"), cfg.num_experts_per_tok, w.get(p + "router.scale"),
                               w.get(p + "router.per_expert_scale"), eps)

        def norm(name):
            return RMSNorm(w.get(p + name + ".weight"), eps)
        return MoE(router, experts), (norm("pre_feedforward_layernorm_2"), norm("post_feedforward_layernorm_1"),
                                      norm("post_feedforward_layernorm_2"))

    def build_layer(self, cfg: ModelConfig, index: int, w: Weights) -> DecoderLayer:
        p = f"model.layers.{index}."
        eps = cfg.rms_norm_eps

        def norm(name):
            return RMSNorm(w.get(p + name + ".weight"), eps)
        mlp = SwiGLU(w.get(p + "mlp.gate_proj.weight"), w.get(p + "mlp.up_proj.weight"),
                     w.get(p + "mlp.down_proj.weight"), act="gelu_tanh")
        wide = 2 if cfg.kv_source(index) is not None and mlp.inter == 2 * cfg.intermediate_size else 1
        if (mlp.inter, mlp.gate_up.in_features, mlp.down.out_features) != (wide * cfg.intermediate_size,
                                                                            cfg.hidden_size, cfg.hidden_size):
            raise ValueError(f"gemma4 layer {index}: MLP of {mlp.inter} x {mlp.gate_up.in_features} but the config "
                             f"implies {cfg.intermediate_size} x {cfg.hidden_size}")
        moe, moe_norms = self._moe(cfg, p, w) if cfg.num_experts else (None, None)
        per_layer = None
        if cfg.per_layer_input_size:
            gate, proj = w.get(p + "per_layer_input_gate.weight"), w.get(p + "per_layer_projection.weight")
            if tuple(gate.shape) != (cfg.per_layer_input_size, cfg.hidden_size) or \
                    tuple(proj.shape) != (cfg.hidden_size, cfg.per_layer_input_size):
                raise ValueError(f"gemma4 layer {index}: per-layer input gate {tuple(gate.shape)} / projection "
                                 f"{tuple(proj.shape)} do not fit {cfg.per_layer_input_size}")
            per_layer = (gate, proj, norm("post_per_layer_input_norm"))
        return Gemma4Layer(index, norm("input_layernorm"), self.build_attention(cfg, p, w, index),
                           norm("pre_feedforward_layernorm"), mlp, mixer_out_norm=norm("post_attention_layernorm"),
                           mlp_out_norm=norm("post_feedforward_layernorm"), moe=moe, moe_norms=moe_norms,
                           scalar=w.get(p + "layer_scalar") if w.has(p + "layer_scalar") else None,
                           per_layer=per_layer)
