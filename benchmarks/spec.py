"""DFlash vs autoregressive decoding on the evaluation prompt sets (../shared/eval/), greedy,
default model and its shipped draft, in one run.

    python benchmarks/spec.py [--draft DIR] [--prompts 5] [--max-tokens 128] [--block-size 8]
                              [--lookup 5] [--threads 2] [--device cpu] [--compile] [--out FILE]

All runs use the serving configuration (int4 layers + int8 LM head on CPU, int8 draft linears;
bf16 on a GPU). Per prompt set:
AR tokens/s, DFlash tokens/s with the fixed trained block, with the adaptive block size, and
with the adaptive block size plus prompt lookup (``--lookup N`` drafts copied where the
context repeats, spec.lookup: the server's default with a draft), and prompt lookup alone
without the draft (``--lookup N`` without ``--draft``), speedups over AR (geometric mean over prompts of each prompt's
DFlash / AR tokens/s; the three modes run each prompt back to back in rotating order, so the
machine's drift hits them alike; tokens/s columns are medians), mean acceptance length (tau) and per-position
acceptance of the fixed block, and whether each DFlash output is identical to AR's (bf16:
a block verify may round a near-tie differently from a one-row step; fp32 is exact, see the
tests). Writes JSON (default benchmarks/results/spec.json) and prints a Markdown table.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
EVAL = ROOT.parent / "shared" / "eval"
SETS = {"code (HumanEval)": "bench_he.jsonl", "math (GSM8K)": "bench_gsm.jsonl", "math (MATH-500)": "bench_math.jsonl",
        "chat (MT-Bench)": "mt_bench.jsonl"}


def load_prompts(file: Path, n: int) -> list[list[dict]]:
    out = []
    for line in file.read_text().splitlines()[:n]:
        row = json.loads(line)
        out.append(row["messages"] if "messages" in row else [{"role": "user", "content": row["turns"][0]}])
    return out


def serving_setup(device: str = "cpu"):
    """(source, pipeline, load_draft) in the serving configuration of the default model on
    ``device``, as the CLI builds it with ``--quantize auto``: on a CPU int4 layers + int8 LM
    head and int8 draft linears, on a GPU bf16 throughout (``load_draft(path)``)."""
    sys.path.insert(0, str(ROOT / "src"))
    from dflash_server.cli.common import draft_quantize, quantize_plan
    from dflash_server.runtime.pipeline import build_pipeline
    from dflash_server.runtime.placement import plan_placement
    from dflash_server.spec.draft import DFlashDraft
    from dflash_server.weights.default_model import default_model_path
    from dflash_server.weights.loader import open_model

    src = open_model(default_model_path())
    quantize = quantize_plan(src, "auto", device == "cpu")
    pipe = build_pipeline(src, plan_placement(src.config.num_layers, [device]), dtype=torch.bfloat16, max_ctx=4096,
                          quantize=quantize, progress=False)

    def load_draft(path):
        return DFlashDraft.load(path, device, torch.bfloat16, 4096, quantize=draft_quantize(quantize[0], device))
    return src, pipe, load_draft


def geomean(xs: list[float]) -> float:
    return math.exp(statistics.mean(math.log(x) for x in xs)) if xs and min(xs) > 0 else 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft")
    ap.add_argument("--prompts", type=int, default=5, help="prompts per set")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int)
    ap.add_argument("--lookup", type=int, default=5, help="prompt-lookup depth of the 'lookup' mode")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N, ...")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the one-token step (AR, and DFlash's plain steps)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "spec.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    src, pipe, load_draft = serving_setup(args.device)
    if args.compile:
        pipe.compile_decode()
    from dflash_server.engine.generate import Engine, GenerationRequest
    from dflash_server.spec.lookup import LookupProposer
    from dflash_server.spec.proposer import DFlashProposer
    from dflash_server.weights.default_model import default_draft_path

    draft_dir = args.draft or default_draft_path()
    if draft_dir is None:
        sys.exit("no draft: pass --draft DIR (the shipped draft is missing)")

    def proposer(adaptive, lookup=0):
        return DFlashProposer(load_draft(draft_dir), pipe, args.block_size, adaptive=adaptive, lookup=lookup)
    engines = {"ar": Engine(pipe), "fixed": Engine(pipe, proposer=proposer(False)),
               "adaptive": Engine(pipe, proposer=proposer(True)),
               "lookup": Engine(pipe, proposer=proposer(True, args.lookup)),
               "lookup_only": Engine(pipe, proposer=LookupProposer(pipe, args.lookup))}
    for e in engines.values():   # as `serve` does: builds compiled graphs, then the block sizer starts afresh
        e.warm_up()
    rows = []
    for name, file in SETS.items():
        tps = {k: [] for k in engines}
        taus, rates, pos_acc, mean_block = [], [], [], []
        same = {"fixed": 0, "adaptive": 0, "lookup": 0, "lookup_only": 0}
        look_tau, look_share = [], []
        prompts = load_prompts(EVAL / file, args.prompts)
        ratios = {"fixed": [], "adaptive": [], "lookup": [], "lookup_only": []}
        for i, messages in enumerate(prompts):
            ids = tuple(src.tokenizer.encode_chat(messages))
            req = GenerationRequest(ids, max_tokens=args.max_tokens)
            n = len(engines)
            order = list(engines)[i % n:] + list(engines)[:i % n]   # rotate: drift hits every mode alike
            res = {k: engines[k].generate(req) for k in order}
            for k, r in res.items():      # decode speed after prefill (first token included)
                tps[k].append(r.completion_tokens / r.decode_s if r.decode_s else 0.0)
            for k in ratios:
                same[k] += res[k].token_ids == res["ar"].token_ids
                ratios[k].append(tps[k][-1] / tps["ar"][-1] if tps["ar"][-1] else 0.0)
            spec = res["fixed"].extra["spec"]
            taus.append(spec["acceptance_length"])
            rates.append(spec["accept_rate"])
            pos_acc.append(spec["position_acceptance"])
            a = res["adaptive"].extra["spec"]           # mean block over all steps, plain ones as 1
            mean_block.append((a["mean_block_size"] * a["steps"] + a["plain_steps"]) /
                              max(1, a["steps"] + a["plain_steps"]))
            lk = res["lookup"].extra["spec"]      # tokens per step over all its steps, plain ones included
            look_tau.append(res["lookup"].completion_tokens / max(1, lk["steps"] + lk["plain_steps"]))
            look_share.append(lk["lookup_steps"] / max(1, lk["steps"] + lk["plain_steps"]))
        med = {k: statistics.median(v) for k, v in tps.items()}
        row = {"set": name, "prompts": len(prompts), "ar_tok_s": med["ar"], "dflash_fixed_tok_s": med["fixed"],
               "dflash_adaptive_tok_s": med["adaptive"], "speedup_fixed": geomean(ratios["fixed"]),
               "speedup_adaptive": geomean(ratios["adaptive"]), "lookup_tok_s": med["lookup"],
               "speedup_lookup": geomean(ratios["lookup"]), "lookup_tokens_per_step": statistics.mean(look_tau),
               "lookup_step_share": statistics.mean(look_share),
               "lookup_only_tok_s": med["lookup_only"], "speedup_lookup_only": geomean(ratios["lookup_only"]),
               "identical_lookup_only": f"{same['lookup_only']}/{len(prompts)}",
               "identical_lookup": f"{same['lookup']}/{len(prompts)}",
               "acceptance_length": statistics.mean(taus),
               "accept_rate": statistics.mean(rates),
               "position_acceptance": [round(statistics.mean(c), 3) for c in zip(*pos_acc)],
               "adaptive_mean_block": statistics.mean(mean_block),
               "identical_fixed": f"{same['fixed']}/{len(prompts)}",
               "identical_adaptive": f"{same['adaptive']}/{len(prompts)}"}
        rows.append(row)
        print(row, file=sys.stderr)
    out = {"model": src.path.name, "draft": str(draft_dir), "block_size": engines["fixed"].proposer.block_size,
           "lookup": args.lookup,
           "device": args.device, "threads": args.threads, "max_tokens": args.max_tokens, "compile": args.compile, "time": time.strftime("%Y-%m-%d %H:%M"),
           "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print("| set | AR tok/s | DFlash fixed B tok/s | DFlash adaptive tok/s | + lookup tok/s | speedup fixed / adaptive / "
          "+ lookup | lookup alone (no draft) | tau (fixed B) | acceptance by position | adaptive mean block | "
          "+ lookup: tokens a step, lookup steps | identical to AR (fixed, adaptive, + lookup, lookup alone) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        pa = " ".join(f"{x:.2f}" for x in r["position_acceptance"][:4])
        print(f"| {r['set']} | {r['ar_tok_s']:.1f} | {r['dflash_fixed_tok_s']:.1f} | {r['dflash_adaptive_tok_s']:.1f} | "
              f"{r['lookup_tok_s']:.1f} | {r['speedup_fixed']:.2f}x / {r['speedup_adaptive']:.2f}x / "
              f"**{r['speedup_lookup']:.2f}x** | {r['speedup_lookup_only']:.2f}x | {r['acceptance_length']:.2f} | {pa} ... | "
              f"{r['adaptive_mean_block']:.2f} | {r['lookup_tokens_per_step']:.2f}, {r['lookup_step_share']:.0%} | "
              f"{r['identical_fixed']}, {r['identical_adaptive']}, {r['identical_lookup']}, "
              f"{r['identical_lookup_only']} |")


if __name__ == "__main__":
    main()
