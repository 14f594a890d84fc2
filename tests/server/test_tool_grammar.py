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
