"""The engine as the HTTP server sees it (engine/serving.py): the real Engine and the tests'
scripted engine both implement every member, so the server reads them without probing."""
import inspect

from dflash_server.engine.generate import Engine
from dflash_server.engine.serving import ServingEngine
from helpers.build import pipeline
from server.scripted import ScriptedEngine


def _members(proto) -> set[str]:
    return {n for n in dir(proto) if not n.startswith("_")} | set(getattr(proto, "__annotations__", {}))


def test_engine_and_scripted_engine_implement_the_protocol(tiny_dir):
    pipe = pipeline(tiny_dir("llama"))
    engines = [Engine(pipe), ScriptedEngine(pipe.tokenizer, {})]
    for eng in engines:
        assert isinstance(eng, ServingEngine), type(eng)
        for name in _members(ServingEngine):
            assert hasattr(eng, name), (type(eng).__name__, name)
    real, scripted = engines
    assert real.stats()["slots_total"] == pipe.lanes and scripted.stats() is None
    assert real.health() == scripted.health() == {"status": "ok"}
    assert real.grammars is not None and scripted.grammars is None
    # the server calls these with the same arguments on both
    for name in ("submit", "generate"):
        assert list(inspect.signature(getattr(Engine, name)).parameters)[:4] == \
            list(inspect.signature(getattr(ScriptedEngine, name)).parameters)[:4]


def test_a_partial_engine_is_not_one():
    class Half:
        tokenizer = pipeline = scheduler = None

        def step(self):
            return []
    assert not isinstance(Half(), ServingEngine)
