"""A short request behind a long prefill, over HTTP, llama-server and ours side by side on the
same GGUF (the default model's), 2 threads, 3 slots each, prompt caches off, the servers taking
turns round by round:

    python benchmarks/mixed_ttft_http.py [--rounds 3] [--long-words 1500] [--out FILE]

Per round and server: a streamed request decoding (200 tokens), then a chat request with a long
prompt (``--long-words`` words, ~4.7 tokens a word), then 0.3 s later a short chat request.
Reported: each request's time to first token (medians over the rounds). In-process, without
HTTP and against our own earlier order: ``benchmarks/mixed_ttft.py``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))


async def first_token(client: httpx.AsyncClient, text: str, tokens: int, delay: float) -> float:
    """Seconds from sending a streamed chat request (after ``delay``) to its first content."""
    await asyncio.sleep(delay)
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": tokens, "ignore_eos": True,
            "stream": True, "cache_prompt": False, "temperature": 0.0}
    t0 = time.perf_counter()
    first = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and first is None:
                for c in json.loads(line[6:]).get("choices") or []:
                    if (c.get("delta") or {}).get("content"):
                        first = time.perf_counter() - t0
    return first if first is not None else float("nan")


async def one_round(url: str, long_text: str, r: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_keepalive_connections=0)) as client:
        stream = asyncio.create_task(first_token(client, f"Round {r}: describe a harbour at dawn.", 200, 0.0))
        long = asyncio.create_task(first_token(client, long_text, 4, 0.5))
        short = asyncio.create_task(first_token(client, f"Round {r}: what is 7 times 8?", 4, 0.8))
        await asyncio.gather(stream, long, short)
    return {"long_ttft_s": long.result(), "short_ttft_s": short.result()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--long-words", type=int, default=1500)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "mixed_ttft_http.json"))
    a = ap.parse_args()
    import serve_concurrency
    from server.serverproc import ServerProc

    from dflash_server.weights.default_model import default_model_path

    serve_concurrency.SLOTS, serve_concurrency.SLOT_CTX = 3, 8192   # llama-server -np 3 -c 24576
    gguf = str(default_model_path())
    long_text = "Summarise this record: " + " ".join(f"w{i}" for i in range(a.long_words))
    servers = {"llama-server -np 3": serve_concurrency.LlamaServer(gguf),
               "dflash-server --parallel 3": ServerProc("--parallel", "3", "--threads", "2", "--max-ctx", "8192",
                                                        "--prefix-cache-slots", "0")}
    res = {n: [] for n in servers}
    try:
        for name, srv in servers.items():   # warm-up
            asyncio.run(one_round(srv.url, "Summarise: " + " ".join(f"w{i}" for i in range(50)), -1))
        for r in range(a.rounds):
            for name in (list(servers) if r % 2 == 0 else list(servers)[::-1]):
                res[name].append(asyncio.run(one_round(servers[name].url, long_text, r)))
                print(name, res[name][-1], file=sys.stderr, flush=True)
    finally:
        for srv in servers.values():
            srv.stop()
    out = {"rounds": a.rounds, "long_words": a.long_words,
           "servers": {n: {"runs": v, **{k: round(statistics.median(x[k] for x in v), 3)
                                          for k in ("long_ttft_s", "short_ttft_s")}} for n, v in res.items()}}
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({n: {k: v[k] for k in ("long_ttft_s", "short_ttft_s")} for n, v in out["servers"].items()}))


if __name__ == "__main__":
    main()
