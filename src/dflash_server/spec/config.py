"""DFlash draft configuration in the z-lab checkpoint format (config.json).

Accepts the format variants seen in published drafts: ``block_size`` at the top level or in
``dflash_config``; ``rope_theta`` flat or under ``rope_parameters``; ``layer_types`` with
per-layer sliding windows; ``target_layer_ids`` defaulting to the paper's uniform spread.
"""
from __future__ import annotations

from dataclasses import dataclass


def default_target_layer_ids(num_target_layers: int, n: int) -> tuple[int, ...]:
    """Uniform from layer 1 to layer L-3 (one tap: the middle layer)."""
    if n == 1:
        return (num_target_layers // 2,)
    return tuple(int(round(1 + i * (num_target_layers - 4) / (n - 1))) for i in range(n))


KNOWN_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")


def _dflash2_fields(arch: str, value, cfg: dict) -> dict:
    if arch != "DFlash2DraftModel":
        return {}
    out = {"dflash2": True}
    for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        v = value(name)
        if v is None:
            raise ValueError(f"DFlash 2 draft config: no {name}")
        out[name] = int(v)
    if cfg.get("vocab_size") is None:
        raise ValueError("DFlash 2 draft config: no vocab_size (the selector's codebooks have a row per token)")
    out["vocab_size"] = int(cfg["vocab_size"])
    return out


def _softcap(v) -> float | None:
    return float(v) if v is not None and float(v) > 0 else None


MAX_DRAFT_LAYERS = 256   # a draft is a few layers; a config claiming millions is not one

@dataclass(frozen=True)
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    # per layer: (causal, window or None). Full attention layers are non-causal (the block
    # attends bidirectionally); sliding layers are causal with a window (vLLM's rule).
    layer_attention: tuple[tuple[bool, int | None], ...] = ()
    num_target_layers: int | None = None
    attention_bias: bool = False
    # the reference's extras: draft input embeddings = the target's raw (unscaled) embedding
    # rows x input_embedding_scale; draft logits x output_multiplier, then tanh-softcapped
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    # DFlash 2 (architectures ["DFlash2DraftModel"]): grouped dynamic causal convolutions
    # around each sublayer and a candidate selector over the top-k of each position
    dflash2: bool = False
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    vocab_size: int = 0

    def __post_init__(self):
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"draft config: {name} must be positive")
        if self.block_size < 2:
            raise ValueError(f"draft config: block_size must be >= 2, got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("draft config: target_layer_ids is empty")
        if not self.layer_attention:
            object.__setattr__(self, "layer_attention", ((False, None),) * self.num_layers)
        if len(self.layer_attention) != self.num_layers:
            raise ValueError("draft config: layer_types has the wrong length")
        if self.dflash2:
            for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "vocab_size"):
                if int(getattr(self, name)) <= 0:
                    raise ValueError(f"DFlash 2 draft config: {name} must be a positive integer")
            if self.hidden_size % self.conv_group_size:
                raise ValueError("DFlash 2 draft config: conv_group_size must divide hidden_size")

    def shape_logits(self, logits):
        """The reference's compute_logits after the head: x output_multiplier, then
        tanh-softcapped at final_logit_softcapping (fp32; unchanged when neither is set)."""
        if self.output_multiplier == 1.0 and not self.final_logit_softcapping:
            return logits
        import torch

        logits = logits.float() * self.output_multiplier
        if self.final_logit_softcapping:
            logits = torch.tanh(logits / self.final_logit_softcapping) * self.final_logit_softcapping
        return logits

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_dict(cls, cfg: dict) -> "DraftConfig":
        """The config of a draft checkpoint (z-lab / reference names). Anything malformed is a
        ValueError naming it, never another exception (hostile folders get one error line)."""
        if not isinstance(cfg, dict):
            raise ValueError("draft config: not a JSON object")
        try:
            return cls._from_dict(cfg)
        except (KeyError, TypeError, AttributeError, IndexError, ZeroDivisionError) as e:
            raise ValueError(f"draft config: malformed ({type(e).__name__}: {e})") from None

    @classmethod
    def _from_dict(cls, cfg: dict) -> "DraftConfig":
        arch = (cfg.get("architectures") or ["DFlashDraftModel"])[0]
        if arch not in KNOWN_ARCHITECTURES:
            raise ValueError(f"draft config: unknown architecture {arch!r} (known: {', '.join(KNOWN_ARCHITECTURES)})")
        dc = dict(cfg.get("dflash_config") or {})

        def value(name, default=None):   # dflash_config first, then the top level (the reference's rule)
            return dc.get(name, cfg.get(name, default))
        try:
            hidden = int(cfg["hidden_size"])
            nh = int(cfg["num_attention_heads"])
            n_layers = int(cfg["num_hidden_layers"])
        except KeyError as e:
            raise ValueError(f"draft config: missing {e.args[0]}") from None
        if not 0 < n_layers <= MAX_DRAFT_LAYERS or nh <= 0 or hidden <= 0:
            raise ValueError(f"draft config: {n_layers} layers, {nh} heads, hidden {hidden} (layers in "
                             f"[1, {MAX_DRAFT_LAYERS}], heads and hidden > 0)")
        if "intermediate_size" not in cfg:
            raise ValueError("draft config: missing intermediate_size")
        block = value("block_size", 16)    # the reference's default
        mask = value("mask_token_id")
        if mask is None:
            raise ValueError("draft config: no dflash_config.mask_token_id")
        n_target = cfg.get("num_target_layers")
        taps = dc.get("target_layer_ids") or cfg.get("target_layer_ids")
        if not taps:
            if n_target is None:
                raise ValueError("draft config: no target_layer_ids and no num_target_layers")
            # the reference (build_target_layer_ids): as many taps as the draft has layers
            taps = default_target_layer_ids(int(n_target), int(dc.get("num_target_features", n_layers)))
        params = dict(cfg.get("rope_parameters") or {})
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
        window = cfg.get("sliding_window")
        forced = dc.get("causal", value("is_causal"))
        types = cfg.get("layer_types")
        if types and len(types) != n_layers:
            raise ValueError(f"draft config: {len(types)} layer_types for {n_layers} layers")
        attn = []
        for i in range(n_layers):
            if types:
                sliding = types[i] == "sliding_attention"
                causal, win = (sliding, int(window) if sliding and window else None)
            elif dc.get("use_swa") and window:  # MiMo-style: non-causal SWA everywhere
                causal, win = False, int(window)
            else:
                causal, win = False, None
            if forced is not None:
                causal = bool(forced)
            attn.append((causal, win))
        return cls(hidden_size=hidden, intermediate_size=int(cfg["intermediate_size"]), num_layers=n_layers,
                   num_heads=nh, num_kv_heads=int(cfg.get("num_key_value_heads") or nh),
                   head_dim=int(cfg.get("head_dim") or hidden // nh), block_size=int(block),
                   mask_token_id=int(mask), target_layer_ids=tuple(int(t) for t in taps),
                   rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
                   layer_attention=tuple(attn), num_target_layers=int(n_target) if n_target is not None else None,
                   attention_bias=bool(cfg.get("attention_bias", False)),
                   input_embedding_scale=float(value("input_embedding_scale", 1.0)),
                   output_multiplier=float(value("output_multiplier", 1.0)),
                   final_logit_softcapping=_softcap(value("final_logit_softcapping")),
                   **_dflash2_fields(arch, value, cfg))

    def to_dict(self) -> dict:
        """config.json in the z-lab format."""
        types = ["sliding_attention" if w else "full_attention" for _, w in self.layer_attention]
        window = next((w for _, w in self.layer_attention if w), None)
        extra = {}
        if self.dflash2:
            extra = {"conv_kernel_size": self.conv_kernel_size, "conv_group_size": self.conv_group_size,
                     "selector_rank": self.selector_rank, "selector_top_k": self.selector_top_k,
                     "vocab_size": self.vocab_size}
        return {
            "architectures": ["DFlash2DraftModel" if self.dflash2 else "DFlashDraftModel"], "model_type": "qwen3",
            **extra,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
            "hidden_act": "silu", "attention_bias": self.attention_bias, "layer_types": types,
            "sliding_window": window, "use_sliding_window": window is not None,
            "num_target_layers": self.num_target_layers, "block_size": self.block_size,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids),
                              "block_size": self.block_size, "input_embedding_scale": self.input_embedding_scale,
                              "output_multiplier": self.output_multiplier,
                              "final_logit_softcapping": self.final_logit_softcapping},
        }
