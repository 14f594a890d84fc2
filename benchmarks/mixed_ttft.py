"""Time to first token of a short prompt that arrives while a long prompt prefills, next to a
running stream, in one process (the engine's step loop, as ``serve --parallel 3`` drives it;
default model, greedy, EOS ignored): the engine's order (the prompt with the fewest tokens left
first, ``StepScheduler.next_prefill``) against arrival order (the scheduler's earlier rule,
patched in for the comparison), rounds alternating, medians.

Per round: a stream decoding; a ``--long``-token prompt joins; one step later a short chat
prompt joins. Reported: the short prompt's and the long prompt's time to first token (from
their submission), and whether every output equals the same request run alone.

    python benchmarks/mixed_ttft.py [--long 2000] [--rounds 3] [--step-tokens 256] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from dflash_server.cli.common import load_engine
from dflash_server.engine.batching import StepScheduler
from dflash_server.engine.config import EngineConfig
from dflash_server.engine.generate import GenerationRequest

ROOT = Path(__file__).resolve().parents[1]
TEXT = ("The river rises every spring and the town rebuilds its bridges, its mills and its markets; "
        "the elders keep a ledger of each flood, the height of the water and the names of the streets it took. ")


def arrival_order(self, skip=()):
    """The scheduler's earlier rule: the oldest prefilling sequence first."""
    return next((s for s in self.prefilling if s not in skip), None)


def one_round(engine, stream, long, short) -> tuple[float, float, list]:
    seqs, first = [], {}

    def mark(i):
        return lambda ev: first.setdefault(i, time.perf_counter()) if ev.token_id >= 0 else None
    t_submit = {}
    seqs.append(engine.submit(stream))
    while not seqs[0].out.tokens:           # the stream is decoding
        engine.step()
    t_submit[1] = time.perf_counter()
    seqs.append(engine.submit(long, on_event=mark(1)))
    engine.step()                           # the long prompt's first piece
    t_submit[2] = time.perf_counter()
    seqs.append(engine.submit(short, on_event=mark(2)))
    while not all(s.done for s in seqs):
        engine.step()
    return first[2] - t_submit[2], first[1] - t_submit[1], [list(s.result.token_ids) for s in seqs]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--long", type=int, default=2000, help="tokens of the long prompt")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--step-tokens", type=int, default=256)
    ap.add_argument("--out", default=str(Path(os.environ.get("OUT", "benchmarks/results")) / "mixed_ttft.json"))
    a = ap.parse_args()
    cfg = EngineConfig(parallel="3", max_ctx=4096, prefix_cache_slots=0, step_tokens=a.step_tokens)
    source, pipe, engine = load_engine(cfg, progress=False)
    tok = source.tokenizer
    long_ids = tok.encode_chat([{"role": "user", "content": "Summarise this record:\n" + TEXT * 80}])[-a.long:]
    stream = GenerationRequest(tuple(tok.encode_chat([{"role": "user", "content": "Describe a harbour."}])),
                               max_tokens=400, ignore_eos=True)
    long = GenerationRequest(tuple(long_ids), max_tokens=8, ignore_eos=True)
    short = GenerationRequest(tuple(tok.encode_chat([{"role": "user", "content": "What is 7 * 8?"}])),
                              max_tokens=8, ignore_eos=True)
    alone = [engine.generate(r).token_ids for r in (stream, long, short)]
    engine_order = StepScheduler.next_prefill
    modes = {"fewest tokens left first": engine_order, "arrival order": arrival_order}
    res = {m: {"short_ttft_s": [], "long_ttft_s": [], "same_tokens": []} for m in modes}
    try:
        for r in range(a.rounds + 1):       # round 0: warm-up
            for name in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
                StepScheduler.next_prefill = modes[name]
                ts, tl, toks = one_round(engine, stream, long, short)
                if r:
                    res[name]["short_ttft_s"].append(round(ts, 3))
                    res[name]["long_ttft_s"].append(round(tl, 3))
                    res[name]["same_tokens"].append(toks == [list(x) for x in alone])
    finally:
        StepScheduler.next_prefill = engine_order
    out = {"long_tokens": len(long_ids), "short_tokens": len(short.prompt_ids), "step_tokens": a.step_tokens,
           "rounds": a.rounds,
           "modes": {m: dict(v, short_ttft_median_s=statistics.median(v["short_ttft_s"]),
                             long_ttft_median_s=statistics.median(v["long_ttft_s"])) for m, v in res.items()}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
