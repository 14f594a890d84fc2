"""Anthropic Messages: a final assistant message is a prefill the answer continues
("the response content will continue immediately from the content in that message"), not a
closed turn followed by a fresh assistant turn."""
import httpx

MSGS = [{"role": "user", "content": "Write a JSON object with one key."}]
PREFILL = '{"answer":'  # (the Anthropic API refuses a prefill ending in whitespace)


def test_final_assistant_message_is_continued(llama_server):
    url = llama_server.url
    # what a continuation must see: the conversation's generation prompt, then the prefill
    ids = httpx.post(url + "/tokenize", json={"messages": MSGS}).json()["tokens"]
    head = httpx.post(url + "/detokenize", json={"tokens": ids}).json()["content"]
    raw = httpx.post(url + "/v1/completions", json={
        "model": "tiny", "prompt": head + PREFILL, "max_tokens": 6, "temperature": 0}).json()
    m = httpx.post(url + "/v1/messages", json={
        "model": "tiny", "max_tokens": 6, "temperature": 0,
        "messages": MSGS + [{"role": "assistant", "content": PREFILL}]}).json()
    seen = m["usage"]["input_tokens"] + m["usage"]["cache_read_input_tokens"]
    assert seen == raw["usage"]["prompt_tokens"], "the prefill turn was closed and a new one opened"
    assert "".join(b["text"] for b in m["content"] if b["type"] == "text") == raw["choices"][0]["text"]
    n = httpx.post(url + "/v1/messages/count_tokens", json={
        "model": "tiny", "messages": MSGS + [{"role": "assistant", "content": PREFILL}]}).json()["input_tokens"]
    assert n == raw["usage"]["prompt_tokens"]
