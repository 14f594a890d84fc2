"""DFlash in the batch: N requests decoding together with and without the draft, in one
process (the engine's step loop, as ``serve --parallel N`` drives it), default model and
its shipped draft, greedy, EOS ignored. With the draft, the running sequences' verify blocks
go through one target forward (and their drafts through one draft pass); ``auto``: each
sequence's block chosen by the batch sizer (a block of 1 is a plain row), a number: that
block for every sequence; ``tree``: DDTree verify (--ddtree), each sequence's tree budget
chosen by the batch sizer, ``treeN``: a tree of N nodes for every sequence; ``off``: the
draft on with ``--batch-spec off`` (the CPU default: sequences decoding together take plain
rows, each keeping its draft context). Without it (``plain``), one batched decode row each. The modes take turns
round by round in rotating order (the VM's speed drifts), after one warm-up run each
(kernels built, the sizers' exploration done, as on a server past its first requests);
reports aggregate tok/s per mode (medians), each mode's median ratio to plain over the
rounds (run back to back, so the drift between rounds cancels), the draft's acceptance and
mean block, and whether every request's tokens equal the plain run's.

    python benchmarks/batch_spec.py [--parallel 4] [--max-tokens 128] [--rounds 3]
                                    [--modes plain,auto,off,2,tree,tree8] [--device cpu] [--out FILE]
                                    [--requests N] [--prompts eval|essay]

``--requests N`` (> --parallel): N requests, at most --parallel in flight, the next submitted
as one ends (as benchmarks/serve_concurrency.py loads a server: 2C requests at concurrency C,
its essay prompts with ``--prompts essay``), so sequences join and leave a running batch.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from dflash_server.cli.common import load_engine
from dflash_server.engine.config import EngineConfig
from dflash_server.engine.generate import GenerationRequest

ROOT = Path(__file__).resolve().parents[1]
EVAL = ROOT.parent / "shared" / "eval"


FALLBACK = ["Write a Python function that reverses a string.", "What is 17 * 23? Show the steps.",
            "Describe the water cycle briefly.", "Write a Python function that checks for a prime.",
            "A train goes 60 km in 45 minutes. What is its speed in km/h?", "Give three tips for a job interview.",
            "Write a Python class for a stack.", "How many minutes are in a week?"]


def prompts(n: int) -> list[list[dict]]:
    """Chat prompts from the evaluation sets, taken in turn (code, math, chat); where the
    sets are not at hand (the GPU machine), a fixed list of the same kinds."""
    if not EVAL.is_dir():
        return [[{"role": "user", "content": FALLBACK[i % len(FALLBACK)]}] for i in range(n)]
    files = ["bench_he.jsonl", "bench_gsm.jsonl", "mt_bench.jsonl"]
    rows = [[json.loads(line) for line in (EVAL / f).read_text().splitlines()[:n]] for f in files]
    out = []
    for i in range(n):
        row = rows[i % 3][i // 3]
        out.append(row["messages"] if "messages" in row else [{"role": "user", "content": row["turns"][0]}])
    return out


def essays(n: int) -> list[list[dict]]:
    """benchmarks/serve_concurrency.py's prompts (chat: short essays)."""
    from serve_concurrency import prompt
    return [prompt(i) for i in range(n)]


def run(engine, reqs, parallel: int | None = None) -> tuple[float, list, list]:
    """Every request to its end, at most ``parallel`` in flight (None: all at once)."""
    parallel = parallel or len(reqs)
    seqs = [engine.submit(r) for r in reqs[:parallel]]
    t0 = time.perf_counter()
    while not all(s.done for s in seqs) or len(seqs) < len(reqs):
        engine.step()
        while len(seqs) < len(reqs) and sum(not s.done for s in seqs) < parallel:
            seqs.append(engine.submit(reqs[len(seqs)]))
    wall = time.perf_counter() - t0
    return wall, [list(s.result.token_ids) for s in seqs], [s.result.extra.get("spec") for s in seqs]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="plain,auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=None, help="requests in all (default --parallel)")
    ap.add_argument("--prompts", choices=("eval", "essay"), default="eval")
    ap.add_argument("--out", default=str(Path(os.environ.get("OUT", "benchmarks/results")) / "batch_spec.json"))
    a = ap.parse_args()
    modes = a.modes.split(",")
    if "plain" not in modes:
        modes.insert(0, "plain")
    engines = {}
    for mode in modes:
        tree = mode.startswith("tree")
        budget = int(mode[4:]) if tree and mode[4:] else None
        cfg = EngineConfig(device=a.device, parallel=str(a.parallel), draft=None if mode == "plain" else "default",
                           no_draft=mode == "plain", ddtree=tree, ddtree_budget=budget,
                           batch_spec="off" if mode == "off" else "on",
                           block_size="auto" if mode in ("plain", "auto", "tree", "off") else
                           (int(mode) if not tree else 8))   # (treeN: a fixed budget, the draft's block of 8 deep)
        source, pipe, engine = load_engine(cfg, progress=False)
        engines[mode] = engine
    tok = source.tokenizer
    reqs = [GenerationRequest(tuple(tok.encode_chat(m)), max_tokens=a.max_tokens, ignore_eos=True)
            for m in (essays if a.prompts == "essay" else prompts)(a.requests or a.parallel)]
    for engine in engines.values():   # warm-up: kernels, and the sizers' exploration (a server's first requests)
        run(engine, reqs, a.parallel)
    rounds = {m: [] for m in modes}
    tokens, spec = {}, {}
    for r in range(a.rounds):
        for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
            wall, toks, sp = run(engines[mode], reqs, a.parallel)
            rounds[mode].append(sum(map(len, toks)) / wall)
            tokens.setdefault(mode, toks)
            spec[mode] = sp
    out = {}
    for mode in modes:
        row = {"tok_s": round(statistics.median(rounds[mode]), 1), "rounds_tok_s": [round(x, 1) for x in rounds[mode]],
               "vs_plain_by_round": round(statistics.median(x / p for x, p in zip(rounds[mode], rounds["plain"])), 3)}
        if mode != "plain":
            sp = spec[mode]
            bs = engines[mode].proposer.batch_sizer
            row.update({"same_tokens": [x == y for x, y in zip(tokens["plain"], tokens[mode])],
                        "acceptance_length": [s["acceptance_length"] for s in sp],
                        "mean_block_size": [s["mean_block_size"] for s in sp],
                        "verify_steps": [s["steps"] for s in sp], "plain_steps": [s["plain_steps"] for s in sp],
                        "batch_sizer": bs.to_dict() if bs is not None else None})
        out[mode] = row
    summary = {"device": a.device, "parallel": a.parallel, "requests": len(reqs), "prompts": a.prompts,
               "max_tokens": a.max_tokens, "rounds": a.rounds,
               "modes": out}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(summary, indent=2))
    print(json.dumps({m: {k: v for k, v in r.items() if k in ("tok_s", "vs_plain_by_round", "same_tokens",
                                                             "acceptance_length", "mean_block_size")}
                      for m, r in out.items()}))


if __name__ == "__main__":
    main()
