"""--compile: the torch.compile'd single-token step equals eager decoding and compiles a
bounded number of graphs (no recompilation per position or per request)."""
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
