"""Qwen3.5 / Qwen3.6 text: hybrid Gated DeltaNet + gated full attention.

Differences from Qwen3: zero-centred ``(1 + w)`` RMSNorms (decoder, final, q/k norms),
partial RoPE (first ``head_dim * partial_rotary_factor`` dims), attention output gate
packed per head in q_proj, and ``linear_attention`` layers (GDN) in a 3:1 pattern.
"""
from __future__ import annotations

from ..layers.gdn import GatedDeltaNet
from .base import Weights
from .config import ModelConfig, eos_ids, rope_from_hf
from .llama import LlamaFamily, check_silu, gguf_name
from .qwen3_5_gguf import GGUF_LAYER_NAMES, config_from_gguf_meta, gguf_layer_name, gguf_transform


class Qwen3_5Family(LlamaFamily):
    name = "qwen3_5"
    hf_architectures = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
    hf_model_types = ("qwen3_5", "qwen3_5_text")
    gguf_archs = ("qwen35",)
    qk_norm = True
    permuted_qk_archs = ()

    def config_from_hf(self, cfg: dict) -> ModelConfig:
        text = dict(cfg.get("text_config") or cfg)
        check_silu(text)
        theta, scaling, partial = rope_from_hf(text)
        if "partial_rotary_factor" not in (text.get("rope_parameters") or {}) and \
                "partial_rotary_factor" not in text:
            partial = 0.25
        if scaling is not None and scaling.get("rope_type", "default") == "default":
            scaling = None
        n = int(text["num_hidden_layers"])
        layer_types = text.get("layer_types")
        if not layer_types:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
        nh = int(text["num_attention_heads"])
        return ModelConfig(
            family=self.name, vocab_size=int(text["vocab_size"]), hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text["intermediate_size"]), num_layers=n, num_heads=nh,
            num_kv_heads=int(text.get("num_key_value_heads") or nh), head_dim=int(text.get("head_dim", 256)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
            partial_rotary_factor=partial,
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            attention_bias=bool(text.get("attention_bias", False)), qk_norm=True,
            attn_output_gate=bool(text.get("attn_output_gate", True)), zero_centred_norm=True,
            layer_types=tuple(layer_types),
            linear_num_key_heads=int(text.get("linear_num_key_heads", 16)),
            linear_num_value_heads=int(text.get("linear_num_value_heads", 32)),
            linear_key_head_dim=int(text.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(text.get("linear_value_head_dim", 128)),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            bos_token_id=text.get("bos_token_id"), eos_token_ids=eos_ids(text.get("eos_token_id")),
        )

    def config_from_gguf(self, meta: dict, arch: str) -> ModelConfig:
        return config_from_gguf_meta(self.name, meta, arch)

    def gguf_tensor(self, hf_name: str, cfg: ModelConfig):
        name = gguf_layer_name(hf_name) or gguf_name(hf_name, GGUF_LAYER_NAMES)
        return name, gguf_transform(hf_name, cfg)

    def expected_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        shapes = super().expected_shapes(cfg)
        H, hk, hv = cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        conv_dim = 2 * hk * dk + hv * dv
        shapes.update({
            "in_proj_qkv.weight": (conv_dim, H), "in_proj_z.weight": (hv * dv, H), "in_proj_b.weight": (hv, H),
            "in_proj_a.weight": (hv, H), "conv1d.weight": (conv_dim, 1, cfg.linear_conv_kernel_dim),
            "A_log": (hv,), "dt_bias": (hv,), "linear_attn.norm.weight": (dv,), "out_proj.weight": (H, hv * dv),
        })
        return shapes

    def build_mixer(self, cfg: ModelConfig, index: int, p: str, w: Weights):
        if cfg.layer_types[index] != "linear_attention":
            return self.build_attention(cfg, p, w, index)
        a = p + "linear_attn."
        return GatedDeltaNet(
            in_proj_qkv=w.get(a + "in_proj_qkv.weight"), in_proj_z=w.get(a + "in_proj_z.weight"),
            in_proj_b=w.get(a + "in_proj_b.weight"), in_proj_a=w.get(a + "in_proj_a.weight"),
            conv_weight=w.get(a + "conv1d.weight"), A_log=w.get(a + "A_log"), dt_bias=w.get(a + "dt_bias"),
            norm_weight=w.get(a + "norm.weight"), out_proj=w.get(a + "out_proj.weight"),
            num_k_heads=cfg.linear_num_key_heads, num_v_heads=cfg.linear_num_value_heads,
            head_k_dim=cfg.linear_key_head_dim, head_v_dim=cfg.linear_value_head_dim, eps=cfg.rms_norm_eps)
