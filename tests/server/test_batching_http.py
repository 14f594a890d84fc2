"""Continuous batching over HTTP: concurrent streamed requests (the official OpenAI client)
get exactly the text each gets alone, share engine steps, and show in /slots, /props and
/metrics."""
import re
import threading

import httpx
import pytest

from .conftest import start_tiny
from .scripted import official_clients

KEY = "batch-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
QUESTIONS = ["Tell me about the sea.", "Why is the sky blue?", "Name three birds.", "Count to five."]


@pytest.fixture(scope="module")
def srv(tiny_dir):
    # bf16 + int8: the native kernels, row-invariant, so concurrency cannot change a token
    s = start_tiny(tiny_dir, "llama", "--dtype", "bf16", "--quantize", "int8", "--parallel", "3",
                   "--api-key", KEY, "--step-tokens", "16")
    yield s
    assert s.stop() == 0, s.output()


def _stream(client, q: str, n: int) -> str:
    parts = []
    for chunk in client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": q}],
                                                max_tokens=n, temperature=0, stream=True,
                                                extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    return "".join(parts)


def _metric(srv, name: str) -> float:
    text = httpx.get(srv.url + "/metrics", headers=AUTH).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _concurrently(client, lengths: list[int]) -> list[str]:
    """The questions streamed at once, from threads released together (4 requests, 3 slots)."""
    got = [None] * len(QUESTIONS)
    gate = threading.Barrier(len(QUESTIONS))

    def run(i):
        gate.wait(30)
        got[i] = _stream(client, QUESTIONS[i], lengths[i])
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(QUESTIONS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return got


def test_concurrent_streams_equal_alone(srv):
    client, _ = official_clients(srv.url)
    client.api_key = KEY
    lengths = [40, 25, 33, 20]
    alone = [_stream(client, q, n) for q, n in zip(QUESTIONS, lengths)]
    # how much the requests overlap depends on when each one reaches the server (on a loaded
    # machine, one may end before the next arrives): every round must equal the requests
    # alone; one of a few rounds must show steps that ran several sequences' rows at once
    seen = []
    for _ in range(4):
        rows0, steps0 = _metric(srv, "dflash_engine_decode_rows_total"), _metric(srv, "dflash_engine_steps_total")
        assert _concurrently(client, lengths) == alone
        rows = _metric(srv, "dflash_engine_decode_rows_total") - rows0
        steps = _metric(srv, "dflash_engine_steps_total") - steps0
        seen.append((rows, steps))
        if rows > steps * 1.5:
            break
    else:
        pytest.fail(f"no round shared its steps (decode rows, steps per round): {seen}")
    assert _metric(srv, 'dflash_engine_batch_size_bucket{le="1.0"}') < _metric(srv, "dflash_engine_batch_size_count")


def test_slots_props_and_auth(srv):
    r = httpx.get(srv.url + "/slots", headers=AUTH)
    assert r.status_code == 200
    slots = r.json()
    assert [s["id"] for s in slots] == [0, 1, 2]
    assert all(s["n_ctx"] == 512 and s["is_processing"] is False and s["id_task"] == -1 for s in slots)
    assert httpx.get(srv.url + "/slots").status_code == 401   # the API key guards it
    props = httpx.get(srv.url + "/props", headers=AUTH).json()
    assert props["slots"]["slots_total"] == 3 and props["runtime"]["parallel"] == 3
    assert props["slots"]["step_tokens"] == 16
