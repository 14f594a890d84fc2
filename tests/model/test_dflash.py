"""DFlash speculative decoding: lossless vs plain decoding, oracle/random drafts, config
variants and clear errors."""
import json

import pytest
import torch

from dflash_server.engine.generate import Engine, GenerationRequest
from dflash_server.engine.sampling import SamplingParams
from dflash_server.spec.config import DraftConfig, default_target_layer_ids
from dflash_server.spec.draft import DFlashDraft
from dflash_server.spec.proposer import DFlashProposer
from helpers.build import pipeline, prompt_ids

from dflash_server import kernels

NATIVE = kernels.enabled() and kernels.load()  # quantized linears' mode: the native kernels by default
Q4, Q8 = ("native", "native") if NATIVE else ("int4", "int8")


def random_draft(pipe, block_size=8, taps=(1, 2), seed=0, layers=2, std=0.05):
    c = pipe.config
    # Gemma targets: their drafts scale the raw embedding rows as the target does (the z-lab
    # Gemma drafts' input_embedding_scale)
    cfg = DraftConfig(hidden_size=c.hidden_size, intermediate_size=96, num_layers=layers, num_heads=4,
                      num_kv_heads=2, head_dim=16, block_size=block_size, mask_token_id=5,
                      target_layer_ids=tuple(taps), num_target_layers=c.num_layers,
                      input_embedding_scale=c.hidden_size ** 0.5 if c.embed_scale else 1.0)
    return DFlashDraft(cfg, DFlashDraft.random_tensors(cfg, seed, std), "cpu", torch.float32, pipe.max_ctx)


def run(pipe, ids, proposer=None, **kw):
    kw.setdefault("ignore_eos", True)
    return Engine(pipe, proposer=proposer).generate(GenerationRequest(tuple(ids), **kw))


class OracleProposer(DFlashProposer):
    """Proposes the target's own greedy continuation (known in advance)."""

    def __init__(self, draft, pipe, block_size, prompt, continuation):
        super().__init__(draft, pipe, block_size)
        self.seq = list(prompt) + list(continuation)

    def propose(self, anchor, start, block):
        return [self.seq[start + 1 + i] if start + 1 + i < len(self.seq) else 0 for i in range(block - 1)]


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5", "gemma3", "gemma4_moe", "gemma4_e", "laguna"])
@pytest.mark.parametrize("stages", [1, 2])
def test_greedy_lossless_across_block_sizes(tiny_dir, family, stages):
    pipe = pipeline(tiny_dir(family), stages=stages)
    ids = prompt_ids(pipe, 30)
    ref = run(pipe, ids, max_tokens=40).token_ids
    for block in (2, 3, 8):
        prop = DFlashProposer(random_draft(pipe, block_size=8), pipe, block_size=block)
        res = run(pipe, ids, prop, max_tokens=40)
        assert res.token_ids == ref, (family, stages, block)
        spec = res.extra["spec"]
        assert spec["steps"] > 0 and 1.0 <= spec["acceptance_length"] <= block


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_oracle_draft_accepts_whole_blocks(tiny_dir, family):
    pipe = pipeline(tiny_dir(family))
    ids = prompt_ids(pipe, 20)
    ref = run(pipe, ids, max_tokens=33).token_ids
    block = 8
    prop = OracleProposer(random_draft(pipe), pipe, block, ids, ref)
    res = run(pipe, ids, prop, max_tokens=33)
    assert res.token_ids == ref
    spec = res.extra["spec"]
    # 1 token from prefill + 4 full blocks of 8 = 33
    assert spec["steps"] == 4 and spec["acceptance_length"] == block and spec["accept_rate"] == 1.0
    assert spec["accept_histogram"][block - 1] == 4


