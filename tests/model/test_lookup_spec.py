"""Prompt-lookup drafts beside the DFlash draft (spec.lookup): lossless against plain
decoding (greedy and seeded sampling, dense and Gated DeltaNet targets, 1-2 stages, several
sequences in one forward), lookups really taken, and turned off per request and per proposer."""
import pytest
import torch

from dflash_server.engine.generate import Engine, GenerationRequest
from dflash_server.engine.sampling import SamplingParams
from dflash_server.spec.proposer import DFlashProposer
from helpers.build import pipeline, prompt_ids, random_draft


def repeating_prompt(pipe, n=24):
    """A prompt that says the same thing twice, so the context repeats from the first step."""
    ids = prompt_ids(pipe, n)
    return ids + ids


def run(pipe, ids, proposer=None, **kw):
    kw.setdefault("ignore_eos", True)
    return Engine(pipe, proposer=proposer).generate(GenerationRequest(tuple(ids), **kw))


@pytest.mark.parametrize("family,stages", [("llama", 1), ("llama", 2), ("qwen3_5", 1), ("qwen3", 2)])
@pytest.mark.parametrize("adaptive", [False, True])
def test_lookup_is_lossless_and_taken(tiny_dir, family, stages, adaptive):
    pipe = pipeline(tiny_dir(family), stages=stages)
    ids = repeating_prompt(pipe)
    ref = run(pipe, ids, max_tokens=40)
    prop = DFlashProposer(random_draft(pipe, block=4), pipe, adaptive=adaptive, lookup=5)
    res = run(pipe, ids, prop, max_tokens=40)
    assert res.token_ids == ref.token_ids, (family, stages, adaptive)
    spec = res.extra["spec"]
    assert spec["lookup_steps"] > 0 and spec["accepted"] > 0   # the repeated prompt gives lookups, kept
    # the same with lookups off: the draft's steps only
    off = run(pipe, ids, DFlashProposer(random_draft(pipe, block=4), pipe, adaptive=adaptive), max_tokens=40)
    assert off.token_ids == ref.token_ids and off.extra["spec"]["lookup_steps"] == 0


def test_lookup_copies_whole_runs(tiny_dir):
    """Where the model repeats its context, lookups accept many tokens a step: fewer verify
    steps than the draft alone, and steps that accepted more drafts than the draft's block."""
    pipe = pipeline(tiny_dir("llama"))
    ids = repeating_prompt(pipe)
    ref = run(pipe, ids, max_tokens=48).token_ids
    seen = ids + ref
    # the model's own output must repeat for the lookups to pay (a tiny random model loops)
    assert len(set(zip(seen[-20:], seen[-19:]))) < 19
    look = run(pipe, ids, DFlashProposer(random_draft(pipe, block=4), pipe, lookup=8), max_tokens=48)
    alone = run(pipe, ids, DFlashProposer(random_draft(pipe, block=4), pipe), max_tokens=48)
    assert look.token_ids == alone.token_ids == ref
    s, a = look.extra["spec"], alone.extra["spec"]
    assert s["steps"] + s["plain_steps"] < a["steps"] + a["plain_steps"]
    assert sum(s["accept_histogram"][4:]) > 0      # more than the block's 3 drafts accepted at once


def test_seeded_sampling_with_lookup_repeats_plain_sampling(tiny_dir):
    pipe = pipeline(tiny_dir("llama"))
    ids = repeating_prompt(pipe)
    sampling = SamplingParams(temperature=0.3, top_k=3, seed=7)   # near-greedy: the tiny model still repeats
    ref = run(pipe, ids, max_tokens=32, sampling=sampling).token_ids
    prop = DFlashProposer(random_draft(pipe, block=4), pipe, adaptive=True, lookup=5)
    res = run(pipe, ids, prop, max_tokens=32, sampling=sampling)
    assert res.token_ids == ref
    assert res.extra["spec"]["lookup_steps"] > 0


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7])
def test_max_tokens_and_stops_inside_a_lookup_block(tiny_dir, max_tokens):
    pipe = pipeline(tiny_dir("llama"))
    ids = repeating_prompt(pipe)
    ref = run(pipe, ids, max_tokens=40)
    res = run(pipe, ids, DFlashProposer(random_draft(pipe, block=4), pipe, lookup=8), max_tokens=max_tokens)
    assert res.token_ids == ref.token_ids[:max_tokens] and res.finish_reason == "length"
    stop = ref.text[5:8]
    plain = run(pipe, ids, max_tokens=40, stop=(stop,))
    spec = run(pipe, ids, DFlashProposer(random_draft(pipe, block=4), pipe, lookup=8), max_tokens=40, stop=(stop,))
    assert spec.text == plain.text and spec.token_ids == plain.token_ids and spec.finish_reason == "stop"


