"""GGUF (llama.cpp ``qwen35``) <-> Hugging Face mapping for Qwen3.5 text models."""
from __future__ import annotations

from .config import ModelConfig
from .llama import LAYER_GGUF_NAMES

GGUF_LAYER_NAMES = dict(LAYER_GGUF_NAMES)
GGUF_LAYER_NAMES.update({
    "post_attention_layernorm": "post_attention_norm",
})


def gguf_transform(hf_name: str, cfg: ModelConfig):
    return None


def config_from_gguf_meta(family: str, meta: dict, arch: str) -> ModelConfig:
    raise ValueError("qwen35 GGUF loading is not implemented yet")
