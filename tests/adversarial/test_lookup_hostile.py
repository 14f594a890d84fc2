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
