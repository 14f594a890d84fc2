"""Prompt lookup (spec.lookup, on by default on a CPU) under hostile prompts: a prompt that is one
token thousands of times, a prompt that is a short cycle, a context filled to its end, a grammar
that forbids what the copy proposes. Each answer equals plain decoding's."""
import pytest

from dflash_server.engine.generate import Engine, GenerationRequest
from dflash_server.engine.grammar import json_schema_grammar
from dflash_server.spec.lookup import LookupProposer
from helpers.build import pipeline, prompt_ids


def both(pipe, ids, **kw):
    kw.setdefault("ignore_eos", True)
    req = GenerationRequest(tuple(ids), **kw)
    return Engine(pipe).generate(req), Engine(pipe, proposer=LookupProposer(pipe, 16)).generate(req)


@pytest.mark.parametrize("kind", ["one token", "cycle of 3"])
def test_degenerate_prompts(tiny_dir, kind):
    pipe = pipeline(tiny_dir("llama"), max_ctx=4096)
    ids = [7] * 3000 if kind == "one token" else [11, 12, 13] * 1000
    plain, look = both(pipe, ids, max_tokens=40)
    assert look.token_ids == plain.token_ids


def test_a_context_filled_to_its_end(tiny_dir):
    """Lookups never propose past the context: the last tokens come one verify at a time."""
    pipe = pipeline(tiny_dir("llama"), max_ctx=96)
    ids = prompt_ids(pipe, 20) * 4
    plain, look = both(pipe, ids, max_tokens=64)
    assert look.token_ids == plain.token_ids and look.finish_reason == plain.finish_reason


def test_a_grammar_that_rejects_the_copy(tiny_dir):
    """The prompt is JSON the copy would repeat; the grammar admits another shape."""
    pipe = pipeline(tiny_dir("llama"))
    ids = pipe.tokenizer.encode('{"a": [1, 2, 3]} {"a": [1, 2, 3]} {"a": [1, 2, 3]} ' * 4)
    schema = {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}
    plain, look = both(pipe, ids, max_tokens=24, grammar=json_schema_grammar(schema), ignore_eos=False)
    assert look.token_ids == plain.token_ids and look.text == plain.text


def test_a_store_fed_degenerate_requests_stays_bounded_and_lossless(tiny_dir):
    """--lookup-store under hostile traffic: requests of one token repeated, short cycles and
    a prompt far longer than the store, run together on three slots and then alone; every
    answer equals plain decoding's and the store never exceeds its capacity."""
    from dflash_server.spec.lookup import LookupStore

    path = tiny_dir("llama")
    plain = Engine(pipeline(path, max_ctx=4096))
    pipe = pipeline(path, max_ctx=4096, lanes=3)
    eng = Engine(pipe, proposer=LookupProposer(pipe, 16))
    eng.proposer.lookup_store = LookupStore(256)
    prompts = [[7] * 600, [11, 12, 13] * 200, prompt_ids(pipe, 20) * 3, [5] * 3000, [11, 12, 13, 14] * 5]
    reqs = [GenerationRequest(tuple(ids), max_tokens=24, ignore_eos=True) for ids in prompts]
    want = [plain.generate(r).token_ids for r in reqs]
    seqs = [eng.submit(r) for r in reqs]
    while eng.has_work:
        eng.step()
        assert len(eng.proposer.lookup_store) <= 256
    assert [s.result.token_ids for s in seqs] == want
    for r, w in zip(reqs, want):             # alone, with the store holding the others' tokens
        assert eng.generate(r).token_ids == w
        assert len(eng.proposer.lookup_store) <= 256
