"""Perplexity on a fixed local text, side by side: ours with ``--kernels aten``, ours with the
native kernels (the default: int8 activations, an fp16 KV cache) and with them and an fp32 KV
cache, transformers fp32 on the dequantized weights, and llama.cpp's ``llama-perplexity`` on
the same GGUF file (its default f16 KV cache), 2 threads:

    python benchmarks/perplexity.py [--kb 120] [--no-llama-cpp] [--no-transformers] [--out FILE]

The text is the first ``--kb`` KB of a few Python standard-library sources of this
interpreter (argparse, textwrap, fractions, statistics), tokenized by each system itself.
Scoring follows llama-perplexity: windows of 512 tokens, each scored on its second half
(positions 256..511, the token after each), BOS in the first position if the model adds
one. Writes JSON (default ``benchmarks/results/perplexity.json``) and a Markdown table.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CTX = 512
FILES = ("argparse.py", "textwrap.py", "fractions.py", "statistics.py")


def corpus(kb: int) -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((stdlib / f).read_text() for f in FILES)
    return text[:kb * 1024]


def windows(ids: list[int], bos: int | None):
    for i in range(len(ids) // CTX):
        w = list(ids[i * CTX:(i + 1) * CTX])
        if bos is not None:
            w[0] = bos
        yield w


def nll_of(logits: torch.Tensor, w: list[int]) -> tuple[float, int]:
    """Summed NLL of tokens CTX/2+1 .. CTX-1 given the logits of positions CTX/2 .. CTX-2."""
    first = CTX // 2
    lp = torch.log_softmax(logits[first:CTX - 1].double(), dim=-1)
    target = torch.tensor(w[first + 1:CTX])
    return -lp.gather(1, target[:, None]).sum().item(), CTX - 1 - first


def ours(text: str, threads: int, kv_dtype: str = "auto") -> dict:
    sys.path.insert(0, str(ROOT / "src"))
    from dflash_server import kernels
    from dflash_server.cli.common import quantize_plan
    from dflash_server.runtime.pipeline import build_pipeline
    from dflash_server.runtime.placement import plan_placement
    from dflash_server.weights.default_model import default_model_path
    from dflash_server.weights.loader import open_model

    torch.set_num_threads(threads)
    src = open_model(default_model_path())
    pipe = build_pipeline(src, plan_placement(src.config.num_layers, ["cpu"]), dtype=torch.bfloat16, max_ctx=CTX,
                          quantize=quantize_plan(src, "auto", True), progress=False, kv_dtype=kv_dtype)
    tok = src.tokenizer
    ids = tok.encode(text, add_bos=False)
    total, count, t0 = 0.0, 0, time.perf_counter()
    for w in windows(ids, tok.bos_token_id if tok.add_bos else None):
        pipe.reset()
        n, c = nll_of(pipe.forward(w, 0, logits="all").logits, w)
        total, count = total + n, count + c
    return {"tokens": len(ids), "chunks": len(ids) // CTX, "scored": count, "ppl": math.exp(total / count),
            "seconds": time.perf_counter() - t0, "kv_dtype": sorted({str(b.k.dtype) for b in pipe.stages[0].banks if b is not None}),
            "kernels": kernels.status()}


def reference(text: str, threads: int) -> dict:
    """transformers fp32 on the GGUF's dequantized weights (its own GGUF loader)."""
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "src"))
    from dflash_server.weights.default_model import default_model_path
    from dflash_server.weights.loader import open_model

    torch.set_num_threads(threads)
    path = default_model_path()
    tok = open_model(path).tokenizer
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = tok.encode(text, add_bos=False)
    total, count, t0 = 0.0, 0, time.perf_counter()
    with torch.no_grad():
        for w in windows(ids, tok.bos_token_id if tok.add_bos else None):
            n, c = nll_of(model(torch.tensor([w])).logits[0], w)
            total, count = total + n, count + c
    return {"tokens": len(ids), "chunks": len(ids) // CTX, "scored": count, "ppl": math.exp(total / count),
            "seconds": time.perf_counter() - t0}


def llama_cpp(text: str, threads: int) -> dict:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from llama_cpp import ensure_built

    sys.path.insert(0, str(ROOT / "src"))
    from dflash_server.weights.default_model import default_model_path

    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    t0 = time.perf_counter()
    out = subprocess.run([str(ensure_built() / "llama-perplexity"), "-m", str(default_model_path()), "-f", f.name,
                          "-c", str(CTX), "-t", str(threads), "-b", str(CTX)], capture_output=True, text=True)
    os.unlink(f.name)
    log = out.stdout + out.stderr
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", log)
    if out.returncode != 0 or m is None:
        raise RuntimeError(f"llama-perplexity failed:\n{log[-2000:]}")
    chunks = re.search(r"over (\d+) chunks", log)
    return {"ppl": float(m.group(1)), "chunks": int(chunks.group(1)) if chunks else None,
            "seconds": time.perf_counter() - t0}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kb", type=int, default=120)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--row", help=argparse.SUPPRESS)
    ap.add_argument("--kv-dtype", default="auto", help=argparse.SUPPRESS)  # internal: that row's KV cache
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "perplexity.json"))
    args = ap.parse_args()
    text = corpus(args.kb)
    if args.row:
        print(json.dumps(reference(text, args.threads) if args.row == "transformers"
                         else ours(text, args.threads, args.kv_dtype)))
        return
    rows = {}
    if not args.no_llama_cpp:
        rows["llama.cpp (llama-perplexity)"] = llama_cpp(text, args.threads)
        print(rows, file=sys.stderr)
    runs = [("ours, --kernels aten", "ours", "0", "auto"), ("ours, native kernels, --kv-dtype f32", "ours", "1", "f32"),
            ("ours, native kernels (default: f16 KV)", "ours", "1", "auto")]
    if not args.no_transformers:
        runs.append(("transformers fp32, dequantized weights", "transformers", "0", "auto"))
    for label, row, flag, kv in runs:
        res = subprocess.run([sys.executable, __file__, "--row", row, "--kb", str(args.kb), "--threads",
                              str(args.threads), "--kv-dtype", kv], env={**os.environ, "DFLASH_KERNELS": flag},
                             stdout=subprocess.PIPE, text=True, check=True)
        rows[label] = json.loads(res.stdout.strip().splitlines()[-1])
        print(label, rows[label], file=sys.stderr)
    base = rows.get("llama.cpp (llama-perplexity)")
    out = {"text": {"files": FILES, "kb": args.kb, "python": sys.version.split()[0],
                    "sha256": hashlib.sha256(text.encode()).hexdigest()[:16]},
           "ctx": CTX, "threads": args.threads, "date": time.strftime("%Y-%m-%d"), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print("| | perplexity | vs llama.cpp |\n|---|---|---|")
    for label, r in rows.items():
        vs = f"{r['ppl'] / base['ppl']:.4f}x" if base else "-"
        print(f"| {label} | {r['ppl']:.4f} | {vs} |")


if __name__ == "__main__":
    main()
