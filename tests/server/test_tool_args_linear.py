"""Hostile review (2026-11-27). A long JSON-format tool-call argument (a coding agent's write_file content) makes the
output parser rescan the whole unfinished argument on every token: quadratic CPU on the
event loop."""
import time

import httpx

from .scripted import ScriptedEngine, ThreadServer, qwen35_tokenizer

BODY = "x = 1\n" * 6000          # 36k characters of file content
JSON_CALL = 'Writing.\n</think>\n\n<tool_call>\n{"name": "write_file", "arguments": {"content": ' + \
    __import__("json").dumps(BODY) + '}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object", "properties": {"content": {"type": "string"}}}}}]


def test_long_json_tool_argument_costs_linear_time(tmp_path_factory):
    engine = ScriptedEngine(qwen35_tokenizer(tmp_path_factory), {"call": JSON_CALL, "text": "Writing.\n</think>\n\n" + BODY}, max_ctx=65536)
    s = ThreadServer(engine)
    try:
        def chat(script, tools):
            body = {"model": "scripted", "max_tokens": 60000,
                    "messages": [{"role": "user", "content": f"write it SCRIPT={script}"}]}
            if tools:
                body["tools"] = TOOLS
            t = time.monotonic()
            r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=600)
            assert r.status_code == 200
            return time.monotonic() - t, r.json()
        plain_s, _ = chat("text", False)
        call_s, out = chat("call", True)
        assert out["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "write_file"
        # the same number of tokens: parsing them as a call must not cost many times more
        print("plain", plain_s, "call", call_s)
        assert call_s < 3 * plain_s + 2, (plain_s, call_s)
    finally:
        s.stop()
