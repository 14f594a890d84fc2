"""GGUF (llama.cpp ``qwen35``) -> Hugging Face mapping for Qwen3.5 / Qwen3.6 text models.

Inverts what llama.cpp's converter does for this architecture:
- every zero-centred RMSNorm except the GDN output norm is stored as ``w + 1``;
- ``A_log`` is stored as ``ssm_a = -exp(A_log)``; ``dt_bias`` as ``ssm_dt.bias``;
- the conv1d weight is squeezed to (C, K);
- when value heads outnumber key heads, value-head rows (or ``out_proj`` columns) are
  reordered from HF's grouped order ``[k0v0, k0v1, .., k1v0, ..]`` to a tiled order
  ``[k0v0, k1v0, .., k0v1, ..]``; we reorder back.
Newer conversions append the MTP block as extra layers (``nextn_predict_layers``); they
are not part of the decoder stack and are ignored.
"""
from __future__ import annotations

import torch

from .config import ModelConfig, eos_ids
from .llama import LAYER_GGUF_NAMES

GGUF_LAYER_NAMES = dict(LAYER_GGUF_NAMES)
GGUF_LAYER_NAMES.update({
    "post_attention_layernorm": "post_attention_norm",
    "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
})
# names whose GGUF form is not "<gguf>.<weight|bias>"
_SPECIAL = {"linear_attn.A_log": "ssm_a", "linear_attn.dt_bias": "ssm_dt.bias"}
_PLUS_ONE = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight")


def reorder_v_heads(t: torch.Tensor, dim: int, outer: int, inner: int, head_dim: int) -> torch.Tensor:
    """View ``dim`` as (outer, inner, head_dim) and swap outer/inner. Grouped->tiled uses
    (num_k_heads, v_per_k); tiled->grouped (our direction) uses (v_per_k, num_k_heads)."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], outer, inner, head_dim, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).contiguous().reshape(shape)


def gguf_layer_name(hf_name: str) -> str | None:
    parts = hf_name.split(".")
    inner = ".".join(parts[3:])
    if parts[:2] == ["model", "layers"] and inner in _SPECIAL:
        return f"blk.{parts[2]}.{_SPECIAL[inner]}"
    return None


def gguf_transform(hf_name: str, cfg: ModelConfig):
    steps = []
    if hf_name == "model.norm.weight" or hf_name.endswith(_PLUS_ONE):
        steps.append(lambda w: w - 1.0)
    if hf_name.endswith("A_log"):
        steps.append(lambda w: torch.log(-w.float()))
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if ".linear_attn." in hf_name and hk and hv and hk != hv:
        r, dv, key_dim = hv // hk, cfg.linear_value_head_dim, cfg.linear_num_key_heads * cfg.linear_key_head_dim

        def v_rows(offset: int, head_dim: int, dim: int = 0):
            def f(w):
                w = w.clone()
                idx = [slice(None)] * w.dim()
                idx[dim] = slice(offset, None)
                w[tuple(idx)] = reorder_v_heads(w[tuple(idx)], dim, r, hk, head_dim)
                return w
            return f
        leaf = hf_name.split("linear_attn.")[1]
        if leaf in ("in_proj_qkv.weight", "conv1d.weight"):
            steps.append(v_rows(2 * key_dim, dv))
        elif leaf == "in_proj_z.weight":
            steps.append(v_rows(0, dv))
        elif leaf in ("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias"):
            steps.append(v_rows(0, 1))
        elif leaf == "out_proj.weight":
            steps.append(v_rows(0, dv, dim=1))
    if hf_name.endswith("conv1d.weight"):
        steps.append(lambda w: w.unsqueeze(1))
    if not steps:
        return None

    def run(w):
        for s in steps:
            w = s(w)
        return w
    return run


def config_from_gguf_meta(family: str, meta: dict, arch: str) -> ModelConfig:
    def g(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    n = int(g("block_count")) - int(g("nextn_predict_layers", 0) or 0)
    interval = int(g("full_attention_interval", 4))
    nh = int(g("attention.head_count"))
    head_dim = int(g("attention.key_length") or int(g("embedding_length")) // nh)
    rot = g("rope.dimension_count")
    nv = int(g("ssm.time_step_rank"))
    return ModelConfig(
        family=family, vocab_size=int(g("vocab_size") or len(meta["tokenizer.ggml.tokens"])),
        hidden_size=int(g("embedding_length")), intermediate_size=int(g("feed_forward_length")),
        num_layers=n, num_heads=nh, num_kv_heads=int(g("attention.head_count_kv") or nh), head_dim=head_dim,
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(g("rope.freq_base", 10000000.0)),
        partial_rotary_factor=(int(rot) / head_dim) if rot else 0.25,
        max_position_embeddings=int(g("context_length", 32768)), qk_norm=True, attn_output_gate=True,
        zero_centred_norm=True,
        layer_types=tuple("linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)),
        linear_num_key_heads=int(g("ssm.group_count")), linear_num_value_heads=nv,
        linear_key_head_dim=int(g("ssm.state_size")), linear_value_head_dim=int(g("ssm.inner_size")) // nv,
        linear_conv_kernel_dim=int(g("ssm.conv_kernel", 4)),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids(meta.get("tokenizer.ggml.eos_token_id")),
        extra={"gguf_arch": arch},
    )
