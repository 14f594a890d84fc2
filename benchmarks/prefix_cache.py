"""Prefix cache: time to first token per turn of a 5-turn chat with a ~2K-token system
prompt on the default model: cold (no cache) vs memory hit vs disk hit after a restart.

    python benchmarks/prefix_cache.py [--threads 2] [--out FILE]

"Restart" = a new engine (fresh weights load, empty memory) on the same --kv-cache-dir.
TTFT here is the engine's prefill time plus the first token (in-process; HTTP adds a
roughly constant overhead, see benchmarks/serve.py). Writes JSON and prints a table.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ["Summarise the policy in one sentence.", "Which rule is the strictest?",
             "Give an example of rule 3 in practice.", "What would you change?", "Thank you, any last advice?"]


def system_prompt(tok, target_tokens=2000) -> str:
    rules = []
    i = 1
    while len(tok.encode("\n".join(rules))) < target_tokens:
        rules.append(f"Rule {i}: employees must document decision {i} with its date, owner, reason and the "
                     f"alternatives considered, and review it after {i % 7 + 1} weeks.")
        i += 1
    return "You are the office policy assistant. The policy:\n" + "\n".join(rules)


def conversation(engine, system, max_tokens):
    from dflash_server.engine.generate import GenerationRequest

    messages = [{"role": "system", "content": system}]
    rows = []
    for q in QUESTIONS:
        messages.append({"role": "user", "content": q})
        ids = tuple(engine.tokenizer.encode_chat(messages))
        t0 = time.perf_counter()
        first = []
        r = engine.generate(GenerationRequest(ids, max_tokens=max_tokens),
                            on_event=lambda e: first.append(time.perf_counter()) if not first else None)
        rows.append({"prompt_tokens": len(ids), "cached_tokens": r.cached_tokens, "source": r.extra.get("cache"),
                     "ttft_s": (first[0] if first else time.perf_counter()) - t0})
        messages.append({"role": "assistant", "content": r.text})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "prefix_cache.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT / "src"))
    from dflash_server.cache.disk import DiskCache
    from dflash_server.engine.generate import Engine
    from dflash_server.runtime.pipeline import build_pipeline
    from dflash_server.runtime.placement import plan_placement
    from dflash_server.weights.default_model import default_model_path
    from dflash_server.weights.loader import open_model

    src = open_model(default_model_path())

    def engine(slots, disk_dir=None):
        pipe = build_pipeline(src, plan_placement(src.config.num_layers, ["cpu"]), dtype=torch.bfloat16,
                              max_ctx=4096, quantize=("int4", "int8"), progress=False)
        disk = DiskCache(disk_dir, "bench", 8 << 30, 0) if disk_dir else None
        return Engine(pipe, prefix_slots=slots, disk_cache=disk)

    system = system_prompt(src.tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        cold = conversation(engine(0), system, args.max_tokens)
        warm_engine = engine(32, tmp)
        warm = conversation(warm_engine, system, args.max_tokens)
        warm_engine.close()
        restarted = conversation(engine(32, tmp), system, args.max_tokens)
    out = {"model": src.path.name, "threads": args.threads, "cold": cold, "memory": warm, "after_restart": restarted}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print("| turn | prompt tokens | cold TTFT s | memory-cache TTFT s (cached) | after restart TTFT s (cached, source) |")
    print("|---|---|---|---|---|")
    for i, (c, w, r) in enumerate(zip(cold, warm, restarted), 1):
        print(f"| {i} | {c['prompt_tokens']} | {c['ttft_s']:.3f} | {w['ttft_s']:.3f} ({w['cached_tokens']}) | "
              f"{r['ttft_s']:.3f} ({r['cached_tokens']}, {r['source']}) |")
    t1 = cold[0]["ttft_s"]
    print(f"\nturn 2-5 memory TTFT / turn-1 TTFT: {max(w['ttft_s'] for w in warm[1:]) / t1:.1%} (max); "
          f"first request after restart / cold: {restarted[0]['ttft_s'] / cold[0]['ttft_s']:.1%}")


if __name__ == "__main__":
    main()
