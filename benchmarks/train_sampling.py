"""Draft-training data sampling throughput (train-draft's first phase), the built-in model
as train-draft loads it on a CPU (bf16, GGUF blocks), each mode in a fresh process,
alternating, on the first ``--prompts`` training prompts:

- ``lockstep``: B continuations of one prompt as a lockstep batch (``build_pipeline(batch=B)``:
  aten kernels, the rows share positions), prompt after prompt;
- ``slots``: B sequence slots (``lanes=B``: one decode row each per forward, batched by the
  native kernels), K continuations of each of B/K prompts, one such batch after another
  (each batch runs until its longest continuation ends);
- ``refill``: the same slots as ``train-draft`` samples (``generate_dataset``): a prompt's
  slots take the next prompt as soon as its K continuations have ended.

    python benchmarks/train_sampling.py [--batch 8] [--continuations K] [--prompts 3] [--max-new 64]
                                        [--modes lockstep,slots,refill] [--runs 2] [--out FILE]

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
MODES = ("lockstep", "slots", "refill")


def one(mode: str, batch: int, per: int, prompts: int, max_new: int) -> dict:
    import tempfile

    import torch

    from dflash_server.cli.train_draft import _pipeline
    from dflash_server.spec.config import default_target_layer_ids
    from dflash_server.spec.train_data import generate_dataset, load_prompts, render, sample_prompt
    from dflash_server.weights.default_model import default_model_path
    from dflash_server.weights.loader import open_model

    torch.set_num_threads(2)
    src = open_model(default_model_path())
    pipe = _pipeline(src, "cpu", torch.bfloat16, "auto", 1024, batch, slots=mode != "lockstep")
    taps = default_target_layer_ids(src.config.num_layers, 5)
    gen = torch.Generator().manual_seed(0)
    rows = load_prompts(split="train")[:prompts]
    todo = [render(pipe.tokenizer, p) for p in rows]
    sample_prompt(pipe, todo[0], taps, 8, gen=gen)          # warm-up
    t, toks = time.perf_counter(), 0
    if mode == "refill":
        with tempfile.TemporaryDirectory() as d:
            man = generate_dataset(pipe, rows, d, taps, prompts * per, max_new=max_new, greedy_after=16,
                                   continuations=per, progress=False)
        toks = man["last_run"]["response_tokens"]
    else:
        step = 1 if mode == "lockstep" else batch // per
        for i in range(0, len(todo), step):
            group = todo[i:i + step] if mode == "slots" else todo[i]
            if mode == "slots" and len(group) < step:      # a short last batch: its prompts K at a time
                group += [group[-1]] * (step - len(group))
            got = sample_prompt(pipe, group, taps, max_new, greedy_after=16, gen=gen)
            toks += sum(len(s.ids) - s.prompt_len for s in got)
    dt = time.perf_counter() - t
    return {"mode": mode, "batch": batch, "continuations": per if mode != "lockstep" else batch,
            "prompts": prompts, "response_tokens": toks, "seconds": round(dt, 2), "tokens_per_s": round(toks / dt, 1)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--continuations", type=int, help="continuations per prompt in the slot modes (default --batch)")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--modes", default="lockstep,slots,refill")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "train_sampling.json"))
    ap.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)
    a = ap.parse_args()
    per = a.continuations or a.batch
    modes = a.modes.split(",")
    if per < 1 or a.batch % per or not set(modes) <= set(MODES):
        ap.error(f"--continuations must divide --batch; --modes among {','.join(MODES)}")
    if a.one:
        print(json.dumps(one(a.one, a.batch, per, a.prompts, a.max_new)))
        return
    runs = []
    for r in range(a.runs):
        for mode in modes:
            out = subprocess.run([sys.executable, __file__, "--one", mode, "--batch", str(a.batch), "--continuations",
                                  str(per), "--prompts", str(a.prompts), "--max-new", str(a.max_new)],
                                 capture_output=True, text=True, check=True)
            res = json.loads(out.stdout.strip().splitlines()[-1]) | {"run": r}
            print(res)
            runs.append(res)
    Path(a.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
