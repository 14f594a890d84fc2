"""A grammar is compiled where it is checked (a thread of the server's pool), not on the
engine's thread: the engine's constraint starts from that compiled matcher (no second
compile: a large schema takes seconds, during which no sequence decodes), and building a
constraint imports nothing heavy (llguidance.torch pulls in torch._dynamo: seconds on the
first constrained request)."""
import json
import subprocess
import sys

import llguidance
import pytest

from dflash_server.engine.grammar import json_schema_grammar
from helpers.grammar import smol_compiler


def test_a_checked_grammar_is_not_compiled_again(monkeypatch):
    comp, tok = smol_compiler()
    g = json_schema_grammar({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(50)}})
    comp.check(g)
    other = json_schema_grammar({"type": "object", "properties": {"q": {"type": "string"}}})
    real, built = llguidance.LLMatcher, []

    def counting(*a, **k):
        built.append(1)
        return real(*a, **k)

    monkeypatch.setattr(llguidance, "LLMatcher", counting)
    c1, c2 = comp.constraint(g), comp.constraint(g)
    assert not built
    # each sequence has a matcher of its own, in the start state
    for t in tok.encode('{"p1":2}', add_bos=False):
        c1.consume(t)
    assert c1.matcher.is_accepting() and not c2.matcher.is_accepting()
    comp.check(g)  # checked again: still cached
    assert not built
    comp.constraint(other)  # never checked: compiled here
    assert built


def test_the_cache_is_bounded():
    comp, _ = smol_compiler()
    for i in range(comp.READY + 5):
        comp.check(json_schema_grammar({"type": "object", "properties": {f"k{i}": {"type": "integer"}}}))
    assert len(comp._ready) == comp.READY


def test_a_bad_grammar_is_refused_by_the_check():
    comp, _ = smol_compiler()
    with pytest.raises(ValueError, match="grammar"):
        comp.check(json.dumps({"grammars": [{"json_schema": {"type": "object", "minProperties": 3,
                                                             "maxProperties": 1}}]}))


def test_building_a_constraint_does_not_import_dynamo(tmp_path):
    code = ("import sys; sys.path.insert(0, 'tests')\n"
            "from helpers.grammar import smol_compiler\n"
            "from dflash_server.engine.grammar import json_schema_grammar\n"
            "comp, _ = smol_compiler(); comp.constraint(json_schema_grammar(None))\n"
            "assert 'torch._dynamo' not in sys.modules, 'dynamo imported'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
