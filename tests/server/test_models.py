"""The real CLI on the default model (no flags at all) and on a tiny Qwen3.5 (think tokens,
XML tool template): official clients round-trip; the reasoning budget is enforced."""
import anthropic
import httpx
import openai
import pytest

from .conftest import start_tiny
from .serverproc import ServerProc

FRANCE = [{"role": "user", "content": "Name the capital of France."}]


@pytest.fixture(scope="module")
def default_server():
    srv = ServerProc()  # no arguments: the built-in model, default placement and quantization
    yield srv
    assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def qwen_server(tiny_dir):
    srv = start_tiny(tiny_dir, "qwen3_5")
    yield srv
    assert srv.stop() == 0, srv.output()


def test_default_model_all_apis(default_server):
    url = default_server.url
    oa = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, _strict_response_validation=True)
    model = oa.models.list().data[0].id
    kw = dict(model=model, messages=FRANCE, max_tokens=12, temperature=0)
    r = oa.chat.completions.create(**kw)
    assert "Paris" in r.choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in oa.chat.completions.create(stream=True, **kw)
                       if c.choices)
    assert streamed == r.choices[0].message.content
    resp = oa.responses.create(model=model, input=FRANCE[0]["content"], max_output_tokens=12, temperature=0)
    assert resp.output_text == r.choices[0].message.content
    comp = oa.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert "Paris" in comp.choices[0].text
    an = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, _strict_response_validation=True)
    m = an.messages.create(model=model, max_tokens=12, messages=FRANCE, system="You are a helpful AI assistant "
                           "named SmolLM, trained by Hugging Face", extra_body={"temperature": 0})
    assert m.content[0].text == r.choices[0].message.content
    with an.messages.stream(model=model, max_tokens=12, messages=FRANCE, extra_body={"temperature": 0}) as s:
        assert "Paris" in "".join(s.text_stream)
    assert an.messages.count_tokens(model=model, messages=FRANCE).input_tokens == r.usage.prompt_tokens
    props = httpx.get(url + "/props").json()
    assert props["model"]["format"] == "gguf" and props["status"] == "ready"


def test_qwen_reasoning_budget_enforced(qwen_server):
    oa = openai.OpenAI(base_url=qwen_server.url + "/v1", api_key="x", max_retries=0,
                       _strict_response_validation=True)
    # max_tokens 40 with effort "low": at most 30 tokens of thinking, then the engine closes it
    r = oa.chat.completions.create(model="tiny", messages=FRANCE, max_tokens=40, temperature=0,
                                   reasoning_effort="low", extra_body={"ignore_eos": True})
    u = r.usage
    assert u.completion_tokens == 40
    assert 1 <= u.completion_tokens_details.reasoning_tokens <= 30 + 2  # + the forced "\n</think>"
    assert r.choices[0].message.content  # the answer got the rest
    # thinking off: the template closes the block in the prompt, nothing is reasoning
    off = oa.chat.completions.create(model="tiny", messages=FRANCE, max_tokens=8, temperature=0,
                                     extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens > u.prompt_tokens
    # Anthropic budget_tokens, same enforcement
    an = anthropic.Anthropic(base_url=qwen_server.url, api_key="x", max_retries=0, _strict_response_validation=True)
    m = an.messages.create(model="tiny", max_tokens=30, messages=FRANCE, thinking={"type": "enabled",
                           "budget_tokens": 5}, extra_body={"temperature": 0, "ignore_eos": True})
    assert m.content[0].type == "thinking" and m.usage.output_tokens == 30
    assert any(b.type == "text" and b.text for b in m.content)


def test_qwen_tool_prompt_rendering(qwen_server):
    """A full tool loop on the real template: declared tools and the fed-back result are
    rendered the Qwen3.5 way, and counting agrees across endpoints."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    msgs = [*FRANCE, {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]}, {"role": "tool", "tool_call_id": "c1",
                                                                       "content": "Sunny"}]
    url = qwen_server.url
    r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": msgs, "tools": tools,
                                                       "max_tokens": 4}).json()
    ids = httpx.post(url + "/tokenize", json={"messages": msgs}).json()["tokens"]
    text = httpx.post(url + "/detokenize", json={"tokens": ids}).json()["content"]
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in text
    assert "<tool_response>\nSunny\n</tool_response>" in text
    assert r["usage"]["prompt_tokens"] > len(ids)  # + the tool declarations in the system turn
    assert r["choices"][0]["finish_reason"] in ("stop", "length")
