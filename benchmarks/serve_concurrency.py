"""Serving many users: llama.cpp's ``llama-server -np 4`` and ``dflash-server serve`` side by
side, on the same GGUF, at concurrency 1, 4 and 8, in one run.

    python benchmarks/serve_concurrency.py [--tokens 128] [--runs 2] [--with-draft] [--with-plain] [--out FILE]
                                           [-- <extra dflash-server flags>]

Both servers run with 2 threads and 4 sequence slots of 2048 tokens each (``-np 4 -c 8192``
vs ``--parallel 4 --max-ctx 2048``), prompt caching off on both sides (every request has its
own prompt as well), and are measured in alternation, each idle while the other runs. At
concurrency C, 2C streamed chat requests are sent with at most C in flight; each asks for
``--tokens`` tokens, ``ignore_eos``. Greedy (temperature 0) and sampled (temperature 0.8,
seeded) workloads. ``--with-draft`` adds our server with the shipped DFlash draft (the same
slots: a request decoding alone speculates, several decode batched) at concurrency 1 and 4.
Our default server on a CPU uses prompt lookup (``--lookup``, spec/lookup.py); ``--with-plain``
adds it with ``--no-draft`` (plain decoding, no lookup) beside it.

Reported per server, concurrency and workload: aggregate tok/s (all completion tokens /
wall time), median time to first token, median per-stream decode tok/s; medians over
``--runs``. Builds llama-server from the llama-cpp-python sdist the first time
(``benchmarks/llama_cpp.py``). Writes JSON (default benchmarks/results/serve_concurrency.json)
and prints a Markdown table.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
SLOTS, SLOT_CTX, THREADS = 4, 2048, 2
TOPICS = ["rivers", "mountains", "bridges", "libraries", "volcanoes", "harbours", "deserts", "forests",
          "glaciers", "islands", "canals", "lighthouses", "markets", "orchards", "railways", "windmills"]


def prompt(i: int) -> list[dict]:
    topic = TOPICS[i % len(TOPICS)]
    return [{"role": "user", "content": f"Request {i}: write a short essay about {topic}, with an introduction, "
                                        f"three paragraphs and a conclusion."}]


class LlamaServer:
    def __init__(self, gguf: str):
        import llama_cpp

        bin_dir = llama_cpp.ensure_built(targets=("llama-server",))
        from server.serverproc import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([str(bin_dir / "llama-server"), "-m", gguf, "--host", "127.0.0.1",
                                      "--port", str(self.port), "-t", str(THREADS), "-tb", str(THREADS),
                                      "-np", str(SLOTS), "-c", str(SLOTS * SLOT_CTX), "--no-webui"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("llama-server exited:\n" + Path(self.log.name).read_text()[-3000:])
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError("llama-server did not start")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)


async def stream_one(client: httpx.AsyncClient, i: int, tokens: int, sampled: bool):
    body = {"messages": prompt(i), "max_tokens": tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "cache_prompt": False,
            "temperature": 0.8 if sampled else 0.0}
    if sampled:
        body["seed"] = 1000 + i
    stamps, usage = [], None
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices") or []:
                if (c.get("delta") or {}).get("content"):
                    stamps.append(time.perf_counter())
    n = usage["completion_tokens"] if usage else len(stamps)
    return t0, stamps, n


async def workload(url: str, conc: int, tokens: int, sampled: bool, base: int) -> dict:
    """2 * conc requests, at most conc in flight."""
    sem = asyncio.Semaphore(conc)

    async def one(i):
        async with sem:
            return await stream_one(client, base + i, tokens, sampled)
    # a fresh connection per request: llama-server may close an idle keep-alive connection
    # just as the next request goes out on it ("Server disconnected without sending a response")
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=httpx.Limits(max_keepalive_connections=0)) \
            as client:
        w0 = time.perf_counter()
        res = await asyncio.gather(*(one(i) for i in range(2 * conc)))
        wall = time.perf_counter() - w0
    ttft = [st[0] - t0 for t0, st, _ in res if st]
    tps = [(n - 1) / (st[-1] - st[0]) for _, st, n in res if len(st) > 1 and st[-1] > st[0]]
    return {"aggregate_tok_s": sum(n for _, _, n in res) / wall, "ttft_s": statistics.median(ttft),
            "decode_tok_s": statistics.median(tps)}


def med(samples: list[dict]) -> dict:
    return {k: round(statistics.median(s[k] for s in samples), 3) for k in samples[0]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--concurrency", default="1,4,8")
    p.add_argument("--with-draft", action="store_true")
    p.add_argument("--with-plain", action="store_true", help="also our server with --no-draft (no prompt lookup)")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/serve_concurrency.json"))
    p.add_argument("flags", nargs="*", help="extra dflash-server flags (after --)")
    a = p.parse_args()
    from server.serverproc import ServerProc

    from dflash_server.weights.default_model import default_model_path

    gguf = str(default_model_path())
    concs = [int(c) for c in a.concurrency.split(",")]
    ours_flags = ["--threads", str(THREADS), "--max-ctx", str(SLOT_CTX), "--prefix-cache-slots", "0", *a.flags]
    servers = {"llama-server -np 4": LlamaServer(gguf),
               "dflash-server --parallel 4": ServerProc("--parallel", str(SLOTS), *ours_flags)}
    if a.with_plain:
        servers["dflash-server --no-draft"] = ServerProc("--parallel", str(SLOTS), "--no-draft", *ours_flags)
    if a.with_draft:
        servers["dflash-server --draft default"] = ServerProc("--parallel", str(SLOTS), "--draft", "default",
                                                              *ours_flags)
    load_before = os.getloadavg()[0]
    samples: dict = {}
    base = 0
    try:
        for name, srv in servers.items():  # warm-up
            asyncio.run(workload(srv.url, 1, 8, False, 900))
        for r in range(a.runs):
            for conc in concs:
                for sampled in (False, True):
                    names = list(servers) if r % 2 == 0 else list(servers)[::-1]
                    for name in names:
                        if "--draft" in name and conc > 4:
                            continue
                        print(f"run {r + 1}/{a.runs} c{conc} {'sampled' if sampled else 'greedy'}: {name}",
                              file=sys.stderr)
                        res = asyncio.run(workload(servers[name].url, conc, a.tokens, sampled, base))
                        samples.setdefault((name, conc, sampled), []).append(res)
                    base += 2 * conc
    finally:
        for srv in servers.values():
            srv.stop()
    rows = [{"server": n, "concurrency": c, "workload": "sampled" if s else "greedy", **med(v)}
            for (n, c, s), v in samples.items()]
    peer = {(r["concurrency"], r["workload"]): r for r in rows if r["server"].startswith("llama-server")}
    for r in rows:
        ref = peer.get((r["concurrency"], r["workload"]))
        r["aggregate_vs_llama_server"] = round(r["aggregate_tok_s"] / ref["aggregate_tok_s"], 3) if ref else None
    out = {"benchmark": "serve_concurrency", "tokens": a.tokens, "runs": a.runs, "model": Path(gguf).name,
           "slots": SLOTS, "slot_ctx": SLOT_CTX, "threads": THREADS, "flags": ours_flags,
           "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)], "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    print("| server | concurrency | workload | aggregate tok/s | vs llama-server | median TTFT s | "
          "decode tok/s per stream |")
    print("|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["workload"], r["concurrency"], r["server"])):
        print(f"| {r['server']} | {r['concurrency']} | {r['workload']} | {r['aggregate_tok_s']:.1f} | "
              f"{r['aggregate_vs_llama_server']:.2f}x | {r['ttft_s']:.2f} | {r['decode_tok_s']:.1f} |")


if __name__ == "__main__":
    main()
