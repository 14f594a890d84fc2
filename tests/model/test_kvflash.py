"""KV Flash: slot-space attention over a bounded pool. While the context fits, output ==
full KV (greedy, with and without DFlash, split and unsplit); any physical layout gives the
same result; page-out / page-in is bit-exact; device KV stays at the pool size."""
import random

import pytest
import torch

from dflash_server.engine.generate import Engine, GenerationRequest
from dflash_server.runtime.kv_pager import KvFlashConfig
from dflash_server.runtime.pipeline import build_pipeline
from dflash_server.runtime.placement import plan_placement
from dflash_server.spec.proposer import DFlashProposer
from dflash_server.weights.loader import open_model
from helpers.build import pipeline, prompt_ids

from .test_dflash import random_draft


def kv_pipeline(path, pool, stages=1, chunk=16, policy="lru", max_ctx=512, tau=64, dtype=torch.float32,
                quantize="dense", lanes=1):
    src = open_model(path)
    shards = plan_placement(src.config.num_layers, ["cpu"] * stages, together=src.config.kv_groups())
    return build_pipeline(src, shards, dtype=dtype, max_ctx=max_ctx, progress=False, quantize=quantize,
                          kvflash=KvFlashConfig(pool, chunk=chunk, policy=policy, tau=tau), lanes=lanes)


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gemma3", "laguna"])
def test_resident_pool_is_bit_exact_in_the_serving_configuration(tiny_dir, family):
    """With the native attention step reading pool slots in logical order, a pool that holds
    everything gives plain decoding's logits bit for bit (bf16, int8 weights; prefill in
    native-sized chunks), whatever the physical layout of its chunks, with DFlash too."""
    path = tiny_dir(family)
    ref_pipe = pipeline(path, dtype=torch.bfloat16, quantize="int8")
    ids = prompt_ids(ref_pipe, 70)
    ref = gen(ref_pipe, ids)
    pipe = kv_pipeline(path, 256, dtype=torch.bfloat16, quantize="int8")
    rnd = random.Random(1)
    pager = pipe.stages[0].pager

    def shuffled_reset(orig=pager.reset):
        orig()
        rnd.shuffle(pager.free)
    pager.reset = shuffled_reset
    got = gen(pipe, ids)
    assert got.token_ids == ref.token_ids and not pager.is_identity()
    for p in (ref_pipe, pipe):      # one more step's logits, bit for bit
        p.reset()
        p.prefill(ids, chunk=64)
    assert torch.equal(ref_pipe.forward([ids[5]], 70, logits="all").logits,
                       pipe.forward([ids[5]], 70, logits="all").logits)
    prop = DFlashProposer(random_draft(pipe, block_size=4), pipe)
    assert gen(pipe, ids, proposer=prop).token_ids == ref.token_ids


def gen(pipe, ids, n=40, proposer=None):
    return Engine(pipe, proposer=proposer, chunk=64).generate(
        GenerationRequest(tuple(ids), max_tokens=n, ignore_eos=True))


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gemma3", "gemma4", "gemma4_e", "laguna"])
@pytest.mark.parametrize("stages", [1, 2])
def test_fits_in_pool_equals_full_kv(tiny_dir, family, stages):
    path = tiny_dir(family)
    ref_pipe = pipeline(path, stages=stages)
    ids = prompt_ids(ref_pipe, 70)
    ref = gen(ref_pipe, ids).token_ids
    pipe = kv_pipeline(path, 256, stages)
    assert gen(pipe, ids).token_ids == ref
    for st in pipe.stages:
        st.pager.check_integrity()
        assert st.pager.page_outs == 0
    prop = DFlashProposer(random_draft(pipe, block_size=4), pipe)
    assert gen(pipe, ids, proposer=prop).token_ids == ref


