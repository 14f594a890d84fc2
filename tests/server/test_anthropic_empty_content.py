"""Anthropic Messages: a user message whose content is an empty block list must not vanish
from the prompt (the model then answers the turn before it as if the user never spoke).
The Anthropic API refuses empty content except in a final assistant message: a 400 is the
expected answer (an empty user turn in the prompt would also do)."""
import httpx

HISTORY = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


def test_empty_user_content_is_not_silently_dropped(llama_server):
    url = llama_server.url
    without = httpx.post(url + "/v1/messages/count_tokens", json={"model": "tiny", "messages": HISTORY})
    r = httpx.post(url + "/v1/messages/count_tokens", json={
        "model": "tiny", "messages": HISTORY + [{"role": "user", "content": []}]})
    assert r.status_code == 400 or r.json()["input_tokens"] != without.json()["input_tokens"], \
        "the empty user message was dropped from the prompt"
    m = httpx.post(url + "/v1/messages", json={
        "model": "tiny", "max_tokens": 2, "messages": HISTORY + [{"role": "user", "content": []}]})
    if m.status_code == 400:
        assert m.json()["type"] == "error"
    else:
        u = m.json()["usage"]
        assert u["input_tokens"] + u["cache_read_input_tokens"] != without.json()["input_tokens"]
