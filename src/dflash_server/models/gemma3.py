"""Gemma 3 text (``Gemma3ForCausalLM``, the text part of ``Gemma3ForConditionalGeneration``).

Differences from Llama: sliding-window layers interleaved with full ones (every sixth is
full), each kind with its own RoPE base (10k local, 1M global, the global one possibly
linearly scaled), per-head q/k RMSNorm, ``(1 + w)`` norms, a norm after the attention and
after the MLP too ("sandwich"), a GELU-tanh gated MLP, embeddings scaled by sqrt(hidden) in
the weights' dtype, attention scaled by ``query_pre_attn_scalar ** -0.5``, tied LM head.

GGUF (llama.cpp's ``gemma3`` arch): the converter stores the norms as ``1 + w``, so they load
as plain norms; llama.cpp fixes what the file does not say: the local RoPE base (10,000)
and the pattern (layer i is full when (i + 1) % 6 == 0).
"""
from __future__ import annotations

import torch

from ..layers.attention import Attention
from ..layers.decoder import DecoderLayer
from ..layers.mlp import SwiGLU
from ..layers.norms import RMSNorm
from .base import Embedding, Weights
from .config import ModelConfig, eos_ids
from .llama import LlamaFamily, gguf_meta, gguf_name

GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
LOCAL_ROPE_THETA = 10000.0  # llama.cpp's (and the HF default) base of the sliding layers
FULL_EVERY = 6              # the sliding/full pattern where the file does not list layer types


def _rope(params: dict | None, default_theta: float) -> tuple[float, dict | None]:
    params = dict(params or {})
    theta = float(params.get("rope_theta", default_theta))
    kind = params.get("rope_type", "default")
    return theta, (params if kind != "default" else None)


