"""Hostile review (2026-11-27). tool_choice required / a named function together with a reasoning effort (or Anthropic
thinking with a budget) on a model with think tokens: a 400 "a grammar constrains the whole
output: it does not combine with a think block", though the forced call's prompt already
closed the think block (enable_thinking: true without a budget is served)."""
import httpx
import pytest

from helpers.tiny import make_tiny_model
from server.serverproc import ServerProc

PARAMS = {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": PARAMS}}]
MSG = [{"role": "user", "content": "time?"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    d = make_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3"))
    s = ServerProc("--model", str(d), "--dtype", "fp32", "--max-ctx", "512", "--threads", "1", "--model-name", "tiny")
    yield s
    assert s.stop() == 0, s.output()


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": MSG, "tools": CHAT_TOOLS, "tool_choice": "required",
                              "reasoning_effort": "low", "max_tokens": 30}),
    ("/v1/chat/completions", {"messages": MSG, "tools": CHAT_TOOLS, "reasoning_effort": "minimal", "max_tokens": 30,
                              "tool_choice": {"type": "function", "function": {"name": "get_time"}}}),
    ("/v1/responses", {"input": "time?", "tools": [{"type": "function", "name": "get_time", "parameters": PARAMS}],
                       "tool_choice": "required", "reasoning": {"effort": "low"}, "max_output_tokens": 30}),
])
def test_forced_call_with_a_reasoning_effort(srv, path, body):
    r = httpx.post(srv.url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
