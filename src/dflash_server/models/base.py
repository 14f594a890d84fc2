"""What every model family provides, and the parts they share (embedding, head)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.linear import Linear
from ..layers.norms import RMSNorm
from .config import ModelConfig



@dataclass(frozen=True)
class Slab:
    """A family's GGUF mapping for one matrix of a stacked 3-D tensor (a layer's experts):
    ``gguf_tensor`` returns ``(name, Slab(i))`` instead of a transform."""

    index: int


class Weights(Protocol):
    """Tensors by Hugging Face name, already on the stage device in the compute dtype
    (norms cast their own weights to fp32)."""

    def get(self, name: str) -> torch.Tensor: ...

    def has(self, name: str) -> bool: ...


class Embedding(nn.Module):
    def __init__(self, weight: torch.Tensor, scale: float | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(ids, self.weight)
        return x * self.scale if self.scale is not None else x

    def per_layer_inputs(self, ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor | None:
        """Inputs every layer reads beside the residual stream (Gemma 4's per-layer
        embeddings), from the token ids and their embeddings ``h``; None for most families."""
        return None


class Family:
    """A model family: config parsing, GGUF mapping and layer construction.

    Subclasses set ``name``, ``hf_architectures`` / ``hf_model_types`` and ``gguf_archs`` and
    implement ``config_from_hf``, ``config_from_gguf`` and ``build_layer``. Weight names are
    Hugging Face names with the ``model.`` prefix (``model.layers.{i}....``).
    """

    name = ""
    hf_architectures: tuple[str, ...] = ()
    hf_model_types: tuple[str, ...] = ()
    gguf_archs: tuple[str, ...] = ()

    def config_from_hf(self, cfg: dict) -> ModelConfig:
        raise NotImplementedError

    def config_from_gguf(self, meta: dict, arch: str) -> ModelConfig:
        raise NotImplementedError

    def gguf_tensor(self, hf_name: str, cfg: ModelConfig) -> tuple[str, Callable | None]:
        """(GGUF tensor name, optional transform to HF layout) for an HF weight name."""
        raise NotImplementedError

    def build_layer(self, cfg: ModelConfig, index: int, w: Weights) -> nn.Module:
        raise NotImplementedError

    def expected_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Weight-name suffix -> shape the config implies (checked at load time)."""
        H, hd, nh, nkv, inter = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, \
            cfg.intermediate_size
        return {
            "embed_tokens.weight": (cfg.vocab_size, H), "lm_head.weight": (cfg.vocab_size, H),
            "model.norm.weight": (H,), "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
            "q_proj.weight": (nh * hd * (2 if cfg.attn_output_gate else 1), H), "k_proj.weight": (nkv * hd, H),
            "v_proj.weight": (nkv * hd, H), "o_proj.weight": (H, nh * hd), "q_norm.weight": (hd,),
            "k_norm.weight": (hd,), "gate_proj.weight": (inter, H), "up_proj.weight": (inter, H),
            "down_proj.weight": (H, inter),
        }

    # --- shared parts -----------------------------------------------------------------
    def build_embedding(self, cfg: ModelConfig, w: Weights) -> nn.Module:
        return Embedding(w.get("model.embed_tokens.weight"))

    def build_final_norm(self, cfg: ModelConfig, w: Weights) -> nn.Module:
        return RMSNorm(w.get("model.norm.weight"), cfg.rms_norm_eps, cfg.zero_centred_norm)

    def build_lm_head(self, cfg: ModelConfig, w: Weights) -> Linear:
        tied = cfg.tie_word_embeddings or not w.has("lm_head.weight")
        return Linear(w.get("model.embed_tokens.weight" if tied else "lm_head.weight"))
