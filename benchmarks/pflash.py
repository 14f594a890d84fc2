"""PFlash: needle-in-a-haystack retrieval and time to first token, full prefill vs the
prompt compressed by the target's own first N layers (self:N), default model, one run.

    python benchmarks/pflash.py [--lengths 2000,4000,8000] [--depths 0.1,0.3,0.5,0.7,0.9]
                                [--ratios 0.05,0.1,0.2,0.3] [--layers 4] [--extra-layers 2,8]
                                [--threads 2] [--out FILE]

The haystack is the evaluation prompts' text (../shared/eval/*.jsonl); one "secret code"
sentence goes in at each depth, the question at the end, through the chat template, so a
prompt is about ``length`` tokens. Each case is one greedy generation of up to 16 tokens
with the prefix cache off; it passes when the answer holds the code ("needle kept": the
compressed prompt still holds the needle sentence's "is <code>."). TTFT is the engine's
prefill time (drafter included). Rows: full prefill; self:``--layers`` at each ratio; and
self:N for each of ``--extra-layers`` at ratio 0.1; and the peer: llama.cpp's own prefill of
prompts of the same mean length (llama-bench on the default model's GGUF, same threads; no
answer). Writes JSON (default
benchmarks/results/pflash.json) and prints a Markdown table.

``--tiny-long 16000,32000``: time to first token only, at those lengths, on a tiny random
long-context llama (8 layers, hidden 256, trained length 65536, built with transformers;
the haystack repeats the evaluation text): full prefill vs self:2 at keep 0.05 and 0.1.
Its answers mean nothing (random weights); "needle kept" still shows what the selection
keeps. Written to benchmarks/results/pflash_tiny_long.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from kvflash import eval_text  # noqa: E402

NAMES = [("Zorbak", "4721"), ("Quillon", "9035"), ("Marvessa", "1168"), ("Telluride", "7702"),
         ("Brannoch", "5849"), ("Ostrava", "3316"), ("Pellucid", "8250")]


def recording(compressor_cls):
    """A Compressor that keeps its last result (to check the needle sentence survived)."""
    class Recording(compressor_cls):
        def compress(self, *a, **kw):
            self.last = super().compress(*a, **kw)
            return self.last
    return Recording


def llama_cpp_prefill(lengths: list[int], threads: int) -> dict[int, float]:
    """Seconds llama.cpp (llama-bench, the default model's own GGUF) takes to prefill each
    length: the peer's full-prefill time to first token."""
    import subprocess

    from llama_cpp import ensure_built

    sys.path.insert(0, str(ROOT / "src"))
    from dflash_server.weights.default_model import default_model_path

    out = subprocess.run([str(ensure_built() / "llama-bench"), "-m", str(default_model_path()), "-t", str(threads),
                          "-p", ",".join(str(n) for n in lengths), "-n", "0", "-r", "1", "-o", "json"],
                         capture_output=True, text=True, check=True)
    return {r["n_prompt"]: r["n_prompt"] / r["avg_ts"] for r in json.loads(out.stdout)}


def cases(tok, lengths, depths):
    text = eval_text()
    out = []
    for n in lengths:
        for j, depth in enumerate(depths):
            name, code = NAMES[(j + n // 1000) % len(NAMES)]
            question = f"What is the secret code of {name}? Answer with the number only."
            body = tok.decode(tok.encode(text)[j * 211:j * 211 + n - 60])
            cut = int(len(body) * depth)
            doc = body[:cut] + f"\n\nIMPORTANT: The secret code of {name} is {code}.\n\n" + body[cut:]
            ids = tok.encode_chat([{"role": "user", "content": doc + "\n\n" + question}])
            out.append({"length": n, "depth": depth, "code": code, "ids": ids, "query": doc + "\n\n" + question})
    return out


def tiny_long(lengths: list[int], out: Path) -> None:
    import tempfile

    sys.path.insert(0, str(ROOT / "src"))
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.tiny import make_tiny_model

    from dflash_server.engine.generate import Engine, GenerationRequest
    from dflash_server.pflash.compressor import Compressor
    from dflash_server.pflash.scorer import PromptScorer
    from dflash_server.runtime.pipeline import build_pipeline
    from dflash_server.runtime.placement import plan_placement
    from dflash_server.weights.loader import open_model

    tmp = tempfile.mkdtemp(prefix="pflash-tiny-long-")
    path = make_tiny_model("llama", Path(tmp), hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=65536,
                           rope_theta=500000.0)
    src = open_model(path)
    max_ctx = max(lengths) + 256
    pipe = build_pipeline(src, plan_placement(src.config.num_layers, ["cpu"]), dtype=torch.bfloat16,
                          max_ctx=max_ctx, quantize="dense", progress=False)
    tok = src.tokenizer
    text_ids = tok.encode(eval_text())
    rows = []
    engines = {None: Engine(pipe), 2: Engine(pipe, compressor=recording(Compressor)(
        PromptScorer.from_stage(pipe.stages[0], 2), tok))}
    for n in lengths:
        body = tok.decode((text_ids * (n // len(text_ids) + 1))[:n - 60])
        question = "What is the secret code of Zorbak? Answer with the number only."
        cut = len(body) // 2
        doc = body[:cut] + "\n\nIMPORTANT: The secret code of Zorbak is 4721.\n\n" + body[cut:]
        query = doc + "\n\n" + question
        ids = tok.encode_chat([{"role": "user", "content": query}])
        for label, layers, ratio in (("full prefill", None, None), ("self:2 keep 0.1", 2, 0.1),
                                     ("self:2 keep 0.05", 2, 0.05)):
            eng = engines[layers]
            res = eng.generate(GenerationRequest(tuple(ids), max_tokens=2, cache_scope="off", compress=ratio,
                                                 compress_query=query if ratio else None))
            pf = res.extra.get("pflash") or {}
            kept = tok.decode(eng.compressor.last.ids) if ratio else doc
            rows.append({"config": label, "prompt_tokens": len(ids),
                         "kept_tokens": pf.get("compressed_tokens", len(ids)), "ttft_s": round(res.prefill_s, 2),
                         "drafter_s": pf.get("drafter_s", 0.0), "needle_kept": "is 4721." in kept})
            print(rows[-1], flush=True)
    for r in rows:
        base = next(b for b in rows if b["config"] == "full prefill" and b["prompt_tokens"] == r["prompt_tokens"])
        r["speedup"] = round(base["ttft_s"] / r["ttft_s"], 2)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": "tiny random llama (8 layers, hidden 256, 65536 positions)",
                               "torch": torch.__version__, "rows": rows}, indent=2))
    print("\n| config | prompt tokens | kept tokens | needle kept | TTFT (s) | vs full prefill |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['prompt_tokens']} | {r['kept_tokens']} | {r['needle_kept']} | {r['ttft_s']} | "
              f"{r['speedup']:.2f}x |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="2000,4000,8000")
    ap.add_argument("--depths", default="0.05,0.15,0.25,0.35,0.45,0.55,0.65,0.75,0.85,0.95")
    ap.add_argument("--ratios", default="0.05,0.1,0.2,0.3")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--extra-layers", default="2,8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tiny-long", help="lengths for the tiny long-context model (e.g. 16000,32000)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pflash.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.tiny_long:
        return tiny_long([int(x) for x in args.tiny_long.split(",")], Path(args.out).with_name("pflash_tiny_long.json"))
    sys.path.insert(0, str(ROOT / "src"))
    from dflash_server.cli.common import quantize_plan
    from dflash_server.engine.generate import Engine, GenerationRequest
    from dflash_server.pflash.compressor import Compressor
    from dflash_server.pflash.scorer import PromptScorer

    Recording = recording(Compressor)
    from dflash_server.runtime.pipeline import build_pipeline
    from dflash_server.runtime.placement import plan_placement
    from dflash_server.weights.default_model import default_model_path
    from dflash_server.weights.loader import open_model

    src = open_model(default_model_path())
    quant = quantize_plan(src, "auto", True)
    lengths = [int(x) for x in args.lengths.split(",")]
    max_ctx = min(src.config.max_position_embeddings, 8192)
    pipe = build_pipeline(src, plan_placement(src.config.num_layers, ["cpu"]), dtype=torch.bfloat16,
                          max_ctx=max_ctx, quantize=quant, progress=False)
    all_cases = cases(src.tokenizer, lengths, [float(x) for x in args.depths.split(",")])
    for c in all_cases:
        assert len(c["ids"]) + 16 < max_ctx, f"a {c['length']}-token case has {len(c['ids'])} tokens"
    configs = [("full prefill", None, None)]
    configs += [(f"self:{args.layers} keep {r}", args.layers, float(r)) for r in args.ratios.split(",")]
    configs += [(f"self:{n} keep 0.1", int(n), 0.1) for n in args.extra_layers.split(",") if n]
    engines = {}
    rows = []
    warm = Engine(pipe)
    warm.generate(GenerationRequest(tuple(all_cases[0]["ids"][:600]), max_tokens=2, cache_scope="off"))
    for label, layers, ratio in configs:
        if layers not in engines:
            comp = Recording(PromptScorer.from_stage(pipe.stages[0], layers), src.tokenizer) if layers else None
            engines[layers] = Engine(pipe, compressor=comp)
        eng = engines[layers]
        for c in all_cases:
            req = GenerationRequest(tuple(c["ids"]), max_tokens=16, cache_scope="off", compress=ratio,
                                    compress_query=c["query"] if ratio else None)
            t0 = time.perf_counter()
            res = eng.generate(req)
            wall = time.perf_counter() - t0
            pf = res.extra.get("pflash") or {}
            kept_text = src.tokenizer.decode(eng.compressor.last.ids) if ratio else ""
            row = {"config": label, "length": c["length"], "depth": c["depth"], "prompt_tokens": len(c["ids"]),
                   "kept_tokens": pf.get("compressed_tokens", len(c["ids"])), "ttft_s": round(res.prefill_s, 3),
                   "drafter_s": pf.get("drafter_s", 0.0), "wall_s": round(wall, 3),
                   "pass": c["code"] in res.text, "answer": res.text[:40],
                   "needle_kept": (f"is {c['code']}." in kept_text) if ratio else True}
            rows.append(row)
            print(row, flush=True)
    peer = llama_cpp_prefill([round(sum(len(c["ids"]) for c in all_cases if c["length"] == n)
                                    / sum(c["length"] == n for c in all_cases)) for n in lengths], args.threads)
    summary = []
    for n, (n_tok, secs) in zip(lengths, peer.items()):
        base = sum(r["ttft_s"] for r in rows if r["config"] == "full prefill" and r["length"] == n) / \
            sum(r["config"] == "full prefill" and r["length"] == n for r in rows)
        summary.append({"config": "llama.cpp full prefill (llama-bench)", "length": n, "prompt_tokens": n_tok,
                        "kept_tokens": n_tok, "needle_kept": None, "accuracy": None, "ttft_s": round(secs, 2),
                        "speedup": round(base / secs, 2)})
    for label, _, _ in configs:
        for n in lengths:
            rs = [r for r in rows if r["config"] == label and r["length"] == n]
            full = [r for r in rows if r["config"] == "full prefill" and r["length"] == n]
            ttft = sum(r["ttft_s"] for r in rs) / len(rs)
            base = sum(r["ttft_s"] for r in full) / len(full)
            summary.append({"config": label, "length": n, "prompt_tokens": round(sum(r["prompt_tokens"] for r in rs)
                                                                                  / len(rs)),
                            "kept_tokens": round(sum(r["kept_tokens"] for r in rs) / len(rs)),
                            "accuracy": round(100 * sum(r["pass"] for r in rs) / len(rs), 1),
                            "needle_kept": round(100 * sum(r["needle_kept"] for r in rs) / len(rs), 1),
                            "ttft_s": round(ttft, 2), "speedup": round(base / ttft, 2)})
    meta = {"threads": args.threads, "quantize": list(quant), "max_ctx": max_ctx, "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "cases_per_length": len(all_cases) // len(lengths)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=2))
    print("\n| config | prompt tokens | kept tokens | needle kept | NIAH accuracy | TTFT (s) | vs full prefill |")
    print("|---|---|---|---|---|---|---|")
    for s in summary:
        pct = (lambda v: "-" if v is None else f"{v}%")
        print(f"| {s['config']} | {s['prompt_tokens']} | {s['kept_tokens']} | {pct(s['needle_kept'])} | "
              f"{pct(s['accuracy'])} | {s['ttft_s']} | {s['speedup']:.2f}x |")


if __name__ == "__main__":
    main()
