"""DFlash in the batch: N requests decoding together with and without the draft, in one
process (the engine's step loop, as ``serve --parallel N`` drives it), default model and
its shipped draft, greedy, EOS ignored. With the draft, the running sequences' verify blocks
go through one target forward (each sequence's block chosen by the batch sizer, a block of
1 being a plain row); without it, one batched decode row each. Modes alternate round by
round (the VM's speed drifts), after one warm-up run each (kernels built, and the sizers'
exploration done, as on a server past its first requests); reports aggregate tok/s per mode
(medians), the draft's acceptance and mean block, and whether every request's tokens equal
the plain run's.

    python benchmarks/batch_spec.py [--parallel 4] [--max-tokens 128] [--rounds 3]
                                    [--block-size auto] [--device cpu] [--out FILE]
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


def prompts(n: int) -> list[list[dict]]:
    """Chat prompts from the evaluation sets, taken in turn (code, math, chat)."""
    files = ["bench_he.jsonl", "bench_gsm.jsonl", "mt_bench.jsonl"]
    rows = [[json.loads(line) for line in (EVAL / f).read_text().splitlines()[:n]] for f in files]
    out = []
    for i in range(n):
        row = rows[i % 3][i // 3]
        out.append(row["messages"] if "messages" in row else [{"role": "user", "content": row["turns"][0]}])
    return out


def run(engine, reqs) -> tuple[float, list, list]:
    seqs = [engine.submit(r) for r in reqs]
    t0 = time.perf_counter()
    while not all(s.done for s in seqs):
        engine.step()
    wall = time.perf_counter() - t0
    return wall, [list(s.result.token_ids) for s in seqs], [s.result.extra.get("spec") for s in seqs]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--block-size", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=str(Path(os.environ.get("OUT", "benchmarks/results")) / "batch_spec.json"))
    a = ap.parse_args()
    block = a.block_size if a.block_size == "auto" else int(a.block_size)
    engines = {}
    for mode in ("plain", "draft"):
        cfg = EngineConfig(device=a.device, parallel=str(a.parallel), draft="default" if mode == "draft" else None,
                           no_draft=mode == "plain", block_size=block)
        source, pipe, engine = load_engine(cfg, progress=False)
        engines[mode] = engine
    tok = source.tokenizer
    reqs = [GenerationRequest(tuple(tok.encode_chat(m)), max_tokens=a.max_tokens, ignore_eos=True)
            for m in prompts(a.parallel)]
    for engine in engines.values():   # warm-up: kernels, and the sizers' exploration (a server's first requests)
        run(engine, reqs)
    rounds = {m: [] for m in engines}
    tokens, spec = {}, None
    for r in range(a.rounds):
        for mode in (("plain", "draft") if r % 2 == 0 else ("draft", "plain")):
            wall, toks, sp = run(engines[mode], reqs)
            rounds[mode].append(sum(map(len, toks)) / wall)
            tokens.setdefault(mode, toks)
            if mode == "draft":
                spec = sp
    med = {m: statistics.median(v) for m, v in rounds.items()}
    summary = {"device": a.device, "parallel": a.parallel, "max_tokens": a.max_tokens, "block_size": a.block_size,
               "plain_tok_s": round(med["plain"], 1), "draft_tok_s": round(med["draft"], 1),
               "draft_vs_plain": round(med["draft"] / med["plain"], 3),
               "rounds_tok_s": {m: [round(x, 1) for x in v] for m, v in rounds.items()},
               "same_tokens": [x == y for x, y in zip(tokens["plain"], tokens["draft"])],
               "acceptance_length": [s and s["acceptance_length"] for s in spec],
               "mean_block_size": [s and s["mean_block_size"] for s in spec],
               "verify_steps": [s and s["steps"] for s in spec], "plain_steps": [s and s["plain_steps"] for s in spec],
               "batch_sizer": (bs.to_dict() if (bs := getattr(engines["draft"].proposer, "batch_sizer", None)) else None)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