def test_random_draft_still_exact_and_mostly_rejected(tiny_dir):
    pipe = pipeline(tiny_dir("llama"))
    ids = prompt_ids(pipe, 20)
    ref = run(pipe, ids, max_tokens=24).token_ids
    res = run(pipe, ids, DFlashProposer(random_draft(pipe, seed=3), pipe), max_tokens=24)
    assert res.token_ids == ref
    assert res.extra["spec"]["acceptance_length"] < 2.0


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 9, 13])
def test_max_tokens_and_stop_strings_mid_block(tiny_dir, max_tokens):
    pipe = pipeline(tiny_dir("qwen3_5"))
    ids = prompt_ids(pipe, 16)
    ref = run(pipe, ids, max_tokens=40)
    prop = OracleProposer(random_draft(pipe), pipe, 8, ids, ref.token_ids)
    res = run(pipe, ids, prop, max_tokens=max_tokens)
    assert res.token_ids == ref.token_ids[:max_tokens] and res.finish_reason == "length"
    text = ref.text
    stop = text[10:13]
    plain = run(pipe, ids, max_tokens=40, stop=(stop,))
    spec = run(pipe, ids, OracleProposer(random_draft(pipe), pipe, 8, ids, ref.token_ids), max_tokens=40,
               stop=(stop,))
    assert spec.text == plain.text == text[:text.index(stop)]
    assert spec.token_ids == plain.token_ids and spec.finish_reason == "stop"


def test_eos_mid_block(tiny_dir):
    pipe = pipeline(tiny_dir("llama"))
    ids = prompt_ids(pipe, 16)
    ref = run(pipe, ids, max_tokens=30).token_ids
    stop_tok = ref[6]
    plain = run(pipe, ids, max_tokens=30, stop_token_ids=(stop_tok,), ignore_eos=False)
    spec = run(pipe, ids, OracleProposer(random_draft(pipe), pipe, 8, ids, ref), max_tokens=30,
               stop_token_ids=(stop_tok,), ignore_eos=False)
    assert spec.token_ids == plain.token_ids == ref[:ref.index(stop_tok) + 1]


def test_cancellation_mid_generation(tiny_dir):
    pipe = pipeline(tiny_dir("llama"))
    ids = prompt_ids(pipe, 16)
    seen = []
    res = Engine(pipe, proposer=DFlashProposer(random_draft(pipe), pipe)).generate(
        GenerationRequest(tuple(ids), max_tokens=50, ignore_eos=True), on_event=seen.append,
        cancelled=lambda: len(seen) >= 5)
    assert res.finish_reason == "cancelled" and 5 <= res.completion_tokens < 50


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_seeded_sampling_identical_to_plain(tiny_dir, family):
    """Every emitted token is drawn from the target distribution with the request's RNG,
    one draw per token, so even sampled output matches plain decoding for a fixed seed."""
    pipe = pipeline(tiny_dir(family))
    ids = prompt_ids(pipe, 16)
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, repetition_penalty=1.1, seed=11)
    ref = run(pipe, ids, max_tokens=30, sampling=params).token_ids
    greedy_ref = run(pipe, ids, max_tokens=30).token_ids
    prop = OracleProposer(random_draft(pipe), pipe, 6, ids, greedy_ref)
    assert run(pipe, ids, prop, max_tokens=30, sampling=params).token_ids == ref


def _exact_joint_23(pipe, ids, params):
    """The target's exact distribution of the 2nd and 3rd sampled tokens (the 1st, from
    the prefill, summed out): the tokens a verify step decides when max_tokens is 3."""
    from dflash_server.engine.sampling import Sampler

    probe = Sampler(SamplingParams(**params), pipe.config.vocab_size, "cpu")

    def dist(prefix):
        pipe.reset()
        return probe.probs(pipe.prefill(prefix).logits[-1])
    exact = {}
    p1 = dist(ids)
    for t1 in p1.nonzero().flatten().tolist():
        p2 = dist(ids + [t1])
        for t2 in p2.nonzero().flatten().tolist():
            p3 = dist(ids + [t1, t2])
            for t3 in p3.nonzero().flatten().tolist():
                exact[(t2, t3)] = exact.get((t2, t3), 0.0) + float(p1[t1] * p2[t2] * p3[t3])
    return exact, p1


