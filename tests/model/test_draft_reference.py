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


def _reference(dflash2=False, vocab=128, hidden=64, n_target=12, **extra):
    """A reference draft with random weights and its config: DFlash 1 (3 layers, default
    init perturbed: norms and biases random too) or DFlash 2 (2 layers, every parameter
    set: its conv base kernels start uninitialized)."""
    from transformers import Qwen3Config

    dflash_cfg = {"mask_token_id": 5, "block_size": 8, **extra.pop("dflash_config", {})}
    if dflash2:
        dflash_cfg.update(conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=5)
    cfg = Qwen3Config(hidden_size=hidden, intermediate_size=96, num_hidden_layers=2 if dflash2 else 3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=vocab,
                      max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0, **extra)
    cfg.num_target_layers = n_target
    cfg.dflash_config = dflash_cfg
    cfg.architectures = ["DFlash2DraftModel" if dflash2 else "DFlashDraftModel"]
    torch.manual_seed(0)
    model = (ref.DFlash2DraftModel if dflash2 else ref.DFlashDraftModel)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if dflash2:
                p.copy_(torch.randn(p.shape) * 0.1 + (1.0 if "norm" in name else 0.0))
            else:
                p.add_(torch.randn(p.shape) * 0.05)
    return model, cfg


def _same_hidden(model, ours, S: int, B: int, seed: int):
    """Feed both drafts the same context features and block embeddings; (ours, reference)
    hidden states after checking they are equal, and the generator for more inputs."""
    H = model.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(1, S, len(model.target_layer_ids) * H, generator=g)
    noise = torch.randn(1, B, H, generator=g)
    with torch.no_grad():
        want = model(position_ids=torch.arange(S + B)[None], noise_embedding=noise, target_hidden=feats)
    ours.append_context(feats, 0)
    got = ours.draft_hidden(noise, S)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    return got, want, g


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
    _same_hidden(model, ours, 11, 8, 1)


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


@pytest.mark.parametrize("arch,needle", [("DFlash2DraftModel", "DFlash 2 draft config: no conv_kernel_size"),
                                         ("LlamaForCausalLM", "unknown architecture")])
def test_other_architectures_are_refused(arch, needle):
    """A DFlash 1 config labelled DFlash 2 lacks DFlash 2's fields: refused, never loaded as DFlash 1."""
    _, cfg = _reference()
    d = cfg.to_dict()
    d["architectures"] = [arch]
    with pytest.raises(ValueError, match=needle):
        DraftConfig.from_dict(d)


def _state(model):
    # the reference's checkpoints name the codebooks without ".weight" (its from_pretrained maps them)
    return {k.replace("_codebook.weight", "_codebook"): v.detach().clone() for k, v in model.state_dict().items()}


def test_dflash2_hidden_states_and_greedy_walk_equal_the_reference():
    model, cfg = _reference(True)
    ours_cfg = DraftConfig.from_dict(cfg.to_dict())
    assert ours_cfg.dflash2 and ours_cfg.selector_top_k == 5 and DraftConfig.from_dict(ours_cfg.to_dict()) == ours_cfg
    ours = DFlashDraft(ours_cfg, _state(model), "cpu", torch.float32, 128)
    B, H = 8, 64
    got, want, g = _same_hidden(model, ours, 9, B, 2)
    head = torch.nn.Linear(H, 128, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(128, H, generator=g))
        path, cands, _ = model.propose(want[:, 1:], torch.tensor([7]), head, 0.0)
        toks, our_cands, q = ours.selector.walk(got[0, 1:], ours_cfg.shape_logits(head(got[0, 1:])), None, 7)
    assert toks == path[0].tolist()
    assert [sorted(r) for r in our_cands.tolist()] == [sorted(r) for r in cands[0].tolist()] and q is None
    with torch.no_grad():
        toks, _, q = ours.selector.walk(got[0, 1:], head(got[0, 1:]), None, 7, 0.8, torch.Generator().manual_seed(0))
    assert q.shape == (B - 1, 5) and torch.allclose(q.sum(-1), torch.ones(B - 1))


def test_dflash2_draft_is_lossless_in_the_engine(tiny_dir):
    from helpers.build import pipeline, prompt_ids

    from dflash_server.engine.generate import Engine, GenerationRequest
    from dflash_server.engine.sampling import SamplingParams
    from dflash_server.spec.proposer import DFlashProposer

    pipe = pipeline(tiny_dir("llama"))
    c = pipe.config
    model, cfg = _reference(True, c.vocab_size, c.hidden_size, c.num_layers, dflash_config={"target_layer_ids": [1, 2]})
    draft = DFlashDraft(DraftConfig.from_dict(cfg.to_dict()), _state(model), "cpu", torch.float32, pipe.max_ctx)
    ids = prompt_ids(pipe, 20)
    req = GenerationRequest(tuple(ids), max_tokens=24, ignore_eos=True)
    plain = Engine(pipe).generate(req).token_ids
    spec = Engine(pipe, proposer=DFlashProposer(draft, pipe, block_size=4)).generate(req)
    assert spec.token_ids == plain and spec.extra["spec"]["steps"] > 0
    sampled = Engine(pipe, proposer=DFlashProposer(draft, pipe, block_size=4, sampled_verify="rejection")).generate(
        GenerationRequest(tuple(ids), SamplingParams(temperature=0.9, seed=1), max_tokens=16, ignore_eos=True))
    assert len(sampled.token_ids) == 16


def test_dflash2_config_needs_its_fields():
    _, cfg = _reference(True)
    d = cfg.to_dict()
    del d["dflash_config"]["selector_top_k"]
    with pytest.raises(ValueError, match="selector_top_k"):
        DraftConfig.from_dict(d)
    _, cfg = _reference(True)
    d = cfg.to_dict()
    d["dflash_config"]["conv_group_size"] = 7
    with pytest.raises(ValueError, match="divide"):
        DraftConfig.from_dict(d)


def test_dflash2_checkpoint_loads_here_and_is_refused_in_a_draft_worker(tiny_dir, tmp_path):
    import json

    from helpers.build import pipeline
    from safetensors.torch import save_file

    from dflash_server.runtime.worker_link import RemoteOptions
    from dflash_server.spec.proposer import DFlashProposer
    from dflash_server.spec.remote_draft import RemoteDraft

    pipe = pipeline(tiny_dir("llama"))
    c = pipe.config
    model, cfg = _reference(True, c.vocab_size, c.hidden_size, c.num_layers, dflash_config={"target_layer_ids": [1, 2]})
    d = tmp_path / "draft2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg.to_dict()))
    save_file({k: v.contiguous() for k, v in _state(model).items()}, str(d / "model.safetensors"))
    local = DFlashDraft.load(d, "cpu", torch.float32, pipe.max_ctx)
    assert local.cfg.dflash2 and local.selector is not None
    DFlashProposer(local, pipe)    # fine here
    remote = RemoteDraft(d, device="cpu", home="cpu", dtype=torch.float32, max_ctx=pipe.max_ctx,
                         options=RemoteOptions(timeout_s=60))
    try:
        with pytest.raises(ValueError, match="runs in this process only"):
            DFlashProposer(remote, pipe)
    finally:
        remote.close()
