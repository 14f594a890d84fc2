"""Laguna (poolside, ``LagunaForCausalLM``): sliding-window and full attention layers with a
softplus output gate, and a sigmoid-routed mixture of experts with a shared expert.

Differences from Llama: per-layer query head counts (the KV heads are the same everywhere);
q/k RMSNorm per head; a gate ``softplus(g_proj(x))`` on the attention output, one value per
head or per element; sliding layers rotate the whole head with their own base, full layers
part of it (possibly with YaRN); MLPs per layer "dense" (SwiGLU) or "sparse" (``layers.moe``:
sigmoid router, optional tanh soft-cap, a selection bias, top-k normalised weights times
``moe_routed_scaling_factor``, plus the shared expert).

Checkpoint names as poolside ships them (and transformers saves them): per-expert
``mlp.experts.{e}.{gate,up,down}_proj``, the selection bias at
``mlp.experts.e_score_correction_bias``, the shared expert at ``mlp.shared_expert.``;
transformers' in-memory names (``mlp.gate.e_score_correction_bias``, ``mlp.shared_experts.``,
stacked ``mlp.experts.gate_up_proj`` / ``down_proj``) are read too.

GGUF (llama.cpp's ``laguna`` arch): experts stacked per layer (``ffn_{gate,up,down}_exps``,
read matrix by matrix), ``exp_probs_b`` the selection bias, ``*_shexp`` the shared expert,
``attn_gate`` the gate (its width says per head or per element), a per-layer head-count
array, the sliding pattern (full where layer % 4 == 0 unless the file lists it), the sliding
layers' RoPE base and width under ``*_swa`` keys. No Q/K permutation (NeoX RoPE). The
converter carries no router soft-cap, and llama.cpp applies none: a GGUF runs without it.
"""
from __future__ import annotations

import re

from ..layers.attention import Attention
from ..layers.decoder import DecoderLayer
from ..layers.mlp import SwiGLU
from ..layers.moe import MoE, SigmoidRouter
from ..layers.norms import RMSNorm
from .base import Family, Slab, Weights
from .config import ModelConfig, eos_ids
from .llama import GLOBAL_GGUF_NAMES, gguf_meta

DEFAULT_ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}}
SWA_PERIOD = 4  # llama.cpp: full attention where layer % 4 == 0 when the file lists no pattern

GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.g_proj.weight": "attn_gate.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
}
for _p, _g in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
    for _kind in ("weight", "bias"):
        GGUF_LAYER_NAMES[f"self_attn.{_p}_proj.{_kind}"] = f"{_g}.{_kind}"
for _part in ("gate", "up", "down"):
    GGUF_LAYER_NAMES[f"mlp.{_part}_proj.weight"] = f"ffn_{_part}.weight"
    GGUF_LAYER_NAMES[f"mlp.shared_expert.{_part}_proj.weight"] = f"ffn_{_part}_shexp.weight"
    GGUF_LAYER_NAMES[f"mlp.shared_experts.{_part}_proj.weight"] = f"ffn_{_part}_shexp.weight"
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


def _gate_kind(gating) -> str:
    """transformers: ``True`` / "per-head" -> one gate per head, anything else per element."""
    return "per_head" if gating is True or str(gating).replace("-", "_") == "per_head" else "per_element"


def _rope(params: dict) -> tuple[float, dict | None, float]:
    theta = float(params.get("rope_theta", 10000.0))
    scaling = params if params.get("rope_type", "default") != "default" else None
    return theta, scaling, float(params.get("partial_rotary_factor", 1.0))


