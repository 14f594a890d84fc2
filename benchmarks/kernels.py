"""Native kernels vs aten vs llama.cpp, side by side in one run, on the default model's
GGUF (SmolLM2-135M-Instruct Q4_1 layers, Q8_0 embeddings / LM head), 2 threads:

    python benchmarks/kernels.py [--threads 2] [--runs 3] [--tokens 128] [--depth 2048] [--no-llama-cpp] [--model GGUF]
                                 [--out FILE]

llama.cpp runs before and after ours (the mean is its figure: this VM drifts).

- llama.cpp (built by ``benchmarks/llama_cpp.py`` from the llama-cpp-python sdist):
  ``llama-bench`` tg128, pp512, and pp1/2/4/8/16 (the cost of one forward of T rows), and tg64
  after a 2048-token context (``-d 2048``: attention over a long KV cache).
- ours, each configuration in a fresh process: the native kernels (default: an fp16 KV
  cache), the native kernels with ``--kv-dtype f32`` and ``--kernels aten`` (torch's int4/int8
  kernels, fp32 KV): greedy decode tok/s (``Engine.generate``, EOS ignored; also
  64 tokens after a 2048-token prompt), prefill
  of 512 tokens, and one forward of T = 1, 2, 4, 8, 16 rows at a fixed position (what a
  DFlash verify block costs), as a ratio to one row (the row counts timed in turn, one forward
  of each per round, medians: the VM's drift then moves them alike).

Writes JSON (default ``benchmarks/results/kernels.json``) and prints a Markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
ROWS = (1, 2, 4, 8, 16)
DEPTH, DEPTH_TOKENS = 2048, 64  # decode of 64 tokens after a 2048-token context (llama-bench tg64 -d 2048)
# label -> (DFLASH_KERNELS, --kv-dtype)
CONFIGS = {"ours, --kernels aten": ("0", "auto"), "ours, native kernels, --kv-dtype f32": ("1", "f32"),
           "ours, native kernels (default: f16 KV)": ("1", "auto")}


def timed(f, reps: int) -> float:
    f()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def interleaved(fs: dict, reps: int) -> dict:
    """Median time of each f in ``fs``, the calls taken in turn (one of each per round), so
    that the machine's drift (this VM's speed moves ~2x within minutes) hits every key alike
    and their ratios stay meaningful."""
    for f in fs.values():
        f()
    ts = {k: [] for k in fs}
    for _ in range(reps):
        for k, f in fs.items():
            t = time.perf_counter()
            f()
            ts[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in ts.items()}


def bench_ours(label: str, threads: int, tokens: int, runs: int, model: str | None, depth: int = DEPTH,
               kv_dtype: str = "auto") -> dict:
    sys.path.insert(0, str(ROOT / "src"))
    from dflash_server import kernels
    from dflash_server.cli.common import quantize_plan
    from dflash_server.engine.generate import Engine, GenerationRequest
    from dflash_server.runtime.pipeline import build_pipeline
    from dflash_server.runtime.placement import plan_placement
    from dflash_server.weights.default_model import default_model_path
    from dflash_server.weights.loader import open_model

    torch.set_num_threads(threads)
    src = open_model(model or default_model_path())
    plan = quantize_plan(src, "auto", True)
    pipe = build_pipeline(src, plan_placement(src.config.num_layers, ["cpu"]), dtype=torch.bfloat16,
                          max_ctx=max(2048, depth + DEPTH_TOKENS + 8), quantize=plan, progress=False,
                          kv_dtype=kv_dtype)
    engine = Engine(pipe)
    ids = src.tokenizer.encode("Once upon a time")
    req = GenerationRequest(tuple(ids), max_tokens=tokens, ignore_eos=True)
    engine.generate(GenerationRequest(tuple(ids), max_tokens=8, ignore_eos=True))  # warm-up
    decode = statistics.median(engine.generate(req).decode_tokens_per_s for _ in range(runs))
    # decode after a long context (llama-bench's tg at depth -d): the KV read per token grows
    deep = (src.tokenizer.encode(" the river floods every spring and the town rebuilds" * (depth // 8 + 8)))[:depth]
    at_depth = statistics.median(
        engine.generate(GenerationRequest(tuple(deep), max_tokens=DEPTH_TOKENS, ignore_eos=True)).decode_tokens_per_s
        for _ in range(max(1, runs - 1))) if depth else None
    long = (src.tokenizer.encode(" the river floods every spring and the town rebuilds" * 60))[:512]
    pipe.reset()
    prefill = 512 / timed(lambda: (pipe.reset(), pipe.prefill(long, chunk=512)), runs)
    pipe.reset()
    pipe.prefill(long[:256], chunk=512)  # the verify rows attend to a 256-token context
    per_rows = interleaved({t: (lambda t=t: pipe.forward(long[256:256 + t], 256, logits="all")) for t in ROWS},
                           max(10, runs * 6))
    return {"name": label, "decode_tok_s": decode, "pp512_tok_s": prefill, "depth": depth,
            "decode_at_depth_tok_s": at_depth,
            "forward_ms": {str(t): per_rows[t] * 1e3 for t in ROWS},
            "forward_vs_one_row": {str(t): per_rows[t] / per_rows[1] for t in ROWS},
            "modes": sorted({m.mode for st in pipe.stages for m in st._linears()}),
            "kv_dtype": sorted({str(b.k.dtype) for st in pipe.stages for b in st.banks if b is not None}),
            "kernels": kernels.status()}


def bench_llama_cpp(threads: int, runs: int, tokens: int, model: str | None, depth: int = DEPTH) -> dict:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from llama_cpp import ensure_built

    sys.path.insert(0, str(ROOT / "src"))
    from dflash_server.weights.default_model import default_model_path

    bench = ensure_built() / "llama-bench"
    prompts = ",".join(str(t) for t in (*ROWS, 512))
    out = subprocess.run([str(bench), "-m", str(model or default_model_path()), "-t", str(threads), "-p", prompts,
                          "-n", str(tokens), "-r", str(runs), "-o", "json"], capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] == tokens and r["n_prompt"] == 0)
    pp = {r["n_prompt"]: r["avg_ts"] for r in rows if r["n_gen"] == 0}
    per_rows = {t: t / pp[t] for t in ROWS}  # seconds per forward of t rows
    at_depth = None
    if depth:
        out = subprocess.run([str(bench), "-m", str(model or default_model_path()), "-t", str(threads), "-p", "0",
                              "-n", str(DEPTH_TOKENS), "-d", str(depth), "-r", str(max(1, runs - 1)), "-o", "json"],
                             capture_output=True, text=True, check=True)
        at_depth = json.loads(out.stdout)[0]["avg_ts"]
    return {"name": "llama.cpp (llama-bench)", "decode_tok_s": tg, "pp512_tok_s": pp[512], "depth": depth,
            "decode_at_depth_tok_s": at_depth,
            "forward_ms": {str(t): per_rows[t] * 1e3 for t in ROWS},
            "forward_vs_one_row": {str(t): per_rows[t] / per_rows[1] for t in ROWS},
            "build_commit": rows[0].get("build_commit")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--model", help="another GGUF (default: the built-in model's)")
    ap.add_argument("--depth", type=int, default=DEPTH, help="also decode 64 tokens after this many (0: skip)")
    ap.add_argument("--config", help=argparse.SUPPRESS)  # internal: one of ours, in this process
    ap.add_argument("--kv-dtype", default="auto", help=argparse.SUPPRESS)  # internal: that config's cache
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kernels.json"))
    args = ap.parse_args()
    if args.config:
        print(json.dumps(bench_ours(args.config, args.threads, args.tokens, args.runs, args.model, args.depth,
                                    args.kv_dtype)))
        return
    rows, peer = [], []
    if not args.no_llama_cpp:
        peer.append(bench_llama_cpp(args.threads, args.runs, args.tokens, args.model, args.depth))
        print(peer[-1], file=sys.stderr)
    for label, (flag, kv) in CONFIGS.items():
        env = {**os.environ, "DFLASH_KERNELS": flag}
        res = subprocess.run([sys.executable, __file__, "--config", label, "--kv-dtype", kv, "--threads", str(args.threads),
                              "--runs", str(args.runs), "--tokens", str(args.tokens), "--depth", str(args.depth)]
                             + (["--model", args.model] if args.model else []), env=env,
                             stdout=subprocess.PIPE, text=True, check=True)
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
        print(rows[-1], file=sys.stderr)
    if not args.no_llama_cpp:
        # llama.cpp again after ours: this VM's speed drifts by 10% over minutes, so the peer's
        # figures are the mean of a run before and a run after
        peer.append(bench_llama_cpp(args.threads, args.runs, args.tokens, args.model, args.depth))
        print(peer[-1], file=sys.stderr)
        base = dict(peer[0], runs_before_after=[{k: p[k] for k in ("decode_tok_s", "pp512_tok_s", "forward_ms",
                                                                    "decode_at_depth_tok_s")} for p in peer])
        base["decode_tok_s"] = statistics.mean(p["decode_tok_s"] for p in peer)
        if args.depth:
            base["decode_at_depth_tok_s"] = statistics.mean(p["decode_at_depth_tok_s"] for p in peer)
        base["pp512_tok_s"] = statistics.mean(p["pp512_tok_s"] for p in peer)
        ms = {t: statistics.mean(p["forward_ms"][str(t)] for p in peer) for t in ROWS}
        base["forward_ms"] = {str(t): ms[t] for t in ROWS}
        base["forward_vs_one_row"] = {str(t): ms[t] / ms[1] for t in ROWS}
        rows.insert(0, base)
        for r in rows[1:]:
            r["decode_vs_llama_cpp"] = r["decode_tok_s"] / base["decode_tok_s"]
            r["pp512_vs_llama_cpp"] = r["pp512_tok_s"] / base["pp512_tok_s"]
            if args.depth:
                r["decode_at_depth_vs_llama_cpp"] = r["decode_at_depth_tok_s"] / base["decode_at_depth_tok_s"]
    out = {"model": args.model or "default", "threads": args.threads, "runs": args.runs, "tokens": args.tokens,
           "torch": torch.__version__,
           "machine": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d"), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    head = " | ".join(f"{t} rows" for t in ROWS[1:])
    print(f"| | decode tok/s | decode @ {args.depth} | pp512 tok/s | one row (ms) | {head} |\n|---|---|---|---|---|"
          + "---|" * len(ROWS[1:]))
    for r in rows:
        ratios = " | ".join(f"{r['forward_vs_one_row'][str(t)]:.2f}x" for t in ROWS[1:])
        vs = f" ({r['decode_vs_llama_cpp']:.2f}x)" if "decode_vs_llama_cpp" in r else ""
        deep = f"{r['decode_at_depth_tok_s']:.1f}" if r.get("decode_at_depth_tok_s") else "-"
        if "decode_at_depth_vs_llama_cpp" in r:
            deep += f" ({r['decode_at_depth_vs_llama_cpp']:.2f}x)"
        print(f"| {r['name']} | {r['decode_tok_s']:.1f}{vs} | {deep} | {r['pp512_tok_s']:.0f} | "
              f"{r['forward_ms']['1']:.2f} | {ratios} |")


if __name__ == "__main__":
    main()
