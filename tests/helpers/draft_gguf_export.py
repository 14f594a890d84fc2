"""Write a DFlash draft GGUF the way the reference system's converters do.

Mirrors ``server/scripts/convert_dflash_to_gguf.py`` / ``quantize_draft_q8.py`` (Luce-Org):
arch ``qwen35-dflash-draft``; ``<arch>.*`` llama-style hparams plus ``dflash.n_target_layers``
(tap count), ``dflash.block_size``, ``dflash.mask_token_id``, ``dflash.target_layer_ids``
(int32[]), ``attention.sliding_window`` (u32) and ``attention.sliding_window_pattern`` (bool per
layer, from ``layer_types``); tensors ``dflash.fc`` / ``dflash.hidden_norm`` / ``output_norm`` /
``blk.N.*`` in checkpoint (out, in) layout; norms F32, matrices F16 / BF16 / Q8_0 (``gguf.quantize``).

``style="llamacpp"`` writes the llama.cpp-fork spelling the reference loader also accepts
(arch ``dflash-draft``, ``dflash_fc``, ``dflash_hidden_norm``, ``blk.N.post_attention_norm``,
``dflash.n_target_features`` instead of ``dflash.n_target_layers``, ``attention.causal``).
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

Q = gguf.GGMLQuantizationType

_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
          "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
          "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
          "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
          "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
          "mlp.down_proj.weight": "ffn_down.weight"}


def gguf_name(zname: str, style: str = "lucebox") -> str:
    top = {"fc.weight": "dflash.fc.weight", "hidden_norm.weight": "dflash.hidden_norm.weight",
           "norm.weight": "output_norm.weight"}
    if style == "llamacpp":
        top.update({"fc.weight": "dflash_fc.weight", "hidden_norm.weight": "dflash_hidden_norm.weight"})
    if zname in top:
        return top[zname]
    _, i, rest = zname.split(".", 2)
    name = f"blk.{i}.{_LAYER[rest]}"
    if style == "llamacpp" and rest == "post_attention_layernorm.weight":
        name = f"blk.{i}.post_attention_norm.weight"
    return name


def export_draft_gguf(cfg, tensors: dict[str, torch.Tensor], dst, *, qtype_for=None, style: str = "lucebox",
                      arch: str | None = None, drop_meta=(), drop_tensors=(), extra_meta=None,
                      vocab_size: int = 248320, ctx_len: int = 32768) -> Path:
    """cfg: DraftConfig; tensors: z-lab names. qtype_for(gguf_name, shape) -> F32/F16/BF16/Q8_0
    for matrices (default F16, like the reference's F16 converter); norms are always F32.
    drop_meta: key suffixes (after ``<arch>.``) to leave out; extra_meta: {suffix: value} to add or
    override; drop_tensors: GGUF names to leave out (for error tests)."""
    arch = arch or ("dflash-draft" if style == "llamacpp" else "qwen35-dflash-draft")
    w = gguf.GGUFWriter(str(dst), arch)
    H = cfg.hidden_size
    windows = [win for _, win in cfg.layer_attention]
    window = next((win for win in windows if win), None)
    meta = {"context_length": ctx_len, "embedding_length": H, "block_count": cfg.num_layers,
            "feed_forward_length": cfg.intermediate_size, "attention.head_count": cfg.num_heads,
            "attention.head_count_kv": cfg.num_kv_heads, "attention.key_length": cfg.head_dim,
            "attention.value_length": cfg.head_dim, "vocab_size": vocab_size,
            "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps), "rope.freq_base": float(cfg.rope_theta)}
    if style == "llamacpp":
        meta["attention.causal"] = False
    else:
        meta["dflash.n_target_layers"] = cfg.num_taps
    meta.update({"dflash.block_size": cfg.block_size, "dflash.mask_token_id": cfg.mask_token_id,
                 "dflash.target_layer_ids": [int(t) for t in cfg.target_layer_ids]})
    if style == "llamacpp":
        meta["dflash.n_target_features"] = cfg.num_taps * H
    if window:
        meta["attention.sliding_window"] = window
        meta["attention.sliding_window_pattern"] = [bool(win) for win in windows]
    if cfg.rope_scaling:
        assert cfg.rope_scaling.get("rope_type") == "linear", cfg.rope_scaling
        meta["rope.scaling.type"] = "linear"
        meta["rope.scaling.factor"] = float(cfg.rope_scaling["factor"])
    meta.update(extra_meta or {})
    w.add_string("general.name", f"DFlash-Draft-{H}h-{cfg.num_layers}L")
    for key, val in meta.items():
        if key in drop_meta:
            continue
        key = f"{arch}.{key}"
        if isinstance(val, bool):
            w.add_bool(key, val)
        elif isinstance(val, int):
            w.add_uint32(key, val)
        elif isinstance(val, float):
            w.add_float32(key, val)
        elif isinstance(val, str):
            w.add_string(key, val)
        else:
            w.add_array(key, list(val))

    def order(item):  # the reference's on-disk order: dflash.* singletons, output_*, then blocks
        n = item[0]
        if n.startswith("dflash"):
            return (0, 0, n)
        if n.startswith("output_"):
            return (1, 0, n)
        return (2, int(n.split(".")[1]), n)

    named = sorted(((gguf_name(z, style), t) for z, t in tensors.items()), key=order)
    for name, t in named:
        if name in drop_tensors:
            continue
        arr = t.detach().float().cpu().numpy().astype(np.float32)
        if name.endswith("_norm.weight") or arr.ndim == 1:
            w.add_tensor(name, arr, raw_dtype=Q.F32)
            continue
        qt = qtype_for(name, arr.shape) if qtype_for else Q.F16
        if qt == Q.F32:
            w.add_tensor(name, arr, raw_dtype=Q.F32)
        elif qt == Q.F16:
            w.add_tensor(name, arr.astype("<f2"), raw_dtype=Q.F16)
        elif qt == Q.BF16:  # raw bf16 bits, as the reference keeps BF16 checkpoints
            bits = t.detach().to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            w.add_tensor(name, bits, raw_dtype=Q.BF16)
        else:
            w.add_tensor(name, gguf.quantize(arr, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(dst)
