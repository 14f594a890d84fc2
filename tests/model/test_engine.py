"""Engine semantics on a tiny model: stop strings, max_tokens, logprobs, streaming events,
cancellation, seeds."""
import pytest

from dflash_server.engine.generate import Engine, GenerationRequest
from dflash_server.engine.sampling import SamplingParams
from helpers.build import pipeline, prompt_ids


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return Engine(pipeline(tiny_dir("llama")))


def test_max_tokens_gives_length(engine):
    ids = prompt_ids(engine.pipeline, 12)
    r = engine.generate(GenerationRequest(tuple(ids), max_tokens=7, ignore_eos=True))
    assert r.finish_reason == "length" and r.completion_tokens == 7


def test_stream_events_concatenate_to_text(engine):
    ids = prompt_ids(engine.pipeline, 12)
    events = []
    r = engine.generate(GenerationRequest(tuple(ids), max_tokens=20, ignore_eos=True), on_event=events.append)
    assert "".join(e.text for e in events) == r.text
    assert [e.token_id for e in events if e.token_id >= 0] == r.token_ids


def test_stop_string_truncates_in_both_modes(engine):
    ids = prompt_ids(engine.pipeline, 12)
    full = engine.generate(GenerationRequest(tuple(ids), max_tokens=30, ignore_eos=True)).text
    assert len(full) > 10
    stop = full[6:9]
    events = []
    r = engine.generate(GenerationRequest(tuple(ids), max_tokens=30, ignore_eos=True, stop=(stop,)),
                        on_event=events.append)
    assert r.finish_reason == "stop" and r.stop_reason == stop
    assert r.text == full[:full.index(stop)]
    assert "".join(e.text for e in events) == r.text


def test_logprobs(engine):
    ids = prompt_ids(engine.pipeline, 12)
    r = engine.generate(GenerationRequest(tuple(ids), max_tokens=5, ignore_eos=True, logprobs=3))
    assert len(r.logprobs) == 5
    for ev, tok in zip(r.logprobs, r.token_ids):
        assert ev.token_id == tok and ev.logprob <= 0
        assert len(ev.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert ev.top_logprobs[0][0] == tok and abs(ev.top_logprobs[0][1] - ev.logprob) < 1e-5


def test_cancel_stops_within_a_step(engine):
    ids = prompt_ids(engine.pipeline, 12)
    n = []
    r = engine.generate(GenerationRequest(tuple(ids), max_tokens=50, ignore_eos=True),
                        on_event=lambda e: n.append(e), cancelled=lambda: len(n) >= 3)
    assert r.finish_reason == "cancelled" and r.completion_tokens == 3


def test_seeded_sampling_reproducible(engine):
    ids = prompt_ids(engine.pipeline, 12)
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=123)
    a = engine.generate(GenerationRequest(tuple(ids), p, max_tokens=12, ignore_eos=True)).token_ids
    b = engine.generate(GenerationRequest(tuple(ids), p, max_tokens=12, ignore_eos=True)).token_ids
    c = engine.generate(GenerationRequest(tuple(ids), SamplingParams(temperature=1.0, top_p=0.9, seed=7),
                                          max_tokens=12, ignore_eos=True)).token_ids
    assert a == b and a != c


def test_eos_stops_unless_ignored(engine):
    eos = engine.tokenizer.eos_token_ids[0]
    ids = prompt_ids(engine.pipeline, 12)
    first = engine.generate(GenerationRequest(tuple(ids), max_tokens=1, ignore_eos=True)).token_ids[0]
    r = engine.generate(GenerationRequest(tuple(ids), max_tokens=10, stop_token_ids=(first,)))
    assert r.finish_reason == "stop" and r.token_ids == [first] and r.text == ""
    assert eos in engine.tokenizer.eos_token_ids


def test_think_budget_forces_close(engine):
    tok = engine.tokenizer
    ids = prompt_ids(engine.pipeline, 12)
    close = tuple(tok.encode("</think>"))
    free = engine.generate(GenerationRequest(tuple(ids), max_tokens=20, ignore_eos=True)).token_ids
    r = engine.generate(GenerationRequest(tuple(ids), max_tokens=20, ignore_eos=True, think_budget=4,
                                          think_open=True, think_close_ids=close))
    # 4 free thinking tokens, then the forced close, then generation continues
    assert r.token_ids[:4] == free[:4]
    assert tuple(r.token_ids[4:4 + len(close)]) == close
    assert len(r.token_ids) == 20


def test_warm_up_fits_a_tiny_context(tiny_dir):
    """Hostile review (2026-11-27): ``serve --compile --max-ctx 10`` died at start: the warm-up
    prompt (11 tokens) did not fit the context. It is cut to fit now."""
    from dflash_server.cli.common import load_engine
    from dflash_server.engine.config import EngineConfig

    for ctx in (10, 2):
        _, _, eng = load_engine(EngineConfig(model=str(tiny_dir("llama")), max_ctx=ctx, dtype="fp32"), progress=False)
        try:
            assert eng.warm_up().completion_tokens >= 1
        finally:
            eng.close()