def _chi2_of_runs(pipe, ids, prop, params, exact, n=600):
    counts, proposed, accepted = {}, 0, 0
    for seed in range(n):
        res = run(pipe, ids, prop, max_tokens=3, sampling=SamplingParams(seed=seed, **params))
        toks = tuple(res.token_ids[1:])
        assert toks in exact
        counts[toks] = counts.get(toks, 0) + 1
        proposed += res.extra["spec"]["proposed"]
        accepted += res.extra["spec"]["accepted"]
    cells = [(k, p) for k, p in exact.items() if n * p >= 5]      # chi-square wants >= 5 expected
    rest = sum(p for k, p in exact.items() if n * p < 5)
    chi2 = sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in cells)
    if rest > 0:
        got = n - sum(counts.get(k, 0) for k, _ in cells)
        chi2 += (got - n * rest) ** 2 / (n * rest)
    dof = len(cells) - (0 if rest > 0 else 1)
    return chi2, dof, proposed, accepted, counts


def chi2_999(dof: int) -> float:
    """99.9th percentile of chi-square with ``dof`` degrees of freedom (Wilson-Hilferty;
    within 0.5% of the exact value from 5 degrees up: 15 -> 37.84 vs 37.70)."""
    z = 3.0902
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


def test_sampled_distribution_matches_target(tiny_dir):
    """Statistical check of exact-match verification (seeded requests): the joint
    distribution of the 2nd and 3rd sampled tokens (decided by a verify block of 2: one
    draft, then the bonus token or a plain step) matches the target's exact distribution
    (computed from its logits), over 600 seeds. Chi-square goodness of fit at the 99.9th
    percentile; cells under 5 expected counts are pooled."""
    pipe = pipeline(tiny_dir("llama"))
    ids = prompt_ids(pipe, 10)
    params = dict(temperature=1.5, top_k=3)
    exact, _ = _exact_joint_23(pipe, ids, params)
    greedy_ref = run(pipe, ids, max_tokens=4).token_ids
    prop = OracleProposer(random_draft(pipe), pipe, 4, ids, greedy_ref)
    chi2, dof, proposed, accepted, counts = _chi2_of_runs(pipe, ids, prop, params, exact)
    assert chi2 < chi2_999(dof), (chi2, dof, counts)
    assert proposed > 0


class MixProposer(DFlashProposer):
    """Rejection-sampling drafts from a q close to the target's: 0.7 on its greedy
    continuation, 0.3 spread over ``spread`` tokens."""

    def __init__(self, draft, pipe, block_size, prompt, continuation, spread):
        super().__init__(draft, pipe, block_size, sampled_verify="rejection")
        self.seq, self.spread = list(prompt) + list(continuation), list(spread)

    def propose_sampled(self, anchor, start, block, sampling, generator):
        V = self.pipeline.config.vocab_size
        q = torch.zeros(block - 1, V)
        for i in range(block - 1):
            q[i, self.spread] = 0.3 / len(self.spread)
            q[i, self.seq[start + 1 + i] if start + 1 + i < len(self.seq) else 0] += 0.7
        return torch.multinomial(q, 1, generator=generator)[:, 0].tolist(), q


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_rejection_sampling_matches_target_distribution(tiny_dir, family):
    """As above, with drafts drawn from a q and kept by rejection sampling (unseeded
    requests' path): drafts are both kept and rejected, the tokens' joint distribution is
    the target's exact one, and a hybrid model's recurrent state follows each rollback."""
    pipe = pipeline(tiny_dir(family))
    ids = prompt_ids(pipe, 10)
    params = dict(temperature=1.5, top_k=3)
    exact, p1 = _exact_joint_23(pipe, ids, params)
    greedy_ref = run(pipe, ids, max_tokens=4).token_ids
    spread = sorted({t for pair in exact for t in pair})
    prop = MixProposer(random_draft(pipe), pipe, 4, ids, greedy_ref, spread)
    chi2, dof, proposed, accepted, counts = _chi2_of_runs(pipe, ids, prop, params, exact)
    assert chi2 < chi2_999(dof), (chi2, dof, counts)
    assert 0 < accepted < proposed


