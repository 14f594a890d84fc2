"""KV Flash: decode speed and device KV bytes vs context length, full KV vs a bounded pool,
default model, in one run.

    python benchmarks/kvflash.py [--contexts 1024,2048,4096,8000] [--pool 1024] [--policy lru]
                                 [--decode 32] [--threads 2] [--out FILE]
    python benchmarks/kvflash.py --retrieval [--pool 512]
    python benchmarks/kvflash.py --parallel 4 [--contexts 1024,2048] [--pool 512]

The context is built from the evaluation prompts (../shared/eval/*.jsonl, concatenated
and tokenized) and prefilled; then ``--decode`` greedy tokens are timed. Writes JSON
(default benchmarks/results/kvflash.json) and prints a Markdown table.

``--parallel N``: N sequence slots (a pool each), each prefilled with its own stretch of the
text (offsets 97 tokens apart), then decoded together, one row per slot in each forward
(``forward_rows``, as ``serve --parallel N`` steps them); decode tok/s is the aggregate.

``--retrieval``: a "secret code" sentence at 30% / 50% depth of ~1900 tokens of the same
text, 5 facts, question at the end (~4x a 512-token pool); pass counts for full KV, lru
and score (written to benchmarks/results/kvflash_retrieval.json).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
EVAL = ROOT.parent / "shared" / "eval"


def eval_text() -> str:
    parts = []
    for f in sorted(EVAL.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            row = json.loads(line)
            msgs = row.get("messages") or [{"content": t} for t in row.get("turns", [])]
            parts += [m["content"] for m in msgs if isinstance(m.get("content"), str)]
    return "\n\n".join(parts)


def retrieval(src, quant, pool: int, out: Path) -> None:
    from dflash_server.engine.generate import Engine, GenerationRequest
    from dflash_server.runtime.kv_pager import KvFlashConfig
    from dflash_server.runtime.pipeline import build_pipeline
    from dflash_server.runtime.placement import plan_placement

    filler = src.tokenizer.encode(eval_text())
    facts = [("Zorbak", "4721"), ("Quillon", "9035"), ("Marvessa", "1168"), ("Telluride", "7702"),
             ("Brannoch", "5849")]
    passed = {}
    for mode in ("full", "lru", "score"):
        kv = None if mode == "full" else KvFlashConfig(pool, policy=mode)
        pipe = build_pipeline(src, plan_placement(src.config.num_layers, ["cpu"]), dtype=torch.bfloat16,
                              max_ctx=4096, quantize=quant, progress=False, kvflash=kv)
        eng, passed[mode] = Engine(pipe), 0
        for i, (name, code) in enumerate(facts):
            for depth in (0.3, 0.5):
                text = src.tokenizer.decode(filler[i * 400:i * 400 + 1900])
                cut = int(len(text) * depth)
                doc = text[:cut] + f"\n\nIMPORTANT: The secret code of {name} is {code}.\n\n" + text[cut:]
                ids = src.tokenizer.encode_chat([{"role": "user", "content": doc + f"\n\nWhat is the secret code "
                                                  f"of {name}? Answer with the number only."}])
                passed[mode] += code in eng.generate(GenerationRequest(tuple(ids), max_tokens=16)).text
        print(mode, passed[mode], "/", 2 * len(facts), flush=True)
    out.write_text(json.dumps({"pool": pool, "cases": 2 * len(facts), "passed": passed}, indent=2))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--retrieval", action="store_true")
    ap.add_argument("--contexts", default="1024,2048,4096,8000")
    ap.add_argument("--pool", type=int, help="pool tokens (default 1024; 512 with --retrieval)")
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parallel", type=int, default=1, help="sequence slots decoding together (default 1)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kvflash.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT / "src"))
    from dflash_server.cli.common import quantize_plan
    from dflash_server.runtime.kv_pager import KvFlashConfig
    from dflash_server.runtime.pipeline import build_pipeline
    from dflash_server.runtime.placement import plan_placement
    from dflash_server.weights.default_model import default_model_path
    from dflash_server.weights.loader import open_model

    src = open_model(default_model_path())
    quant = quantize_plan(src, "auto", True)
    if args.retrieval:
        return retrieval(src, quant, args.pool or 512, Path(args.out).with_name("kvflash_retrieval.json"))
    args.pool = args.pool or 1024
    contexts = [int(x) for x in args.contexts.split(",")]
    max_ctx = max(contexts) + args.decode
    ids = src.tokenizer.encode(eval_text())
    N = args.parallel
    assert len(ids) >= max(contexts) + 97 * (N - 1), f"only {len(ids)} tokens of evaluation text"
    shards = plan_placement(src.config.num_layers, ["cpu"])
    results = []
    for mode in ("full KV", f"KV Flash {args.pool} ({args.policy})"):
        kv = None if mode == "full KV" else KvFlashConfig(args.pool, policy=args.policy)
        pipe = build_pipeline(src, shards, dtype=torch.bfloat16, max_ctx=max_ctx, quantize=quant, progress=False,
                              kvflash=kv, lanes=N)
        for n in contexts:
            toks = []
            t0 = time.perf_counter()
            for lane in range(N):
                pipe.select(lane)
                pipe.reset()
                toks.append(int(pipe.prefill(ids[97 * lane:97 * lane + n], chunk=512).logits[-1].argmax()))
            prefill_s = time.perf_counter() - t0
            pos = n
            t0 = time.perf_counter()
            for _ in range(args.decode):
                if N == 1:
                    toks = [int(pipe.forward(toks, pos).logits[-1].argmax())]
                else:
                    toks = pipe.forward_rows(toks, list(range(N)), [pos] * N).logits.argmax(-1).tolist()
                pos += 1
            dt = time.perf_counter() - t0
            row = {"mode": mode, "context": n, "decode_tps": round(N * args.decode / dt, 2),
                   "prefill_s": round(prefill_s, 2), "device_kv_mib": round(pipe.kv_bytes() / 2**20, 2)}
            stats = pipe.kvflash_stats()
            if stats:
                row.update(paged_chunks=stats[0]["paged_chunks"], host_kv_mib=round(stats[0]["host_bytes"] / 2**20, 2))
            results.append(row)
            print(row, flush=True)
    short = {r["mode"]: r["decode_tps"] for r in results if r["context"] == contexts[0]}
    for r in results:
        r["vs_short_context"] = round(r["decode_tps"] / short[r["mode"]], 3)
    meta = {"pool": args.pool, "policy": args.policy, "decode": args.decode, "threads": args.threads, "parallel": N,
            "quantize": list(quant), "max_ctx": max_ctx, "torch": torch.__version__, "cpu_count": os.cpu_count()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print("\n| mode | context | decode tok/s | vs shortest context | device KV (MiB) | paged-out KV in host memory (MiB) |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['mode']} | {r['context']} | {r['decode_tps']} | {r['vs_short_context']:.2f}x | "
              f"{r['device_kv_mib']} | {r.get('host_kv_mib', '-')} |")


if __name__ == "__main__":
    main()
