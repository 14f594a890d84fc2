"""Tool calls, reasoning, Unicode and engine failures through all three APIs, with the
official clients, on scripted model output (Qwen3.5 tokenizer and chat template)."""
import json

import anthropic
import httpx
import openai
import pytest

from .scripted import ThreadServer, official_clients, scripted_server

XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n</function>\n</tool_call>")
SCRIPTS = {
    "xml_tool": "The user wants the weather.\n</think>\n\n" + XML_CALL,
    "json_tool": 'Let me look.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                 '"days": 3}}\n</tool_call>',
    "two_tools": "Two cities.\n</think>\n\n" + XML_CALL + "\n" + XML_CALL.replace("Paris", "Rome"),
    "malformed": "Checking.\n</think>\n\nSure <tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
    "unicode": "Préparation… 🧠\n</think>\n\nhéllo wörld 🌍 ∑ 日本語 — ok",
    "forced": "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    "answer": "Sunny, 21 degrees in Paris.",
    "fail_early": "FAIL_EARLY",
    "fail_mid": "FAIL_MID:Some text that will not finish",
}
ARGS = {"city": "Paris", "days": 3}
TOOL = {"name": "get_weather", "description": "Weather forecast",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]}}
CHAT_TOOLS = [{"type": "function", "function": TOOL}]
RESP_TOOLS = [{"type": "function", **TOOL}]
ANTH_TOOLS = [{"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}]
THINK = {"type": "enabled", "budget_tokens": 50}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = scripted_server(tmp_path_factory, SCRIPTS)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oa(srv):
    return official_clients(srv.url)[0]


@pytest.fixture(scope="module")
def an(srv):
    return official_clients(srv.url)[1]


def ask(script):
    return f"What is the weather in Paris? SCRIPT={script}"


def chat(oa, script, stream=False, **kw):
    args = dict(model="scripted", messages=[{"role": "user", "content": ask(script)}], max_tokens=200,
                tools=CHAT_TOOLS) | kw
    if not stream:
        c = oa.chat.completions.create(**args).choices[0]
        m = c.message
        calls = [(t.id, t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls or []]
        return m.content, getattr(m, "reasoning_content", None), calls, c.finish_reason
    content, reasoning, calls, finish = [], [], {}, None
    for ch in oa.chat.completions.create(stream=True, **args):
        for c in ch.choices:
            d = c.delta
            content.append(d.content or "")
            reasoning.append((d.model_extra or {}).get("reasoning_content") or "")
            for t in d.tool_calls or []:
                cur = calls.setdefault(t.index, {"id": "", "name": "", "args": ""})
                cur["id"] += t.id or ""
                cur["name"] += t.function.name or ""
                cur["args"] += t.function.arguments or ""
            finish = c.finish_reason or finish
    calls = [(c["id"], c["name"], json.loads(c["args"])) for _, c in sorted(calls.items())]
    return "".join(content) or None, "".join(reasoning) or None, calls, finish


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("script", ["xml_tool", "json_tool"])
def test_chat_tool_calls(oa, script, stream):
    content, reasoning, calls, finish = chat(oa, script, stream)
    assert finish == "tool_calls" and content is None
    assert reasoning == SCRIPTS[script].split("\n</think>")[0]
    assert [(n, a) for _, n, a in calls] == [("get_weather", ARGS)] and calls[0][0].startswith("call_")


def test_chat_parallel_calls(oa):
    assert [a["city"] for _, _, a in chat(oa, "two_tools")[2]] == ["Paris", "Rome"]
    assert [a["city"] for _, _, a in chat(oa, "two_tools", stream=True)[2]] == ["Paris", "Rome"]
    assert [a["city"] for _, _, a in chat(oa, "two_tools", parallel_tool_calls=False)[2]] == ["Paris"]


def test_malformed_call_is_not_leaked_half_parsed(oa):
    expect = "Sure <tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
    for stream in (False, True):
        content, reasoning, calls, finish = chat(oa, "malformed", stream)
        assert (content, reasoning, calls, finish) == (expect, "Checking.", [], "stop")


def test_unicode_stream_equals_nonstream(oa, an):
    a = chat(oa, "unicode", tools=None)
    b = chat(oa, "unicode", stream=True, tools=None)
    assert a == b and a[0] == "héllo wörld 🌍 ∑ 日本語 — ok" and a[1] == "Préparation… 🧠"
    with an.messages.stream(model="scripted", max_tokens=100, thinking=THINK,
                            messages=[{"role": "user", "content": ask("unicode")}]) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[1].text == a[0]


@pytest.mark.parametrize("stream", [False, True])
def test_responses_tool_call(oa, stream):
    kw = dict(model="scripted", input=ask("xml_tool"), tools=RESP_TOOLS, reasoning={"effort": "high"})
    if stream:
        with oa.responses.stream(**kw) as s:
            types = [e.type for e in s]
            r = s.get_final_response()
        assert "response.function_call_arguments.done" in types and "response.reasoning_text.delta" in types
    else:
        r = oa.responses.create(**kw)
    assert [o.type for o in r.output] == ["reasoning", "function_call"]
    assert r.output[0].content[0].text == "The user wants the weather."
    fc = r.output[1]
    assert fc.name == "get_weather" and json.loads(fc.arguments) == ARGS and fc.call_id.startswith("call_")
    assert r.status == "completed"


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_tool_use(an, stream):
    kw = dict(model="scripted", max_tokens=200, tools=ANTH_TOOLS, thinking=THINK,
              messages=[{"role": "user", "content": ask("xml_tool")}])
    if stream:
        with an.messages.stream(**kw) as s:
            m = s.get_final_message()
    else:
        m = an.messages.create(**kw)
    assert m.stop_reason == "tool_use"
    assert [b.type for b in m.content] == ["thinking", "tool_use"]
    assert m.content[0].thinking == "The user wants the weather."
    use = m.content[1]
    assert use.name == "get_weather" and use.input == ARGS and use.id.startswith("toolu_")


def test_tool_results_fed_back_identically_in_all_apis(srv, oa, an):
    """Second turn: the assistant's call and the tool's result, in each API's own shape,
    must reach the model as the same template-rendered prompt."""
    q, result = "What is the weather in Paris? SCRIPT=answer", "Sunny, 21 C"
    oa.chat.completions.create(model="scripted", max_tokens=50, tools=CHAT_TOOLS, messages=[
        {"role": "user", "content": q},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": result}],
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    p_chat = srv.engine.prompts[-1]
    oa.responses.create(model="scripted", max_output_tokens=50, tools=RESP_TOOLS, reasoning={"effort": "none"}, input=[
        {"role": "user", "content": q},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": json.dumps(ARGS)},
        {"type": "function_call_output", "call_id": "call_1", "output": result}])
    p_resp = srv.engine.prompts[-1]
    m = an.messages.create(model="scripted", max_tokens=50, tools=ANTH_TOOLS, messages=[
        {"role": "user", "content": q},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": ARGS}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": result}]}])
    p_anth = srv.engine.prompts[-1]
    assert p_chat == p_resp == p_anth
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>" in p_chat
    assert f"<tool_response>\n{result}\n</tool_response>" in p_chat and '"name": "get_weather"' in p_chat
    assert m.content[0].text == SCRIPTS["answer"] and m.stop_reason == "end_turn"


def test_forced_tool_choice(srv, oa):
    for choice in ({"type": "function", "function": {"name": "get_weather"}},):
        content, reasoning, calls, finish = chat(oa, "forced", tool_choice=choice)
        assert srv.engine.prompts[-1].endswith("</think>\n\n<tool_call>\n<function=get_weather>\n")
        assert finish == "tool_calls" and [(n, a) for _, n, a in calls] == [("get_weather", ARGS)]
    chat(oa, "forced", tool_choice="required")
    assert srv.engine.prompts[-1].endswith("<tool_call>\n")
    content, _, calls, _ = chat(oa, "json_tool", tool_choice="none")
    assert calls == [] and "<tool_call>" in content and "get_weather" not in srv.engine.prompts[-1]


def test_thinking_switches_reach_the_template(srv, oa, an):
    chat(oa, "answer", tools=None, reasoning_effort="none")
    assert srv.engine.prompts[-1].endswith("<think>\n\n</think>\n\n")
    chat(oa, "answer", tools=None)  # the template's default: thinking on
    assert srv.engine.prompts[-1].endswith("<think>\n")
    an.messages.create(model="scripted", max_tokens=20, messages=[{"role": "user", "content": ask("answer")}])
    assert srv.engine.prompts[-1].endswith("</think>\n\n")  # Anthropic: off unless asked
    an.messages.create(model="scripted", max_tokens=200, thinking=THINK,
                       messages=[{"role": "user", "content": ask("answer")}])
    assert srv.engine.prompts[-1].endswith("<think>\n")


def test_engine_failures_are_errors_never_partial_200(srv, oa, an):
    for script in ("fail_early", "fail_mid"):
        with pytest.raises(openai.InternalServerError):
            chat(oa, script)
        r = httpx.post(srv.url + "/v1/messages", json={"model": "scripted", "max_tokens": 50,
                                                       "messages": [{"role": "user", "content": ask(script)}]})
        assert r.status_code == 500 and r.json()["error"]["type"] == "api_error"
    with pytest.raises(openai.InternalServerError):  # failed before streaming began: a real 500
        chat(oa, "fail_early", stream=True)
    with pytest.raises(openai.APIError):  # failed mid-stream: an error event the SDK raises
        chat(oa, "fail_mid", stream=True)
    with pytest.raises(anthropic.APIStatusError):
        with an.messages.stream(model="scripted", max_tokens=50,
                                messages=[{"role": "user", "content": ask("fail_mid")}]) as s:
            s.get_final_message()
    events = [e.type for e in oa.responses.create(model="scripted", input=ask("fail_mid"), stream=True)]
    assert events[-2:] == ["error", "response.failed"]
    assert chat(oa, "answer", tools=None, reasoning_effort="none")[0] == SCRIPTS["answer"]  # it carries on


def test_chat_template_file_overrides_the_model_template(srv):
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "
    other = ThreadServer(srv.engine, chat_template=template)
    try:
        r = httpx.post(other.url + "/v1/chat/completions", json={"messages": [
            {"role": "developer", "content": "Be brief."}, {"role": "user", "content": ask("answer")}]})
        assert r.status_code == 200
        assert srv.engine.prompts[-1] == f"[system] Be brief.\n[user] {ask('answer')}\n[assistant] "
        assert r.json()["choices"][0]["message"]["content"] == SCRIPTS["answer"]
    finally:
        other.stop()


def test_one_log_line_per_request(srv, oa, an, caplog):
    """Each finished request logs one info line (endpoint, prompt and cached tokens, TTFT,
    output tokens and speed, finish reason); a failed one logs its reason."""
    import logging

    with caplog.at_level(logging.INFO, logger="dflash_server.requests"):
        chat(oa, "answer")
        an.messages.create(model="scripted", max_tokens=50, messages=[{"role": "user", "content": ask("answer")}])
        with pytest.raises(openai.APIError):
            chat(oa, "fail_early")
    lines = [r.getMessage() for r in caplog.records if r.name == "dflash_server.requests"]
    assert len(lines) == 3, lines
    assert lines[0].startswith("chat: ") and "prompt tokens" in lines[0] and "ttft" in lines[0] \
        and "finish stop" in lines[0], lines[0]
    assert lines[1].startswith("messages: ") and "tok/s" in lines[1], lines[1]
    assert lines[2].startswith("chat failed after") and "Error: " in lines[2], lines[2]


@pytest.fixture(scope="module")
def paced(tmp_path_factory):
    """The scripted engine at a slow decode's pace (a token every 40 ms), so tokens reach the
    client in separate steps as a real model's do. (At 10 ms a loaded CI machine's event loop
    fell behind and sent the Anthropic arguments as one coalesced burst, as the server does
    with the tokens of one speculative step: Job.next_batch.)"""
    from .scripted import ScriptedEngine, ThreadServer, qwen35_tokenizer

    s = ThreadServer(ScriptedEngine(qwen35_tokenizer(tmp_path_factory), SCRIPTS, delay_s=0.04))
    yield official_clients(s.url)
    s.stop()


@pytest.mark.parametrize("script", ["xml_tool", "json_tool"])
def test_tool_arguments_stream_through_the_sdk_helpers(paced, script):
    """Arguments arrive in several deltas (one per argument, then the closing brace) and each
    SDK's stream helper assembles the call: OpenAI chat, Responses and Anthropic."""
    oa, an = paced
    msgs = [{"role": "user", "content": ask(script)}]
    with oa.chat.completions.stream(model="scripted", messages=msgs, max_tokens=200, tools=CHAT_TOOLS) as s:
        events = list(s)
        final = s.get_final_completion()
    deltas = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    assert len(deltas) >= 3, [e.type for e in events]
    call = final.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGS
    assert "".join(e.arguments_delta for e in deltas) == call.function.arguments

    with oa.responses.stream(model="scripted", input=ask(script), tools=RESP_TOOLS) as s:
        events = list(s)
        r = s.get_final_response()
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) >= 3 and "".join(e.delta for e in deltas) == r.output[-1].arguments
    assert json.loads(r.output[-1].arguments) == ARGS and [o.type for o in r.output][-1] == "function_call"

    with an.messages.stream(model="scripted", max_tokens=200, tools=ANTH_TOOLS, messages=msgs) as s:
        events = list(s)
        m = s.get_final_message()
    parts = [e for e in events if e.type == "input_json"]
    assert len(parts) >= 3 and parts[-1].snapshot == ARGS
    assert m.content[-1].type == "tool_use" and m.content[-1].input == ARGS