def test_shuffled_physical_layout_equals_identity(tiny_dir):
    path = tiny_dir("llama")
    ids = prompt_ids(pipeline(path), 90)
    a = kv_pipeline(path, 256)
    b = kv_pipeline(path, 256)
    rnd = random.Random(0)

    def shuffled_reset(pager=b.stages[0].pager, orig=b.stages[0].pager.reset):
        orig()
        rnd.shuffle(pager.free)
    b.stages[0].pager.reset = shuffled_reset
    ra, rb = gen(a, ids), gen(b, ids)
    assert not b.stages[0].pager.is_identity()
    assert ra.token_ids == rb.token_ids
    a.reset(), b.reset()
    la, lb = a.prefill(ids, chunk=32).logits, b.prefill(ids, chunk=32).logits
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)


def test_page_out_and_in_is_bit_exact_and_device_kv_stays_constant(tiny_dir):
    path = tiny_dir("qwen3_5")
    pipe = kv_pipeline(path, 128, chunk=16)  # 8 chunks: sink 1 + tail 4 + 2 + the spare
    st = pipe.stages[0]
    device_bytes = st.kv_bytes()
    ids = prompt_ids(pipe, 96)
    pipe.prefill(ids, chunk=16)
    C, phys = 16, st.pager.resident[1]
    before = [(s.k[:, :, phys * C:(phys + 1) * C].clone(), s.v[:, :, phys * C:(phys + 1) * C].clone())
              for s in st.pool.states]
    res = gen(pipe, ids, n=120)  # context 216 > pool 128: chunks get paged out
    assert len(res.token_ids) == 120
    st.pager.check_integrity()
    stats = st.kvflash_stats()
    assert stats["page_outs"] > 0 and stats["paged_chunks"] > 0 and stats["host_bytes"] > 0
    assert st.kv_bytes() == device_bytes  # device KV does not grow with the context
    # same prompt again, then write into chunk 1 after it was paged out: it comes back bit-exact
    pipe.reset()
    pipe.prefill(ids, chunk=16)
    more = prompt_ids(pipe, 48, seed=1)
    for k in range(0, 48, 16):
        pipe.forward(more[k:k + 16], 96 + k)
    assert 1 in st.pager.paged
    st.pool.apply(st.pager.plan_write(24, 25))  # a write into chunk 1 pages it back in
    p = st.pager.resident[1]
    after = [(s.k[:, :, p * C:(p + 1) * C], s.v[:, :, p * C:(p + 1) * C]) for s in st.pool.states]
    for (k0, v0), (k1, v1) in zip(before, after):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    st.pager.check_integrity()


@pytest.mark.parametrize("family,policy", [("llama", "lru"), ("qwen3_5", "lru"), ("llama", "score"),
                                           ("qwen3_5", "score")])
def test_snapshots_of_a_paged_pool_restore_and_round_trip(tiny_dir, family, policy):
    """Snapshots work while the pool is identity-mapped and after paging (the logical rows,
    the resident chunk list and the policy's state: use order, scores, latest queries, the
    next re-selection's position): restore == uninterrupted, also through export/import; with
    ``score`` and tau 8 the continuations re-select and evict by the restored scores."""
    path = tiny_dir(family)
    pipe = kv_pipeline(path, 128, chunk=16, policy=policy, tau=8)
    ids = prompt_ids(pipe, 200)
    pipe.prefill(ids[:40], chunk=16)
    pipe.snapshot_save(1)  # identity-mapped
    for k in range(40, 160, 16):  # 160 positions > the pool of 128: chunks are paged out
        pipe.forward(ids[k:k + 16], k)
    st = pipe.stages[0]
    assert st.pager.paged
    pipe.snapshot_save(2)
    resident, policy_state = sorted(st.pager.resident), st.pager.policy.state()

    def continuation(start):
        return torch.cat([pipe.forward(ids[k:k + 8], k, logits="all").logits for k in range(start, start + 16, 8)])
    ref2 = continuation(160)
    pipe.reset()
    pipe.snapshot_restore(1)
    ref1 = continuation(40)
    for slot, start, ref in ((2, 160, ref2), (1, 40, ref1)):
        pipe.reset()
        pipe.snapshot_restore(slot)
        st.pager.check_integrity()
        if slot == 2:
            assert sorted(st.pager.resident) == resident and st.pager.paged
            assert st.pager.policy.state() == policy_state
        torch.testing.assert_close(continuation(start), ref, rtol=1e-5, atol=1e-5)  # same keys, other slot order
    exported = pipe.snapshot_export(2)
    pipe.snapshot_import(3, exported)
    pipe.reset()
    pipe.snapshot_restore(3)
    torch.testing.assert_close(continuation(160), ref2, rtol=1e-5, atol=1e-5)
    bad = dict(exported)
    bad["ls0.kvflash_table.0"] = torch.tensor([[0, 0], [1, 0]])  # one physical chunk twice
    with pytest.raises(ValueError, match="page table"):
        pipe.snapshot_import(4, bad)
    counters = exported["ls0.kvflash_counters.0"]
    for value in ([-1, 8], [counters[0].item(), 13], [counters[0].item(), -8]):   # (13: not a multiple of tau)
        with pytest.raises(ValueError, match="policy state"):
            pipe.snapshot_import(4, dict(exported, **{"ls0.kvflash_counters.0": torch.tensor(value)}))


