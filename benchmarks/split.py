"""Layer split: unsplit vs in-process split vs local + remote split (shard worker over
shared memory, and over TCP with inline frames), on the default model, in one run.

    python benchmarks/split.py [--prompts 3] [--max-tokens 64] [--threads 2] [--no-draft] [--out FILE]

Per placement: TTFT (prefill of the prompt, cache off), AR decode tokens/s, DFlash
tokens/s with the shipped draft, whether the output equals unsplit AR, and the pure IPC
round trip of the shard protocol (an empty ``health`` call). Prompts: the first user
turns of ../shared/eval/mt_bench.jsonl. Writes JSON (default
benchmarks/results/split.json) and prints a Markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("GOMP_SPINCOUNT", "3000")  # as the CLI does for remote splits (cli/__init__.py)
import torch  # noqa: E402 - libgomp reads GOMP_SPINCOUNT when torch loads it

ROOT = Path(__file__).resolve().parents[1]
EVAL = ROOT.parent / "shared" / "eval" / "mt_bench.jsonl"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-draft", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "split.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT / "src"))
    from dflash_server.cli.common import quantize_plan
    from dflash_server.engine.generate import Engine, GenerationRequest
    from dflash_server.runtime.pipeline import build_pipeline
    from dflash_server.runtime.placement import parse_devices, plan_placement
    from dflash_server.runtime.remote import SECRET_ENV, RemoteOptions
    from dflash_server.spec.draft import DFlashDraft
    from dflash_server.spec.proposer import DFlashProposer
    from dflash_server.weights.default_model import default_draft_path, default_model_path
    from dflash_server.weights.loader import open_model

    src = open_model(default_model_path())
    quant = quantize_plan(src, "auto", True)
    rows = [json.loads(line) for line in EVAL.read_text().splitlines()[:args.prompts]]
    prompts = [src.tokenizer.encode_chat([{"role": "user", "content": r["turns"][0]}]) for r in rows]

    secret = secrets.token_hex(16)
    port = free_port()
    tcp_worker = subprocess.Popen([sys.executable, "-m", "dflash_server", "shard-worker", "--bind",
                                   f"tcp://127.0.0.1:{port}"], env=dict(os.environ, **{SECRET_ENV: secret}),
                                  stdout=subprocess.PIPE, text=True)
    tcp_worker.stdout.readline()
    placements = {
        "unsplit": ("cpu", None),
        "in-process split (cpu,cpu)": ("cpu,cpu", None),
        "local + remote, shared memory": ("cpu,remote:cpu", RemoteOptions(transport="shm")),
        "local + remote, TCP inline": ("cpu,remote:cpu", RemoteOptions(connect=f"tcp://127.0.0.1:{port}",
                                                                      secret=secret.encode(), transport="inline")),
    }
    results, ref = {}, None
    try:
        for name, (devices, remote) in placements.items():
            shards = plan_placement(src.config.num_layers, parse_devices(devices))
            pipe = build_pipeline(src, shards, dtype=torch.bfloat16, max_ctx=2048, quantize=quant, progress=False,
                                  remote=remote, threads=args.threads)
            row = {"ttft_s": [], "ar_tps": [], "dflash_tps": [], "tau": []}
            outs = []
            ipc = []  # per remote forward: (call time, worker compute time)
            stage = pipe.stages[-1]
            if hasattr(stage, "link"):
                client = stage.link.ready()
                plain_call = client.call

                def timed_call(op, a=None, t=None, **kw):
                    t0 = time.perf_counter()
                    res = plain_call(op, a, t, **kw)
                    if op == "forward" and t["x"].shape[1] == 1:
                        ipc.append((time.perf_counter() - t0, res[0]["compute_s"]))
                    return res
                client.call = timed_call
            ar = Engine(pipe)
            for ids in prompts:
                req = GenerationRequest(tuple(ids), max_tokens=args.max_tokens, ignore_eos=True)
                ar.generate(GenerationRequest(tuple(ids), max_tokens=4, ignore_eos=True))  # warm up
                r = ar.generate(req)
                row["ttft_s"].append(r.prefill_s)
                row["ar_tps"].append(r.decode_tokens_per_s)
                outs.append(r.token_ids)
            if not args.no_draft and default_draft_path() is not None:
                draft = DFlashDraft.load(default_draft_path(), device="cpu", dtype=torch.bfloat16, max_ctx=2048)
                spec = Engine(pipe, proposer=DFlashProposer(draft, pipe))
                for ids in prompts:
                    r = spec.generate(GenerationRequest(tuple(ids), max_tokens=args.max_tokens, ignore_eos=True))
                    row["dflash_tps"].append(r.decode_tokens_per_s)
                    row["tau"].append(r.extra["spec"]["acceptance_length"])
            if ipc:
                client.call = plain_call
                t = []
                for _ in range(300):
                    t0 = time.perf_counter()
                    client.call("health")
                    t.append(time.perf_counter() - t0)
                row["ipc_round_trip_us"] = round(statistics.median(t) * 1e6, 1)
                # what one decode step pays beyond the worker's own compute: transport,
                # (de)serialization, wake-ups of the idle process
                row["ipc_overhead_ms_per_token"] = round(statistics.median(a - b for a, b in ipc) * 1e3, 3)
                row["worker_compute_ms_per_token"] = round(statistics.median(b for _, b in ipc) * 1e3, 3)
            ref = ref or outs
            row["same_as_unsplit"] = outs == ref
            results[name] = {k: (round(statistics.median(v), 4) if isinstance(v, list) and v else v)
                             for k, v in row.items() if v != []}
            pipe.close()
            print(name, results[name], flush=True)
    finally:
        tcp_worker.terminate()
        tcp_worker.wait(10)
    base = results["unsplit"]["ar_tps"]
    for r in results.values():
        r["ar_vs_unsplit"] = round(r["ar_tps"] / base, 3)
    meta = {"prompts": args.prompts, "max_tokens": args.max_tokens, "threads": args.threads, "quantize": list(quant),
            "torch": torch.__version__, "cpu_count": os.cpu_count()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print("\n| placement | TTFT (s) | AR tok/s | vs unsplit | DFlash tok/s | tau | IPC round trip (us) "
          "| IPC overhead per token (ms) | same output |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['ttft_s']:.3f} | {r['ar_tps']:.1f} | {r['ar_vs_unsplit']:.2f}x | "
              f"{r.get('dflash_tps', float('nan')):.1f} | {r.get('tau', float('nan')):.2f} | "
              f"{r.get('ipc_round_trip_us', '-')} | {r.get('ipc_overhead_ms_per_token', '-')} | "
              f"{r['same_as_unsplit']} |")


if __name__ == "__main__":
    main()
