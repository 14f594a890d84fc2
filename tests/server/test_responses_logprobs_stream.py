"""Hostile review (2026-11-27). Responses ``top_logprobs``: the non-streamed response carries each token's logprobs on its
output_text part; the streamed one never does (every delta, the done event and the final
response say ``logprobs: []``), so stream != non-stream."""
import json

import httpx
import pytest

from server.serverproc import ServerProc


@pytest.fixture(scope="module")
def srv():
    s = ServerProc("--threads", "1")
    yield s
    assert s.stop() == 0, s.output()


def test_streamed_responses_carry_logprobs(srv):
    body = {"input": "Say hi", "max_output_tokens": 6, "top_logprobs": 2, "temperature": 0}
    whole = httpx.post(srv.url + "/v1/responses", json=body, timeout=60).json()
    want = whole["output"][0]["content"][0]["logprobs"]
    assert len(want) == 6
    deltas, final = [], None
    with httpx.stream("POST", srv.url + "/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                e = json.loads(line[5:])
                if e["type"] == "response.output_text.delta":
                    deltas += e["logprobs"]
                if e["type"] in ("response.completed", "response.incomplete"):
                    final = e["response"]
    assert [d["token"] for d in deltas] == [w["token"] for w in want]
    assert final["output"][0]["content"][0]["logprobs"] == want