def test_lookup_in_the_batch_equals_alone(tiny_dir):
    """Several sequences stepping together (the draft's blocks or plain rows in a batch,
    lookups once a sequence runs alone): each gives exactly what it gives alone."""
    path = tiny_dir("llama")
    plain = Engine(pipeline(path))
    pipe = pipeline(path, lanes=3)
    eng = Engine(pipe, proposer=DFlashProposer(random_draft(pipe, block=4), pipe, adaptive=True, lookup=5))
    reqs = [GenerationRequest(tuple(p), max_tokens=m, ignore_eos=True) for p, m in
            ((repeating_prompt(pipe, 10), 48), (prompt_ids(pipe, 17, seed=3), 14), (repeating_prompt(pipe, 6), 9))]
    reqs.append(GenerationRequest(tuple(repeating_prompt(pipe, 8)), max_tokens=12, ignore_eos=True,
                                  sampling=SamplingParams(temperature=0.9, seed=11)))
    want = [plain.generate(r).token_ids for r in reqs]
    seqs = [eng.submit(r) for r in reqs]
    while eng.has_work:
        eng.step()
    assert [s.result.token_ids for s in seqs] == want
    assert sum(s.result.extra["spec"]["lookup_steps"] for s in seqs) > 0
    assert max(eng.batch_sizes) >= 2


def test_a_request_that_does_not_speculate_does_not_look_up(tiny_dir):
    pipe = pipeline(tiny_dir("llama"))
    ids = repeating_prompt(pipe)
    res = run(pipe, ids, DFlashProposer(random_draft(pipe, block=4), pipe, lookup=5), max_tokens=16, speculate=False)
    assert res.token_ids == run(pipe, ids, max_tokens=16).token_ids
    assert "spec" not in res.extra or res.extra["spec"]["lookup_steps"] == 0


def test_lookup_depth_is_validated(tiny_dir):
    pipe = pipeline(tiny_dir("llama"))
    for bad in (-1, 17):
        with pytest.raises(ValueError, match="lookup depth"):
            DFlashProposer(random_draft(pipe, block=4), pipe, lookup=bad)


# --- prompt lookup alone (--lookup N without --draft): LookupProposer ---------------------------

from dflash_server.spec.lookup import LookupProposer  # noqa: E402


@pytest.mark.parametrize("family,stages", [("llama", 1), ("qwen3_5", 1), ("llama", 2)])
def test_lookup_alone_is_lossless(tiny_dir, family, stages):
    pipe = pipeline(tiny_dir(family), stages=stages)
    ids = repeating_prompt(pipe)
    ref = run(pipe, ids, max_tokens=40)
    res = run(pipe, ids, LookupProposer(pipe, 6), max_tokens=40)
    assert res.token_ids == ref.token_ids
    spec = res.extra["spec"]
    assert spec["lookup_steps"] > 0 and spec["plain_steps"] + spec["steps"] < 40
    sampling = SamplingParams(temperature=0.3, top_k=3, seed=5)
    assert run(pipe, ids, LookupProposer(pipe, 6), max_tokens=24, sampling=sampling).token_ids == \
        run(pipe, ids, max_tokens=24, sampling=sampling).token_ids


