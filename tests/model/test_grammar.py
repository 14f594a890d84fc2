"""Grammar-constrained decoding: outputs validate against their JSON schema (checked by
the ``jsonschema`` package) for every family, greedy and sampled; a draft (DFlash) and
batching leave them unchanged; a bad grammar is a clear error."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from dflash_server.engine.generate import Engine, GenerationRequest
from dflash_server.engine.grammar import json_schema_grammar
from dflash_server.engine.sampling import SamplingParams
from helpers.build import pipeline, prompt_ids

SCHEMAS = {
    "nested": {"type": "object", "additionalProperties": False, "required": ["user", "ok"],
               "properties": {"user": {"type": "object", "additionalProperties": False, "required": ["id", "name"],
                                       "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                                                      "name": {"type": "string", "maxLength": 12}}},
                              "ok": {"type": "boolean"}}},
    "enum_array": {"type": "object", "additionalProperties": False, "required": ["tags"],
                   "properties": {"tags": {"type": "array", "minItems": 1, "maxItems": 4,
                                           "items": {"enum": ["red", "green", "blue"]}}}},
    "bounded": {"type": "object", "additionalProperties": False, "required": ["age", "score"],
                "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                               "score": {"type": "number", "minimum": -1, "maximum": 1}}},
    "optional": {"type": "object", "additionalProperties": False, "required": ["a"],
                 "properties": {"a": {"type": "string", "maxLength": 6}, "b": {"type": ["integer", "null"], "minimum": -9, "maximum": 9}}},
}
GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=1.0, top_p=0.95, seed=11)


def _gen(eng, ids, schema, sampling=GREEDY, n=160):
    return eng.generate(GenerationRequest(tuple(ids), sampling=sampling, max_tokens=n,
                                          grammar=json_schema_grammar(schema)))


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5", "gemma3", "gemma4", "gemma4_moe", "gemma4_e", "laguna"])
def test_outputs_validate_against_the_schema(tiny_dir, family):
    pipe = pipeline(tiny_dir(family))
    eng = Engine(pipe)
    ids = prompt_ids(pipe, 12)
    for name, schema in SCHEMAS.items():
        for sampling in (GREEDY, SAMPLED):
            res = _gen(eng, ids, schema, sampling)
            if res.finish_reason == "length":
                # JSON numbers have no digit limit: a random model may write digits until
                # max_tokens (every token still admitted by the grammar: the engine checks)
                assert re.search(r"[0-9]{40}$", res.text), (family, name, res.text)
                continue
            assert res.finish_reason == "stop", (family, name, res.text)
            jsonschema.validate(json.loads(res.text), schema)


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gemma4", "laguna"])
def test_json_object_and_a_draft_leave_output_unchanged(tiny_dir, family):
    """DFlash drafts are verified against the grammar too (a forbidden draft is a rejection):
    output with a draft equals output without, greedy and sampled (dense, hybrid with its
    recurrent-state rollback, sliding-window and MoE families)."""
    from dflash_server import kernels

    # seeded sampling verifies exactly (the same draws as plain decoding), so it is token-equal
    # only where a verify block's logits round as one-row steps do: with the native kernels
    # (bf16, int8 weights: row-invariant). In fp32 aten they differ by ~1e-6, which moves a
    # sampled token (qwen3_5 / gemma4 on any CPU; llama on an AMD Zen 4, not on Intel: BLAS
    # blocking). Greedy agrees on all, in fp32.
    runs = [(pipeline(tiny_dir(family)), (GREEDY,))]
    if family in ("llama", "qwen3_5") and kernels.enabled() and kernels.load():
        runs.append((pipeline(tiny_dir(family), dtype=torch.bfloat16, quantize="int8"), (SAMPLED,)))
    for pipe, samplings in runs:
        _draft_leaves_output_unchanged(pipe, samplings)


def _draft_leaves_output_unchanged(pipe, samplings) -> None:
    from dflash_server.spec.proposer import DFlashProposer

    from .test_dflash import random_draft

    ids = prompt_ids(pipe, 12)
    plain = Engine(pipe)
    spec = Engine(pipe, proposer=DFlashProposer(random_draft(pipe, block_size=4), pipe))
    for schema in (None, SCHEMAS["nested"], SCHEMAS["enum_array"]):
        for sampling in samplings:
            req = GenerationRequest(tuple(ids), sampling=sampling, max_tokens=120, grammar=json_schema_grammar(schema))
            a, b = plain.generate(req), spec.generate(req)
            assert a.token_ids == b.token_ids and b.extra["spec"]["steps"] > 0
            if a.finish_reason == "stop":  # (a random model may write one endless key under json_object)
                assert isinstance(json.loads(a.text), dict)
            else:
                assert schema is None and a.text.startswith("{")


def test_batched_constrained_requests_equal_alone(tiny_dir):
    from .test_batching import _pipe, _run_together

    path = tiny_dir("llama")
    alone = Engine(_pipe(path, 1))
    eng = Engine(_pipe(path, 3))
    reqs = [GenerationRequest(tuple(prompt_ids(alone.pipeline, 8 + i, seed=i)), max_tokens=80,
                              grammar=json_schema_grammar(s) if s != "free" else None, sampling=samp)
            for i, (s, samp) in enumerate([(SCHEMAS["bounded"], GREEDY), ("free", GREEDY),
                                           (SCHEMAS["optional"], SAMPLED), (SCHEMAS["nested"], GREEDY)])]
    want = [alone.generate(r).token_ids for r in reqs]
    seqs, _ = _run_together(eng, reqs, when=[0, 0, 1, 2])
    assert [s.result.token_ids for s in seqs] == want
    for s, r in zip(seqs, reqs):
        if r.grammar is not None:
            json.loads(s.result.text)


def test_bad_grammars_are_errors(tiny_dir):
    pipe = pipeline(tiny_dir("llama"))
    eng = Engine(pipe)
    for bad in ('{"grammars": [{"json_schema": {"type": "bogus"}}]}', "not json", '{"grammars": 5}'):
        with pytest.raises(ValueError, match="grammar"):
            eng.grammars.check(bad)
        with pytest.raises(ValueError, match="grammar"):
            eng.submit(GenerationRequest((1, 2, 3), grammar=bad))
    with pytest.raises(ValueError, match="think"):
        GenerationRequest((1, 2), grammar=json_schema_grammar(None), think_open=True)
