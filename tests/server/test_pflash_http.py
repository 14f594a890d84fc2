"""PFlash through the HTTP APIs: which prompts are compressed (threshold, continuations,
per-request overrides), usage counting the raw prompt with the compressed count beside
it, /props and /metrics, the official clients, and the errors."""
from __future__ import annotations

import httpx
import pytest

from .conftest import start_tiny

LONG = " ".join(f"Line {i}: the river runs past the old mill and under the stone bridge." for i in range(40))
MID = " ".join(f"Line {i}: the river runs past the old mill and under the stone bridge." for i in range(20))


@pytest.fixture(scope="module")
def pflash_server(tiny_dir):
    srv = start_tiny(tiny_dir, "llama", "--prefill-compression", "auto", "--prefill-threshold", "300",
                     "--prefill-keep-ratio", "0.2", "--prefill-drafter", "self:2")
    yield srv
    assert srv.stop() == 0, srv.output()


def _chat(srv, messages, **extra):
    return httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "max_tokens": 4, "temperature": 0, "messages": messages, **extra})


def test_long_prompts_are_compressed_and_usage_counts_the_raw_prompt(pflash_server):
    """LONG is longer than the 512-token context: compressed, it fits."""
    r = _chat(pflash_server, [{"role": "user", "content": LONG + "\nWhich bridge?"}])
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    assert u["prompt_tokens"] > 300
    assert 0 < u["prompt_tokens_details"]["compressed_tokens"] < u["prompt_tokens"] // 2
    pf = r.json()["timings"]["pflash"]
    assert pf["raw_tokens"] == u["prompt_tokens"] and pf["compressed_tokens"] == u["prompt_tokens_details"][
        "compressed_tokens"] and pf["drafter_s"] > 0
    short = _chat(pflash_server, [{"role": "user", "content": "Hello there"}]).json()
    assert "compressed_tokens" not in short["usage"]["prompt_tokens_details"] and "pflash" not in short["timings"]


def test_continuations_and_overrides(pflash_server):
    history = [{"role": "user", "content": MID}, {"role": "assistant", "content": "Yes."},
               {"role": "user", "content": "And then?"}]
    r = _chat(pflash_server, history).json()
    assert "compressed_tokens" not in r["usage"]["prompt_tokens_details"]       # keeps the prefix cache
    r = _chat(pflash_server, history, prefill_compression="always").json()
    assert "compressed_tokens" in r["usage"]["prompt_tokens_details"]
    r = _chat(pflash_server, [{"role": "user", "content": MID}], prefill_compression="off").json()
    assert "compressed_tokens" not in r["usage"]["prompt_tokens_details"]
    tight = _chat(pflash_server, [{"role": "user", "content": MID}],
                  prefill_compression={"keep_ratio": 0.05}).json()["usage"]["prompt_tokens_details"]
    loose = _chat(pflash_server, [{"role": "user", "content": MID}],
                  prefill_compression={"keep_ratio": 0.6}).json()["usage"]["prompt_tokens_details"]
    assert tight["compressed_tokens"] < loose["compressed_tokens"]
    r = _chat(pflash_server, [{"role": "user", "content": MID}],
              prefill_compression={"threshold": 100000}).json()
    assert "compressed_tokens" not in r["usage"]["prompt_tokens_details"]
    short = _chat(pflash_server, [{"role": "user", "content": "Hello there, tell me more."}],
                  prefill_compression={"mode": "always"}).json()
    assert "compressed_tokens" in short["usage"]["prompt_tokens_details"]


@pytest.mark.parametrize("value", ["sometimes", 1, {"mode": "never"}, {"keep_ratio": 0}, {"keep_ratio": 1.5},
                                   {"keep_ratio": "0.5"}, {"threshold": 0}, {"threshold": 2.5}, [], None])
def test_bad_overrides_are_400(pflash_server, value):
    r = _chat(pflash_server, [{"role": "user", "content": "hi"}], prefill_compression=value)
    if value is None:
        assert r.status_code == 200
    else:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] in ("prefill_compression", None) or "prefill_compression" in r.text


@pytest.mark.parametrize("sid", ["", "x" * 257, 5])
def test_bad_session_ids_are_400(pflash_server, sid):
    assert _chat(pflash_server, [{"role": "user", "content": "hi"}], session_id=sid).status_code == 400


def test_other_apis_props_metrics_and_the_official_clients(pflash_server):
    import anthropic
    import openai

    url = pflash_server.url
    r = httpx.post(url + "/v1/completions", timeout=120, json={"model": "tiny", "prompt": LONG, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["compressed_tokens"] > 0
    r = httpx.post(url + "/v1/responses", timeout=120, json={"model": "tiny", "input": LONG, "max_output_tokens": 3,
                                                             "store": False})
    assert r.status_code == 200 and r.json()["usage"]["input_tokens_details"]["compressed_tokens"] > 0
    oa = openai.OpenAI(base_url=url + "/v1", api_key="x")
    c = oa.chat.completions.create(model="tiny", max_tokens=3, messages=[{"role": "user", "content": LONG}],
                                   extra_body={"prefill_compression": {"mode": "always", "keep_ratio": 0.1},
                                               "session_id": "s1"})
    assert c.usage.prompt_tokens > 300 and c.usage.prompt_tokens_details.cached_tokens == 0
    an = anthropic.Anthropic(base_url=url, api_key="x")
    m = an.messages.create(model="tiny", max_tokens=3, messages=[{"role": "user", "content": LONG}])
    assert m.usage.input_tokens > 300
    props = httpx.get(url + "/props").json()["pflash"]
    assert props["enabled"] and props["mode"] == "auto" and props["threshold"] == 300
    assert props["drafter"] == "self:2" and props["scoring_layers"] == 2 and props["calls"] >= 4
    assert 0 < props["compression_ratio"] < 1
    metrics = httpx.get(url + "/metrics").text
    line = next(m for m in metrics.splitlines() if m.startswith("dflash_pflash_compressions_total "))
    assert float(line.split()[1]) >= 4
    assert "dflash_pflash_compression_ratio " in metrics


def test_a_server_without_a_drafter_says_so(llama_server):
    r = _chat(llama_server, [{"role": "user", "content": "hi"}], prefill_compression="always")
    assert r.status_code == 400 and "--prefill-drafter" in r.json()["error"]["message"]
    assert httpx.get(llama_server.url + "/props").json()["pflash"]["enabled"] is False
    # auto on the server's side is off here: a long prompt goes through whole
    r = _chat(llama_server, [{"role": "user", "content": MID}])
    assert r.status_code == 200 and "compressed_tokens" not in r.json()["usage"]["prompt_tokens_details"]
    r = _chat(llama_server, [{"role": "user", "content": LONG}])   # longer than the context: no drafter to help
    assert r.status_code == 400 and "context size" in r.json()["error"]["message"]