def test_config_validation_and_auto_size():
    with pytest.raises(ValueError):
        KvFlashConfig(0)
    with pytest.raises(ValueError):
        KvFlashConfig(512, policy="random")
    assert KvFlashConfig("auto").pool_tokens(8192) == 4096
    assert KvFlashConfig("auto").pool_tokens(600) == 512
    assert KvFlashConfig("auto").pool_tokens(8192, budget_tokens=3000) == 3072  # from free GPU memory
    assert KvFlashConfig("auto").pool_tokens(8192, budget_tokens=10) == 512
    with pytest.raises(ValueError):
        KvFlashConfig(512, tau=0)


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gemma3", "gemma4", "gemma4_e", "laguna"])
def test_auto_pool_budget_from_free_device_memory(tiny_dir, family, monkeypatch):
    """``--kvflash auto`` on a GPU: half of the free memory after a 1.5 GiB reserve, divided
    by the K+V bytes per token of this stage's attention layers (GDN layers hold none). The
    CUDA query is faked (no GPU in CI); the arithmetic is the real one."""
    pipe = kv_pipeline(tiny_dir(family), 256)
    st, cfg = pipe.stages[0], pipe.config
    attn = sum(1 for s in st.states if s.kind == "kv")
    # qwen3_5: GDN layers too; gemma4_e: KV-shared layers hold none of their own
    assert attn == sum(1 for i, t in enumerate(cfg.layer_types) if t != "linear_attention" and cfg.kv_source(i) is None)
    per_token = 4 * sum(2 * cfg.layer_kv_heads(i) * cfg.layer_head_dim(i) for i, t in enumerate(cfg.layer_types)
                        if t != "linear_attention" and cfg.kv_source(i) is None)  # fp32 K and V
    assert st._kv_budget_tokens(KvFlashConfig("auto")) is None  # not on a GPU
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (8 << 30, 16 << 30))
    monkeypatch.setattr(st, "device", torch.device("cuda", 0))
    assert st._kv_budget_tokens(KvFlashConfig("auto")) == ((8 << 30) - (3 << 29)) // 2 // per_token
    assert st._kv_budget_tokens(KvFlashConfig(512)) is None  # an explicit size is kept
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1 << 30, 16 << 30))  # below the reserve
    assert KvFlashConfig("auto").pool_tokens(4096, st._kv_budget_tokens(KvFlashConfig("auto"))) == 512
    assert KvFlashConfig(100).pool_tokens(8192) == 512  # at least sink + tail + 2 chunks + the spare
    assert KvFlashConfig(1000).pool_tokens(8192) == 1024
    assert KvFlashConfig(9000).pool_tokens(8192) == 8192


