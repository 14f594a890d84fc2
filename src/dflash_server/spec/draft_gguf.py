"""DFlash drafts stored as GGUF: config from ``<arch>.*`` metadata, tensors under z-lab names.

The format is the one written by the reference system's converters
(``server/scripts/convert_dflash_to_gguf.py`` and ``quantize_draft_q8.py``, read by
``server/src/draft/draft_gguf_loader.cpp``), plus the llama.cpp-fork spelling of the same
thing (``dflash-draft`` arch, ``dflash_fc`` / ``dflash_hidden_norm`` / ``post_attention_norm``)
that the reference loader also accepts:

* ``general.architecture``: ``qwen35-dflash-draft``, ``dflash-draft`` or ``gemma4-dflash-draft``.
* ``<arch>.embedding_length / block_count / feed_forward_length / attention.head_count /
  attention.head_count_kv / attention.key_length / attention.layer_norm_rms_epsilon /
  rope.freq_base``; ``<arch>.dflash.block_size / mask_token_id / target_layer_ids (int32[]) /
  n_target_layers`` (the number of tapped layers, i.e. ``fc`` in-features / hidden);
  ``<arch>.attention.sliding_window`` (u32) and ``attention.sliding_window_pattern``
  (bool per layer, true = sliding; from the checkpoint's ``layer_types``).
* Tensors keep the checkpoint's (out, in) layout (GGUF ne is just its reverse; no permutes or
  value transforms); norms are F32, matrices F16/BF16/Q8_0 (or any type GGUFFile reads).

Sliding layers become ``(causal=True, window)`` and full layers ``(False, None)``, the same
rule DraftConfig.from_dict applies to ``layer_types``. When the file has no
``target_layer_ids``, the taps follow the uniform rule for ``num_target_layers`` if given,
else the reference's 27B default ``[1, 16, 31, 46, 61]`` for a 5-tap, 5120-wide draft
(``quantize_draft_q8.py`` does not write the ids). Not used: ``dflash.n_target_layers`` /
``n_target_features`` (``fc``'s shape decides, as in the reference), ``attention.causal``,
gemma4's ``dflash.logit_softcap``, and auxiliary heads (``dflash.domino.*``).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import ModelLoadError
from ..weights.gguf_file import GGUFFile
from .config import DraftConfig, default_target_layer_ids

DRAFT_ARCHES = ("qwen35-dflash-draft", "dflash-draft", "gemma4-dflash-draft")
# the reference's fixed capture layers for the Qwen3.5/3.6-27B draft (5 taps of a 64-layer target)
_DEFAULT_27B_TAPS = (1, 16, 31, 46, 61)

# z-lab name -> GGUF names, first present wins (reference converter name first)
_TOP = {"fc.weight": ("dflash.fc.weight", "dflash_fc.weight"),
        "hidden_norm.weight": ("dflash.hidden_norm.weight", "dflash_hidden_norm.weight"),
        "norm.weight": ("output_norm.weight",)}
_LAYER = {"input_layernorm.weight": ("attn_norm.weight",),
          "post_attention_layernorm.weight": ("ffn_norm.weight", "post_attention_norm.weight"),
          "self_attn.q_proj.weight": ("attn_q.weight",), "self_attn.k_proj.weight": ("attn_k.weight",),
          "self_attn.v_proj.weight": ("attn_v.weight",), "self_attn.o_proj.weight": ("attn_output.weight",),
          "self_attn.q_norm.weight": ("attn_q_norm.weight",), "self_attn.k_norm.weight": ("attn_k_norm.weight",),
          "mlp.gate_proj.weight": ("ffn_gate.weight",), "mlp.up_proj.weight": ("ffn_up.weight",),
          "mlp.down_proj.weight": ("ffn_down.weight",)}


def _f32(v) -> float:
    """A GGUF float32 as the decimal it was written from (1e-6, not 9.99999997e-07)."""
    return float(f"{float(v):.7g}")


def load_gguf_draft(path: str | Path, num_target_layers: int | None = None
                    ) -> tuple[DraftConfig, dict[str, torch.Tensor]]:
    """(config, tensors under z-lab names) for ``DFlashDraft(cfg, tensors, ...)``.
    ValueError for a file that is not a DFlash draft GGUF or is inconsistent."""
    path = Path(path)
    try:
        f = GGUFFile(path)
        arch = f.arch
    except ModelLoadError as e:
        raise ValueError(str(e)) from None
    if arch not in DRAFT_ARCHES:
        raise ValueError(f"{path}: general.architecture {arch!r} is not a DFlash draft (expected one of "
                         f"{', '.join(DRAFT_ARCHES)}); a target model cannot be used as --draft")
    meta = f.meta
    missing = object()

    def opt(key, default=None):
        v = meta.get(f"{arch}.{key}", missing)
        return default if v is missing else v

    def req(key):
        v = opt(key, missing)
        if v is missing:
            raise ValueError(f"{path}: draft GGUF has no {arch}.{key} metadata")
        return v

    H, n_layers, ff = int(req("embedding_length")), int(req("block_count")), int(req("feed_forward_length"))
    nh, nkv = int(req("attention.head_count")), int(req("attention.head_count_kv"))
    if nh <= 0 or nkv <= 0 or nh % nkv:
        raise ValueError(f"{path}: head_count {nh} is not a positive multiple of head_count_kv {nkv}")
    block, mask, theta = req("dflash.block_size"), req("dflash.mask_token_id"), req("rope.freq_base")
    hd = int(opt("attention.key_length", 0) or opt("attention.value_length", 0) or 0)
    if not hd:
        name = "blk.0.attn_q_norm.weight"
        if not f.has(name):
            raise ValueError(f"{path}: draft GGUF has no {arch}.attention.key_length metadata")
        hd = f.tensors[name].shape[-1]

    # --- tensor names and shapes (header only; data is read last) ----------------------
    def resolve(gnames: tuple[str, ...], shape: tuple[int, ...] | None) -> str:
        gname = next((g for g in gnames if f.has(g)), None)
        if gname is None:
            raise ValueError(f"{path}: draft GGUF is missing tensor {' / '.join(gnames)}")
        got = tuple(f.tensors[gname].shape)
        if shape is not None and got != shape:
            raise ValueError(f"{path}: tensor {gname} has shape {got}, the metadata implies {shape}")
        return gname

    fc_name = resolve(_TOP["fc.weight"], None)
    fc_shape = tuple(f.tensors[fc_name].shape)
    if len(fc_shape) != 2 or fc_shape[0] != H or fc_shape[1] % H:
        raise ValueError(f"{path}: tensor {fc_name} has shape {fc_shape}, expected ({H}, n_taps * {H})")
    target_hidden = opt("dflash.target_hidden")
    if target_hidden is not None and int(target_hidden) != H:
        raise ValueError(f"{path}: target hidden size {target_hidden} != draft hidden size {H} is not supported")
    n_taps = fc_shape[1] // H
    per_layer = {"input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
                 "self_attn.q_proj.weight": (nh * hd, H), "self_attn.k_proj.weight": (nkv * hd, H),
                 "self_attn.v_proj.weight": (nkv * hd, H), "self_attn.o_proj.weight": (H, nh * hd),
                 "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
                 "mlp.gate_proj.weight": (ff, H), "mlp.up_proj.weight": (ff, H), "mlp.down_proj.weight": (H, ff)}
    names = {"fc.weight": fc_name, "hidden_norm.weight": resolve(_TOP["hidden_norm.weight"], (H,)),
             "norm.weight": resolve(_TOP["norm.weight"], (H,))}
    for i in range(n_layers):
        for z, shape in per_layer.items():
            names[f"layers.{i}.{z}"] = resolve(tuple(f"blk.{i}.{g}" for g in _LAYER[z]), shape)
    if f.has(f"blk.{n_layers}.attn_q.weight"):
        raise ValueError(f"{path}: has more layers than {arch}.block_count = {n_layers}")

    # --- taps ---------------------------------------------------------------------------
    ids = opt("dflash.target_layer_ids")
    if ids is not None:
        if not isinstance(ids, list) or not ids:
            raise ValueError(f"{path}: {arch}.dflash.target_layer_ids must be a non-empty integer array")
        taps = tuple(int(t) for t in ids)
        if len(taps) != n_taps:
            raise ValueError(f"{path}: {len(taps)} target_layer_ids but {fc_name} takes {n_taps} tapped layers "
                             f"({fc_shape[1]} in-features / hidden {H})")
    elif num_target_layers is not None:
        taps = default_target_layer_ids(int(num_target_layers), n_taps)
    elif (n_taps, H) == (len(_DEFAULT_27B_TAPS), 5120):
        taps = _DEFAULT_27B_TAPS
    else:
        raise ValueError(f"{path}: draft GGUF has no {arch}.dflash.target_layer_ids (and the target's layer "
                         f"count is unknown, so the {n_taps} taps cannot be placed)")

    # --- attention layout ---------------------------------------------------------------
    window = int(opt("attention.sliding_window", 0) or 0)
    pattern = opt("attention.sliding_window_pattern")
    if pattern is None:
        sliding = [False] * n_layers
    elif isinstance(pattern, list):
        if len(pattern) != n_layers:
            raise ValueError(f"{path}: {arch}.attention.sliding_window_pattern has {len(pattern)} entries for "
                             f"{n_layers} layers")
        sliding = [bool(p) for p in pattern]
    else:  # llama.cpp's period form: every n-th layer is full attention
        n = int(pattern)
        sliding = [n > 0 and i % n < n - 1 for i in range(n_layers)]
    attention = tuple((s, window if s and window else None) for s in sliding)

    scaling = None
    kind = opt("rope.scaling.type")
    if kind not in (None, "none"):
        if kind != "linear":
            raise ValueError(f"{path}: rope scaling type {kind!r} is not supported for drafts")
        scaling = {"rope_type": "linear", "factor": _f32(req("rope.scaling.factor"))}
    try:
        cfg = DraftConfig(hidden_size=H, intermediate_size=ff, num_layers=n_layers, num_heads=nh,
                          num_kv_heads=nkv, head_dim=hd, block_size=int(block), mask_token_id=int(mask),
                          target_layer_ids=taps, rms_norm_eps=_f32(opt("attention.layer_norm_rms_epsilon", 1e-6)),
                          rope_theta=_f32(theta), rope_scaling=scaling,
                          layer_attention=attention,
                          num_target_layers=int(num_target_layers) if num_target_layers is not None else None)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None
    try:
        tensors = {z: f.get(g) for z, g in names.items()}
    except ModelLoadError as e:
        raise ValueError(str(e)) from None
    return cfg, tensors
