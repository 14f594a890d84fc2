"""DFlash vs autoregressive decoding on the evaluation prompt sets (../shared/eval/), greedy,
default model and its shipped draft, in one run.

    python benchmarks/spec.py [--draft DIR] [--prompts 5] [--max-tokens 128] [--block-size 8]
                              [--threads 2] [--out FILE]

Per prompt set: AR tokens/s with int4 weights (our fastest AR) and with dense bf16, DFlash
tokens/s (dense bf16 target, which verifies blocks faster), speedup over the best AR,
mean acceptance length (tau) and accept rate. DFlash outputs are checked to be identical
to AR on the same (bf16) weights (lossless). Writes JSON
(default benchmarks/results/spec.json) and prints a Markdown table.
"""
from __future__ import annotations

import argparse
import json
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft")
    ap.add_argument("--prompts", type=int, default=5, help="prompts per set")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "spec.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT / "src"))
    from dflash_server.engine.generate import Engine, GenerationRequest
    from dflash_server.runtime.pipeline import build_pipeline
    from dflash_server.runtime.placement import plan_placement
    from dflash_server.spec.draft import DFlashDraft
    from dflash_server.spec.proposer import DFlashProposer
    from dflash_server.weights.default_model import default_draft_path, default_model_path
    from dflash_server.weights.loader import open_model

    src = open_model(default_model_path())
    draft_dir = args.draft or default_draft_path()
    if draft_dir is None:
        sys.exit("no draft: pass --draft DIR (the shipped draft is missing)")
    shards = plan_placement(src.config.num_layers, ["cpu"])
    ar_pipe = build_pipeline(src, shards, dtype=torch.bfloat16, max_ctx=4096, quantize=("int4", "int8"),
                             progress=False)
    sp_pipe = build_pipeline(src, shards, dtype=torch.bfloat16, max_ctx=4096, quantize="dense", progress=False)
    ar = Engine(ar_pipe)
    ar_dense = Engine(sp_pipe)
    draft = DFlashDraft.load(draft_dir, "cpu", torch.bfloat16, 4096)
    sp = Engine(sp_pipe, proposer=DFlashProposer(draft, sp_pipe, args.block_size))
    draft_q = DFlashDraft.load(draft_dir, "cpu", torch.bfloat16, 4096)
    sp_q = Engine(ar_pipe, proposer=DFlashProposer(draft_q, ar_pipe, args.block_size))
    warm = GenerationRequest(tuple(src.tokenizer.encode("Hello")), max_tokens=8, ignore_eos=True)
    for e in (ar, sp, sp_q):
        e.generate(warm)
    rows = []
    for name, file in SETS.items():
        ar_tps, dense_tps, sp_tps, spq_tps, taus, rates, same = [], [], [], [], [], [], 0
        prompts = load_prompts(EVAL / file, args.prompts)
        for messages in prompts:
            ids = tuple(src.tokenizer.encode_chat(messages))
            req = GenerationRequest(ids, max_tokens=args.max_tokens)
            a = ar.generate(req)
            d = ar_dense.generate(req)
            b = sp.generate(req)
            c = sp_q.generate(req)
            # lossless: DFlash output == AR output on the same weights
            same += d.token_ids == b.token_ids and a.token_ids == c.token_ids
            spq_tps.append(c.completion_tokens / c.decode_s if c.decode_s else 0.0)
            dense_tps.append(d.completion_tokens / d.decode_s if d.decode_s else 0.0)
            # decode speed over the whole generation after prefill (first token included)
            ar_tps.append(a.completion_tokens / a.decode_s if a.decode_s else 0.0)
            sp_tps.append(b.completion_tokens / b.decode_s if b.decode_s else 0.0)
            taus.append(b.extra["spec"]["acceptance_length"])
            rates.append(b.extra["spec"]["accept_rate"])
        row = {"set": name, "prompts": len(prompts), "ar_tok_s": statistics.median(ar_tps),
               "ar_dense_tok_s": statistics.median(dense_tps),
               "dflash_tok_s": statistics.median(sp_tps), "dflash_int4_tok_s": statistics.median(spq_tps), "acceptance_length": statistics.mean(taus),
               "accept_rate": statistics.mean(rates), "identical_outputs": f"{same}/{len(prompts)}"}
        best_ar = max(row["ar_tok_s"], row["ar_dense_tok_s"])
        best_sp = max(row["dflash_tok_s"], row["dflash_int4_tok_s"])
        row["speedup"] = best_sp / best_ar if best_ar else 0.0
        rows.append(row)
        print(row, file=sys.stderr)
    out = {"model": src.path.name, "draft": str(draft_dir), "block_size": sp.proposer.block_size,
           "threads": args.threads, "max_tokens": args.max_tokens, "time": time.strftime("%Y-%m-%d %H:%M"),
           "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print("| set | AR tok/s (int4) | AR tok/s (bf16) | DFlash tok/s (int4) | DFlash tok/s (bf16) | "
          "best vs best AR | acceptance length | accept rate | identical to AR |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['set']} | {r['ar_tok_s']:.1f} | {r['ar_dense_tok_s']:.1f} | {r['dflash_int4_tok_s']:.1f} | "
              f"{r['dflash_tok_s']:.1f} | {r['speedup']:.2f}x | "
              f"{r['acceptance_length']:.2f} | {r['accept_rate']:.2f} | {r['identical_outputs']} |")


if __name__ == "__main__":
    main()
