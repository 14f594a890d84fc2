"""Hostile-input review (2026-11-27). A streamed Responses answer whose tool call is cut off by max_output_tokens (after its
first argument) stores a ``None`` output placeholder in the conversation: continuing it by
``previous_response_id`` is a 500 (forever: the stored response is poisoned), and the
stream's output_index of the item after the cut call disagrees with the final output."""
import json

import httpx
import pytest

from server.scripted import scripted_server

# the Qwen3.5 template opens a think block; the call is long enough to be cut mid-way
CUT = ("ok\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
       "<parameter=days>\n3\n</parameter>\n<parameter=note>\n" + "word " * 60 + "\n</parameter>\n"
       "</function>\n</tool_call>")
TOOLS = [{"type": "function", "name": "get_weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                           "note": {"type": "string"}}}}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = scripted_server(tmp_path_factory, {"cut": CUT, "two": "ok\n</think>\n\nSecond."})
    yield s
    s.stop()


def _stream(srv, body):
    events = []
    with httpx.stream("POST", srv.url + "/v1/responses", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
    return events


def _cut(srv):
    events = _stream(srv, {"input": "Weather? SCRIPT=cut", "tools": TOOLS, "max_output_tokens": 40, "stream": True})
    assert events[-1]["type"] == "response.incomplete"
    return events, events[-1]["response"]


def test_output_indexes_match_the_final_output(srv):
    events, resp = _cut(srv)
    # every output_item.done names the index its item has in the final output
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [e["item"]["id"] for e in done] == [o["id"] for o in resp["output"]]
    assert [e["output_index"] for e in done] == list(range(len(resp["output"])))
    # the announced call closes as incomplete, with what it streamed; its text follows as a message
    types = [o["type"] for o in resp["output"]]
    assert types == ["reasoning", "function_call", "message"], types
    call, msg = resp["output"][1], resp["output"][2]
    assert call["type"] == "function_call" and call["status"] == "incomplete" and call["name"] == "get_weather"
    assert call["arguments"] and msg["type"] == "message" and "<tool_call>" in msg["content"][0]["text"]


def test_continuing_a_streamed_response_with_a_cut_call(srv):
    _, resp = _cut(srv)
    r = httpx.post(srv.url + "/v1/responses", json={"input": "More SCRIPT=two", "previous_response_id": resp["id"]},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["output"][-1]["content"][0]["text"] == "Second."
