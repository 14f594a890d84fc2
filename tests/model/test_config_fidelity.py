"""Hostile review (2026-11-27): config keys transformers honours that were silently ignored
(wrong logits, no word): now honoured (matched against transformers in fp32) or refused with
a clear error. Gemma 3 / Gemma 4 ``attention_bias`` (the q/k/v/o biases were never read:
refused), ``hidden_act`` other than SiLU in the Llama / Qwen3 / Qwen3.5 families (SiLU was
used whatever it said: refused), Gemma 3's Hub key ``sliding_window_pattern`` (the pattern
fell back to 6: read now), and a ``partial_rotary_factor`` on Gemma 4's default-RoPE sliding
layers (transformers rotates the whole head there: so do we now)."""
import json
import shutil

import pytest
import torch

from dflash_server.errors import ModelLoadError
from helpers.build import pipeline, prompt_ids
from helpers.tiny import load_hf, make_tiny_model


def _parity(path, n=60):
    hf = load_hf(path)
    pipe = pipeline(path)
    ids = prompt_ids(pipe, n)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    ours = pipe.forward(ids, 0, logits="all").logits
    return (ours - ref).abs().max().item()


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_gemma_attention_bias_is_refused(tiny_dir, family):
    with pytest.raises((ValueError, ModelLoadError), match="attention_bias"):
        pipeline(tiny_dir(family, attention_bias=True))


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3", "llama"])
def test_an_activation_other_than_silu_is_refused(tiny_dir, family):
    with pytest.raises((ValueError, ModelLoadError), match="hidden_act"):
        pipeline(tiny_dir(family, hidden_act="gelu_pytorch_tanh"))


def test_gemma3_sliding_window_pattern_key(tiny_dir, tmp_path):
    path = tmp_path / "g3"
    shutil.copytree(tiny_dir("gemma3"), path)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["layer_types"]
    cfg["sliding_window_pattern"] = 3
    (path / "config.json").write_text(json.dumps(cfg))
    assert load_hf(path).config.layer_types == ["sliding_attention", "sliding_attention", "full_attention"] * 2
    assert pipeline(path).config.layer_types == ("sliding_attention", "sliding_attention", "full_attention") * 2
    assert _parity(path) < 2e-3


def test_gemma4_sliding_layers_rotate_the_whole_head(tmp_path):
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            "full_attention": {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.25}}
    assert _parity(make_tiny_model("gemma4", tmp_path / "g4", rope_parameters=rope)) < 2e-3