def test_lookup_alone_in_the_batch_and_with_prefix_hits(tiny_dir):
    """Lookup alone with several slots and a prefix cache: each request gives what it gives
    on a plain engine with the same cache, hits included (its snapshots are the plain
    engine's: no draft context)."""
    path = tiny_dir("llama")
    plain = Engine(pipeline(path), prefix_slots=8)
    pipe = pipeline(path, lanes=3)
    eng = Engine(pipe, proposer=LookupProposer(pipe, 5), prefix_slots=8)
    tok = plain.tokenizer
    turn = [{"role": "system", "content": "You are a terse assistant who answers in one line. " * 3},
            {"role": "user", "content": "Hello there"}]
    warm = GenerationRequest(tuple(tok.encode_chat(turn)), max_tokens=4, ignore_eos=True)
    for e in (plain, eng):
        answer = e.generate(warm).text
    turn.append({"role": "assistant", "content": answer})
    reqs = [GenerationRequest(tuple(tok.encode_chat(turn + [{"role": "user", "content": q}])), max_tokens=16,
                              ignore_eos=True) for q in ("What is two plus two?", "Say hi. Say hi. Say hi.")]
    reqs.append(GenerationRequest(tuple(repeating_prompt(pipe, 9)), max_tokens=20, ignore_eos=True))
    want = [plain.generate(r) for r in reqs]
    seqs = [eng.submit(r) for r in reqs]
    while eng.has_work:
        eng.step()
    got = [s.result for s in seqs]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.cached_tokens for g in got] == [w.cached_tokens for w in want] and want[0].cached_tokens > 0
    assert sum(g.extra["spec"]["lookup_steps"] for g in got) > 0
    assert eng.stats()["speculative"]["method"] == "lookup"


def test_lookup_alone_refuses_a_depth_of_zero(tiny_dir):
    pipe = pipeline(tiny_dir("llama"))
    for bad in (0, 17):
        with pytest.raises(ValueError, match="lookup depth"):
            LookupProposer(pipe, bad)


def test_graft_adds_a_chain_to_a_tree():
    """ddtree.graft: the chain follows the tree's nodes where they hold its tokens, then
    appends its own (parents before children), at most ``limit`` new nodes."""
    from dflash_server.spec.ddtree import DraftTree, chain_tree, graft

    tree = DraftTree([5, 6, 7, 8], (-1, 0, 0, 1, 3), 3)   # 5 -> 7 -> 8 and 6 under the root
    got, added = graft(tree, [5, 7, 9, 10], 8)
    assert added == 2 and got.tokens == [5, 6, 7, 8, 9, 10] and got.parents == (-1, 0, 0, 1, 3, 3, 5)
    assert got.depth == 4 and got.children()[3] == {8: 4, 9: 5}
    got, added = graft(tree, [6, 1, 2], 1)              # a new branch, cut at the limit
    assert added == 1 and got.tokens == [5, 6, 7, 8, 1] and got.parents == (-1, 0, 0, 1, 3, 2)
    assert graft(tree, [5, 7], 4) == (tree, 0)           # already in the tree
    got, added = graft(chain_tree([]), [3, 4], 4)         # an empty tree: the chain alone
    assert got == chain_tree([3, 4]) and added == 2
    for t in (got, graft(tree, [5, 7, 9, 10], 8)[0]):
        assert all(p < r for r, p in enumerate(t.parents) if r > 0)


