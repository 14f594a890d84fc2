"""DDTree vs DFlash chains vs autoregressive decoding on the evaluation prompt sets, greedy,
default model and its shipped draft, serving configuration, in one run.

    python benchmarks/ddtree.py [--budgets 4,8,16,22] [--prompts 3] [--max-tokens 96]
                                [--threads 2] [--out FILE]

Per prompt set: AR tok/s, the chain (fixed trained block, and adaptive), each fixed tree
budget and the adaptive budget (what ``--ddtree`` serves): tok/s
(medians), speedup over AR (geometric mean of per-prompt ratios; modes run back to back per
prompt in rotating order), acceptance length tau, mean tree size, and how many outputs equal
AR's. Also the cost of one tree verify of each budget relative to a one-row step. Writes JSON
(default benchmarks/results/ddtree.json) and prints a Markdown table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec import EVAL, ROOT, SETS, geomean, load_prompts, serving_setup  # noqa: E402


def verify_cost(pipe, budgets: list[int], reps: int = 20) -> dict[str, float]:
    """ms of a one-row step, and of a tree verify of each budget / the one-row step (the
    chain-shaped tree: a best-first tree's cost depends only on its row count)."""
    pipe.reset()
    pipe.forward(list(range(100, 356)), 0)
    out = {}

    def timed(rows):
        ts = []
        for _ in range(reps):  # (each keeps its root: the position moves on by one)
            pipe.checkpoint()
            t0 = time.perf_counter()
            pipe.forward(list(range(400, 400 + rows)), pipe.length, logits="all", tree=(-1,) + tuple(range(rows - 1)))
            ts.append(time.perf_counter() - t0)
            pipe.rollback_tree([0])
        return statistics.median(ts)
    one = timed(1)
    out["one_row_ms"] = round(one * 1e3, 3)
    for b in budgets:
        out[f"tree_{b}_x"] = round(timed(b + 1) / one, 3)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft")
    ap.add_argument("--budgets", default="4,8,16,22")
    ap.add_argument("--prompts", type=int, default=3, help="prompts per set")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lookup", type=int, default=5,
                    help="prompt-lookup depth of the *_lookup modes (0: leave them out)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ddtree.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    budgets = [int(b) for b in args.budgets.split(",")]
    src, pipe, load_draft = serving_setup("cpu")
    from dflash_server.engine.generate import Engine, GenerationRequest
    from dflash_server.spec.proposer import DFlashProposer
    from dflash_server.weights.default_model import default_draft_path

    draft = load_draft(args.draft or default_draft_path())
    engines = {"ar": Engine(pipe), "chain": Engine(pipe, proposer=DFlashProposer(draft, pipe)),
               "chain_auto": Engine(pipe, proposer=DFlashProposer(draft, pipe, adaptive=True))}
    for b in budgets:
        engines[f"tree{b}"] = Engine(pipe, proposer=DFlashProposer(draft, pipe, tree_budget=b))
    # what `--ddtree` serves by default: the adaptive budget, up to the largest given
    engines["tree_auto"] = Engine(pipe, proposer=DFlashProposer(draft, pipe, tree_budget=max(budgets), adaptive=True))
    if args.lookup:   # prompt lookup beside the draft: the default chain, and its chain grafted onto trees
        engines["chain_auto_lookup"] = Engine(pipe, proposer=DFlashProposer(draft, pipe, adaptive=True,
                                                                            lookup=args.lookup))
        engines[f"tree{budgets[0]}_lookup"] = Engine(pipe, proposer=DFlashProposer(
            draft, pipe, tree_budget=budgets[0], lookup=args.lookup))
        engines["tree_auto_lookup"] = Engine(pipe, proposer=DFlashProposer(
            draft, pipe, tree_budget=max(budgets), adaptive=True, lookup=args.lookup))
    for e in engines.values():
        e.warm_up()
    modes = [k for k in engines if k != "ar"]
    rows = []
    for name, file in SETS.items():
        tps = {k: [] for k in engines}
        ratio = {k: [] for k in modes}
        tau = {k: [] for k in modes}
        nodes = {k: [] for k in modes}
        same = {k: 0 for k in modes}
        prompts = load_prompts(EVAL / file, args.prompts)
        for i, messages in enumerate(prompts):
            req = GenerationRequest(tuple(src.tokenizer.encode_chat(messages)), max_tokens=args.max_tokens)
            keys = list(engines)
            order = keys[i % len(keys):] + keys[:i % len(keys)]
            res = {k: engines[k].generate(req) for k in order}
            for k, r in res.items():
                tps[k].append(r.completion_tokens / r.decode_s if r.decode_s else 0.0)
            for k in modes:
                spec = res[k].extra["spec"]
                ratio[k].append(tps[k][-1] / tps["ar"][-1] if tps["ar"][-1] else 0.0)
                tau[k].append(spec["acceptance_length"])
                nodes[k].append(spec["proposed"] / spec["steps"] if spec["steps"] else 0.0)
                same[k] += res[k].token_ids == res["ar"].token_ids
        row = {"set": name, "prompts": len(prompts), "ar_tok_s": round(statistics.median(tps["ar"]), 2),
               "modes": {k: {"tok_s": round(statistics.median(tps[k]), 2), "speedup": round(geomean(ratio[k]), 3),
                             "tau": round(statistics.mean(tau[k]), 3), "drafted_per_step": round(statistics.mean(nodes[k]), 2),
                             "identical": f"{same[k]}/{len(prompts)}"} for k in modes}}
        rows.append(row)
        print(row, file=sys.stderr)
    cost = verify_cost(pipe, budgets)
    out = {"model": src.path.name, "threads": args.threads, "max_tokens": args.max_tokens,
           "block_size": engines["chain"].proposer.block_size, "budgets": budgets,
           "time": time.strftime("%Y-%m-%d %H:%M"), "verify_cost": cost, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print("| set | AR tok/s | " + " | ".join(f"{k}: tok/s, speedup, tau" for k in modes) + " |")
    print("|---|---|" + "---|" * len(modes))
    for r in rows:
        cells = [f"{m['tok_s']:.1f}, {m['speedup']:.2f}x, {m['tau']:.2f} ({m['identical']})" for m in r["modes"].values()]
        print(f"| {r['set']} | {r['ar_tok_s']:.1f} | " + " | ".join(cells) + " |")
    print("verify cost vs one row:", cost)


if __name__ == "__main__":
    main()
