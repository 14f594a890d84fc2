"""Grammars of forced tool calls (``tool_choice`` required / named), checked with llguidance
on the smol tokenizer: what they accept and what they refuse."""
from dflash_server.server.tools import make_toolset


def test_xml_number_bounds_are_enforced():
    """Qwen3.5's XML calls: an integer / number parameter's minimum, maximum (exclusive too)
    and multipleOf hold in a forced call."""
    from dflash_server.server.tool_grammar import tool_grammar
    from helpers.grammar import accepts, smol_compiler

    tools = make_toolset([{"name": "book", "parameters": {"type": "object", "required": ["nights", "rating"],
                                                         "properties": {
        "nights": {"type": "integer", "minimum": 1, "maximum": 14},
        "rating": {"type": "number", "exclusiveMinimum": 0, "maximum": 5, "multipleOf": 0.5}}}}],
        choice="function", forced_name="book")
    comp, _ = smol_compiler()
    g = tool_grammar(tools, "xml", comp.lark_text)

    def call(nights, rating):
        return (f"<parameter=nights>\n{nights}\n</parameter>\n<parameter=rating>\n{rating}\n</parameter>\n"
                "</function>\n</tool_call>")
    assert accepts(g, call(7, 4.5)) and accepts(g, call(14, 5)) and accepts(g, call(1, 0.5))
    for nights, rating in ((15, 4), (0, 4), (-2, 4), (3, 0), (3, 5.5), (3, 4.2)):
        assert not accepts(g, call(nights, rating)), (nights, rating)


def _auto_with_format():
    from dflash_server.engine.grammar import json_schema_grammar
    from dflash_server.server.tool_grammar import tool_grammar
    from helpers.grammar import smol_compiler

    tools = make_toolset([{"name": "get_time", "parameters": {
        "type": "object", "required": ["zone"], "properties": {"zone": {"enum": ["UTC", "CET"]}}}}],
        choice="auto", parallel=False)
    answer = json_schema_grammar({"type": "object", "required": ["city"], "additionalProperties": False,
                                  "properties": {"city": {"type": "string", "maxLength": 8}}})
    comp, _ = smol_compiler()
    return {fmt: tool_grammar(tools, fmt, comp.lark_text, answer) for fmt in ("json", "xml", "gemma4")}, answer


def test_format_with_tools_auto_is_the_answer_or_a_call():
    """tool_choice auto with a structured-output format: the output is the answer in that
    format or a well-formed call (Hermes JSON, Qwen3.5 XML, Gemma 4), nothing else."""
    from helpers.grammar import accepts

    grammars, _ = _auto_with_format()
    calls = {"json": '<tool_call>\n{"name":"get_time","arguments":{"zone":"CET"}}\n</tool_call>',
             "xml": "<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>",
             "gemma4": '<|tool_call>call:get_time{zone:<|"|>CET<|"|>}<tool_call|>'}
    for fmt, g in grammars.items():
        assert accepts(g, '{"city":"Paris"}'), fmt
        assert accepts(g, calls[fmt]), fmt
        assert not accepts(g, '{"city":"Paris, France"}'), fmt          # the answer's schema holds
        assert not accepts(g, '{"town":"Paris"}'), fmt
        assert not accepts(g, "The weather is fine."), fmt             # no free text
        wrong = calls[fmt].replace("get_time", "get_date")
        assert not accepts(g, wrong), fmt                              # only declared functions
    assert not accepts(grammars["json"], calls["json"].replace("CET", "PST"))


def test_format_with_forced_tools_is_the_call():
    """A forced call with a format: the grammar is the call's (the format shapes a later
    turn's answer), and tools with tool_choice none leave the format's grammar alone."""
    from dflash_server.server.tool_grammar import tool_grammar
    from helpers.grammar import smol_compiler

    _, answer = _auto_with_format()
    comp, _ = smol_compiler()
    spec = [{"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}]
    forced = make_toolset(spec, choice="required")
    assert tool_grammar(forced, "json", comp.lark_text, answer) == tool_grammar(forced, "json", comp.lark_text)
    assert tool_grammar(make_toolset(spec, choice="none"), "json", comp.lark_text, answer) == answer
    assert tool_grammar(make_toolset(spec, choice="auto"), "json", comp.lark_text, None) is None


def test_xml_parameter_names_the_format_cannot_carry_are_refused():
    """Hostile review (2026-11-27): a parameter name holding a newline or '>' cannot be read
    back from ``<parameter=NAME>``: a forced call came back as text with finish_reason stop.
    The grammar refuses such a schema (the server's 400 on ``tools``); JSON formats carry it."""
    import pytest

    from dflash_server.server.tool_grammar import tool_grammar
    from helpers.grammar import smol_compiler

    comp, _ = smol_compiler()
    for bad in ("a\n>b", "x>y", "<p"):
        tools = make_toolset([{"name": "f", "parameters": {"type": "object", "properties": {bad: {"type": "string"}}}}],
                             choice="required")
        with pytest.raises(ValueError, match="XML tool format"):
            tool_grammar(tools, "xml", comp.lark_text)
        assert tool_grammar(tools, "json", comp.lark_text) is not None