@pytest.mark.parametrize("family,stages", [("llama", 1), ("qwen3_5", 1), ("qwen3", 2)])
def test_lookup_grafted_onto_trees_is_lossless_and_taken(tiny_dir, family, stages):
    """DDTree steps with prompt lookup: the lookup's chain is a path of the tree (alone where
    the adaptive budget chose a plain step); greedy and seeded sampling == plain decoding,
    lookups taken and accepted beyond what the trees alone accept."""
    pipe = pipeline(tiny_dir(family), stages=stages)
    ids = repeating_prompt(pipe)
    for sampling in (SamplingParams(), SamplingParams(temperature=0.3, top_k=3, seed=7)):
        ref = run(pipe, ids, max_tokens=40, sampling=sampling).token_ids
        for adaptive in (False, True):
            prop = DFlashProposer(random_draft(pipe, block=4), pipe, tree_budget=4, adaptive=adaptive, lookup=5)
            res = run(pipe, ids, prop, max_tokens=40, sampling=sampling)
            assert res.token_ids == ref, (family, stages, sampling, adaptive)
            spec = res.extra["spec"]
            assert spec["tree_steps"] > 0 and spec["lookup_steps"] > 0
        alone = run(pipe, ids, DFlashProposer(random_draft(pipe, block=4), pipe, tree_budget=4), max_tokens=40,
                    sampling=sampling)
        assert alone.token_ids == ref and alone.extra["spec"]["lookup_steps"] == 0
        if sampling.greedy:   # the tiny model repeats its prompt: the lookup's chains are accepted
            assert spec["acceptance_length"] > alone.extra["spec"]["acceptance_length"]


# --- lookups across requests (--lookup-store): spec.lookup.LookupStore ---------------------------

from dflash_server.spec.lookup import LookupStore  # noqa: E402


@pytest.mark.parametrize("family,kind", [("llama", "alone"), ("llama", "draft"), ("qwen3_5", "alone")])
def test_a_store_of_earlier_requests_is_lossless_and_taken(tiny_dir, family, kind):
    """A request run again copies its earlier answer from the store: fewer verify steps, the
    same tokens (greedy and seeded sampling), and requests of other prompts are unchanged."""
    pipe = pipeline(tiny_dir(family))
    ids = prompt_ids(pipe, 24)
    sampling = SamplingParams(temperature=0.8, seed=11)
    ref = run(pipe, ids, max_tokens=40).token_ids
    ref_s = run(pipe, ids, max_tokens=40, sampling=sampling).token_ids
    other = prompt_ids(pipe, 17)[::-1]
    ref_o = run(pipe, other, max_tokens=24).token_ids

    def proposer():
        p = LookupProposer(pipe, 8) if kind == "alone" else DFlashProposer(random_draft(pipe, block=4), pipe, lookup=8)
        return p

    without = Engine(pipe, proposer=proposer())
    with_store = Engine(pipe, proposer=proposer())
    with_store.proposer.lookup_store = LookupStore(10_000)
    req = GenerationRequest(tuple(ids), max_tokens=40, ignore_eos=True)
    first = with_store.generate(req)
    assert first.token_ids == ref and len(with_store.proposer.lookup_store) == len(ids) + 40 + 1
    again, base = with_store.generate(req), without.generate(req)
    assert again.token_ids == base.token_ids == ref
    a, b = again.extra["spec"], base.extra["spec"]
    assert a["steps"] + a["plain_steps"] < b["steps"] + b["plain_steps"]   # the store's copy was verified
    assert with_store.proposer.lookup_store.matches > 0
    sreq = GenerationRequest(tuple(ids), max_tokens=40, ignore_eos=True, sampling=sampling)
    assert with_store.generate(sreq).token_ids == ref_s
    assert with_store.generate(GenerationRequest(tuple(other), max_tokens=24, ignore_eos=True)).token_ids == ref_o
    stats = with_store.stats()["speculative"]["lookup_store"]
    assert stats["tokens"] == len(with_store.proposer.lookup_store) and stats["capacity"] == 10_000
    assert without.stats()["speculative"]["lookup_store"] is None


def test_a_request_that_does_not_speculate_is_not_stored(tiny_dir):
    pipe = pipeline(tiny_dir("llama"))
    eng = Engine(pipe, proposer=LookupProposer(pipe, 4))
    eng.proposer.lookup_store = LookupStore(1000)
    eng.generate(GenerationRequest(tuple(prompt_ids(pipe, 12)), max_tokens=8, ignore_eos=True, speculate=False))
    assert len(eng.proposer.lookup_store) == 0
    eng.generate(GenerationRequest(tuple(prompt_ids(pipe, 12)), max_tokens=8, ignore_eos=True))
    assert len(eng.proposer.lookup_store) == 12 + 8 + 1
