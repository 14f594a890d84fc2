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

ARCH = {"llama": "llama", "qwen3": "qwen3", "qwen3_5": "qwen35", "laguna": "laguna", "gemma4": "gemma4"}
# llama.cpp's laguna tensor names (llama-arch.cpp; the PyPI gguf-py has no laguna map):
# HF suffix inside model.layers.{i}. -> GGUF suffix inside blk.{i}.
LAGUNA_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.g_proj.weight": "attn_gate.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.e_score_correction_bias": "exp_probs_b.bias",
    **{f"mlp.{p}_proj.weight": f"ffn_{p}.weight" for p in ("gate", "up", "down")},
    **{f"mlp.shared_expert.{p}_proj.weight": f"ffn_{p}_shexp.weight" for p in ("gate", "up", "down")},
}


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


def _laguna_meta(w: gguf.GGUFWriter, cfg: dict) -> None:
    """The keys llama.cpp's converter (conversion/laguna.py + base.py) writes for Laguna."""
    a, n, hd = "laguna", cfg["num_hidden_layers"], cfg["head_dim"]
    heads = cfg.get("num_attention_heads_per_layer") or [cfg["num_attention_heads"]] * n
    w.add_array(f"{a}.attention.head_count", heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_vocab_size(cfg["vocab_size"])
    rope = cfg["rope_parameters"]
    full, swa = rope["full_attention"], rope.get("sliding_attention")
    w.add_rope_freq_base(full["rope_theta"])
    w.add_uint32(f"{a}.rope.dimension_count", int(hd * full.get("partial_rotary_factor", 1.0)))
    if full.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(full["factor"])
        w.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
    if cfg.get("sliding_window") and "sliding_attention" in cfg["layer_types"]:  # M.1: all full, no window
        w.add_uint32(f"{a}.attention.sliding_window", cfg["sliding_window"])
        w.add_array(f"{a}.attention.sliding_window_pattern",
                    [t == "sliding_attention" for t in cfg["layer_types"]])
        w.add_float32(f"{a}.rope.freq_base_swa", swa["rope_theta"])
        w.add_uint32(f"{a}.rope.dimension_count_swa", int(hd * swa.get("partial_rotary_factor", 1.0)))
    w.add_uint32(f"{a}.expert_count", cfg["num_experts"])
    w.add_uint32(f"{a}.expert_used_count", cfg["num_experts_per_tok"])
    w.add_uint32(f"{a}.expert_feed_forward_length", cfg["moe_intermediate_size"])
    w.add_uint32(f"{a}.expert_shared_feed_forward_length", cfg["shared_expert_intermediate_size"])
    w.add_bool(f"{a}.expert_weights_norm", True)
    w.add_float32(f"{a}.expert_weights_scale", cfg["moe_routed_scaling_factor"])
    w.add_uint32(f"{a}.expert_gating_func", 2)  # sigmoid
    dense = next((i for i, t in enumerate(cfg["mlp_layer_types"]) if t != "dense"), n)
    w.add_uint32(f"{a}.leading_dense_block_count", dense)


def _laguna_tensors(tensors: dict, cfg: dict):
    """(GGUF name, fp32 tensor): experts stacked per layer as llama.cpp's converter does."""
    import re

    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, t in sorted(tensors.items()):
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            yield {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                   "lm_head.weight": "output.weight"}[name], t.float()
            continue
        layer, inner = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name).groups()
        e = re.fullmatch(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", inner)
        if e:
            experts.setdefault((int(layer), e.group(2)), {})[int(e.group(1))] = t.float()
            continue
        yield f"blk.{layer}.{LAGUNA_NAMES[inner]}", t.float()
    for (layer, part), mats in sorted(experts.items()):
        yield f"blk.{layer}.ffn_{part}_exps.weight", torch.stack([mats[i] for i in range(len(mats))])


def _gemma4_meta(w: gguf.GGUFWriter, cfg: dict) -> None:
    """The keys llama.cpp's converter (conversion/gemma.py, Gemma4Model) writes."""
    a, types = "gemma4", cfg["layer_types"]
    full_cfg = next(v for k, v in cfg["per_layer_config"].items() if types[int(k)] == "full_attention")
    hd, hd_full = cfg["head_dim"], full_cfg["head_dim"]
    w.add_head_count(cfg["num_attention_heads"])
    w.add_array(f"{a}.attention.head_count_kv", [cfg["num_key_value_heads"] if t == "sliding_attention"
                                                 else full_cfg.get("num_key_value_heads", cfg["num_key_value_heads"])
                                                 for t in types])
    w.add_key_length(hd_full)
    w.add_value_length(hd_full)
    w.add_uint32(f"{a}.attention.key_length_swa", hd)
    w.add_uint32(f"{a}.attention.value_length_swa", hd)
    w.add_array(f"{a}.attention.sliding_window_pattern", [t == "sliding_attention" for t in types])
    w.add_uint32(f"{a}.attention.sliding_window", cfg["sliding_window"])
    w.add_uint32(f"{a}.attention.shared_kv_layers", cfg.get("num_kv_shared_layers") or 0)
    w.add_uint32(f"{a}.embedding_length_per_layer_input", cfg.get("hidden_size_per_layer_input") or 0)
    shared = cfg.get("num_kv_shared_layers") or 0
    if cfg.get("use_double_wide_mlp") and shared:  # the converter's per-layer MLP sizes
        n, ff = cfg["num_hidden_layers"], cfg["intermediate_size"]
        w.add_array(f"{a}.feed_forward_length", [ff if i < n - shared else 2 * ff for i in range(n)])
    rope = cfg["rope_parameters"]
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    w.add_float32(f"{a}.rope.freq_base_swa", rope["sliding_attention"]["rope_theta"])
    w.add_uint32(f"{a}.rope.dimension_count", hd_full)
    w.add_uint32(f"{a}.rope.dimension_count_swa", hd)
    if cfg.get("final_logit_softcapping"):
        w.add_float32(f"{a}.final_logit_softcapping", cfg["final_logit_softcapping"])
    if cfg.get("enable_moe_block"):
        w.add_uint32(f"{a}.expert_count", cfg["num_experts"])
        w.add_uint32(f"{a}.expert_used_count", cfg["top_k_experts"])
        w.add_uint32(f"{a}.expert_feed_forward_length", cfg["moe_intermediate_size"])


def _gemma4_tensors(tensors: dict, cfg: dict):
    """(GGUF name, fp32 tensor) as llama.cpp's converter names them, plus rope_freqs."""
    import re

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, cfg["num_hidden_layers"])
    special = {"router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale",
               "layer_scalar": "layer_output_scale.weight", "experts.gate_up_proj": "ffn_gate_up_exps.weight",
               "experts.down_proj": "ffn_down_exps.weight"}
    for name, t in sorted(tensors.items()):
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if m and m.group(2) in special:
            yield f"blk.{m.group(1)}.{special[m.group(2)]}", t.float()
            continue
        base, _, kind = name.rpartition(".")
        yield f"{names.get_name(base)}.{kind}", t.float()
    full = next(v for k, v in cfg["per_layer_config"].items() if cfg["layer_types"][int(k)] == "full_attention")
    half = full["head_dim"] // 2
    turning = int(cfg["rope_parameters"]["full_attention"]["partial_rotary_factor"] * half)
    yield "rope_freqs.weight", torch.tensor([1.0] * turning + [1e30] * (half - turning))