def test_seeded_and_unseeded_requests_choose_their_verification(tiny_dir):
    pipe = pipeline(tiny_dir("llama"))
    prop = DFlashProposer(random_draft(pipe), pipe)
    assert prop.rejection_sampling(SamplingParams(temperature=0.8))
    assert not prop.rejection_sampling(SamplingParams(temperature=0.8, seed=3))   # repeats plain decoding
    assert not prop.rejection_sampling(SamplingParams())                          # greedy
    assert DFlashProposer(random_draft(pipe), pipe, sampled_verify="rejection").rejection_sampling(
        SamplingParams(temperature=0.8, seed=3))
    assert not DFlashProposer(random_draft(pipe), pipe, sampled_verify="exact").rejection_sampling(
        SamplingParams(temperature=0.8))
    with pytest.raises(ValueError):
        DFlashProposer(random_draft(pipe), pipe, sampled_verify="sometimes")
    # the draft's own sampled proposals: tokens in the vocabulary, q rows are distributions
    ids = prompt_ids(pipe, 12)
    pipe.reset()
    prop.add_context(pipe.prefill(ids, capture=prop.taps).captures, 0, len(ids))
    toks, q = prop.propose_sampled(ids[-1], len(ids), 5, SamplingParams(temperature=0.9),
                                   torch.Generator().manual_seed(0))
    assert len(toks) == 4 and q.shape == (4, pipe.config.vocab_size)
    assert torch.allclose(q.sum(-1), torch.ones(4), atol=1e-4) and all(q[i, t] > 0 for i, t in enumerate(toks))
    # truncated as the target's p is: at most top_k tokens per row, each drawn from them
    toks, q = prop.propose_sampled(ids[-1], len(ids), 5, SamplingParams(temperature=0.9, top_k=3),
                                   torch.Generator().manual_seed(0))
    assert ((q > 0).sum(-1) <= 3).all() and all(q[i, t] > 0 for i, t in enumerate(toks))
    toks, q = prop.propose_sampled(ids[-1], len(ids), 5, SamplingParams(temperature=0.9, top_p=0.5),
                                   torch.Generator().manual_seed(0))
    full = prop.propose_sampled(ids[-1], len(ids), 5, SamplingParams(temperature=0.9), torch.Generator())[1]
    for row, ref_row in zip(q, full):   # the kept tokens are the most likely ones, the fewest reaching 0.5
        kept = row > 0
        assert ref_row[kept].sum() >= 0.5 - 1e-5 and ref_row[kept].min() >= ref_row[~kept].max()
    res = run(pipe, ids, prop, max_tokens=12, sampling=SamplingParams(temperature=0.9))   # unseeded: rejection
    assert len(res.token_ids) == 12


def test_config_variants_parse():
    base = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16}
    a = DraftConfig.from_dict({**base, "block_size": 16, "rope_theta": 1e6,
                               "dflash_config": {"mask_token_id": 7, "target_layer_ids": [1, 2]}})
    assert a.block_size == 16 and a.rope_theta == 1e6 and a.target_layer_ids == (1, 2)
    b = DraftConfig.from_dict({**base, "rope_parameters": {"rope_theta": 1e7, "rope_type": "default"},
                               "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
                               "sliding_window": 32,
                               "dflash_config": {"block_size": 8, "mask_token_id": 7, "target_layer_ids": [0]}})
    assert b.block_size == 8 and b.rope_theta == 1e7 and b.rope_scaling is None
    assert b.layer_attention == ((True, 32), (True, 32), (False, None))
    c = DraftConfig.from_dict({**base, "block_size": 4, "num_target_layers": 36,
                               "dflash_config": {"mask_token_id": 7}})
    # one tap per draft layer (the reference's build_target_layer_ids), unless num_target_features says
    assert c.target_layer_ids == (1, 17, 33) == default_target_layer_ids(36, 3)
    c5 = DraftConfig.from_dict({**base, "num_target_layers": 36,
                                "dflash_config": {"mask_token_id": 7, "num_target_features": 5}})
    assert c5.target_layer_ids == (1, 9, 17, 25, 33) and c5.block_size == 16   # the reference's default block
    d = DraftConfig.from_dict({**base, "block_size": 4, "dflash_config": {"mask_token_id": 7, "causal": True,
                                                                          "target_layer_ids": [1]}})
    assert all(causal for causal, _ in d.layer_attention)
    assert DraftConfig.from_dict(a.to_dict()) == a
    for bad in ({**base}, {**base, "block_size": 4}, {**base, "block_size": 1, "dflash_config": {"mask_token_id": 1}}):
        with pytest.raises(ValueError):
            DraftConfig.from_dict(bad)


