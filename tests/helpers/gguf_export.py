"""Write a GGUF from a tiny HF model directory the way llama.cpp's converter does
(names from gguf-py's own HF->GGUF map; llama Q/K permutation; qwen35 norm +1,
-exp(A_log), squeezed conv, tiled value-head order), with chosen quant types."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from . import kquant
from .qwen_tokenizer import add_gguf_tokenizer_metadata

ARCH = {"llama": "llama", "qwen3": "qwen3", "qwen3_5": "qwen35"}


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _reorder_v(t: torch.Tensor, dim: int, hk: int, r: int, hd: int) -> torch.Tensor:
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], hk, r, hd, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).contiguous().reshape(shape)


def _forward_transform(name: str, w: torch.Tensor, family: str, cfg: dict) -> tuple[str, torch.Tensor]:
    if family == "llama":
        if name.endswith("q_proj.weight"):
            w = _permute(w, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = _permute(w, cfg["num_key_value_heads"])
    if family == "qwen3_5":
        hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        r, dv, kd = hv // hk, cfg["linear_value_head_dim"], hk * cfg["linear_key_head_dim"]
        if name.endswith("conv1d.weight"):
            w = w.squeeze(1)
        if ".linear_attn." in name and hk != hv:
            leaf = name.split("linear_attn.")[1]
            if leaf in ("in_proj_qkv.weight", "conv1d.weight"):
                w = torch.cat([w[:2 * kd], _reorder_v(w[2 * kd:], 0, hk, r, dv)])
            elif leaf == "in_proj_z.weight":
                w = _reorder_v(w, 0, hk, r, dv)
            elif leaf in ("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias"):
                w = _reorder_v(w, 0, hk, r, 1)
            elif leaf == "out_proj.weight":
                w = _reorder_v(w, 1, hk, r, dv)
        if name.endswith(".A_log"):
            w = -torch.exp(w)
        elif name.endswith(".dt_bias"):
            name = name.replace(".dt_bias", ".dt_proj.bias")
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            w = w + 1
    return name, w


def export_gguf(src: Path, dst: Path, family: str, tokenizer_meta: dict, qtype_for=None) -> Path:
    """qtype_for(gguf_name, shape) -> GGMLQuantizationType for 2-D weights (default F32)."""
    cfg = json.loads((Path(src) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    arch = ARCH[family]
    n = cfg["num_hidden_layers"]
    name_map = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), n)
    w = gguf.GGUFWriter(str(dst), arch)
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_block_count(n)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if family != "llama":
        w.add_key_length(hd)
        w.add_value_length(hd)
    if family == "llama":
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(hd)
    if family == "qwen3_5":
        w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
        w.add_ssm_state_size(cfg["linear_key_head_dim"])
        w.add_ssm_group_count(cfg["linear_num_key_heads"])
        w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
        w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
        w.add_full_attention_interval(3)
        w.add_rope_dimension_count(int(hd * rope.get("partial_rotary_factor", 0.25)))
        w.add_rope_dimension_sections([11, 11, 10, 0])
    add_gguf_tokenizer_metadata(w, tokenizer_meta)
    tensors = load_file(str(Path(src) / "model.safetensors"))
    for name, t in sorted(tensors.items()):
        name = name.replace("model.language_model.", "model.")
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        name, t = _forward_transform(name, t.float(), family, cfg)
        gname = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname, name
        arr = t.numpy().astype(np.float32)
        qt = gguf.GGMLQuantizationType.F32
        if arr.ndim == 2 and not gname.endswith("norm.weight") and qtype_for is not None:
            qt = qtype_for(gname, arr.shape)
        if qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, arr)
        elif qt == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gname, arr.astype(np.float16))
        elif qt.name in ("Q4_K", "Q5_K", "Q6_K"):  # gguf-py cannot write these: our plain quantizer
            w.add_tensor(gname, kquant.quantize(arr, qt.name), raw_dtype=qt)
        else:
            w.add_tensor(gname, gguf.quants.quantize(arr, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(dst)

