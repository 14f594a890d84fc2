"""--compile: the torch.compile'd single-token step equals eager decoding (captures
included, as DFlash's plain steps use them) and compiles a bounded number of graphs (no
recompilation per position or per request)."""
import pytest
import torch

from helpers.build import greedy, pipeline, prompt_ids


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_compiled_decode_equals_eager(tiny_dir, family):
    import torch._dynamo

    path = tiny_dir(family)
    eager = pipeline(path)
    compiled = pipeline(path)
    compiled.compile_decode()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for n, seed in ((9, 0), (23, 1), (9, 2)):  # other prompt lengths: other start positions
        ids = prompt_ids(eager, n, seed=seed)
        assert greedy(compiled, ids, max_tokens=12) == greedy(eager, ids, max_tokens=12)
    # one static graph for the first position, one with the position symbolic for the rest
    assert 1 <= torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2


def test_compiled_step_returns_the_same_captures(tiny_dir):
    import torch._dynamo

    path = tiny_dir("llama")
    eager, compiled = pipeline(path, stages=2), pipeline(path, stages=2)
    compiled.compile_decode()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    ids = prompt_ids(eager, 11)
    for p in (eager, compiled):
        p.reset()
        p.forward(ids, 0, logits="last")
    for i, tok in enumerate((5, 17, 3, 99)):
        capture = (1, 2) if i % 2 else ()  # alternate: plain steps with and without taps
        a = eager.forward([tok], len(ids) + i, logits="last", capture=capture)
        # the same position again with the other capture set (rewrites the same cache rows)
        other = compiled.forward([tok], len(ids) + i, logits="last", capture=() if capture else (1, 2))
        b = compiled.forward([tok], len(ids) + i, logits="last", capture=capture)
        assert torch.allclose(a.logits, b.logits, atol=1e-5, rtol=1e-5)
        # with or without captures a step runs the same graph: identical logits
        assert torch.equal(b.logits, other.logits)
        assert sorted(a.captures) == sorted(b.captures) == list(capture)
        for k in capture:
            assert torch.allclose(a.captures[k], b.captures[k], atol=1e-5, rtol=1e-5)
    # per stage: a static graph for the first position and a dynamic one, whatever is captured
    assert 2 <= torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 4


@pytest.mark.parametrize("family,max_graphs", [("llama", 4), ("qwen3_5", 2)])
def test_compiled_dflash_equals_eager_plain_decoding(tiny_dir, family, max_graphs):
    """--compile with a draft: verify blocks run the compiled layer loop too (attention-only
    stages: a static graph, then one with the block length symbolic; plus the two of the
    single-token step), and the output is still plain decoding's, token for token, for a
    useless and for a perfect draft. Gated DeltaNet stages compile single-token steps only
    (their block form would compile a graph per block length)."""
    import torch._dynamo

    from dflash_server.spec.proposer import DFlashProposer
    from .test_dflash import OracleProposer, random_draft, run

    path = tiny_dir(family)
    eager, compiled = pipeline(path), pipeline(path)
    compiled.compile_decode()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    ids = prompt_ids(eager, 30)
    ref = greedy(eager, ids, max_tokens=40)
    for block in (3, 8):
        res = run(compiled, ids, DFlashProposer(random_draft(compiled), compiled, block_size=block), max_tokens=40)
        assert res.token_ids == ref, block
    res = run(compiled, ids, OracleProposer(random_draft(compiled), compiled, 8, ids, ref), max_tokens=40)
    assert res.token_ids == ref and res.extra["spec"]["acceptance_length"] > 7
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= max_graphs


def test_warm_up_builds_every_graph_before_the_first_request(tiny_dir):
    """``serve --compile`` runs Engine.warm_up before it reports ready: afterwards a request
    with the adaptive block size compiles nothing new (and decodes exactly)."""
    import torch._dynamo

    from dflash_server.engine.generate import Engine, GenerationRequest
    from dflash_server.spec.proposer import DFlashProposer
    from .test_dflash import random_draft

    path = tiny_dir("llama")
    eager, compiled = pipeline(path), pipeline(path)
    compiled.compile_decode()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    engine = Engine(compiled, proposer=DFlashProposer(random_draft(compiled), compiled, adaptive=True))
    engine.warm_up()
    assert engine.proposer.sizer.cost == {}   # its step times included the compiles
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs >= 3                         # decode step(s) and the verify graphs
    ids = prompt_ids(eager, 25, seed=4)
    res = engine.generate(GenerationRequest(tuple(ids), max_tokens=30, ignore_eos=True))
    assert res.token_ids == greedy(eager, ids, max_tokens=30)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
