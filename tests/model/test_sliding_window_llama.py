"""Hostile review (2026-11-27): the Llama family (Llama, Mistral, Qwen2) and Qwen3 ignored
``sliding_window`` / ``use_sliding_window`` / ``max_window_layers``, so every layer attended
over the whole context: logits wrong from the window on (max diff 0.8-2.0, argmax changed)
without a word. They follow transformers now; ``mlp_bias`` (never applied) is refused."""
import pytest
import torch

from helpers.build import pipeline, prompt_ids
from helpers.tiny import _perturb, load_hf, make_tiny_model, write_smol_tokenizer


SMALL = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True, eos_token_id=2,
             bos_token_id=1)


def _hf_model(kind, dst, **cfg):
    """A small seeded ``transformers`` model of ``kind`` ("Mistral", "Qwen2") saved at ``dst``."""
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, f"{kind}Config")(**SMALL, **cfg)
    m = getattr(transformers, f"{kind}ForCausalLM")(config)
    _perturb(m, 0)
    dst.mkdir()
    m.save_pretrained(dst, safe_serialization=True)
    write_smol_tokenizer(dst)
    return dst


@pytest.mark.parametrize("kind", ["mistral", "qwen3", "qwen2"])
def test_sliding_window_matches_transformers(tmp_path, kind):
    if kind == "mistral":
        path = _hf_model("Mistral", tmp_path / "m", head_dim=16, sliding_window=24)
    elif kind == "qwen2":
        path = _hf_model("Qwen2", tmp_path / "m", use_sliding_window=True, sliding_window=24, max_window_layers=1)
    else:
        path = make_tiny_model(kind, tmp_path / "q", use_sliding_window=True, sliding_window=24,
                               max_window_layers=1)
    pipe = pipeline(path)
    assert "sliding_attention" in pipe.config.layer_types and pipe.config.sliding_window == 24
    hf = load_hf(path)
    ids = prompt_ids(pipe, 100)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    ours = pipe.forward(ids, 0, logits="all").logits
    assert (ours - ref).abs().max().item() < 2e-3
    # and decode steps past the window (the cache's older rows masked) as the prefill
    pipe.reset()
    pipe.forward(ids[:60], 0)
    steps = torch.cat([pipe.forward([t], 60 + i, logits="all").logits for i, t in enumerate(ids[60:])])
    assert (steps - ref[60:]).abs().max().item() < 2e-3


def test_a_qwen_window_without_use_sliding_window_is_full_attention(tmp_path):
    path = make_tiny_model("qwen3", tmp_path / "q", use_sliding_window=False, sliding_window=24)
    assert set(pipeline(path).config.layer_types) == {"full_attention"}


def test_mlp_bias_is_refused(tmp_path):
    from dflash_server.errors import ModelLoadError

    path = make_tiny_model("llama", tmp_path / "m", mlp_bias=True)
    with pytest.raises((ValueError, ModelLoadError), match="mlp_bias"):
        pipeline(path)
