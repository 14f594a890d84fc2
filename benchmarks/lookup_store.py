"""Lookups across requests (``--lookup-store``) on the default model in the serving
configuration: a proposer with and without a store of earlier requests, on the evaluation sets,
greedy. ``--proposer draft`` (the default): the server's default proposer, the shipped draft's
adaptive chain + prompt lookup; ``--proposer lookup``: prompt lookup alone, no draft model (a
server run with ``--no-draft --lookup N``).

    python benchmarks/lookup_store.py [--proposer draft|lookup] [--warm 100] [--prompts 5]
                                      [--max-tokens 96] [--out FILE]

The store is first filled with ``--warm`` requests of the project's training prompts
(src/dflash_server/assets/train_prompts.jsonl, never the evaluation sets), as a server that
has served other users would hold; then every evaluation prompt runs once per engine, in
alternating order, and the store also keeps what the evaluation prompts before it answered
(each prompt runs once, so no request finds its own answer). Reports tok/s, tau (tokens per
verify step), lookup steps and whether every output equals the engine without a store.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec import EVAL, ROOT, SETS, geomean, load_prompts, serving_setup  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--proposer", choices=("draft", "lookup"), default="draft",
                    help="the shipped draft with prompt lookup (the server's default), or lookup alone")
    ap.add_argument("--warm", type=int, default=100, help="training prompts answered into the store first")
    ap.add_argument("--prompts", type=int, default=5, help="evaluation prompts per set")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--capacity", type=int, default=1_000_000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "lookup_store.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    src, pipe, load_draft = serving_setup("cpu")
    from dflash_server.engine.config import DEFAULT_LOOKUP
    from dflash_server.engine.generate import Engine, GenerationRequest
    from dflash_server.spec.lookup import LookupProposer, LookupStore
    from dflash_server.spec.proposer import DFlashProposer
    from dflash_server.weights.default_model import default_draft_path

    def engine(store: bool) -> Engine:
        if args.proposer == "lookup":
            prop = LookupProposer(pipe, DEFAULT_LOOKUP)
        else:
            prop = DFlashProposer(load_draft(str(default_draft_path())), pipe, adaptive=True, lookup=DEFAULT_LOOKUP)
        if store:
            prop.lookup_store = LookupStore(args.capacity)
        return Engine(pipe, proposer=prop)

    engines = {"no store": engine(False), "store": engine(True)}
    store = engines["store"].proposer.lookup_store
    train = [json.loads(line)["messages"] for line in open(ROOT / "src" / "dflash_server" / "assets" / "train_prompts.jsonl")]
    t0 = time.perf_counter()
    for msgs in train[:args.warm]:
        engines["store"].generate(GenerationRequest(tuple(src.tokenizer.encode_chat(msgs)), max_tokens=args.max_tokens))
    print(f"store warmed with {args.warm} training requests: {len(store)} tokens, "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    rows, k = [], 0
    for name, file in SETS.items():
        acc = {m: {"tokens": 0, "seconds": 0.0, "steps": 0, "lookup_steps": 0, "ratios": []} for m in engines}
        same = 0
        prompts = [tuple(src.tokenizer.encode_chat(m)) for m in load_prompts(EVAL / file, args.prompts)]
        for ids in prompts:
            order = list(engines) if k % 2 == 0 else list(engines)[::-1]
            k += 1
            got = {}
            for m in order:
                res = engines[m].generate(GenerationRequest(ids, max_tokens=args.max_tokens))
                spec = res.extra["spec"]
                a = acc[m]
                a["tokens"] += len(res.token_ids)
                a["seconds"] += res.decode_s
                a["steps"] += spec["steps"] + spec["plain_steps"]
                a["lookup_steps"] += spec["lookup_steps"]
                got[m] = res
            same += got["store"].token_ids == got["no store"].token_ids
            acc["store"]["ratios"].append((len(got["store"].token_ids) / got["store"].decode_s)
                                          / (len(got["no store"].token_ids) / got["no store"].decode_s))
        row = {"set": name, "prompts": len(prompts), "same_output": same}
        for m, a in acc.items():
            row[m] = {"tok_s": a["tokens"] / a["seconds"], "tau": a["tokens"] / max(a["steps"], 1),
                      "lookup_steps": a["lookup_steps"]}
        row["speedup"] = geomean(acc["store"]["ratios"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = {"args": vars(args), "store": store.to_dict(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print("| set | no store tok/s, tau | store tok/s, tau | store / no store | same output |")
    print("|---|---|---|---|---|")
    for r in rows:
        a, b = r["no store"], r["store"]
        print(f"| {r['set']} | {a['tok_s']:.1f}, {a['tau']:.2f} | {b['tok_s']:.1f}, {b['tau']:.2f} | "
              f"{r['speedup']:.2f}x | {r['same_output']}/{r['prompts']} |")


if __name__ == "__main__":
    main()