def test_score_policy_observes_attention_and_stays_exact_while_it_fits(tiny_dir):
    path = tiny_dir("llama")
    ids = prompt_ids(pipeline(path), 70)
    ref = gen(pipeline(path), ids).token_ids
    pipe = kv_pipeline(path, 256, policy="score")
    assert gen(pipe, ids).token_ids == ref
    score = pipe.stages[0].pager.policy.score
    assert score and all(v >= 0 for v in score.values()) and max(score.values()) > 0
    long_pipe = kv_pipeline(path, 128, chunk=16, policy="score")
    res = gen(long_pipe, ids, n=80)  # 150 positions: the least attended chunks leave the pool
    pager = long_pipe.stages[0].pager
    pager.check_integrity()
    assert len(res.token_ids) == 80 and pager.page_outs > 0 and 0 in pager.resident


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gemma3", "gemma4", "gemma4_e", "laguna"])
def test_prefix_cache_hit_equals_miss_with_a_paged_pool(tiny_dir, family):
    """Multi-turn chat longer than the pool (lru): snapshots carry the page table, prefill
    forwards stop at chunk boundaries once the pool can be full, so a hit continues exactly
    like a fresh prefill, turn after turn. (Not for ``score``: its residency depends on
    where earlier re-selections happened, e.g. at the end of the previous turn's prompt, which
    a fresh prefill of the whole conversation does not repeat; a restored snapshot continues
    exactly like the uninterrupted sequence, see the round-trip test above.)"""
    path = tiny_dir(family)
    long_system = "You are a terse assistant who answers in one word. " * 30  # > the pool

    def converse(slots):
        eng = Engine(kv_pipeline(path, 256, chunk=16), prefix_slots=slots, chunk=100)  # 100: not chunk-aligned
        messages, out = [{"role": "system", "content": long_system}], []
        for q in ("Hi", "And then?", "Why?"):
            messages.append({"role": "user", "content": q})
            ids = eng.tokenizer.encode_chat(messages)
            assert len(ids) > 256
            res = eng.generate(GenerationRequest(tuple(ids), max_tokens=6, ignore_eos=True))
            assert res.extra["kvflash"]["page_outs"] > 0
            out.append(res)
            messages.append({"role": "assistant", "content": res.text})
        return out
    cached, fresh = converse(4), converse(0)
    for turn, (a, b) in enumerate(zip(cached, fresh)):
        assert a.token_ids == b.token_ids, turn
        assert (a.cached_tokens > 0) == (turn > 0) and b.cached_tokens == 0


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_score_policy_state_does_not_depend_on_how_the_prompt_was_cut(tiny_dir, family):
    """The score policy sits out a prompt's body (it re-selects on the prompt's last tokens):
    a prompt four times the pool prefilled in chunks of 5, 7, 16 or 100 tokens (serving's step
    budget and prefix-cache hits cut it at other places) leaves the same residency, policy
    state and latest queries, and the same greedy continuation (which re-selects every 8)."""
    path = tiny_dir(family)
    got = []
    for chunk in (5, 7, 16, 100):   # (past the pool's filling, forwards also stop at its 16-token chunks)
        pipe = kv_pipeline(path, 128, chunk=16, policy="score", tau=8, dtype=torch.bfloat16, quantize="int8")
        ids = prompt_ids(pipe, 500, seed=4)
        res = Engine(pipe, chunk=chunk).generate(GenerationRequest(tuple(ids), max_tokens=20, ignore_eos=True))
        pool = pipe.stages[0].pool
        assert res.extra["kvflash"]["page_outs"] > 0 and pool.reselects > 1
        rows = pool.pager.policy.state()[0]   # (chunk, last use, score); the use clock counts forwards
        evict = sorted(rows, key=lambda r: (r[2], r[1]))   # the policy's eviction order
        got.append((res.token_ids, dict(pool.pager.resident), [(c, v) for c, _, v in rows],
                    [c for c, _, _ in evict], pool.last_q))
    for token_ids, resident, scores, evict, last_q in got[1:]:
        assert token_ids == got[0][0] and resident == got[0][1] and scores == got[0][2] and evict == got[0][3]
        assert all(torch.equal(a, b) for a, b in zip(last_q, got[0][4], strict=True))


