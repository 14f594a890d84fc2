"""Layer split: unsplit vs in-process split vs local + remote split (shard worker over
shared memory, and over TCP with inline frames), on the default model, in one run.

    python benchmarks/split.py [--prompts 3] [--max-tokens 64] [--reps 3] [--threads 2] [--no-draft] [--out FILE]

Per placement: TTFT (prefill of the prompt, cache off), AR decode tokens/s, DFlash
tokens/s with the shipped draft, whether the output equals unsplit AR, and the pure IPC
round trip of the shard protocol (an empty ``health`` call). Prompts: the first user
turns of ../shared/eval/mt_bench.jsonl.

"vs unsplit" is the median over rounds of the ratio of two generations of the same prompt
run close together (min and max in the JSON): this VM's speed drifts by tens of percent
over minutes, so a ratio of per-placement medians is noisier.

Writes JSON (default benchmarks/results/split.json) and prints a Markdown table.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from dflash_server.runtime.openmp import tune_for_split  # noqa: E402 - torch-free

tune_for_split()  # as the CLI does for remote splits, for every placement alike (see runtime/openmp.py)
import torch  # noqa: E402 - libgomp reads GOMP_SPINCOUNT when torch loads it

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
    ap.add_argument("--reps", type=int, default=3, help="rounds over all prompts and placements")
    ap.add_argument("--no-draft", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "split.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from dflash_server.cli.common import draft_quantize, quantize_plan
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
    # every placement is built first and the runs alternate between them (rotating order,
    # --reps rounds), so drift of the machine's speed hits all placements alike; one
    # placement after another gave the in-process split anywhere from 0.81x to 1.06x
    setups, ipc = {}, {}
    try:
        for name, (devices, remote) in placements.items():
            shards = plan_placement(src.config.num_layers, parse_devices(devices))
            pipe = build_pipeline(src, shards, dtype=torch.bfloat16, max_ctx=2048, quantize=quant, progress=False,
                                  remote=remote, threads=args.threads)
            engines = {"ar": Engine(pipe)}
            if not args.no_draft and default_draft_path() is not None:
                draft = DFlashDraft.load(default_draft_path(), device="cpu", dtype=torch.bfloat16, max_ctx=2048,
                                         quantize=draft_quantize(quant[0], "cpu"))  # as the CLI does
                engines["dflash"] = Engine(pipe, proposer=DFlashProposer(draft, pipe))
            stage = pipe.stages[-1]
            if hasattr(stage, "link"):
                client, log = stage.link.ready(), []
                ipc[name] = (client, client.call, log)

                def timed_call(op, a=None, t=None, _call=client.call, _log=log, **kw):
                    t0 = time.perf_counter()
                    res = _call(op, a, t, **kw)
                    if op == "forward" and t["x"].shape[1] == 1:
                        _log.append((time.perf_counter() - t0, res[0]["compute_s"]))
                    return res
                client.call = timed_call
            for e in engines.values():  # warm up
                e.generate(GenerationRequest(tuple(prompts[0]), max_tokens=4, ignore_eos=True))
            setups[name] = (pipe, engines)
        rows = {name: {"ttft_s": [], "ar_tps": [], "dflash_tps": [], "tau": [], "outs": []} for name in setups}
        names = list(setups)
        for rep in range(args.reps):
            for k, ids in enumerate(prompts):
                order = names[(rep + k) % len(names):] + names[:(rep + k) % len(names)]
                for name in order:  # AR of all placements first: the pairs compared are close in time
                    row = rows[name]
                    r = setups[name][1]["ar"].generate(GenerationRequest(tuple(ids), max_tokens=args.max_tokens,
                                                                         ignore_eos=True))
                    row["ttft_s"].append(r.prefill_s)
                    row["ar_tps"].append(r.decode_tokens_per_s)
                    if rep == 0:
                        row["outs"].append(r.token_ids)
                for name in order:
                    engines, row = setups[name][1], rows[name]
                    if "dflash" in engines:
                        r = engines["dflash"].generate(GenerationRequest(tuple(ids), max_tokens=args.max_tokens,
                                                                         ignore_eos=True))
                        row["dflash_tps"].append(r.decode_tokens_per_s)
                        row["tau"].append(r.extra["spec"]["acceptance_length"])
        results, ref = {}, rows["unsplit"]["outs"]
        for name, row in rows.items():
            if name in ipc:
                client, plain_call, log = ipc[name]
                client.call = plain_call
                t = []
                for _ in range(300):
                    t0 = time.perf_counter()
                    client.call("health")
                    t.append(time.perf_counter() - t0)
                row["ipc_round_trip_us"] = round(statistics.median(t) * 1e6, 1)
                # what one decode step pays beyond the worker's own compute: transport,
                # (de)serialization, wake-ups of the idle process
                row["ipc_overhead_ms_per_token"] = round(statistics.median(a - b for a, b in log) * 1e3, 3)
                row["worker_compute_ms_per_token"] = round(statistics.median(b for _, b in log) * 1e3, 3)
            row["same_as_unsplit"] = row.pop("outs") == ref
            results[name] = {k: (round(statistics.median(v), 4) if isinstance(v, list) and v else v)
                             for k, v in row.items() if v != []}
            print(name, results[name], flush=True)
    finally:
        for pipe, _ in setups.values():
            pipe.close()
        tcp_worker.terminate()
        tcp_worker.wait(10)
    for name, r in results.items():  # per round: two generations of one prompt, close in time
        ratios = [a / b for a, b in zip(rows[name]["ar_tps"], rows["unsplit"]["ar_tps"])]
        r["ar_vs_unsplit"] = round(statistics.median(ratios), 3)
        r["ar_vs_unsplit_min_max"] = [round(min(ratios), 3), round(max(ratios), 3)]
    meta = {"prompts": args.prompts, "reps": args.reps, "max_tokens": args.max_tokens,
            "threads": args.threads, "quantize": list(quant), "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
            "torch": torch.__version__, "cpu_count": os.cpu_count()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print("\n| placement | TTFT (s) | AR tok/s | vs unsplit (min-max) | DFlash tok/s | tau | IPC round trip (us) "
          "| IPC overhead per token (ms) | same output |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        lo, hi = r["ar_vs_unsplit_min_max"]
        print(f"| {name} | {r['ttft_s']:.3f} | {r['ar_tps']:.1f} | {r['ar_vs_unsplit']:.2f}x ({lo:.2f}-{hi:.2f}) | "
              f"{r.get('dflash_tps', float('nan')):.1f} | {r.get('tau', float('nan')):.2f} | "
              f"{r.get('ipc_round_trip_us', '-')} | {r.get('ipc_overhead_ms_per_token', '-')} | "
              f"{r['same_as_unsplit']} |")


if __name__ == "__main__":
    main()
