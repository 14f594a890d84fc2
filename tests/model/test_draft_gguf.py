"""DFlash drafts from GGUF (the reference converter's format): same config and outputs as the
safetensors draft, lossless speculative decoding, and clear errors for bad files."""
import gguf
import pytest
import torch

from dflash_server.engine.generate import Engine, GenerationRequest
from dflash_server.spec.config import DraftConfig
from dflash_server.spec.draft import DFlashDraft
from dflash_server.spec.draft_gguf import load_gguf_draft
from dflash_server.spec.proposer import DFlashProposer
from helpers.build import pipeline, prompt_ids
from helpers.draft_gguf_export import export_draft_gguf

Q = gguf.GGMLQuantizationType


def draft_cfg(H=64, taps=(1, 2), layers=2, attention=((True, 8), (False, None)), **kw):
    return DraftConfig(hidden_size=H, intermediate_size=96, num_layers=layers, num_heads=4, num_kv_heads=2,
                       head_dim=16, block_size=8, mask_token_id=5, target_layer_ids=tuple(taps),
                       rms_norm_eps=1e-6, rope_theta=1e6, layer_attention=attention, **kw)


def rounded(tensors, dtype):
    """Weights exactly representable in ``dtype`` (so an F16/BF16 file holds the same weights)."""
    return {k: v.to(dtype).float() for k, v in tensors.items()}


def hidden_states(draft, seed=0, n_ctx=20):
    g = torch.Generator().manual_seed(seed)
    H, taps, B = draft.cfg.hidden_size, draft.cfg.num_taps, draft.cfg.block_size
    draft.reset()
    draft.append_context(torch.randn(1, n_ctx, taps * H, generator=g), 0)
    return draft.draft_hidden(torch.randn(1, B, H, generator=g), n_ctx)


def run(pipe, ids, proposer=None, **kw):
    return Engine(pipe, proposer=proposer).generate(GenerationRequest(tuple(ids), ignore_eos=True, **kw))


@pytest.mark.parametrize("qtype,style", [(Q.F32, "lucebox"), (Q.F16, "lucebox"), (Q.BF16, "lucebox"),
                                         (Q.F16, "llamacpp")])
def test_gguf_draft_equals_safetensors_draft(tmp_path, qtype, style):
    cfg = draft_cfg()
    t = DFlashDraft.random_tensors(cfg, seed=1, std=0.05)
    if qtype != Q.F32:
        t = rounded(t, torch.float16 if qtype == Q.F16 else torch.bfloat16)
    path = export_draft_gguf(cfg, t, tmp_path / "d.gguf", qtype_for=lambda n, s: qtype, style=style)
    got_cfg, got = load_gguf_draft(path)
    assert got_cfg == cfg
    assert got.keys() == t.keys()
    for k in t:
        assert got[k].shape == t[k].shape and torch.equal(got[k].float(), t[k]), k
    ref = DFlashDraft(cfg, t, "cpu", torch.float32, 64)
    loaded = DFlashDraft.load(path, "cpu", torch.float32, 64)  # the .gguf dispatch
    assert loaded.cfg == cfg
    torch.testing.assert_close(hidden_states(loaded), hidden_states(ref), atol=1e-3, rtol=0)


def test_q8_0_gguf_draft_is_close(tmp_path):
    cfg = draft_cfg(layers=3, taps=(0, 1, 2), attention=((True, 6), (True, 6), (False, None)))
    t = DFlashDraft.random_tensors(cfg, seed=2, std=0.05)
    mixed = {"dflash.fc.weight": Q.F16, "blk.1.attn_output.weight": Q.F32}  # the rest Q8_0
    path = export_draft_gguf(cfg, t, tmp_path / "q8.gguf", qtype_for=lambda n, s: mixed.get(n, Q.Q8_0))
    got_cfg, got = load_gguf_draft(path)
    assert got_cfg == cfg
    for k in t:  # Q8_0: 8-bit per 32-block, error <= scale/2 = absmax/254
        assert (got[k].float() - t[k]).abs().max() <= t[k].abs().max() / 250 + 1e-6, k
    a = hidden_states(DFlashDraft(cfg, got, "cpu", torch.float32, 64))
    b = hidden_states(DFlashDraft(cfg, t, "cpu", torch.float32, 64))
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.999
    assert (a - b).abs().max() < 0.05 * b.abs().max()


class RecordingProposer(DFlashProposer):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.proposals = []

    def propose(self, anchor, start, block):
        out = super().propose(anchor, start, block)
        self.proposals.append(list(out))
        return out