def test_retrieval_beyond_the_pool_with_the_score_policy():
    """A fact early in a ~2K-token prompt (4x the 512-token pool) is answered by the default
    model with the score policy as with full KV; LRU (which keeps only the sink and the
    most recent chunks) loses it. Measured over 5 facts x 2 depths (benchmarks/kvflash.py
    --retrieval): full KV 9/10, score 9/10, lru 0/10; here 4 cases full KV answers."""
    from dflash_server.cli.common import quantize_plan
    from dflash_server.weights.default_model import default_model_path

    src = open_model(default_model_path())
    quant = quantize_plan(src, "auto", True)
    filler = src.tokenizer.encode(" ".join(["The committee reviewed the quarterly report on regional "
                                            f"rainfall, crop yields and road repairs in district {i}." for i in range(200)]))
    cases = [("Zorbak", "4721", 0.3), ("Zorbak", "4721", 0.5), ("Brannoch", "5849", 0.3), ("Brannoch", "5849", 0.5)]
    passed = {}
    for mode in ("full", "score", "lru"):
        kv = None if mode == "full" else KvFlashConfig(512, policy=mode)
        pipe = build_pipeline(src, plan_placement(src.config.num_layers, ["cpu"]), dtype=torch.bfloat16,
                              max_ctx=2304, quantize=quant, progress=False, kvflash=kv)
        eng = Engine(pipe)
        passed[mode] = 0
        for name, code, depth in cases:
            text = src.tokenizer.decode(filler[:1900])
            cut = int(len(text) * depth)
            doc = text[:cut] + f"\n\nIMPORTANT: The secret code of {name} is {code}.\n\n" + text[cut:]
            ids = src.tokenizer.encode_chat([{"role": "user", "content": doc + f"\n\nWhat is the secret code of "
                                              f"{name}? Answer with the number only."}])
            assert len(ids) >= 4 * 512 - 100
            out = eng.generate(GenerationRequest(tuple(ids), max_tokens=16)).text
            passed[mode] += code in out
    print("retrieval passes out of", len(cases), passed)
    assert passed["full"] >= 3, passed  # the model can answer without KV Flash
    # measured 4 of 4; one miss is allowed: a 135M model answers some cases on a knife edge
    assert passed["score"] >= 3 and passed["score"] > passed["lru"], passed


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gemma3", "gemma4", "gemma4_e", "laguna"])
def test_dflash_equals_plain_decoding_while_paging(tiny_dir, family):
    """With chunks paged out, a verify block that enters a new chunk defers the eviction
    (the spare chunk), so every position sees the keys plain decoding saw: DFlash == AR
    token for token under the lru policy, for several block sizes."""
    path = tiny_dir(family)
    pipe = kv_pipeline(path, 128, chunk=16)
    ids = prompt_ids(pipe, 40)
    ref = gen(pipe, ids, n=150)  # 190 positions, pool of 128
    assert pipe.stages[0].pager.page_outs > 0
    for block in (3, 4, 8):
        prop = DFlashProposer(random_draft(pipe, block_size=8), pipe, block_size=block)
        res = gen(pipe, ids, n=150, proposer=prop)
        assert res.token_ids == ref.token_ids, block
        pipe.stages[0].pager.check_integrity()


class _Oracle(DFlashProposer):
    """Drafts from a known continuation ``text`` (prompt + answer): whole blocks accepted,
    but every third draft's second token wrong (a block cut short); a tree has the right token
    second at its first depth (a likelier wrong one first), so the accepted path's rows come
    after rows of the other branch (rows at other places than their positions)."""

    def __init__(self, draft, pipe, text, **kw):
        super().__init__(draft, pipe, **kw)
        self.text, self.calls = text, 0

    def _right(self, start, block):
        self.calls += 1
        out = [self.text[start + 1 + i] if start + 1 + i < len(self.text) else 0 for i in range(block - 1)]
        if self.calls % 3 == 0 and len(out) > 1:
            out[1] = (out[1] + 1) % self.pipeline.config.vocab_size
        return out

    def propose(self, anchor, start, block):
        return self._right(start, block)

    def _draft_logits(self, anchor, start, block):
        out = torch.full((block - 1, self.pipeline.config.vocab_size), -30.0)
        right = self._right(start, block)
        for i, t in enumerate(right):
            out[i, t] = 10.0
        out[0, right[0]], out[0, (right[0] + 1) % out.shape[1]] = 4.9, 5.0
        return out


