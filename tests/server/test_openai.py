"""OpenAI Chat Completions, Completions and Responses through the official client
(strict response validation) against the real CLI on a tiny Llama."""
import httpx
import openai
import pytest

MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Count to five, please."}]
NOEOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def client(llama_server):
    return openai.OpenAI(base_url=llama_server.url + "/v1", api_key="unused", max_retries=0,
                         _strict_response_validation=True)


@pytest.fixture(scope="module")
def loose(llama_server):
    # the SDK types a streamed completion's finish_reason as non-null; the real API sends null
    return openai.OpenAI(base_url=llama_server.url + "/v1", api_key="unused", max_retries=0)


def chat_text(client, stream=False, **kw):
    args = dict(model="tiny", messages=MSGS, max_tokens=12, temperature=0) | kw
    if not stream:
        r = client.chat.completions.create(**args)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage
    parts, finish, usage = [], None, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    return "".join(parts), finish, usage


def test_models_health_props(client, llama_server):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    assert httpx.get(llama_server.url + "/health").json() == {"status": "ok"}
    props = httpx.get(llama_server.url + "/props").json()
    assert props["model"]["id"] == "tiny" and props["model"]["num_layers"] == 4
    assert props["placement"] == [{"device": "cpu", "layers": [0, 4], "remote": False}]
    assert props["shards"] == [] and props["kvflash"] == {"enabled": False, "stages": []}
    assert props["limits"]["max_ctx"] == 512 and props["capabilities"]["tools"] is True
    assert props["speculative"]["enabled"] in (False, True) and "prefix" in props["cache"]


def test_greedy_deterministic_and_stream_equals_nonstream(client):
    a = chat_text(client, extra_body=NOEOS)
    b = chat_text(client, extra_body=NOEOS)
    s = chat_text(client, stream=True, extra_body=NOEOS)
    assert a[0] and a[0] == b[0] == s[0]
    assert a[1] == s[1] == "length"
    assert a[2].completion_tokens == s[2].completion_tokens == 12
    assert a[2].prompt_tokens == s[2].prompt_tokens


def test_usage_matches_tokenizer(client, llama_server):
    text, _, usage = chat_text(client)
    tok = httpx.post(llama_server.url + "/tokenize", json={"messages": MSGS}).json()
    assert usage.prompt_tokens == tok["count"] == len(tok["tokens"])
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 0 <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    detok = httpx.post(llama_server.url + "/detokenize", json={"tokens": tok["tokens"]}).json()
    assert detok["content"].endswith("<|im_start|>assistant\n") and "Count to five" in detok["content"]


def test_prefix_cache_hit_equals_miss(client, llama_server):
    if not httpx.get(llama_server.url + "/props").json()["cache"]["prefix"]["enabled"]:
        pytest.skip("prefix cache disabled")
    msgs = [{"role": "user", "content": "Tell me a story about a cat."},
            {"role": "assistant", "content": "Once there was a cat."}, {"role": "user", "content": "And then?"}]
    first = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0,
                                           extra_body=NOEOS)
    again = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0,
                                           extra_body=NOEOS)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].message.content == first.choices[0].message.content


def test_max_tokens_gives_length_in_both_modes(client):
    for stream in (False, True):
        text, finish, usage = chat_text(client, stream=stream, max_completion_tokens=3, extra_body=NOEOS)
        assert finish == "length" and usage.completion_tokens == 3


def test_stop_strings_in_both_modes(client):
    full = chat_text(client, max_tokens=24, extra_body=NOEOS)[0]
    assert len(full) > 12, full
    stop = full[5:9]
    expect = full[:full.index(stop)]
    for stream in (False, True):
        text, finish, _ = chat_text(client, stream=stream, max_tokens=24, stop=[stop, "zzzz-never"],
                                    extra_body=NOEOS)
        assert (text, finish) == (expect, "stop")


