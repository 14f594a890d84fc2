"""The cost of one forward of T rows relative to one row, per kernel path, in one run:
the default path (AMX where the CPU has it) against ``DFLASH_KERNELS_ISA=avx512-vnni`` (or
any names of ``kernels.ISAS``), each in a fresh process, alternating, default model, 2 threads:

    python benchmarks/isa_rows.py [--isas default,avx512-vnni] [--runs 2] [--threads 2] [--out FILE]

A forward of T rows at position 256 (after a 256-token prefill) with logits for every row,
as a DFlash verify block runs; medians of 30 calls. Writes JSON (default
``benchmarks/results/isa_rows.json``) and prints one line per process.
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

ROOT = Path(__file__).resolve().parents[1]
ROWS = (1, 2, 4, 8, 16)


def one(threads: int) -> dict:
    import torch

    sys.path.insert(0, str(ROOT / "src"))
    from dflash_server import kernels
    from dflash_server.cli.common import quantize_plan
    from dflash_server.runtime.pipeline import build_pipeline
    from dflash_server.runtime.placement import plan_placement
    from dflash_server.weights.default_model import default_model_path
    from dflash_server.weights.loader import open_model

    torch.set_num_threads(threads)
    kernels.load()
    src = open_model(default_model_path())
    pipe = build_pipeline(src, plan_placement(src.config.num_layers, ["cpu"]), dtype=torch.bfloat16, max_ctx=2048,
                          quantize=quantize_plan(src, "auto", True), progress=False)
    ids = src.tokenizer.encode(" the river floods every spring and the town rebuilds" * 40)[:300]
    pipe.prefill(ids[:256], chunk=512)
    ms = {}
    for t in ROWS:
        pipe.forward(ids[256:256 + t], 256, logits="all")
        ts = []
        for _ in range(30):
            t0 = time.perf_counter()
            pipe.forward(ids[256:256 + t], 256, logits="all")
            ts.append(time.perf_counter() - t0)
        ms[t] = statistics.median(ts) * 1e3
    return {"isa": kernels.status().get("isa"), "forward_ms": {str(t): ms[t] for t in ROWS},
            "forward_vs_one_row": {str(t): ms[t] / ms[1] for t in ROWS}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--isas", default="default,avx512-vnni")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "isa_rows.json"))
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.threads)))
        return
    runs = []
    for r in range(args.runs):
        for isa in args.isas.split(","):
            env = dict(os.environ)
            env.pop("DFLASH_KERNELS_ISA", None)
            if isa != "default":
                env["DFLASH_KERNELS_ISA"] = isa
            out = subprocess.run([sys.executable, __file__, "--one", "--threads", str(args.threads)], env=env,
                                 capture_output=True, text=True, check=True)
            res = json.loads(out.stdout.strip().splitlines()[-1]) | {"asked": isa, "run": r}
            runs.append(res)
            print(res["asked"], res["isa"], " ".join(f"{t}:{res['forward_ms'][str(t)]:.2f}ms"
                                                     f"({res['forward_vs_one_row'][str(t)]:.2f}x)" for t in ROWS))
    Path(args.out).write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                          "date": time.strftime("%Y-%m-%d"), "threads": args.threads,
                                          "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