@pytest.mark.parametrize("family,stages", [("llama", 1), ("qwen3_5", 1), ("llama", 2)])
def test_score_policy_pages_a_drafted_sequence_as_its_plain_decoding(tiny_dir, family, stages):
    """The score policy observes a row only once its position is committed (one at a time, as
    a plain decode step), and a speculative block commits no further than where plain decoding
    re-selects or evicts next (Pipeline.spec_room). So in the serving configuration (bf16, int8:
    a row's masses are the same bits in any forward) a sequence far past its pool (128 tokens,
    16-token chunks, a re-selection every 8 tokens) gives its plain decoding's tokens, and ends
    with the same resident chunks (in other pool places), scores and counts, drafted in blocks of 8 and 3 (accepted whole or
    cut short), with DDTrees, and in a step loop beside a plainly decoded sequence."""
    path = tiny_dir(family)
    kv = dict(chunk=16, policy="score", tau=8, dtype=torch.bfloat16, quantize="int8")
    ids = prompt_ids(pipeline(path), 60, seed=3)
    req = GenerationRequest(tuple(ids), max_tokens=110, ignore_eos=True)

    def outcome(pipe, res):
        out = [res.token_ids]
        for st in pipe.stages:   # (every stage pages its own pool)
            st.select(0)
            st.pool.commit(st.length)
            pager = st.pager
            out += [st.length, sorted(pager.resident), sorted(pager.paged), dict(pager.policy.score),
                    pager.page_outs, pager.page_ins, st.pool.reselects, [q.clone() for q in st.pool.last_q]]
        return out

    def same(got, want):
        return len(got) == len(want) and all(
            all(torch.equal(a, b) for a, b in zip(g, w, strict=True)) if isinstance(g, list) and g and
            isinstance(g[0], torch.Tensor) else g == w for g, w in zip(got, want))

    plain = kv_pipeline(path, 128, stages, **kv)
    want = outcome(plain, Engine(plain, chunk=64).generate(req))
    assert want[5] > 0 and want[7] > 10   # page-outs, re-selections (of the first stage)
    text = list(ids) + want[0]
    for block, budget in ((8, 0), (3, 0), (8, 6)):
        pipe = kv_pipeline(path, 128, stages, **kv)
        prop = _Oracle(random_draft(pipe, block_size=8), pipe, text, block_size=block, tree_budget=budget)
        res = Engine(pipe, proposer=prop, chunk=64).generate(req)
        assert res.extra["spec"]["accept_histogram"][2:] != [0] * (block - 2), block   # blocks of several rows
        assert same(outcome(pipe, res), want), (block, budget)
    # two slots in one step loop: this sequence's rows among another's (batched plain rows)
    pipe = kv_pipeline(path, 128, stages, lanes=2, **kv)
    eng = Engine(pipe, proposer=_Oracle(random_draft(pipe, block_size=8), pipe, text, block_size=8), chunk=64)
    other = GenerationRequest(tuple(prompt_ids(pipe, 30, seed=9)), max_tokens=60, ignore_eos=True, speculate=False)
    seqs = [eng.submit(req), eng.submit(other)]
    while eng.has_work:
        eng.step()
    assert same(outcome(pipe, seqs[0].result), want)


def test_sliding_layers_keep_their_window_resident(tiny_dir):
    """The pool keeps at least a sliding layer's window of recent chunks resident: a model
    whose layers all slide (window 100, 16-token chunks: 8 recent chunks) decodes far past
    its pool exactly as with full KV, while chunks page out."""
    path = tiny_dir("gemma3", sliding_window=100, layer_types=("sliding_attention",) * 6)
    ref_pipe = pipeline(path)
    ids = prompt_ids(ref_pipe, 180)
    ref = gen(ref_pipe, ids, n=60).token_ids
    pipe = kv_pipeline(path, 64, chunk=16)  # raised to sink + 8 recent + 3 chunks = 192 tokens
    st = pipe.stages[0]
    assert st.pager.tail == 8 and st.pager.pool_tokens == 192
    assert gen(pipe, ids, n=60).token_ids == ref
    assert st.pager.page_outs > 0


