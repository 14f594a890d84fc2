"""Draft-training data sampling throughput (train-draft's first phase): B continuations per
prompt drawn together either as a lockstep batch (``build_pipeline(batch=B)``: aten kernels,
the rows share positions) or in B sequence slots (``lanes=B``: one decode row each per
forward, batched by the native kernels), the built-in model as train-draft loads it on a CPU
(bf16, GGUF blocks), each mode in a fresh process, alternating:

    python benchmarks/train_sampling.py [--batch 8] [--prompts 3] [--max-new 64] [--runs 2] [--out FILE]

Writes JSON (default ``benchmarks/results/train_sampling.json``): response tokens per second.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one(slots: bool, batch: int, prompts: int, max_new: int) -> dict:
    import torch

    from dflash_server.cli.train_draft import _pipeline
    from dflash_server.spec.config import default_target_layer_ids
    from dflash_server.spec.train_data import load_prompts, render, sample_prompt
    from dflash_server.weights.default_model import default_model_path
    from dflash_server.weights.loader import open_model

    torch.set_num_threads(2)
    src = open_model(default_model_path())
    pipe = _pipeline(src, "cpu", torch.bfloat16, "auto", 1024, batch, slots=slots)
    taps = default_target_layer_ids(src.config.num_layers, 5)
    gen = torch.Generator().manual_seed(0)
    todo = [render(pipe.tokenizer, p) for p in load_prompts(split="train")[:prompts]]
    sample_prompt(pipe, todo[0], taps, 8, gen=gen)          # warm-up
    t, toks = time.perf_counter(), 0
    for ids in todo:
        got = sample_prompt(pipe, ids, taps, max_new, greedy_after=16, gen=gen)
        toks += sum(len(s.ids) - s.prompt_len for s in got)
    dt = time.perf_counter() - t
    return {"mode": "slots" if slots else "lockstep", "batch": batch, "response_tokens": toks,
            "seconds": round(dt, 2), "tokens_per_s": round(toks / dt, 1)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "train_sampling.json"))
    ap.add_argument("--one", choices=["slots", "lockstep"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one == "slots", a.batch, a.prompts, a.max_new)))
        return
    runs = []
    for r in range(a.runs):
        for mode in ("lockstep", "slots"):
            out = subprocess.run([sys.executable, __file__, "--one", mode, "--batch", str(a.batch), "--prompts",
                                  str(a.prompts), "--max-new", str(a.max_new)], capture_output=True, text=True,
                                 check=True)
            res = json.loads(out.stdout.strip().splitlines()[-1]) | {"run": r}
            print(res)
            runs.append(res)
    Path(a.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
