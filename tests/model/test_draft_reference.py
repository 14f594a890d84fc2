"""The DFlash draft against the authors' reference implementation (PyPI ``dflash`` 0.1.0,
its ``model.py``; a test-only dependency installed without its own dependencies): the same
random checkpoint gives the same draft hidden states and logits for every config option the
reference reads, and configs it cannot mean the same thing for are refused."""
from __future__ import annotations

import pytest
import torch

from dflash_server.spec.config import DraftConfig
from dflash_server.spec.draft import DFlashDraft

import dflash.model as ref  # noqa: E402  (the README's test command installs it: --no-deps dflash==0.1.0)


def _reference(**extra):
    from transformers import Qwen3Config

    dflash_cfg = {"mask_token_id": 5, "block_size": 8, **extra.pop("dflash_config", {})}
    cfg = Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=512,
                      rms_norm_eps=1e-6, rope_theta=10000.0, **extra)
    cfg.num_target_layers = 12
    cfg.dflash_config = dflash_cfg
    cfg.architectures = ["DFlashDraftModel"]
    torch.manual_seed(0)
    model = ref.DFlashDraftModel(cfg).eval()
    with torch.no_grad():   # random norms and biases too: every weight matters
        for p in model.parameters():
            p.add_(torch.randn(p.shape) * 0.05)
    return model, cfg


CASES = {
    "full": {},
    "sliding causal": {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                       "sliding_window": 5},
    "sliding non-causal": {"layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
                           "sliding_window": 3, "is_causal": False},
    "causal": {"is_causal": True},
    "attention bias": {"attention_bias": True},
    "taps given": {"dflash_config": {"target_layer_ids": [2, 7]}},
}


@pytest.mark.parametrize("case", list(CASES))
def test_hidden_states_equal_the_reference(case):
    model, cfg = _reference(**{k: v for k, v in CASES[case].items()})
    ours_cfg = DraftConfig.from_dict(cfg.to_dict())
    assert list(ours_cfg.target_layer_ids) == list(model.target_layer_ids)
    tensors = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ours = DFlashDraft(ours_cfg, tensors, "cpu", torch.float32, 128)
    S, B, H = 11, 8, 64
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(1, S, len(model.target_layer_ids) * H, generator=g)
    noise = torch.randn(1, B, H, generator=g)
    with torch.no_grad():
        want = model(position_ids=torch.arange(S + B)[None], noise_embedding=noise, target_hidden=feats)
    ours.append_context(feats, 0)
    got = ours.draft_hidden(noise, S)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_default_taps_block_size_and_logit_shaping():
    model, cfg = _reference(dflash_config={"output_multiplier": 0.5, "final_logit_softcapping": 3.0,
                                           "input_embedding_scale": 2.5})
    d = cfg.to_dict()
    d["dflash_config"].pop("block_size")
    ours = DraftConfig.from_dict(d)
    assert list(ours.target_layer_ids) == list(model.target_layer_ids) == [1, 5, 9]   # one per draft layer
    cfg.dflash_config = {k: v for k, v in cfg.dflash_config.items() if k != "block_size"}
    assert ours.block_size == ref.DFlashDraftModel(cfg).block_size == 16
    assert ours.input_embedding_scale == 2.5
    head = torch.nn.Linear(64, 128, bias=False)
    hidden = torch.randn(1, 4, 64)
    with torch.no_grad():
        torch.testing.assert_close(ours.shape_logits(head(hidden)), model.compute_logits(hidden, head))
    assert DraftConfig.from_dict(ours.to_dict()) == ours


@pytest.mark.parametrize("arch,needle", [("DFlash2DraftModel", "DFlash 2"), ("LlamaForCausalLM", "unknown architecture")])
def test_other_architectures_are_refused(arch, needle):
    _, cfg = _reference()
    d = cfg.to_dict()
    d["architectures"] = [arch]
    with pytest.raises(ValueError, match=needle):
        DraftConfig.from_dict(d)
