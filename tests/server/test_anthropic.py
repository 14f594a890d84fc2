"""Anthropic Messages and count_tokens through the official client (strict response
validation) against the real CLI on a tiny Llama."""
import anthropic
import httpx
import pytest

MSGS = [{"role": "user", "content": "Count to five, please."}]
# this SDK generation has no temperature argument any more: send it as an extra field
GREEDY = {"temperature": 0}
NOEOS = {"ignore_eos": True, **GREEDY}


@pytest.fixture(scope="module")
def client(llama_server):
    return anthropic.Anthropic(base_url=llama_server.url, api_key="unused", max_retries=0,
                               _strict_response_validation=True)


def text_of(msg) -> str:
    return "".join(b.text for b in msg.content if b.type == "text")


def test_messages_roundtrip_and_usage(client):
    m = client.messages.create(model="tiny", max_tokens=8, messages=MSGS, system="You are terse.",
                               extra_body=GREEDY)
    assert m.role == "assistant" and m.type == "message" and m.id.startswith("msg_")
    assert m.stop_reason in ("end_turn", "max_tokens")
    n = client.messages.count_tokens(model="tiny", messages=MSGS, system="You are terse.").input_tokens
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == n
    assert m.usage.output_tokens <= 8
    # system as text blocks renders the same prompt
    blocks = [{"type": "text", "text": "You are terse."}]
    assert client.messages.count_tokens(model="tiny", messages=MSGS, system=blocks).input_tokens == n
    assert client.messages.count_tokens(model="tiny", messages=MSGS).input_tokens != n


def test_same_prompt_as_openai_chat(client, llama_server):
    m = client.messages.create(model="tiny", max_tokens=10, messages=MSGS, system="You are terse.",
                               extra_body=GREEDY)
    chat = httpx.post(llama_server.url + "/v1/chat/completions", json={
        "model": "tiny", "max_tokens": 10, "temperature": 0,
        "messages": [{"role": "system", "content": "You are terse."}, *MSGS]}).json()
    assert chat["usage"]["prompt_tokens"] == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    assert text_of(m) == chat["choices"][0]["message"]["content"]


def test_stream_equals_nonstream(client):
    kw = dict(model="tiny", max_tokens=12, messages=MSGS, extra_body=NOEOS)
    m = client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert m.stop_reason == final.stop_reason == "max_tokens"
    assert text_of(m) == streamed == text_of(final)
    assert final.usage.output_tokens == m.usage.output_tokens == 12
    events = [e.type for e in client.messages.create(stream=True, **kw)]
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert events[1] == "content_block_start" and "message_delta" in events


def test_stop_sequences(client):
    kw = dict(model="tiny", max_tokens=24, messages=MSGS, extra_body=NOEOS)
    full = text_of(client.messages.create(**kw))
    stop = full[6:9]
    m = client.messages.create(stop_sequences=[stop], **kw)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert text_of(m) == full[:full.index(stop)]
    with client.messages.stream(stop_sequences=[stop], **kw) as s:
        assert "".join(s.text_stream) == text_of(m)
        assert s.get_final_message().stop_sequence == stop


def test_errors_in_anthropic_shape(client, llama_server):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny", max_tokens=5000, messages=MSGS)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nope", max_tokens=4, messages=MSGS)
    r = httpx.post(llama_server.url + "/v1/messages", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = httpx.post(llama_server.url + "/v1/messages", json={"model": "tiny", "messages": MSGS})  # no max_tokens
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(llama_server.url + "/v1/messages", json={
        "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]})
    assert r.status_code == 400 and "image" in r.json()["error"]["message"]