def _aten_attention(pipe) -> None:
    """Turn ``pipe``'s native attention (and its stack) off."""
    for st in pipe.stages:
        st._stack = None
        for layer in st.layers:
            layer.mixer.native, layer._fused = False, False


def _count_aten(pipe, calls: list) -> None:
    """Append to ``calls`` at every aten attention call of ``pipe``."""
    for st in pipe.stages:
        for layer in st.layers:
            orig = layer.mixer._attend
            layer.mixer._attend = lambda *a, _orig=orig, **kw: calls.append(1) or _orig(*a, **kw)


def test_score_policy_on_the_native_step_observes_what_aten_observes(tiny_dir):
    """The native attention step feeds KV Flash's score policy: the attention each slot
    receives and the latest queries agree with aten's path within rounding (fp32), so
    eviction and re-selection make the same choices and the tokens are the same."""
    path = tiny_dir("llama")
    ids = prompt_ids(pipeline(path), 150)
    native, aten = (kv_pipeline(path, 128, chunk=16, policy="score", tau=8) for _ in range(2))
    _aten_attention(aten)
    native_calls, aten_calls = [], []
    _count_aten(native, native_calls)
    _count_aten(aten, aten_calls)
    got = [gen(p, ids, n=40) for p in (native, aten)]
    assert got[0].token_ids == got[1].token_ids and not native_calls and aten_calls
    (pa, pb), (qa, qb) = [p.stages[0].pager for p in (native, aten)], [p.stages[0].pool for p in (native, aten)]
    assert pa.page_outs == pb.page_outs > 0 and pa.resident == pb.resident and qa.reselects == qb.reselects > 0
    sa, sb = pa.policy.score, pb.policy.score
    assert sa.keys() == sb.keys() and max(sb.values()) > 0
    assert all(abs(sa[c] - sb[c]) <= 1e-4 * max(1.0, abs(sb[c])) for c in sa), (sa, sb)
    assert len(qa.last_q) == len(qb.last_q) == native.config.num_layers
    assert all(a.shape == b.shape and torch.allclose(a, b, atol=1e-4) for a, b in zip(qa.last_q, qb.last_q))


def test_score_policy_through_the_stack(tiny_dir):
    """The serving configuration (bf16, int8 layers): a paging pool's forwards with the score
    policy run through the fused stack, and what they observe (masses after a 150-token
    prefill and decode steps, the latest queries) is aten's within bf16 rounding."""
    path = tiny_dir("llama")
    ids = prompt_ids(pipeline(path), 150)
    native, aten = (kv_pipeline(path, 128, chunk=16, policy="score", dtype=torch.bfloat16, quantize="int8")
                    for _ in range(2))
    _aten_attention(aten)
    stack = native.stages[0]._native_stack()
    calls, run = [], stack.run
    stack.run = lambda *a, **kw: calls.append(1) or run(*a, **kw)
    for p in (native, aten):
        p.reset()
        p.prefill(ids, chunk=32)
        for i in range(3):
            p.forward([ids[i]], 150 + i)
    assert len(calls) >= 8
    (pa, pb), (qa, qb) = [p.stages[0].pager for p in (native, aten)], [p.stages[0].pool for p in (native, aten)]
    assert pa.page_outs == pb.page_outs > 0 and pa.resident == pb.resident
    sa, sb = pa.policy.score, pb.policy.score
    assert sa.keys() == sb.keys() and max(sb.values()) > 0
    assert all(abs(sa[c] - sb[c]) <= 0.05 * max(1.0, abs(sb[c])) for c in sa), (sa, sb)
    assert len(qa.last_q) == len(qb.last_q) == native.config.num_layers
    for a, b in zip(qa.last_q, qb.last_q):   # the committed rows: the prompt's tail (16: the pool's
        # largest forward), 2 decode rows (the third waits for its position to be committed)
        assert a.shape == b.shape == (1, 16 + 2, native.config.num_heads, native.config.head_dim)
        assert a.dtype == b.dtype
        assert torch.allclose(a.float(), b.float(), atol=0.05, rtol=0.02)
