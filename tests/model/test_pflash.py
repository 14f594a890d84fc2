"""PFlash on tiny models: the drafter's scores against transformers' own attention
probabilities, and compression end to end (self:N, a drafter of another family)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_server.engine.generate import Engine, GenerationRequest
from dflash_server.errors import CompressionError
from dflash_server.pflash.compressor import Compressor, find_span
from dflash_server.pflash.scorer import PromptScorer
from dflash_server.pflash.select import SelectParams
from dflash_server.runtime.pipeline import build_pipeline
from dflash_server.runtime.placement import plan_placement
from dflash_server.weights.loader import open_model


def _pipe(path, dtype=torch.float32, quantize="dense", max_ctx=1024, stages=1):
    src = open_model(path)
    shards = plan_placement(src.config.num_layers, ["cpu"] * stages, None)
    return build_pipeline(src, shards, dtype=dtype, max_ctx=max_ctx, quantize=quantize, progress=False)


def _reference_scores(path, ids, n_layers):
    """max over the first n_layers layers and all heads of the last 8 rows' attention
    probabilities, mean over those rows: from transformers' eager attention."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        out = m(torch.tensor([ids]), output_attentions=True)
    att = [a for a in out.attentions[:n_layers] if a is not None]
    return torch.stack([a[0, :, -8:, :] for a in att]).amax(dim=(0, 1)).mean(0).double().numpy()


@pytest.mark.parametrize("family,n_layers", [("llama", 3), ("qwen3", 2), ("gemma3", 5)])
def test_scores_match_transformers_attention(tiny_dir, family, n_layers):
    """gemma3 with 5 layers: sliding layers (window 24 < the prompt) and a full one."""
    path = tiny_dir(family)
    pipe = _pipe(path)
    ids = torch.randint(10, 30000, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    scorer = PromptScorer.from_stage(pipe.stages[0], n_layers, chunk=48)   # several prefill chunks first
    got = scorer.score(ids)
    want = _reference_scores(path, ids, n_layers)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-4)


def test_scorer_on_a_hybrid_model_and_layer_ranges(tiny_dir):
    pipe = _pipe(tiny_dir("qwen3_5"))
    kinds = [layer.new_state(1, "meta", torch.float32).kind for layer in pipe.stages[0].layers]
    first_attn = kinds.index("kv")
    with pytest.raises(ValueError, match="no attention layer"):
        PromptScorer.from_stage(pipe.stages[0], first_attn)     # only Gated DeltaNet layers
    scorer = PromptScorer.from_stage(pipe.stages[0], first_attn + 1)
    s = scorer.score(list(range(100, 180)))
    assert s.shape == (80,) and np.isfinite(s).all() and s.sum() > 0
    for bad in (0, len(pipe.stages[0].layers) + 1):
        with pytest.raises(ValueError):
            PromptScorer.from_stage(pipe.stages[0], bad)


