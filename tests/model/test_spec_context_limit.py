"""Hostile review (2026-11-27): at the context limit greedy output with a draft was one token
longer than plain decoding (a verify block could commit its bonus token at position
max_ctx): the speculative paths now stop, and size their blocks and trees, as plain decoding
does, so draft == no draft there too and prompt + completion never exceed the context."""
import pytest

from dflash_server.engine.generate import Engine, GenerationRequest
from dflash_server.spec.proposer import DFlashProposer
from helpers.build import pipeline, prompt_ids, random_draft


def _proposer(pipe, tree_budget=0, block=8):
    return DFlashProposer(random_draft(pipe, layers=1, block=block), pipe, tree_budget=tree_budget)


@pytest.mark.parametrize("mode", ["oracle chain", "tree"])
@pytest.mark.parametrize("lanes", [1, 2])
def test_draft_equals_plain_at_the_context_limit(tiny_dir, mode, lanes):
    ctx = 48
    pipe = pipeline(tiny_dir("llama"), max_ctx=ctx, lanes=lanes)
    ids = tuple(prompt_ids(pipe, 30))
    req = GenerationRequest(ids, max_tokens=100, ignore_eos=True)
    plain = Engine(pipe).generate(req)
    assert len(ids) + plain.completion_tokens == ctx and plain.finish_reason == "length"
    prop = _proposer(pipe, tree_budget=7 if mode == "tree" else 0)
    if mode == "oracle chain":   # the target's own continuation as drafts: whole blocks accepted to the limit
        def propose(anchor, start, block):
            done = start - len(ids) + 1
            return list(plain.token_ids[done:done + block - 1]) + [5] * max(0, block - 1 - (len(plain.token_ids) - done))
        prop.propose = propose
    got = Engine(pipe, proposer=prop).generate(req)
    assert got.token_ids == plain.token_ids and got.finish_reason == "length"
    if mode == "oracle chain":
        assert got.extra["spec"]["acceptance_length"] > 2


def test_block_sizes_past_the_verify_limit_are_refused(tiny_dir, caplog):
    """A verify block is at most 64 rows (the native attention step's limit): a larger one
    is an error at start-up, not a failure on the first request; one past the draft's trained
    block is allowed with a warning (its extra positions are drafted out of distribution)."""
    pipe = pipeline(tiny_dir("llama"))
    draft = random_draft(pipe, layers=1, block=4)
    for bad in (1, 65, 200):
        with pytest.raises(ValueError, match="block size"):
            DFlashProposer(draft, pipe, block_size=bad)
    with caplog.at_level("WARNING", logger="dflash_server"):
        DFlashProposer(draft, pipe, block_size=8)
    assert "larger than the draft's trained block" in caplog.text
    DFlashProposer(draft, pipe, block_size=64)


def test_a_draft_trained_on_longer_blocks_verifies_at_most_64(tiny_dir):
    pipe = pipeline(tiny_dir("llama"))
    assert DFlashProposer(random_draft(pipe, layers=1, block=80), pipe).block_size == 64