def export_gguf(src: Path, dst: Path, family: str, tokenizer_meta: dict, qtype_for=None) -> Path:
    """qtype_for(gguf_name, shape) -> GGMLQuantizationType for 2-D weights and stacked
    experts (default F32)."""
    cfg = json.loads((Path(src) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    arch = ARCH[family]
    n = cfg["num_hidden_layers"]
    name_map = None if family in ("laguna", "gemma4") else \
        gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), n)
    w = gguf.GGUFWriter(str(dst), arch)
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_block_count(n)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    if not (family == "gemma4" and cfg.get("use_double_wide_mlp") and cfg.get("num_kv_shared_layers")):
        w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    if family == "laguna":
        _laguna_meta(w, cfg)
    elif family == "gemma4":
        _gemma4_meta(w, cfg)
    else:
        w.add_head_count(cfg["num_attention_heads"])
        w.add_head_count_kv(cfg["num_key_value_heads"])
        w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if family not in ("llama", "laguna", "gemma4"):
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
    if cfg.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    tensor_list = _laguna_tensors(tensors, cfg) if family == "laguna" else _gemma4_tensors(tensors, cfg) \
        if family == "gemma4" else _mapped(tensors, family, cfg, name_map)
    for gname, t in tensor_list:
        arr = t.numpy().astype(np.float32)
        qt = gguf.GGMLQuantizationType.F32
        if arr.ndim in (2, 3) and not gname.endswith(("norm.weight", "ffn_gate_inp.weight", "per_layer_token_embd.weight")) \
                and qtype_for is not None:
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



def _mapped(tensors: dict, family: str, cfg: dict, name_map):
    for name, t in sorted(tensors.items()):
        name = name.replace("model.language_model.", "model.")
        name, t = _forward_transform(name, t.float(), family, cfg)
        gname = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname, name
        yield gname, t
