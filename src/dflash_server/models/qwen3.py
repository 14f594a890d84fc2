"""Qwen3 dense: Llama layout plus per-head QK RMSNorm; explicit head_dim."""
from __future__ import annotations

from .llama import LlamaFamily


class Qwen3Family(LlamaFamily):
    name = "qwen3"
    hf_architectures = ("Qwen3ForCausalLM",)
    hf_model_types = ("qwen3",)
    gguf_archs = ("qwen3",)
    qk_norm = True
    permuted_qk_archs = ()
