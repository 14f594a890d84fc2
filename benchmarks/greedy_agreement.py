"""How often greedy output agrees between ours (aten kernels, default), ours with
``--native-kernels`` (int8 activations) and llama.cpp (``llama-simple``, also int8
activations) on the same GGUF, chat-templated MT-Bench first turns:

    python benchmarks/greedy_agreement.py [--prompts 20] [--tokens 32] [--out FILE]

Reports, per pair, the share of prompts with identical text and the mean length of the
common prefix in characters. Evidence for whether int8 activations change answers more than
the peer's own numerics do. Writes ``benchmarks/results/greedy_agreement.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from itertools import combinations
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
EVAL = ROOT.parent / "shared" / "eval" / "mt_bench.jsonl"


def prompts(n: int) -> list[str]:
    return [json.loads(line)["turns"][0] for line in EVAL.read_text().splitlines()[:n]]


def ours(texts: list[str], tokens: int) -> list[str]:
    sys.path.insert(0, str(ROOT / "src"))
    from dflash_server.cli.common import quantize_plan
    from dflash_server.engine.generate import Engine, GenerationRequest
    from dflash_server.runtime.pipeline import build_pipeline
    from dflash_server.runtime.placement import plan_placement
    from dflash_server.weights.default_model import default_model_path
    from dflash_server.weights.loader import open_model

    torch.set_num_threads(2)
    src = open_model(default_model_path())
    pipe = build_pipeline(src, plan_placement(src.config.num_layers, ["cpu"]), dtype=torch.bfloat16, max_ctx=1024,
                          quantize=quantize_plan(src, "auto", True), progress=False)
    engine = Engine(pipe, prefix_slots=0)
    out = []
    for t in texts:
        ids = src.tokenizer.encode_chat([{"role": "user", "content": t}])
        out.append(engine.generate(GenerationRequest(tuple(ids), max_tokens=tokens, ignore_eos=True)).text)
    return out


def llama_cpp(texts: list[str], tokens: int) -> list[str]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from llama_cpp import ensure_built

    sys.path.insert(0, str(ROOT / "src"))
    from dflash_server.weights.default_model import default_model_path
    from dflash_server.weights.loader import open_model

    path = default_model_path()
    tok = open_model(path).tokenizer
    bin_dir = ensure_built(targets=("llama-simple",))
    out = []
    for t in texts:
        prompt = tok.render_chat([{"role": "user", "content": t}])
        r = subprocess.run([str(bin_dir / "llama-simple"), "-m", str(path), "-n", str(tokens), prompt],
                           capture_output=True, text=True, check=True)
        out.append(r.stdout[len(prompt):] if r.stdout.startswith(prompt) else r.stdout)
    return out


def common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--row", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "greedy_agreement.json"))
    args = ap.parse_args()
    texts = prompts(args.prompts)
    if args.row:
        print(json.dumps(ours(texts, args.tokens)))
        return
    outputs = {"llama.cpp": llama_cpp(texts, args.tokens)}
    for label, flag in (("ours aten", "0"), ("ours native", "1")):
        res = subprocess.run([sys.executable, __file__, "--row", label, "--prompts", str(args.prompts), "--tokens",
                              str(args.tokens)], env={**os.environ, "DFLASH_KERNELS": flag}, stdout=subprocess.PIPE,
                             text=True, check=True)
        outputs[label] = json.loads(res.stdout.strip().splitlines()[-1])
    pairs = {}
    for a, b in combinations(outputs, 2):
        same = [x.strip() == y.strip() for x, y in zip(outputs[a], outputs[b])]
        prefix = [common_prefix(x.strip(), y.strip()) for x, y in zip(outputs[a], outputs[b])]
        pairs[f"{a} vs {b}"] = {"identical": sum(same) / len(same),
                                "mean_common_prefix_chars": sum(prefix) / len(prefix)}
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "prompts": args.prompts,
                                          "tokens": args.tokens, "pairs": pairs, "outputs": outputs}, indent=2))
    print("| pair | identical | mean common prefix (chars) |\n|---|---|---|")
    for k, v in pairs.items():
        print(f"| {k} | {v['identical']:.0%} | {v['mean_common_prefix_chars']:.0f} |")


if __name__ == "__main__":
    main()
