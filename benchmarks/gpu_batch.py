"""Batched decoding on a GPU (continuous batching, ``--parallel N``), with and without CUDA
graphs, in one process: N requests submitted together to one engine, greedy, EOS ignored;
aggregate decode tok/s and whether each request's tokens equal between the two (fp32 exact;
bf16 may part at near ties). Run by ``benchmarks/gpu_check.sh``; also runs on ``--device cpu``
(no graphs there: both rows eager).

    python benchmarks/gpu_batch.py [--device cuda] [--parallel 4] [--max-tokens 128] [--dtype fp32]
                                   [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from dflash_server.cli.common import load_engine
from dflash_server.engine.config import EngineConfig
from dflash_server.engine.generate import GenerationRequest

PROMPTS = ["Name the capital of France, then list three facts about it.",
           "Write a Python function that reverses a string.",
           "Explain what a hash table is in two sentences.",
           "List five fruits and their colours.",
           "What is the boiling point of water at sea level?",
           "Give three tips for a job interview.",
           "Describe the water cycle briefly.",
           "Translate 'good morning' into French, Spanish and German."]


def batch(device: str, parallel: int, tokens: int, dtype: str, graphs: str) -> dict:
    cfg = EngineConfig(device=device, parallel=str(parallel), dtype=dtype, cuda_graphs=graphs,
                       quantize="none" if dtype == "fp32" else "auto")
    source, pipe, engine = load_engine(cfg, progress=False)
    tok = source.tokenizer
    reqs = [GenerationRequest(tuple(tok.encode_chat([{"role": "user", "content": p}])), max_tokens=tokens,
                              ignore_eos=True) for p in (PROMPTS * 4)[:parallel]]
    engine.generate(GenerationRequest(reqs[0].prompt_ids, max_tokens=8, ignore_eos=True))   # warm-up
    seqs = [engine.submit(r) for r in reqs]
    t0 = time.perf_counter()
    while not all(s.done for s in seqs):
        engine.step()
    if pipe.stages[0].device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    graphs_on = [st._graphs is not None for st in pipe.stages if hasattr(st, "_graphs")]
    out = [list(s.result.token_ids) for s in seqs]
    return {"graphs": graphs, "graphs_on": graphs_on, "wall_s": round(wall, 3),
            "aggregate_tok_s": round(sum(map(len, out)) / wall, 1), "token_ids": out}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--out", default=str(Path(os.environ.get("OUT", "benchmarks/results")) / "gpu_batch.json"))
    args = ap.parse_args()
    runs = {g: batch(args.device, args.parallel, args.max_tokens, args.dtype, g) for g in ("auto", "off")}
    same = [a == b for a, b in zip(runs["auto"]["token_ids"], runs["off"]["token_ids"])]
    summary = {"device": args.device, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
               "parallel": args.parallel, "dtype": args.dtype, "max_tokens": args.max_tokens,
               "graphs_tok_s": runs["auto"]["aggregate_tok_s"], "eager_tok_s": runs["off"]["aggregate_tok_s"],
               "graphs_on": runs["auto"]["graphs_on"], "same_tokens": same, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}))


if __name__ == "__main__":
    main()
