"""A/B of two checkouts on this noisy VM: forwards of 1, 8 and 16 rows of the default model
(bf16, native kernels, 2 threads, at position 256 after a 256-token prefill, logits for every
row as a verify block), each checkout in its own process, alternating:

    git worktree add /tmp/base <commit>
    python benchmarks/forward_ab.py --src /tmp/base/src --src src [--runs 2] [--rows 1,8,16] [--out FILE]

Each checkout builds its kernels in its own cache (DFLASH_KERNELS_CACHE=<src>/../.kcache-ab).
Medians of 40 forwards. Prints one line per process; writes JSON (default
``benchmarks/results/forward_ab.json``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROWS = (1, 8, 16)


def one(src: str, threads: int, rows=ROWS) -> dict:
    sys.path.insert(0, src)
    import torch

    from dflash_server import kernels
    from dflash_server.cli.common import quantize_plan
    from dflash_server.runtime.pipeline import build_pipeline
    from dflash_server.runtime.placement import plan_placement
    from dflash_server.weights.default_model import default_model_path
    from dflash_server.weights.loader import open_model

    torch.set_num_threads(threads)
    assert kernels.load() and kernels.__file__.startswith(src), kernels.__file__
    source = open_model(default_model_path())
    pipe = build_pipeline(source, plan_placement(source.config.num_layers, ["cpu"]), dtype=torch.bfloat16,
                          max_ctx=2048, quantize=quantize_plan(source, "auto", True), progress=False)
    ids = source.tokenizer.encode(" the river floods every spring and the town rebuilds" * 40)[:300]
    pipe.prefill(ids[:256], chunk=512)
    ms = {}
    for t in rows:
        mode = "last" if t == 1 else "all"
        for _ in range(5):
            pipe.forward(ids[256:256 + t], 256, logits=mode)
        ts = []
        for _ in range(40):
            t0 = time.perf_counter()
            pipe.forward(ids[256:256 + t], 256, logits=mode)
            ts.append(time.perf_counter() - t0)
        ms[str(t)] = statistics.median(ts) * 1e3
    return {"forward_ms": ms, "vs_one_row": {k: v / ms["1"] for k, v in ms.items()}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", action="append", default=[], help="a checkout's src/ directory (give two)")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "forward_ab.json"))
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts (1 first)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    rows = tuple(int(t) for t in args.rows.split(","))
    if rows[0] != 1:
        ap.error("--rows must start with 1 (the others are reported relative to it)")
    if args.one:
        print(json.dumps(one(args.one, args.threads, rows)))
        return
    if not args.src:
        ap.error("give --src at least once")
    runs = []
    for r in range(args.runs):
        for src in args.src:
            src = str(Path(src).resolve())
            env = dict(os.environ, DFLASH_KERNELS_CACHE=str(Path(src).parent / ".kcache-ab"), DFLASH_KERNELS="1")
            out = subprocess.run([sys.executable, __file__, "--one", src, "--threads", str(args.threads),
                                  "--rows", args.rows], env=env,
                                 capture_output=True, text=True, check=True)
            res = json.loads(out.stdout.strip().splitlines()[-1]) | {"src": src, "run": r}
            runs.append(res)
            print(src, " ".join(f"{t} rows {res['forward_ms'][str(t)]:.2f} ms" for t in rows),
                  " ".join(f"{t}/1 {res['vs_one_row'][str(t)]:.2f}x" for t in rows[1:]), flush=True)
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "threads": args.threads,
                                          "rows": list(rows), "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