def _needle_prompt(tok, n_filler=60):
    rng = np.random.default_rng(0)
    words = "the a house river blue green walked ran under over bright dark cold old new city".split()
    lines = [" ".join(rng.choice(words, 10)) + "." for _ in range(n_filler)]
    lines.insert(n_filler // 2, "The magic number of the vault is 90210.")
    question = "What is the magic number of the vault?"
    text = " ".join(lines) + "\n" + question
    return tok.encode(text), question


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_self_drafter_keeps_an_anchored_needle_and_counts_the_raw_prompt(tiny_dir, family):
    pipe = _pipe(tiny_dir(family), torch.bfloat16, "int8")
    n_attn = [layer.new_state(1, "meta", torch.float32).kind for layer in pipe.stages[0].layers].index("kv") + 1
    comp = Compressor(PromptScorer.from_stage(pipe.stages[0], n_attn, chunk=256), pipe.tokenizer,
                      SelectParams(head_chunks=1, tail_chunks=2))
    eng = Engine(pipe, compressor=comp)
    ids, question = _needle_prompt(pipe.tokenizer)
    res = eng.generate(GenerationRequest(tuple(ids), max_tokens=4, ignore_eos=True, compress=0.1,
                                         compress_query=question))
    pf = res.extra["pflash"]
    assert res.prompt_tokens == len(ids) and pf["raw_tokens"] == len(ids)
    assert pf["compressed_tokens"] < len(ids) // 3 and pf["anchor_chunks"] >= 1
    kept = comp.compress(ids, 0.1, question).ids
    assert _is_subsequence(kept, ids)
    needle = pipe.tokenizer.encode(" 90210.", add_bos=False)
    assert find_span(kept, needle) is not None            # the needle survived
    assert comp.stats()["calls"] == 2
    # the same compressed prompt, prefilled plainly, decodes the same tokens
    plain = Engine(_pipe(tiny_dir(family), torch.bfloat16, "int8"))
    assert plain.generate(GenerationRequest(tuple(kept), max_tokens=4, ignore_eos=True)).token_ids == res.token_ids


def _is_subsequence(sub, seq):
    it = iter(seq)
    return all(any(x == y for y in it) for x in sub)


def test_kept_ids_are_a_subsequence_in_order(tiny_dir):
    pipe = _pipe(tiny_dir("llama"))
    comp = Compressor(PromptScorer.from_stage(pipe.stages[0], 2), pipe.tokenizer, SelectParams(chunk=8))
    ids = torch.randint(10, 40000, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    c = comp.compress(ids, 0.25)
    assert _is_subsequence(c.ids, ids) and len(c.ids) < len(ids)
    assert [s for s, _ in c.selection.spans] == sorted(s for s, _ in c.selection.spans)


def test_cross_family_drafter_file(tiny_dir):
    """A qwen3 drafter (its own tokenizer) compresses for a llama target: the prompt goes
    through text; the needle sentence's text survives."""
    pipe = _pipe(tiny_dir("llama"), torch.bfloat16, "int8")
    scorer = PromptScorer.load(str(tiny_dir("qwen3")), device="cpu", dtype=torch.float32, max_ctx=1024, n_layers=2)
    assert scorer.tokenizer is not None and len(scorer.layers) == 2
    comp = Compressor(scorer, pipe.tokenizer, SelectParams(head_chunks=1, tail_chunks=2))
    assert not comp.same_vocab
    ids, question = _needle_prompt(pipe.tokenizer)
    eng = Engine(pipe, compressor=comp)
    res = eng.generate(GenerationRequest(tuple(ids), max_tokens=3, ignore_eos=True, compress=0.1,
                                         compress_query=question))
    pf = res.extra["pflash"]
    assert pf["drafter_tokens"] != pf["raw_tokens"]          # read in the drafter's own vocabulary
    assert pf["compressed_tokens"] < len(ids) // 3
    text = pipe.tokenizer.decode(comp.compress(ids, 0.1, question).ids)
    assert "90210" in text and text.rstrip().endswith(question)


def test_drafter_errors_are_clear(tiny_dir):
    pipe = _pipe(tiny_dir("llama"), max_ctx=256)
    with pytest.raises(ValueError, match="needs a drafter"):
        Engine(pipe).submit(GenerationRequest((1, 2, 3), max_tokens=2, compress=0.5))
    with pytest.raises(ValueError):
        GenerationRequest((1, 2, 3), max_tokens=2, compress=1.5)
    small = PromptScorer.load(str(tiny_dir("qwen3")), device="cpu", dtype=torch.float32, max_ctx=64, n_layers=1)
    assert small.max_tokens == 1024           # its trained length: more than the 64 asked for
    eng = Engine(pipe, compressor=Compressor(small, pipe.tokenizer))
    ids, _ = _needle_prompt(pipe.tokenizer, 20)
    with pytest.raises(ValueError, match="drafter reads at most 1024"):   # the target's count, at submit
        eng.submit(GenerationRequest(tuple(ids * 8)[:1100], max_tokens=2, compress=0.5))
    text_ids = pipe.tokenizer.encode(" 7" * 1000, add_bos=False)   # fewer target tokens than drafter ones
    if len(text_ids) <= 1024:
        with pytest.raises(ValueError, match="drafter tokens; the drafter reads at most 1024"):
            eng.generate(GenerationRequest(tuple(text_ids), max_tokens=2, compress=0.5))

    class Broken:
        tokenizer, name, layers, last_s, max_tokens = None, "broken", [None], 0.0, 4096

        def score(self, ids):
            raise RuntimeError("device lost")
    eng = Engine(pipe, compressor=Compressor(Broken(), pipe.tokenizer))
    with pytest.raises(CompressionError, match="PFlash compression failed: RuntimeError: device lost"):
        eng.generate(GenerationRequest(tuple(ids[:100]), max_tokens=2, compress=0.5))
    # the engine goes on serving afterwards
    assert len(eng.generate(GenerationRequest(tuple(ids[:20]), max_tokens=2, ignore_eos=True)).token_ids) == 2


def test_drafter_in_a_shard_worker_scores_as_in_process(tiny_dir):
    from dflash_server.pflash.remote import RemoteScorer
    from dflash_server.runtime.worker_link import RemoteOptions

    path = str(tiny_dir("qwen3"))
    local = PromptScorer.load(path, device="cpu", dtype=torch.float32, max_ctx=1024, n_layers=2)
    remote = RemoteScorer(path, device="cpu", dtype=torch.float32, max_ctx=1024, options=RemoteOptions(timeout_s=60),
                          n_layers=2)
    try:
        assert remote.max_tokens == local.max_tokens and len(remote.layers) == 2
        ids = torch.randint(10, 30000, (120,), generator=torch.Generator().manual_seed(3)).tolist()
        np.testing.assert_array_equal(remote.score(ids), local.score(ids))
        pipe = _pipe(tiny_dir("llama"))
        a = Compressor(remote, pipe.tokenizer).compress(_needle_prompt(pipe.tokenizer)[0], 0.2)
        b = Compressor(local, pipe.tokenizer).compress(_needle_prompt(pipe.tokenizer)[0], 0.2)
        assert a.ids == b.ids
        with pytest.raises(ValueError, match="token ids must be in"):
            remote.link.call("pflash_score", {}, {"ids": torch.tensor([10 ** 9], dtype=torch.int64)})
        with pytest.raises(ValueError, match="non-empty 1-D int64"):
            remote.link.call("pflash_score", {}, {"ids": torch.zeros(2, 2, dtype=torch.int64)})
        assert remote.score(ids[:50]).shape == (50,)   # the worker serves on after bad requests
    finally:
        remote.close()