class Gemma3Family(LlamaFamily):
    name = "gemma3"
    hf_architectures = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
    hf_model_types = ("gemma3_text", "gemma3")
    gguf_archs = ("gemma3",)
    qk_norm = True
    permuted_qk_archs = ()

    def config_from_hf(self, cfg: dict) -> ModelConfig:
        text = dict(cfg.get("text_config") or cfg)
        if text.get("attn_logit_softcapping") is not None:
            raise ValueError("gemma3: attn_logit_softcapping is not supported")
        if text.get("use_bidirectional_attention"):
            raise ValueError("gemma3: bidirectional attention (an embedding model) is not a generator")
        if text.get("attention_bias"):
            raise ValueError("gemma3: attention_bias (q/k/v/o projection biases) is not supported")
        n = int(text["num_hidden_layers"])
        # the Hub's configs name the pattern sliding_window_pattern, transformers' own _sliding_...
        pattern = int(text.get("sliding_window_pattern") or text.get("_sliding_window_pattern") or FULL_EVERY)
        layer_types = text.get("layer_types") or [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
        params = text.get("rope_parameters") or {}
        if "full_attention" in params or "sliding_attention" in params:
            theta, scaling = _rope(params.get("full_attention"), 1_000_000.0)
            local, local_scaling = _rope(params.get("sliding_attention"), LOCAL_ROPE_THETA)
        else:  # the flat form of older configs
            theta, scaling = float(text.get("rope_theta", 1_000_000.0)), text.get("rope_scaling")
            local, local_scaling = float(text.get("rope_local_base_freq", LOCAL_ROPE_THETA)), None
        if local_scaling is not None:
            raise ValueError("gemma3: scaled RoPE on the sliding layers is not supported")
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "default":
            scaling = None
        nh = int(text["num_attention_heads"])
        act = text.get("hidden_activation") or text.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"gemma3: unsupported activation {act!r}")
        return ModelConfig(
            family=self.name, vocab_size=int(text["vocab_size"]), hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text["intermediate_size"]), num_layers=n, num_heads=nh,
            num_kv_heads=int(text.get("num_key_value_heads") or nh), head_dim=int(text.get("head_dim", 256)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=int(text.get("max_position_embeddings", 131072)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", True))),
            attention_bias=bool(text.get("attention_bias", False)), qk_norm=True, zero_centred_norm=True,
            layer_types=tuple(layer_types), sliding_window=int(text.get("sliding_window") or 4096),
            query_pre_attn_scalar=float(text.get("query_pre_attn_scalar", 256)), rope_local_theta=local,
            hidden_act="gelu_tanh", embed_scale=True, sandwich_norms=True,
            final_logit_softcapping=float(text["final_logit_softcapping"]) if text.get("final_logit_softcapping")
            else None,
            bos_token_id=text.get("bos_token_id"), eos_token_ids=eos_ids(text.get("eos_token_id")),
        )

    def config_from_gguf(self, meta: dict, arch: str) -> ModelConfig:
        def g(key, default=None):
            return gguf_meta(meta, arch, key, default)
        n = int(g("block_count"))
        nh = int(g("attention.head_count"))
        hidden = int(g("embedding_length"))
        head_dim = int(g("attention.key_length") or hidden // nh)
        scaling = None
        if g("rope.scaling.type") == "linear":
            scaling = {"rope_type": "linear", "factor": float(g("rope.scaling.factor"))}
        # llama.cpp: 1/sqrt(head_dim), except the 27B (62 layers), whose scale is 1/sqrt(hidden/heads)
        scalar = hidden / nh if n == 62 else head_dim
        return ModelConfig(
            family=self.name, vocab_size=int(g("vocab_size") or len(meta["tokenizer.ggml.tokens"])),
            hidden_size=hidden, intermediate_size=int(g("feed_forward_length")), num_layers=n, num_heads=nh,
            num_kv_heads=int(g("attention.head_count_kv") or nh), head_dim=head_dim,
            rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(g("rope.freq_base", 1_000_000.0)), rope_scaling=scaling,
            max_position_embeddings=int(g("context_length", 131072)), tie_word_embeddings=True,
            qk_norm=True, zero_centred_norm=False,  # the file holds 1 + w
            layer_types=tuple("full_attention" if (i + 1) % FULL_EVERY == 0 else "sliding_attention"
                              for i in range(n)),
            sliding_window=int(g("attention.sliding_window", 4096)), query_pre_attn_scalar=float(scalar),
            rope_local_theta=LOCAL_ROPE_THETA, hidden_act="gelu_tanh", embed_scale=True, sandwich_norms=True,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos_ids(meta.get("tokenizer.ggml.eos_token_id")),
            extra={"gguf_arch": arch},
        )

    def gguf_tensor(self, hf_name: str, cfg: ModelConfig):
        return gguf_name(hf_name, GGUF_LAYER_NAMES), None

    def expected_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        shapes = super().expected_shapes(cfg)
        H = cfg.hidden_size
        shapes.update({"pre_feedforward_layernorm.weight": (H,), "post_feedforward_layernorm.weight": (H,)})
        return shapes

    def build_embedding(self, cfg: ModelConfig, w: Weights) -> Embedding:
        weight = w.get("model.embed_tokens.weight")
        # sqrt(hidden) rounded to the weights' dtype, as transformers multiplies
        return Embedding(weight, torch.tensor(cfg.hidden_size ** 0.5, dtype=weight.dtype))

    def build_attention(self, cfg: ModelConfig, p: str, w: Weights, index: int = 0) -> Attention:
        a = p + "self_attn."
        eps, zc = cfg.rms_norm_eps, cfg.zero_centred_norm
        sliding = cfg.layer_types[index] == "sliding_attention"
        return Attention(
            q=w.get(a + "q_proj.weight"), k=w.get(a + "k_proj.weight"), v=w.get(a + "v_proj.weight"),
            o=w.get(a + "o_proj.weight"), num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim, q_norm=RMSNorm(w.get(a + "q_norm.weight"), eps, zc),
            k_norm=RMSNorm(w.get(a + "k_norm.weight"), eps, zc), scale=cfg.query_pre_attn_scalar ** -0.5,
            window=cfg.sliding_window if sliding else None, local_rope=sliding)

    def build_layer(self, cfg: ModelConfig, index: int, w: Weights) -> DecoderLayer:
        p = f"model.layers.{index}."
        eps, zc = cfg.rms_norm_eps, cfg.zero_centred_norm

        def norm(name):
            return RMSNorm(w.get(p + name + ".weight"), eps, zc)
        mlp = SwiGLU(w.get(p + "mlp.gate_proj.weight"), w.get(p + "mlp.up_proj.weight"),
                     w.get(p + "mlp.down_proj.weight"), act="gelu_tanh")
        return DecoderLayer(index, norm("input_layernorm"), self.build_attention(cfg, p, w, index),
                            norm("pre_feedforward_layernorm"), mlp,
                            mixer_out_norm=norm("post_attention_layernorm"),
                            mlp_out_norm=norm("post_feedforward_layernorm"))