def test_seed_reproducible(client):
    kw = dict(temperature=1.0, top_p=0.95, max_tokens=10, extra_body=NOEOS)
    a = chat_text(client, seed=7, **kw)[0]
    assert a == chat_text(client, seed=7, **kw)[0] == chat_text(client, stream=True, seed=7, **kw)[0]
    assert a != chat_text(client, seed=8, **kw)[0]


def test_logprobs(client):
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body=NOEOS)
    entries = r.choices[0].logprobs.content
    assert len(entries) == 4
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].token == e.token  # greedy picks the most likely token
    assert "".join(e.token for e in entries) == r.choices[0].message.content
    streamed = [e for ch in client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2, stream=True,
        extra_body=NOEOS) for c in ch.choices if c.logprobs and c.logprobs.content for e in c.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries]


def test_n_choices_sequential(client):
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=5, temperature=1.0, seed=3, n=2,
                                       extra_body=NOEOS)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 10
    idx = {c.index for ch in client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=3, n=2,
                                                            stream=True) for c in ch.choices}
    assert idx == {0, 1}


def test_completions(client, loose):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0, extra_body=NOEOS)
    r = client.completions.create(**kw)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
    streamed = "".join(c.choices[0].text for c in loose.completions.create(stream=True, **kw) if c.choices)
    assert streamed == r.choices[0].text
    echo = client.completions.create(echo=True, logprobs=2, **kw)
    assert echo.choices[0].text == "Once upon a time" + r.choices[0].text
    assert len(echo.choices[0].logprobs.tokens) == 6
    multi = client.completions.create(**{**kw, "prompt": ["a b c", "d e f"]}, n=2)
    assert [c.index for c in multi.choices] == [0, 1, 2, 3]
    ids = client.completions.create(**{**kw, "prompt": [1, 2, 3]})
    assert ids.usage.prompt_tokens == 3


def test_responses(client):
    kw = dict(model="tiny", input=MSGS[1]["content"], instructions=MSGS[0]["content"], max_output_tokens=12,
              temperature=0)
    r = client.responses.create(**kw, extra_body=NOEOS)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == chat_text(client, extra_body=NOEOS)[0]  # same prompt as chat
    assert r.usage.output_tokens == 12
    # a stop string ends it early: status "completed" (extension field, as in chat)
    stop = {"stop": [r.output_text[4:7]], **NOEOS}
    r2 = client.responses.create(**kw, extra_body=stop)
    assert r2.status == "completed" and r2.output_text == r.output_text[:r.output_text.index(stop["stop"][0])]
    with client.responses.stream(**kw, extra_body=stop) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert final.output_text == "".join(deltas) == r2.output_text
    assert final.usage.output_tokens == r2.usage.output_tokens
    events = [e.type for e in client.responses.create(**kw, stream=True, extra_body=NOEOS)]
    assert events[0] == "response.created" and events[-1] == "response.incomplete"
    assert "response.output_text.delta" in events and "response.output_item.done" in events


def test_context_overflow_is_400_with_numbers(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=100_000)
    msg = e.value.body["message"]
    assert "100000" in msg and "512" in msg
    # without max_tokens the default is clamped to what fits: no error
    assert client.chat.completions.create(model="tiny", messages=MSGS, temperature=0,
                                          extra_body={"ignore_eos": False}).choices[0].finish_reason


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-nope", messages=MSGS, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-nope")


def test_metrics(client, llama_server):
    chat_text(client, stream=True)
    text = httpx.get(llama_server.url + "/metrics").text
    for name in ("dflash_requests_total", "dflash_time_to_first_token_seconds_count",
                 "dflash_inter_token_latency_seconds_bucket", "dflash_generated_tokens_total",
                 "dflash_prompt_tokens_total", "dflash_queue_depth", "dflash_decode_tokens_per_second_count",
                 "dflash_spec_accepted_tokens_total", "dflash_prefix_cache_hits_total"):
        assert name in text, name
    assert 'route="/v1/chat/completions",status="200"' in text
