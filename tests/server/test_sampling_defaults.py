"""What a request that sets no sampling field gets: the server's flags, else the model's
own settings (generation_config.json, GGUF general.sampling.*), else llama.cpp's; per
field, shown with its source in /props."""
import json
import logging
import shutil

import httpx
import pytest

from dflash_server.server.config import LLAMA_CPP_SAMPLING, ServerConfig
from dflash_server.weights.generation_config import sampling_defaults

from .conftest import TINY_ARGS
from .scripted import ScriptedEngine, ThreadServer, qwen35_tokenizer
from .serverproc import ServerProc


def test_model_settings_from_hf_and_gguf(tmp_path, caplog):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": "x", "repetition_penalty": -1}))
    caplog.set_level(logging.WARNING)
    assert sampling_defaults(tmp_path, "hf") == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    assert sum("ignoring" in r.getMessage() for r in caplog.records) == 2
    meta = {"general.sampling.temp": 0.7, "general.sampling.top_k": 64, "general.sampling.top_p": 0.95,
            "general.sampling.min_p": 0.0, "general.sampling.penalty_repeat": 1.05}
    assert sampling_defaults(tmp_path / "m.gguf", "gguf", meta) == {
        "temperature": 0.7, "top_k": 64, "top_p": 0.95, "min_p": 0.0, "repetition_penalty": 1.05}
    garbage = {"general.sampling.temp": "hot", "general.sampling.top_k": 2.5, "general.sampling.top_p": float("nan"),
               "general.sampling.min_p": [0.1], "general.sampling.penalty_repeat": True}
    assert sampling_defaults(tmp_path / "m.gguf", "gguf", garbage) == {}
    assert sampling_defaults(tmp_path / "none", "hf") == {}
    (tmp_path / "generation_config.json").write_text("{broken")
    assert sampling_defaults(tmp_path, "hf") == {}


def test_flag_beats_model_beats_llama_cpp():
    values, sources = ServerConfig(default_top_k=5).sampling_defaults({"temperature": 0.6, "top_k": 20})
    assert values == {**LLAMA_CPP_SAMPLING, "temperature": 0.6, "top_k": 5}
    assert sources == {"temperature": "model", "top_k": "flag", "top_p": "llama.cpp", "min_p": "llama.cpp",
                       "repetition_penalty": "llama.cpp"}
    assert LLAMA_CPP_SAMPLING == {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05,
                                  "repetition_penalty": 1.0}
    with pytest.raises(ValueError):
        ServerConfig(default_top_p=0)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return qwen35_tokenizer(tmp_path_factory)


def test_requests_fill_each_missing_field(tok):
    engine = ScriptedEngine(tok, {})
    s = ThreadServer(engine, info={"sampling": {"temperature": 0.6, "top_p": 0.9}}, default_min_p=0.1)
    try:
        msgs = [{"role": "user", "content": "hi"}]
        for path, body in (("/v1/chat/completions", {"messages": msgs}), ("/v1/completions", {"prompt": "hi"}),
                           ("/v1/responses", {"input": "hi"}), ("/v1/messages", {"messages": msgs, "max_tokens": 5})):
            assert httpx.post(s.url + path, json=body).status_code == 200
            sp = engine.requests[-1].sampling
            assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (0.6, 0.9, 40, 0.1), path
        httpx.post(s.url + "/v1/chat/completions", json={"messages": msgs, "temperature": 0, "top_k": 0})
        sp = engine.requests[-1].sampling
        assert (sp.temperature, sp.top_k, sp.top_p) == (0.0, 0, 0.9)  # what the request says wins, 0 included
        props = httpx.get(s.url + "/props").json()["default_generation_settings"]
        assert props["temperature"] == 0.6 and props["top_k"] == 40 and props["min_p"] == 0.1
        assert props["sources"] == {"temperature": "model", "top_p": "model", "top_k": "llama.cpp",
                                    "min_p": "flag", "repetition_penalty": "llama.cpp"}
    finally:
        s.stop()


def test_serve_reads_generation_config(tiny_dir, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(tiny_dir("llama"), model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_p": 0.5}))
    with ServerProc("--model", str(model), *TINY_ARGS, "--default-top-k", "7") as srv:
        got = httpx.get(srv.url + "/props").json()["default_generation_settings"]
    assert (got["temperature"], got["top_p"], got["top_k"], got["min_p"]) == (0.3, 0.5, 7, 0.05)
    assert got["sources"]["temperature"] == "model" and got["sources"]["top_k"] == "flag"


@pytest.mark.parametrize("flag", [("--default-top-p", "2"), ("--default-temperature", "-1"), ("--default-top-k", "x"),
                                  ("--default-min-p", "nan"), ("--default-repetition-penalty", "0")])
def test_bad_default_flags_are_one_line_errors(flag):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "dflash_server", "serve", *flag], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and flag[0].removeprefix("--").replace("-", "_") in \
        r.stderr.replace("-", "_"), r.stderr