def test_draft_target_mismatch_errors(tiny_dir, tmp_path):
    from safetensors.torch import save_file

    pipe = pipeline(tiny_dir("llama"))
    with pytest.raises(ValueError, match="target_layer_ids"):
        DFlashProposer(random_draft(pipe, taps=(1, 9)), pipe)
    cfg = DraftConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=16, block_size=4, mask_token_id=5, target_layer_ids=(1,))
    with pytest.raises(ValueError, match="hidden_size"):
        DFlashProposer(DFlashDraft(cfg, DFlashDraft.random_tensors(cfg), "cpu", torch.float32, 64), pipe)
    # a checkpoint whose tensors do not match its config
    d = tmp_path / "draft"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg.to_dict()))
    t = DFlashDraft.random_tensors(cfg)
    t["fc.weight"] = torch.zeros(32, 64)
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="fc.weight"):
        DFlashDraft.load(d, "cpu", torch.float32, 64)


def test_save_load_round_trip(tiny_dir, tmp_path):
    from safetensors.torch import save_file

    pipe = pipeline(tiny_dir("llama"))
    draft = random_draft(pipe, seed=4)
    (tmp_path / "config.json").write_text(json.dumps(draft.cfg.to_dict()))
    save_file(draft.zlab_state_dict(), str(tmp_path / "model.safetensors"))
    again = DFlashDraft.load(tmp_path, "cpu", torch.float32, pipe.max_ctx)
    ids = prompt_ids(pipe, 12)
    a = run(pipe, ids, DFlashProposer(draft, pipe), max_tokens=12)
    b = run(pipe, ids, DFlashProposer(again, pipe), max_tokens=12)
    assert a.extra["spec"] == b.extra["spec"]


def test_fast_int4_draft_head_is_lossless(tiny_dir):
    """The draft's own int4 LM head (CPU, bf16) only changes proposals, never the output."""
    pipe = pipeline(tiny_dir("llama"), dtype=torch.bfloat16)
    ids = prompt_ids(pipe, 20)
    ref = run(pipe, ids, max_tokens=24).token_ids
    draft = random_draft(pipe)
    prop = DFlashProposer(draft, pipe, block_size=4)
    assert prop.head is not None and prop.head.mode == Q4
    assert run(pipe, ids, prop, max_tokens=24).token_ids == ref
    assert DFlashProposer(draft, pipe, fast_head=False).head is None


def with_vocab(draft, ids):
    """The same draft, proposing only ``ids``."""
    t = {**draft.zlab_state_dict(), "vocab_ids": torch.as_tensor(ids)}
    return DFlashDraft(draft.cfg, t, "cpu", draft.dtype, draft.max_ctx)