def test_speculative_decoding_with_gguf_draft_is_lossless(tiny_dir, tmp_path):
    pipe = pipeline(tiny_dir("llama"))
    cfg = draft_cfg(H=pipe.config.hidden_size, taps=(1, 2))
    t = DFlashDraft.random_tensors(cfg, seed=4, std=0.05)
    ids = prompt_ids(pipe, 16)
    ref = run(pipe, ids, max_tokens=16)
    drafts = {"mem": DFlashDraft(cfg, t, "cpu", torch.float32, pipe.max_ctx)}
    for name, qt in (("f32", Q.F32), ("q8", Q.Q8_0)):
        path = export_draft_gguf(cfg, t, tmp_path / f"{name}.gguf", qtype_for=lambda n, s, qt=qt: qt)
        drafts[name] = DFlashDraft.load(path, "cpu", torch.float32, pipe.max_ctx)
    props = {}
    for name, d in drafts.items():
        props[name] = RecordingProposer(d, pipe, block_size=6)
        res = run(pipe, ids, props[name], max_tokens=16)
        assert res.token_ids == ref.token_ids, name
        assert res.extra["spec"]["steps"] > 0
    # the GGUF draft proposes exactly what the in-memory draft does (F32), nearly so for Q8_0
    assert props["f32"].proposals == props["mem"].proposals
    flat = [(a, b) for pa, pb in zip(props["q8"].proposals, props["mem"].proposals) for a, b in zip(pa, pb)]
    assert len(props["q8"].proposals) == len(props["mem"].proposals)
    assert sum(a == b for a, b in flat) >= 0.8 * len(flat)


def test_missing_target_layer_ids(tmp_path):
    cfg = draft_cfg(taps=(1, 2))
    path = export_draft_gguf(cfg, DFlashDraft.random_tensors(cfg), tmp_path / "d.gguf",
                             drop_meta=("dflash.target_layer_ids",))
    with pytest.raises(ValueError, match="target_layer_ids"):
        load_gguf_draft(path)
    got, _ = load_gguf_draft(path, num_target_layers=36)  # the uniform rule, as for config.json
    assert got.target_layer_ids == (1, 33) and got.num_target_layers == 36


def test_sliding_window_metadata_variants(tmp_path):
    cfg = draft_cfg(layers=3, attention=((False, None),) * 3)
    t = DFlashDraft.random_tensors(cfg)
    # no pattern: all full attention (window alone does not make a layer sliding)
    p = export_draft_gguf(cfg, t, tmp_path / "a.gguf", extra_meta={"attention.sliding_window": 16})
    assert load_gguf_draft(p)[0].layer_attention == ((False, None),) * 3
    # llama.cpp's period form: every 3rd layer full
    p = export_draft_gguf(cfg, t, tmp_path / "b.gguf", extra_meta={"attention.sliding_window": 16,
                                                                   "attention.sliding_window_pattern": 3})
    assert load_gguf_draft(p)[0].layer_attention == ((True, 16), (True, 16), (False, None))


def _bad(tmp_path, **kw):
    cfg = kw.pop("cfg", draft_cfg())
    tensors = kw.pop("tensors", None) or DFlashDraft.random_tensors(cfg)
    return export_draft_gguf(cfg, tensors, tmp_path / "bad.gguf", **kw)


@pytest.mark.parametrize("make,match", [
    (lambda p: _bad(p, arch="qwen35"), "not a DFlash draft"),
    (lambda p: _bad(p, drop_meta=("dflash.block_size",)), "dflash.block_size"),
    (lambda p: _bad(p, drop_meta=("dflash.mask_token_id",)), "dflash.mask_token_id"),
    (lambda p: _bad(p, drop_meta=("embedding_length",)), "embedding_length"),
    (lambda p: _bad(p, drop_meta=("rope.freq_base",)), "rope.freq_base"),
    (lambda p: _bad(p, drop_tensors=("blk.1.ffn_gate.weight",)), "missing tensor blk.1.ffn_gate"),
    (lambda p: _bad(p, drop_tensors=("dflash.hidden_norm.weight",)), "missing tensor dflash.hidden_norm"),
    (lambda p: _bad(p, extra_meta={"feed_forward_length": 128}), r"blk.0.ffn_gate.weight has shape \(96, 64\)"),
    (lambda p: _bad(p, extra_meta={"attention.head_count": 8}), r"attn_q.weight has shape"),
    (lambda p: _bad(p, extra_meta={"attention.head_count_kv": 3}), "multiple of head_count_kv"),
    (lambda p: _bad(p, extra_meta={"dflash.target_layer_ids": [1, 2, 3]}), "3 target_layer_ids"),
    (lambda p: _bad(p, extra_meta={"attention.sliding_window_pattern": [True]}), "sliding_window_pattern"),
    (lambda p: _bad(p, extra_meta={"dflash.block_size": 1}), "block_size"),
    (lambda p: _bad(p, extra_meta={"dflash.target_hidden": 128}), "target hidden size"),
    (lambda p: _bad(p, extra_meta={"block_count": 1}), "more layers"),
    (lambda p: _bad(p, tensors={**DFlashDraft.random_tensors(draft_cfg()), "fc.weight": torch.zeros(64, 96)}),
     r"dflash.fc.weight has shape \(64, 96\)"),
])
def test_bad_draft_gguf_errors(tmp_path, make, match):
    path = make(tmp_path)
    with pytest.raises(ValueError, match=match):
        DFlashDraft.load(path, "cpu", torch.float32, 64)


def test_corrupt_and_truncated_files(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="not a valid GGUF"):
        DFlashDraft.load(junk, "cpu", torch.float32, 64)
    with pytest.raises(ValueError, match="no such file"):
        DFlashDraft.load(tmp_path / "absent.gguf", "cpu", torch.float32, 64)
    good = _bad(tmp_path)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(ValueError, match="truncated"):
        DFlashDraft.load(cut, "cpu", torch.float32, 64)

