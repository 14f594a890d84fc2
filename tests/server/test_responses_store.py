"""Responses state: ``store`` (default on), ``previous_response_id``, ``GET``/``DELETE
/v1/responses/{id}`` with the official client; a continued conversation replays the stored
turns (and, on a real model, hits the prefix cache); hostile ids are clear 4xx."""
from __future__ import annotations

import httpx
import openai
import pytest

from dflash_server.server.response_store import ResponseStore

from .conftest import start_tiny
from .scripted import official_clients, scripted_server

# (the Qwen3.5 template opens a think block: each script closes it)
SCRIPTS = {"one": "ok\n</think>\n\nFirst answer.", "two": "ok\n</think>\n\nSecond answer.",
           "three": "ok\n</think>\n\nThird answer.", "think": "Hmm, a thought.\n</think>\n\nThought through."}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = scripted_server(tmp_path_factory, SCRIPTS)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oa(srv):
    return official_clients(srv.url)[0]


def test_three_turns_by_previous_response_id(srv, oa):
    r1 = oa.responses.create(model="scripted", instructions="Be brief.", input="Hello SCRIPT=one")
    r2 = oa.responses.create(model="scripted", input="More SCRIPT=two", previous_response_id=r1.id)
    prompt2 = srv.engine.prompts[-1]
    # the first turn and its answer are replayed; its instructions are not carried over
    assert "Hello SCRIPT=one" in prompt2 and "First answer." in prompt2 and "Be brief." not in prompt2
    r3 = oa.responses.create(model="scripted", input=[{"role": "user", "content": "Last SCRIPT=three"}],
                             previous_response_id=r2.id, stream=True)
    done = [e for e in r3 if e.type == "response.completed"][0].response
    prompt3 = srv.engine.prompts[-1]
    assert prompt3.index("First answer.") < prompt3.index("Second answer.") < prompt3.index("Last SCRIPT=three")
    assert r2.previous_response_id == r1.id and done.previous_response_id == r2.id and done.output_text == \
        "Third answer."
    got = oa.responses.retrieve(done.id)  # a streamed response is stored too
    assert got.id == done.id and got.output_text == "Third answer."


def test_reasoning_and_calls_are_replayed(srv, oa):
    r1 = oa.responses.create(model="scripted", input="Think SCRIPT=think", reasoning={"effort": "low"})
    assert [o.type for o in r1.output] == ["reasoning", "message"]
    oa.responses.create(model="scripted", input="Next SCRIPT=one", previous_response_id=r1.id)
    assert "Thought through." in srv.engine.prompts[-1]


def test_get_delete_and_not_found(srv, oa):
    r = oa.responses.create(model="scripted", input="Hi SCRIPT=one")
    assert oa.responses.retrieve(r.id).output_text == "First answer."
    oa.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        oa.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        oa.responses.create(model="scripted", input="x", previous_response_id="resp_unknown")
    assert e.value.body["param"] == "previous_response_id"
    kept = oa.responses.create(model="scripted", input="Hi SCRIPT=one", store=False)
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(kept.id)


@pytest.mark.parametrize("body, status", [
    ({"input": "x", "previous_response_id": ""}, 400),
    ({"input": "x", "previous_response_id": "r" * 300}, 400),
    ({"input": "x", "previous_response_id": 12}, 400),
    ({"input": "x", "conversation": {"id": "conv_1"}}, 400),
    ({"input": "x", "previous_response_id": "../../etc/passwd"}, 404),
    ({"input": "x", "store": "yes"}, 400),
])
def test_hostile_fields(srv, body, status):
    r = httpx.post(srv.url + "/v1/responses", json={"model": "scripted", **body}, timeout=30)
    assert r.status_code == status and "error" in r.json(), r.text


@pytest.mark.parametrize("rid", ["resp_nope", "x" * 5000, "%00", "a/b"])
def test_hostile_ids_on_get_and_delete(srv, rid):
    for method in ("GET", "DELETE"):
        r = httpx.request(method, srv.url + "/v1/responses/" + rid, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["message"], (method, r.text)


def test_store_is_bounded():
    store = ResponseStore(max_items=3, max_bytes=10_000)
    for i in range(5):
        store.put(f"r{i}", {"id": f"r{i}"}, [{"type": "message", "content": "x" * 100}])
    assert len(store) == 3 and store.get("r0") is None and store.get("r4") is not None
    store.get("r2")                        # used: r3 is now the oldest
    store.put("r5", {"id": "r5"}, [])
    assert store.get("r3") is None and store.get("r2") is not None
    store.put("big", {"id": "big"}, [{"content": "y" * 20_000}])  # larger than the whole store: not kept
    assert store.get("big") is None and store.bytes <= 10_000
    store.put("fill", {"id": "fill"}, [{"content": "z" * 6_000}])
    store.put("fill2", {"id": "fill2"}, [{"content": "z" * 6_000}])  # both do not fit: the older goes
    assert store.bytes <= 10_000 and store.get("fill") is None and store.get("fill2") is not None


def test_continued_conversation_hits_the_prefix_cache(tiny_dir):
    srv = start_tiny(tiny_dir, "llama")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        prev, cached = None, []
        for q in ("Describe the sea in a few words.", "Why is it salty?", "And the rivers?"):
            kw = {"previous_response_id": prev} if prev else {}
            r = client.responses.create(model="tiny", input=q, max_output_tokens=6, temperature=0, **kw)
            cached.append(r.usage.input_tokens_details.cached_tokens)
            prev = r.id
        assert cached[0] == 0 and cached[1] > 0 and cached[2] > cached[1], cached
    finally:
        assert srv.stop() == 0, srv.output()
