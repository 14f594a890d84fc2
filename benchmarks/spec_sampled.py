"""Sampled DFlash: acceptance and speed of rejection sampling vs exact-match verification,
default model and its shipped draft, temperatures 0.7 and 1.0, in one run.

    python benchmarks/spec_sampled.py [--prompts 4] [--max-tokens 96] [--temperatures 0.7,1.0]
                                      [--threads 2] [--out FILE]

Per temperature and prompt set (the evaluation prompts): plain sampling (AR), DFlash with
exact-match verification (drafts the argmax, keeps it where it equals the target's own
sample: what a seeded request does) and with rejection sampling (drafts drawn from the
draft's distribution, kept with probability min(1, p/q): unseeded requests), both at the
trained block size; acceptance length (tokens committed per verify step) and decode
tokens/s (medians), each prompt's three modes back to back. Every request is seeded (the
mode is forced on the proposer), so the run repeats. Writes JSON (default
benchmarks/results/spec_sampled.json) and prints a Markdown table.

``--modes default`` instead compares what a CPU server does by default at temperature: plain
sampling, the shipped draft with prompt lookup 5 and the adaptive block size verifying by
rejection sampling (what an unseeded request gets), and prompt lookup alone; speedups are
geometric means of each prompt's ratio to plain sampling, the modes back to back in rotating
order. ``--draft DIR`` replaces the shipped draft.
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
sys.path.insert(0, str(ROOT / "benchmarks"))
from spec import EVAL, SETS, geomean, load_prompts, serving_setup  # noqa: E402


def rotated_runs(engines: dict, tokenizer, args, seed0: int):
    """Per temperature and prompt set: (T, set name, one {mode: result} per prompt), each
    prompt's seeded request (seed ``seed0 + i``) run on every engine back to back in
    rotating order, so the machine's drift hits every mode alike."""
    from dflash_server.engine.generate import GenerationRequest
    from dflash_server.engine.sampling import SamplingParams

    n = len(engines)
    for temp in [float(t) for t in args.temperatures.split(",")]:
        for name, file in SETS.items():
            runs = []
            for i, messages in enumerate(load_prompts(EVAL / file, args.prompts)):
                req = GenerationRequest(tuple(tokenizer.encode_chat(messages)),
                                        SamplingParams(temperature=temp, seed=seed0 + i), max_tokens=args.max_tokens)
                order = list(engines)[i % n:] + list(engines)[:i % n]
                runs.append({k: engines[k].generate(req) for k in order})
            yield temp, name, runs


def tok_s(r) -> float:
    return r.completion_tokens / r.decode_s if r.decode_s else 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=4, help="prompts per set")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperatures", default="0.7,1.0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", default="verify", choices=["verify", "default"],
                    help="verify: exact match vs rejection at the trained block; default: the CPU default vs plain")
    ap.add_argument("--draft", help="draft directory (default: the shipped one)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "spec_sampled.json"))
    args = ap.parse_args()
    if args.modes == "default":
        return default_modes(args)
    torch.set_num_threads(args.threads)
    src, pipe, load_draft = serving_setup("cpu")
    from dflash_server.engine.generate import Engine
    from dflash_server.spec.proposer import DFlashProposer
    from dflash_server.weights.default_model import default_draft_path

    draft_dir = args.draft or default_draft_path()
    engines = {"ar": Engine(pipe),
               "exact": Engine(pipe, proposer=DFlashProposer(load_draft(draft_dir), pipe, sampled_verify="exact")),
               "rejection": Engine(pipe, proposer=DFlashProposer(load_draft(draft_dir), pipe,
                                                                  sampled_verify="rejection"))}
    for e in engines.values():
        e.warm_up()
    rows = []
    for temp, name, runs in rotated_runs(engines, src.tokenizer, args, 1000):
        tps = {k: [tok_s(r[k]) for r in runs] for k in engines}
        tau = {k: [r[k].extra["spec"]["acceptance_length"] for r in runs] for k in ("exact", "rejection")}
        row = {"temperature": temp, "set": name, "ar_tok_s": round(statistics.median(tps["ar"]), 1),
               "exact_tok_s": round(statistics.median(tps["exact"]), 1),
               "rejection_tok_s": round(statistics.median(tps["rejection"]), 1),
               "tau_exact": round(statistics.mean(tau["exact"]), 3),
               "tau_rejection": round(statistics.mean(tau["rejection"]), 3)}
        rows.append(row)
        print(row, flush=True)
    out = {"model": src.path.name, "draft": str(draft_dir), "block_size": engines["exact"].proposer.block_size,
           "threads": args.threads, "max_tokens": args.max_tokens, "prompts": args.prompts,
           "time": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print("\n| T | set | AR tok/s | exact-match tok/s | rejection tok/s | tau exact | tau rejection |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['temperature']} | {r['set']} | {r['ar_tok_s']} | {r['exact_tok_s']} | {r['rejection_tok_s']} | "
              f"{r['tau_exact']} | {r['tau_rejection']} |")


def default_modes(args):
    """Plain sampling vs the default CPU configuration (draft + lookup, adaptive, rejection)
    vs lookup alone, per temperature and set."""
    torch.set_num_threads(args.threads)
    src, pipe, load_draft = serving_setup("cpu")
    from dflash_server.engine.generate import Engine
    from dflash_server.spec.lookup import LookupProposer
    from dflash_server.spec.proposer import DFlashProposer
    from dflash_server.weights.default_model import default_draft_path

    draft_dir = args.draft or default_draft_path()
    engines = {"ar": Engine(pipe),
               "default": Engine(pipe, proposer=DFlashProposer(load_draft(draft_dir), pipe, adaptive=True, lookup=5,
                                                                sampled_verify="rejection")),
               "lookup_only": Engine(pipe, proposer=LookupProposer(pipe, 5))}
    for e in engines.values():
        e.warm_up()
    rows = []
    for temp, name, runs in rotated_runs(engines, src.tokenizer, args, 2000):
        ratios = {k: [tok_s(r[k]) / tok_s(r["ar"]) if tok_s(r["ar"]) else 0.0 for r in runs]
                  for k in ("default", "lookup_only")}
        per_step = [r["default"].completion_tokens / max(1, r["default"].extra["spec"]["steps"] +
                                                        r["default"].extra["spec"]["plain_steps"]) for r in runs]
        med = {k: round(statistics.median(tok_s(r[k]) for r in runs), 1) for k in engines}
        row = {"temperature": temp, "set": name, "ar_tok_s": med["ar"], "default_tok_s": med["default"],
               "lookup_only_tok_s": med["lookup_only"], "speedup_default": round(geomean(ratios["default"]), 3),
               "speedup_lookup_only": round(geomean(ratios["lookup_only"]), 3),
               "default_tokens_per_step": round(statistics.mean(per_step), 3)}
        rows.append(row)
        print(row, flush=True)
    out = {"model": src.path.name, "draft": str(draft_dir), "modes": "default", "threads": args.threads,
           "max_tokens": args.max_tokens, "prompts": args.prompts, "time": time.strftime("%Y-%m-%d %H:%M"),
           "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print("\n| T | set | plain tok/s | default (draft + lookup) tok/s | lookup alone tok/s | speedup default | "
          "speedup lookup alone | default: tokens a step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['temperature']} | {r['set']} | {r['ar_tok_s']} | {r['default_tok_s']} | {r['lookup_only_tok_s']} | "
              f"{r['speedup_default']:.2f}x | {r['speedup_lookup_only']:.2f}x | {r['default_tokens_per_step']} |")


if __name__ == "__main__":
    main()