@pytest.mark.parametrize("dtype,stages", [(torch.float32, 1), (torch.float32, 2), (torch.bfloat16, 1)])
def test_draft_vocab_restricts_proposals_and_stays_lossless(tiny_dir, dtype, stages):
    """A draft with ``vocab_ids`` proposes exactly the best of those tokens under the full
    head's logits (fp32: dense head of those rows), never another token, and the output is
    still plain decoding's; in bf16 on a CPU its own head is int4 with only those rows."""
    pipe = pipeline(tiny_dir("llama"), stages=stages, dtype=dtype)
    V = pipe.config.vocab_size
    ids = prompt_ids(pipe, 20)
    ref = run(pipe, ids, max_tokens=30).token_ids
    full = random_draft(pipe, seed=2)
    vocab = torch.randperm(V, generator=torch.Generator().manual_seed(1))[:V // 3].sort().values
    vocab = torch.unique(torch.cat([vocab, torch.tensor(ref[:10])]))   # some proposals can be right
    draft = with_vocab(full, vocab)
    prop = DFlashProposer(draft, pipe, block_size=4)
    assert prop.head.out_features == len(prop.head_ids) and set(prop.head_ids.tolist()) == set(vocab.tolist())
    assert prop.head.mode == (Q4 if dtype == torch.bfloat16 else "dense")
    res = run(pipe, ids, prop, max_tokens=30)
    assert res.token_ids == ref and res.extra["spec"]["steps"] > 0
    # the proposals: argmax over the vocabulary's columns of the pipeline's own head
    pipe.reset()
    feats = pipe.prefill(ids, capture=prop.taps).captures
    prop.reset()
    prop.add_context(feats, 0)
    got = prop.propose(ids[-1], len(ids), 4)
    if dtype == torch.float32:
        emb = pipe.embed(torch.tensor([[ids[-1]] + [prop.mask_id] * 3]))
        logits = pipe.project(draft.draft_hidden(emb, len(ids))[:, 1:])[0, :, :V]
        assert got == vocab[logits[:, vocab].argmax(-1)].tolist()
    assert len(got) == 3 and set(got) <= set(vocab.tolist())


def test_draft_vocab_checked_and_round_trips(tiny_dir, tmp_path):
    from safetensors.torch import save_file

    pipe = pipeline(tiny_dir("llama"))
    V = pipe.config.vocab_size
    draft = random_draft(pipe, seed=4)
    assert draft.vocab_ids is None and "vocab_ids" not in draft.zlab_state_dict()
    (tmp_path / "config.json").write_text(json.dumps(draft.cfg.to_dict()))
    for bad, match in [(torch.tensor([[1, 2]]), "1-D"), (torch.tensor([], dtype=torch.long), "non-empty"),
                       (torch.tensor([1.0, 2.0]), "integers"), (torch.tensor([3, 2]), "sorted"),
                       (torch.tensor([2, 2]), "distinct"), (torch.tensor([-1, 2]), "negative")]:
        save_file({**draft.zlab_state_dict(), "vocab_ids": bad}, str(tmp_path / "model.safetensors"))
        with pytest.raises(ValueError, match=match):
            DFlashDraft.load(tmp_path, "cpu", torch.float32, 64)
    save_file({**draft.zlab_state_dict(), "vocab_ids": torch.tensor([0, V])}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        DFlashProposer(DFlashDraft.load(tmp_path, "cpu", torch.float32, 64), pipe)
    ids32 = torch.arange(0, V, 2, dtype=torch.int32)     # any integer dtype is taken
    save_file({**draft.zlab_state_dict(), "vocab_ids": ids32}, str(tmp_path / "model.safetensors"))
    again = DFlashDraft.load(tmp_path, "cpu", torch.float32, 64)
    assert again.vocab_ids.dtype == torch.int64 and torch.equal(again.vocab_ids, ids32.long())
    assert torch.equal(again.zlab_state_dict()["vocab_ids"], ids32.long())


def test_int8_draft_linears_lossless_and_close(tiny_dir):
    """Weight-only int8 draft linears (the CLI's choice on a CPU with a quantized target):
    the output still equals plain decoding, and the draft's hidden states stay close to the
    dense draft's."""
    from dflash_server.cli.common import draft_quantize
    from dflash_server.layers.linear import Linear

    pipe = pipeline(tiny_dir("llama"))
    ids = prompt_ids(pipe, 20)
    ref = run(pipe, ids, max_tokens=24).token_ids
    dense = random_draft(pipe)
    tensors = DFlashDraft.random_tensors(dense.cfg, 0, 0.05)
    q = DFlashDraft(dense.cfg, tensors, "cpu", torch.float32, pipe.max_ctx, quantize="int8")
    assert {m.mode for m in q.modules() if isinstance(m, Linear)} == {Q8} and q.nbytes() < dense.nbytes()
    assert run(pipe, ids, DFlashProposer(q, pipe, block_size=4), max_tokens=24).token_ids == ref
    feats = torch.randn(1, 10, dense.cfg.num_taps * dense.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    emb = torch.randn(1, 4, dense.cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    for d in (dense, q):
        d.reset()
        d.append_context(feats, 0)
    a, b = dense.draft_hidden(emb, 10), q.draft_hidden(emb, 10)
    assert (a - b).norm() / a.norm() < 0.02
    with pytest.raises(ValueError, match="int8"):
        DFlashDraft(dense.cfg, tensors, "cpu", torch.float32, pipe.max_ctx, quantize="int3")
    assert draft_quantize("int4", "cpu") == draft_quantize("int8", "remote:cpu") == "int8"
    assert draft_quantize("dense", "cpu") == draft_quantize("int4", "cuda:0") == "dense"


@pytest.mark.parametrize("family,stages", [("llama", 1), ("qwen3_5", 1), ("qwen3_5", 2)])
def test_adaptive_block_size_lossless(tiny_dir, family, stages):
    """Each step picks its block (1 = a plain step) from measured times and acceptance: the
    output is plain decoding's whatever it picks; an oracle draft is run with long blocks, a
    random draft mostly as plain steps."""
    pipe = pipeline(tiny_dir(family), stages=stages)
    ids = prompt_ids(pipe, 24)
    ref = run(pipe, ids, max_tokens=90).token_ids
    rand = DFlashProposer(random_draft(pipe, seed=3), pipe, adaptive=True)
    assert rand.sizer is not None and rand.sizer.max_block == 8

    def machine_costs(sizer):  # a CPU-like cost shape instead of this (loaded) machine's timings
        real = sizer.observe
        sizer.observe = lambda block, acc, seconds: real(block, acc, 0.01 * (1 + 0.15 * (block - 1)))
    machine_costs(rand.sizer)
    res = run(pipe, ids, rand, max_tokens=90)
    assert res.token_ids == ref
    spec = res.extra["spec"]
    committed = spec["steps"] * spec["acceptance_length"] + spec["plain_steps"]
    assert round(committed) == len(ref) - 1                         # the first token comes from prefill
    assert spec["plain_steps"] > spec["steps"]                      # a useless draft is mostly skipped
    oracle = OracleProposer(random_draft(pipe), pipe, 8, ids, ref)
    oracle.sizer = rand.sizer.__class__(8)
    machine_costs(oracle.sizer)
    res = run(pipe, ids, oracle, max_tokens=90)
    assert res.token_ids == ref
    assert res.extra["spec"]["mean_block_size"] > 5 and res.extra["spec"]["accept_rate"] == 1.0


def test_deferred_draft_context_equals_immediate(tiny_dir):
    pipe = pipeline(tiny_dir("llama"))
    ids = prompt_ids(pipe, 12)
    now, later = DFlashProposer(random_draft(pipe), pipe), DFlashProposer(random_draft(pipe), pipe)
    pipe.reset()
    caps = pipe.forward(ids, 0, logits="none", capture=now.taps).captures
    for i in range(len(ids)):
        one = {t: c[:, i:i + 1] for t, c in caps.items()}
        now.add_context(one, i)
        later.add_context(one, i, defer=True)
    assert later.draft.context.length == 0                   # nothing projected yet
    assert later.context_length == len(ids)                  # reading the length flushes
    for a, b in zip(now.draft.context.k + now.draft.context.v, later.draft.context.k + later.draft.context.v):
        assert torch.allclose(a[:, :, :len(ids)], b[:, :, :len(ids)], atol=1e-5)
    later.add_context({t: c[:, :2] for t, c in caps.items()}, 0, defer=True)
    later.add_context({t: c[:, 1:2] for t, c in caps.items()}, 1, defer=True)   # not contiguous: flushes first
    assert later.draft.context.length == 2 and not later._pending