class LagunaFamily(Family):
    name = "laguna"
    hf_architectures = ("LagunaForCausalLM",)
    hf_model_types = ("laguna",)
    gguf_archs = ("laguna",)

    def config_from_hf(self, cfg: dict) -> ModelConfig:
        if cfg.get("moe_apply_router_weight_on_input"):
            raise ValueError("laguna: moe_apply_router_weight_on_input is not supported (nor by transformers)")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"laguna: unsupported activation {act!r}")
        n = int(cfg["num_hidden_layers"])
        nh = int(cfg["num_attention_heads"])
        layer_types = tuple(cfg.get("layer_types") or ["full_attention"] * n)
        rope = cfg.get("rope_parameters") or DEFAULT_ROPE
        if "full_attention" not in rope and "sliding_attention" not in rope:
            rope = {"full_attention": rope, "sliding_attention": rope}  # one set for every layer
        theta, scaling, partial = _rope(rope.get("full_attention") or DEFAULT_ROPE["full_attention"])
        local_theta = local_scaling = local_partial = None
        if "sliding_attention" in layer_types:
            local_theta, local_scaling, local_partial = _rope(rope.get("sliding_attention")
                                                              or DEFAULT_ROPE["sliding_attention"])
        mlp_types = tuple(cfg.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n - 1))
        return ModelConfig(
            family=self.name, vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]), num_layers=n, num_heads=nh,
            num_kv_heads=int(cfg.get("num_key_value_heads") or nh),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // nh),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
            partial_rotary_factor=partial, rope_local_theta=local_theta, rope_local_scaling=local_scaling,
            local_partial_rotary_factor=local_partial,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 131072)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)), qk_norm=True, layer_types=layer_types,
            sliding_window=int(cfg["sliding_window"]) if cfg.get("sliding_window") else None,
            heads_per_layer=tuple(int(h) for h in cfg.get("num_attention_heads_per_layer") or ()),
            attn_softplus_gate=_gate_kind(cfg.get("gating", True)), mlp_layer_types=mlp_types,
            num_experts=int(cfg.get("num_experts", 0)), num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0)),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0)),
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 0)),
            moe_routed_scaling_factor=float(cfg.get("moe_routed_scaling_factor", 1.0)),
            moe_router_softcap=float(cfg.get("moe_router_logit_softcapping") or 0.0),
            bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids(cfg.get("eos_token_id")),
        )

    def config_from_gguf(self, meta: dict, arch: str) -> ModelConfig:
        def g(key, default=None):
            return gguf_meta(meta, arch, key, default)
        n = int(g("block_count"))
        heads = g("attention.head_count")
        heads = [int(h) for h in heads] if isinstance(heads, (list, tuple)) else [int(heads)] * n
        hidden = int(g("embedding_length"))
        head_dim = int(g("attention.key_length") or hidden // heads[0])
        window = int(g("attention.sliding_window", 0) or 0)
        pattern = g("attention.sliding_window_pattern")
        if window <= 0:
            layer_types = ("full_attention",) * n
        elif isinstance(pattern, (list, tuple)):
            layer_types = tuple("sliding_attention" if p else "full_attention" for p in pattern[:n])
        else:
            period = int(pattern or SWA_PERIOD)
            layer_types = tuple("sliding_attention" if period == 0 or i % period else "full_attention"
                                for i in range(n))
        rot = int(g("rope.dimension_count") or head_dim)
        scaling = None
        if g("rope.scaling.type") == "yarn":
            scaling = {"rope_type": "yarn", "factor": float(g("rope.scaling.factor")),
                       "original_max_position_embeddings": int(g("rope.scaling.original_context_length")),
                       "beta_fast": g("rope.scaling.yarn_beta_fast"), "beta_slow": g("rope.scaling.yarn_beta_slow"),
                       "attention_factor": g("rope.scaling.yarn_attn_factor")}
        elif g("rope.scaling.type") == "linear":
            scaling = {"rope_type": "linear", "factor": float(g("rope.scaling.factor"))}
        theta = float(g("rope.freq_base", 500000.0))
        if not g("expert_weights_norm", True):
            raise ValueError("laguna GGUF: un-normalised expert weights (expert_weights_norm false) are not supported")
        gating = g("expert_gating_func")
        if gating not in (None, 0, 2):  # llama.cpp: 0 none (defaults to sigmoid for laguna), 2 sigmoid
            raise ValueError(f"laguna GGUF: expert gating function {gating} is not sigmoid")
        dense = int(g("leading_dense_block_count", 1))
        experts = int(g("expert_count", 0))
        return ModelConfig(
            family=self.name, vocab_size=int(g("vocab_size") or len(meta["tokenizer.ggml.tokens"])),
            hidden_size=hidden, intermediate_size=int(g("feed_forward_length")), num_layers=n, num_heads=heads[0],
            num_kv_heads=int(g("attention.head_count_kv")), head_dim=head_dim,
            rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)), rope_theta=theta,
            rope_scaling=scaling, partial_rotary_factor=rot / head_dim,
            rope_local_theta=float(g("rope.freq_base_swa", theta)) if "sliding_attention" in layer_types else None,
            local_partial_rotary_factor=int(g("rope.dimension_count_swa") or rot) / head_dim,
            max_position_embeddings=int(g("context_length", 131072)), qk_norm=True, layer_types=layer_types,
            sliding_window=window or None, heads_per_layer=tuple(heads), attn_softplus_gate="per_head",
            mlp_layer_types=tuple("dense" if i < dense or not experts else "sparse" for i in range(n)),
            num_experts=experts, num_experts_per_tok=int(g("expert_used_count", 0)),
            moe_intermediate_size=int(g("expert_feed_forward_length", 0)),
            shared_expert_intermediate_size=int(g("expert_shared_feed_forward_length", 0)),
            moe_routed_scaling_factor=float(g("expert_weights_scale", 1.0) or 1.0),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos_ids(meta.get("tokenizer.ggml.eos_token_id")),
            extra={"gguf_arch": arch},
        )

    def gguf_tensor(self, hf_name: str, cfg: ModelConfig):
        if hf_name in GLOBAL_GGUF_NAMES:
            return GLOBAL_GGUF_NAMES[hf_name], None
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
        if m is None:
            raise KeyError(hf_name)
        layer, inner = m.groups()
        e = _EXPERT.fullmatch(inner)
        if e is not None:
            return f"blk.{layer}.ffn_{e.group(2)}_exps.weight", Slab(int(e.group(1)))
        if inner not in GGUF_LAYER_NAMES:
            raise KeyError(hf_name)
        return f"blk.{layer}.{GGUF_LAYER_NAMES[inner]}", None

    def expected_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        shapes = super().expected_shapes(cfg)
        # query heads vary per layer: build_attention checks q/o (and the gate) itself
        for key in ("q_proj.weight", "o_proj.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight"):
            shapes.pop(key)
        return shapes

    def build_attention(self, cfg: ModelConfig, index: int, p: str, w: Weights) -> Attention:
        def opt(name):
            return w.get(name) if w.has(name) else None
        a = p + "self_attn."
        nh, hd, H = cfg.heads(index), cfg.head_dim, cfg.hidden_size
        q, o, g = w.get(a + "q_proj.weight"), w.get(a + "o_proj.weight"), w.get(a + "g_proj.weight")
        if tuple(q.shape) != (nh * hd, H) or tuple(o.shape) != (H, nh * hd):
            raise ValueError(f"laguna layer {index}: q_proj {tuple(q.shape)} / o_proj {tuple(o.shape)} do not fit "
                             f"{nh} heads of {hd}")
        want = {"per_head": nh, "per_element": nh * hd}
        if cfg.extra.get("gguf_arch") is None and g.shape[0] != want[cfg.attn_softplus_gate]:
            raise ValueError(f"laguna layer {index}: g_proj has {g.shape[0]} outputs but the config's gating "
                             f"({cfg.attn_softplus_gate}) implies {want[cfg.attn_softplus_gate]}")
        sliding = cfg.layer_types[index] == "sliding_attention"
        eps = cfg.rms_norm_eps
        return Attention(
            q=q, k=w.get(a + "k_proj.weight"), v=w.get(a + "v_proj.weight"), o=o,
            q_bias=opt(a + "q_proj.bias"), k_bias=opt(a + "k_proj.bias"), v_bias=opt(a + "v_proj.bias"),
            o_bias=opt(a + "o_proj.bias"), num_heads=nh, num_kv_heads=cfg.num_kv_heads, head_dim=hd,
            q_norm=RMSNorm(w.get(a + "q_norm.weight"), eps), k_norm=RMSNorm(w.get(a + "k_norm.weight"), eps),
            window=cfg.sliding_window if sliding else None, local_rope=sliding and cfg.rope_local_theta is not None,
            softplus_gate=g)

    def build_mlp(self, cfg: ModelConfig, index: int, p: str, w: Weights):
        m = p + "mlp."
        if cfg.mlp_layer_types[index] == "dense":
            return SwiGLU(w.get(m + "gate_proj.weight"), w.get(m + "up_proj.weight"), w.get(m + "down_proj.weight"))
        E, inter = cfg.num_experts, cfg.moe_intermediate_size
        if w.has(m + "experts.0.gate_proj.weight"):
            experts = [SwiGLU(*(w.get(f"{m}experts.{e}.{part}_proj.weight") for part in ("gate", "up", "down")))
                       for e in range(E)]
        else:  # transformers' stacked form
            gu, down = w.get(m + "experts.gate_up_proj"), w.get(m + "experts.down_proj")
            experts = [SwiGLU(gu[e, :inter], gu[e, inter:], down[e]) for e in range(E)]
        for e, ex in enumerate(experts):
            if (ex.inter, ex.gate_up.in_features, ex.down.out_features) != (inter, cfg.hidden_size, cfg.hidden_size):
                raise ValueError(f"laguna layer {index}: expert {e} has shape {ex.inter} x {ex.gate_up.in_features} "
                                 f"but the config implies {inter} x {cfg.hidden_size}")
        shared_p = next((f"{m}{s}." for s in ("shared_expert", "shared_experts") if w.has(f"{m}{s}.gate_proj.weight")),
                        None)
        shared = None if shared_p is None else SwiGLU(*(w.get(f"{shared_p}{part}_proj.weight")
                                                       for part in ("gate", "up", "down")))
        bias_name = next((n for n in (m + "experts.e_score_correction_bias", m + "gate.e_score_correction_bias")
                          if w.has(n)), None)
        router = SigmoidRouter(w.get(m + "gate.weight"), cfg.num_experts_per_tok,
                               w.get(bias_name) if bias_name else None, cfg.moe_router_softcap)
        return MoE(router, experts, shared=shared, routed_scale=cfg.moe_routed_scaling_factor)

    def build_layer(self, cfg: ModelConfig, index: int, w: Weights) -> DecoderLayer:
        p = f"model.layers.{index}."
        eps = cfg.rms_norm_eps
        return DecoderLayer(index, RMSNorm(w.get(p + "input_layernorm.weight"), eps),
                            self.build_attention(cfg, index, p, w),
                            RMSNorm(w.get(p + "post_attention_layernorm.weight"), eps),
                            self.build_mlp(cfg, index, p, w))
