"""HTTP serving overhead: TTFT and tokens/s through SSE streaming at concurrency 1 and 4,
side by side with the same engine called in-process, on the same prompt, in one run.

    python benchmarks/serve.py [--tokens 128] [--runs 3] [--out FILE] [-- <serve/model flags>]

Flags after ``--`` go to both the in-process engine and ``dflash-server serve`` (e.g.
``-- --model path.gguf --no-draft``; the prefix cache is off unless a flag turns it on, so
TTFT includes the prefill). Both sides are loaded at once and measured in alternation (each
idles while the other runs), so background load on a shared machine hits them alike.
Writes JSON (default benchmarks/results/serve.json) and prints a Markdown table; medians
over ``--runs``.

TTFT is measured from sending the request (HTTP) / submitting it (in-process) to the first
token; decode tok/s from the first to the last token of one stream; the concurrency-4 rows
also give aggregate tok/s (all tokens / wall time): both paths run the engine's step loop,
so concurrent requests share steps up to its sequence slots (``--parallel``). For the
comparison with llama-server at several concurrencies see ``serve_concurrency.py``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
MESSAGES = [{"role": "user", "content": (
    "Summarise the following notes in three bullet points, then answer the question at the end.\n"
    + "Notes: the river floods every spring; the town built a levee in 1952, raised it in 1978 and again in "
      "2011 after a record flood. " * 6 + "\nQuestion: when was the levee first built?")}]


def median(xs):
    return statistics.median(xs) if xs else 0.0


# --- in-process ---------------------------------------------------------------------------------
class InProcess:
    def __init__(self, flags: list[str], tokens: int):
        from dflash_server.cli import build_parser
        from dflash_server.cli.common import engine_config, load_engine
        from dflash_server.engine.generate import GenerationRequest
        from dflash_server.engine.sampling import SamplingParams

        args = build_parser().parse_args(["serve", *flags])
        _, _, self.engine = load_engine(engine_config(args), progress=False)
        ids = self.engine.tokenizer.encode_chat(MESSAGES)
        self.prompt_tokens = len(ids)
        self.req = GenerationRequest(tuple(ids), SamplingParams(temperature=0.0), tokens, ignore_eos=True)
        self.engine.generate(GenerationRequest(tuple(ids), max_tokens=8, ignore_eos=True))  # warm-up

    def run(self, conc: int):
        """``conc`` requests submitted together and stepped to the end, as the server's worker
        thread drives the engine (they share steps up to the engine's sequence slots)."""
        stamps = [[] for _ in range(conc)]
        w0 = time.perf_counter()
        for i in range(conc):
            self.engine.submit(self.req, on_event=lambda ev, i=i: ev.token_id >= 0 and stamps[i].append(
                time.perf_counter()))
        while self.engine.has_work:
            self.engine.step()
        return [(w0, st, len(st)) for st in stamps], time.perf_counter() - w0


# --- over HTTP ---------------------------------------------------------------------------------
async def stream_one(client: httpx.AsyncClient, tokens: int) -> tuple[float, list[float], int]:
    body = {"messages": MESSAGES, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
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
            for c in chunk["choices"]:
                if c["delta"].get("content"):
                    stamps.append(time.perf_counter())
    return t0, stamps, usage["completion_tokens"] if usage else len(stamps)


async def http_run(url: str, tokens: int, conc: int):
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        w0 = time.perf_counter()
        results = await asyncio.gather(*(stream_one(client, tokens) for _ in range(conc)))
        return list(results), time.perf_counter() - w0


def summarize(samples) -> dict:
    ttft, tps, agg = [], [], []
    for results, wall in samples:
        for t0, st, n in results:
            ttft.append(st[0] - t0)
            tps.append((n - 1) / (st[-1] - st[0]))
        agg.append(sum(n for _, _, n in results) / wall)
    return {"ttft_s": median(ttft), "decode_tok_s": median(tps), "aggregate_tok_s": median(agg)}


def measure(flags: list[str], tokens: int, runs: int) -> tuple[int, dict, dict]:
    """Both sides loaded at once (each idles while the other runs) and measured in
    alternation, so background load on a shared machine hits them alike."""
    from server.serverproc import ServerProc

    inproc = InProcess(flags, tokens)
    samples = {("in", c): [] for c in (1, 4)} | {("http", c): [] for c in (1, 4)}
    with ServerProc(*flags) as srv:
        asyncio.run(http_run(srv.url, 8, 1))  # warm-up
        for r in range(runs):
            for conc in (1, 4):
                print(f"run {r + 1}/{runs}, concurrency {conc}", file=sys.stderr)
                samples[("in", conc)].append(inproc.run(conc))
                samples[("http", conc)].append(asyncio.run(http_run(srv.url, tokens, conc)))
    ins = {f"c{c}": summarize(samples[("in", c)]) for c in (1, 4)}
    http = {f"c{c}": summarize(samples[("http", c)]) for c in (1, 4)}
    return inproc.prompt_tokens, ins, http


def stack_cost(tokens: int = 1500) -> dict:
    """CPU time the HTTP path adds per streamed token, measured with an engine that costs
    nothing (scripted text through the real tokenizer, app, scheduler, SSE and an HTTP
    client, all in this process): robust to background load, unlike wall-clock rates."""
    from dflash_server.weights.default_model import default_model_path
    from dflash_server.weights.loader import open_model
    from server.scripted import ScriptedEngine, ThreadServer

    tok = open_model(default_model_path()).tokenizer
    text = "The quick brown fox jumps over the lazy dog. " * (tokens // 9)
    engine = ScriptedEngine(tok, {"long": text}, delay_s=0.002)  # paced: every token its own SSE chunk
    n = len(tok.encode(text, add_bos=False))
    c0 = time.process_time()
    engine.generate(SimpleNamespace(prompt_ids=(1,), stop=(), max_tokens=10**9), on_event=lambda ev: None)
    engine_s = time.process_time() - c0
    srv = ThreadServer(engine)
    body = {"messages": [{"role": "user", "content": "SCRIPT=long"}], "max_tokens": n + 8, "stream": True}
    try:
        samples = []
        for _ in range(3):
            c0 = time.process_time()
            with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=600) as r:
                for _line in r.iter_lines():
                    pass
            samples.append(time.process_time() - c0)
    finally:
        srv.stop()
    per_token = (median(samples) - engine_s) / n
    return {"tokens": n, "stack_cpu_us_per_token": round(per_token * 1e6, 1)}


def stack_share(stack: dict, measured_tok_s: float) -> dict:
    """The stack's CPU per token as a share of one decode step, at the rate measured here
    and at the quiet-machine default-model rate in results/decode.json (if present)."""
    out = {"overhead_pct_at_measured_rate": round(stack["stack_cpu_us_per_token"] * 1e-4 * measured_tok_s, 2)}
    ref = ROOT / "benchmarks/results/decode.json"
    if ref.is_file():
        rows = [r for r in json.loads(ref.read_text()).get("rows", []) if r.get("name", "").startswith("ours auto")]
        if rows:
            tps = rows[0]["decode_tok_s"]
            out["reference_decode_tok_s"] = round(tps, 1)
            out["overhead_pct_at_reference_rate"] = round(stack["stack_cpu_us_per_token"] * 1e-4 * tps, 2)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/serve.json"))
    p.add_argument("flags", nargs="*", help="model / placement flags for both sides (after --)")
    a = p.parse_args()
    # measure real prefill: without this the warm-up would leave the prompt in the prefix cache
    a.flags = ["--prefix-cache-slots", "0", *a.flags]
    load_before = os.getloadavg()[0]
    stack = stack_cost()
    prompt_tokens, inproc, http = measure(a.flags, a.tokens, a.runs)
    rows = []
    for conc in ("c1", "c4"):
        i, h = inproc[conc], http[conc]
        rows.append({"concurrency": int(conc[1:]), "inprocess": i, "http": h,
                     "decode_overhead_pct": 100 * (1 - h["decode_tok_s"] / i["decode_tok_s"]),
                     "aggregate_overhead_pct": 100 * (1 - h["aggregate_tok_s"] / i["aggregate_tok_s"]),
                     "ttft_delta_ms": 1000 * (h["ttft_s"] - i["ttft_s"])})
    out = {"benchmark": "serve", "tokens": a.tokens, "runs": a.runs, "flags": a.flags,
           "prompt_tokens": prompt_tokens, "machine": platform.processor() or platform.machine(),
           "python": platform.python_version(), "cpus": os.cpu_count(),
           "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)], "rows": rows,
           "stack": {**stack, **stack_share(stack, inproc["c1"]["decode_tok_s"])}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    print("| concurrency | path | TTFT ms (median) | decode tok/s per stream | aggregate tok/s |")
    print("|---|---|---|---|---|")
    for r in rows:
        for name in ("inprocess", "http"):
            x = r[name]
            print(f"| {r['concurrency']} | {'in-process engine' if name == 'inprocess' else 'HTTP SSE'} | "
                  f"{1000 * x['ttft_s']:.0f} | {x['decode_tok_s']:.1f} | {x['aggregate_tok_s']:.1f} |")
        print(f"| {r['concurrency']} | overhead | {r['ttft_delta_ms']:+.0f} ms | {r['decode_overhead_pct']:+.1f}% | "
              f"{r['aggregate_overhead_pct']:+.1f}% |")
    st = out["stack"]
    print(f"\nHTTP stack (app + SSE + client) CPU per streamed token: {st['stack_cpu_us_per_token']} us "
          f"= {st['overhead_pct_at_measured_rate']}% of a decode step at the rate measured here, "
          f"{st.get('overhead_pct_at_reference_rate', '?')}% at {st.get('reference_decode_tok_s', '?')} tok/s")


if __name__ == "__main__":
    main()
