"""Draft acceptance on the evaluation prompt sets (../shared/eval/), no timing: compare drafts
for the default model by what greedy verification accepts, in the serving configuration
(int4 layers + int8 LM head on CPU, int8 draft linears), with the trained block size.

    python benchmarks/acceptance.py [--draft DIR ...] [--prompts 10] [--max-tokens 96]
                                    [--temperature T] [--threads 2] [--out FILE]

Per set and draft: mean acceptance length (tau, committed tokens per verify step, bonus
included) over all steps of all prompts, and per-position acceptance (the fraction of
verify steps in which draft position k was accepted). Without --draft: the shipped one.
``--temperature T`` (> 0): seeded sampled requests (prompt i: seed 1000 + i, the same for
every draft) verified by rejection sampling (drafts drawn from the draft's distribution, kept
with probability min(1, p/q)), so tau measures how close the draft's distribution is to the
target's, not only its argmax.
Writes JSON (default benchmarks/results/acceptance.json) and prints a Markdown table.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec import EVAL, ROOT, SETS, load_prompts, serving_setup  # noqa: E402  (spec.py's prompt sets and setup)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", action="append", help="draft directory (repeatable; default: the shipped draft)")
    ap.add_argument("--prompts", type=int, default=10, help="prompts per set")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: rejection sampling")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N, ...")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "acceptance.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    src, pipe, load_draft = serving_setup(args.device)
    from dflash_server.engine.generate import Engine, GenerationRequest
    from dflash_server.engine.sampling import SamplingParams
    from dflash_server.spec.proposer import DFlashProposer
    from dflash_server.weights.default_model import default_draft_path

    drafts = args.draft or [str(default_draft_path())]
    verify = "rejection" if args.temperature > 0 else "auto"
    engines = {d: Engine(pipe, proposer=DFlashProposer(load_draft(d), pipe, sampled_verify=verify)) for d in drafts}
    rows = []
    for name, file in SETS.items():
        prompts = [tuple(src.tokenizer.encode_chat(m)) for m in load_prompts(EVAL / file, args.prompts)]
        for d, eng in engines.items():
            committed = steps = 0
            pos_hits, pos_tries = [], []
            for i, ids in enumerate(prompts):
                sampling = SamplingParams(temperature=args.temperature, seed=1000 + i) if args.temperature > 0 \
                    else SamplingParams()
                spec = eng.generate(GenerationRequest(ids, sampling, max_tokens=args.max_tokens)).extra["spec"]
                committed += spec["acceptance_length"] * spec["steps"]
                steps += spec["steps"]
                for k, rate in enumerate(spec["position_acceptance"]):   # weight each prompt by its steps
                    if k == len(pos_hits):
                        pos_hits.append(0.0)
                        pos_tries.append(0)
                    pos_hits[k] += rate * spec["steps"]
                    pos_tries[k] += spec["steps"]
            row = {"set": name, "draft": d, "prompts": len(prompts), "steps": steps,
                   "acceptance_length": committed / steps if steps else 0.0,
                   "position_acceptance": [round(h / t, 3) for h, t in zip(pos_hits, pos_tries)]}
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
    out = {"model": src.path.name, "drafts": drafts, "threads": args.threads, "max_tokens": args.max_tokens,
           "temperature": args.temperature,
           "time": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print("| set | draft | tau | acceptance of draft positions 1-4 |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['set']} | {r['draft']} | {r['acceptance_length']:.2f} | "
              f"{' '.join(f'{p:.2f}' for p in r['position_acceptance'][:4])} |")


if __name__ == "__main__":
    main()
