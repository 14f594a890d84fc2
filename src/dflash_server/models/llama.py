"""Llama-style dense decoders: Llama / SmolLM2 / Mistral-like, Qwen2 (QKV bias)."""
from __future__ import annotations

from ..layers.attention import Attention
from ..layers.decoder import DecoderLayer
from ..layers.mlp import SwiGLU
from ..layers.norms import RMSNorm
from .base import Family, Weights
from .config import ModelConfig, eos_ids, rope_from_hf

# Hugging Face name suffix (inside model.layers.{i}.) -> GGUF name suffix (inside blk.{i}.)
LAYER_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
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
GLOBAL_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str, layer_names: dict[str, str]) -> str:
    if hf_name in GLOBAL_GGUF_NAMES:
        return GLOBAL_GGUF_NAMES[hf_name]
    parts = hf_name.split(".")
    if parts[:2] != ["model", "layers"]:
        raise KeyError(hf_name)
    inner, kind = ".".join(parts[3:-1]), parts[-1]
    return f"blk.{parts[2]}.{layer_names[inner]}.{kind}"


def unpermute_rope(w, n_head: int):
    """Invert llama.cpp's Q/K row permutation (interleaved-pair RoPE -> half-rotation)."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def gguf_meta(meta: dict, arch: str, key: str, default=None):
    return meta.get(f"{arch}.{key}", default)


def check_silu(cfg: dict) -> None:
    """The SwiGLU MLP (and Qwen3.5's convolution) compute SiLU: another ``hidden_act`` is refused
    rather than silently replaced."""
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act {act!r} is not supported (SiLU only)")


def sliding_layers(cfg: dict, n: int) -> tuple[tuple[str, ...], int | None]:
    """(layer_types, sliding_window) as transformers reads a Llama-family config: Mistral's
    ``sliding_window`` on every layer; Qwen2 / Qwen3's only with ``use_sliding_window``, on the
    layers from ``max_window_layers`` on; an explicit ``layer_types`` list first; Llama has
    none. ((), None): every layer full."""
    kind = cfg.get("model_type")
    window = cfg.get("sliding_window")
    if kind == "llama" or (kind in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False)):
        window = None
    if cfg.get("layer_types"):
        types = tuple(cfg["layer_types"])
        if not window:   # sliding layers without a window attend over everything, as there
            types = tuple("full_attention" if t == "sliding_attention" else t for t in types)
        return types, int(window) if window else None
    if not window:
        return (), None
    if kind in ("qwen2", "qwen3"):
        start = int(cfg.get("max_window_layers", n) if cfg.get("max_window_layers") is not None else n)
        return tuple("sliding_attention" if i >= start else "full_attention" for i in range(n)), int(window)
    return ("sliding_attention",) * n, int(window)


class LlamaFamily(Family):
    name = "llama"
    hf_architectures = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
    hf_model_types = ("llama", "mistral", "qwen2")
    gguf_archs = ("llama", "qwen2")
    qk_norm = False
    permuted_qk_archs = ("llama",)  # llama.cpp permutes Q/K rows only for these

    def config_from_hf(self, cfg: dict) -> ModelConfig:
        theta, scaling, partial = rope_from_hf(cfg)
        nh = int(cfg["num_attention_heads"])
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias: MLP projection biases are not supported")
        check_silu(cfg)
        layer_types, window = sliding_layers(cfg, int(cfg["num_hidden_layers"]))
        return ModelConfig(
            family=self.name, vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]),
            num_heads=nh, num_kv_heads=int(cfg.get("num_key_value_heads") or nh),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // nh),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
            partial_rotary_factor=partial,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
            qk_norm=self.qk_norm, bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids(cfg.get("eos_token_id")), layer_types=layer_types, sliding_window=window,
        )

    def config_from_gguf(self, meta: dict, arch: str) -> ModelConfig:
        def g(key, default=None):
            return gguf_meta(meta, arch, key, default)
        nh = int(g("attention.head_count"))
        hidden = int(g("embedding_length"))
        head_dim = int(g("attention.key_length") or hidden // nh)
        rot = g("rope.dimension_count")
        scaling = None
        if g("rope.scaling.type") in ("linear",):
            scaling = {"rope_type": "linear", "factor": float(g("rope.scaling.factor"))}
        return ModelConfig(
            family=self.name, vocab_size=int(g("vocab_size") or len(meta["tokenizer.ggml.tokens"])),
            hidden_size=hidden, intermediate_size=int(g("feed_forward_length")),
            num_layers=int(g("block_count")), num_heads=nh,
            num_kv_heads=int(g("attention.head_count_kv") or nh), head_dim=head_dim,
            rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(g("rope.freq_base", 10000.0)), rope_scaling=scaling,
            partial_rotary_factor=(int(rot) / head_dim) if rot else 1.0,
            max_position_embeddings=int(g("context_length", 4096)),
            attention_bias=False, qk_norm=self.qk_norm,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos_ids(meta.get("tokenizer.ggml.eos_token_id")),
            extra={"gguf_arch": arch},
        )

    def gguf_tensor(self, hf_name: str, cfg: ModelConfig):
        name = gguf_name(hf_name, LAYER_GGUF_NAMES)
        if cfg.extra.get("gguf_arch") in self.permuted_qk_archs and hf_name.endswith(
                ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            heads = cfg.num_heads if ".q_proj." in hf_name else cfg.num_kv_heads
            return name, lambda w: unpermute_rope(w, heads)
        return name, None

    def build_attention(self, cfg: ModelConfig, p: str, w: Weights, index: int = 0) -> Attention:
        def opt(name):
            return w.get(name) if w.has(name) else None
        a = p + "self_attn."
        norms = {}
        if cfg.qk_norm:
            norms = dict(q_norm=RMSNorm(w.get(a + "q_norm.weight"), cfg.rms_norm_eps, cfg.zero_centred_norm),
                         k_norm=RMSNorm(w.get(a + "k_norm.weight"), cfg.rms_norm_eps, cfg.zero_centred_norm))
        return Attention(
            q=w.get(a + "q_proj.weight"), k=w.get(a + "k_proj.weight"), v=w.get(a + "v_proj.weight"),
            o=w.get(a + "o_proj.weight"), q_bias=opt(a + "q_proj.bias"), k_bias=opt(a + "k_proj.bias"),
            v_bias=opt(a + "v_proj.bias"), o_bias=opt(a + "o_proj.bias"),
            num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            output_gate=cfg.attn_output_gate,
            window=cfg.sliding_window if cfg.layer_types[index] == "sliding_attention" else None, **norms)

    def build_mlp(self, cfg: ModelConfig, p: str, w: Weights) -> SwiGLU:
        return SwiGLU(w.get(p + "mlp.gate_proj.weight"), w.get(p + "mlp.up_proj.weight"),
                      w.get(p + "mlp.down_proj.weight"))

    def build_mixer(self, cfg: ModelConfig, index: int, p: str, w: Weights):
        return self.build_attention(cfg, p, w, index)

    def build_layer(self, cfg: ModelConfig, index: int, w: Weights) -> DecoderLayer:
        p = f"model.layers.{index}."
        eps, zc = cfg.rms_norm_eps, cfg.zero_centred_norm
        return DecoderLayer(index, RMSNorm(w.get(p + "input_layernorm.weight"), eps, zc),
                            self.build_mixer(cfg, index, p, w),
                            RMSNorm(w.get(p + "post_attention_layernorm.weight"), eps, zc),
                            self.build_mlp(cfg, p, w))
