"""Families llama.cpp runs and transformers defines, checked against llama.cpp itself: a tiny
seeded-random model of each variant (the tests' ``helpers.tiny``), written to GGUF as
llama.cpp's converter names it (``helpers.gguf_export``), then greedy continuation of one
prompt by ``llama-simple`` (built from the llama-cpp-python sdist, as the other benchmarks
do) and by us from the same F32 file, token for token:

    python benchmarks/family_vs_llama_cpp.py [--tokens 24] [--out FILE]

Variants: Laguna with sliding + full layers (YaRN over half the head on the full ones,
window smaller than the text), per-head and per-element attention gates, and an all-full
Laguna (M.1's shape); Gemma 4 dense (full layers with their own head size, values from the
keys, proportional RoPE, soft-capped logits), with routed experts (26B-A4B's shape) and with
per-layer inputs, KV-shared last layers and double-wide MLPs (E2B's shape).
Writes JSON (default ``benchmarks/results/family_vs_llama_cpp.json``).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "benchmarks")]

PROMPT = ("The quick brown fox jumps over the lazy dog because it wanted to see what was on the other side "
          "of the river")
# label -> (tiny model kind, GGUF family, overrides); llama.cpp's laguna carries no router soft-cap
NO_CAP = {"moe_router_logit_softcapping": 0.0}
VARIANTS = {
    "laguna, sliding + full (YaRN), per-head gate": ("laguna", "laguna", NO_CAP),
    "laguna, per-element gate": ("laguna", "laguna", {**NO_CAP, "gating": "per-element", "seed": 5}),
    "laguna, all full (M.1 shape)": ("laguna", "laguna", {**NO_CAP, "seed": 7, "layer_types": ["full_attention"] * 4,
                                                          "mlp_layer_types": ["dense", "dense", "sparse", "sparse"]}),
    "gemma4, dense (31B shape)": ("gemma4", "gemma4", {}),
    "gemma4, experts beside the MLP (26B-A4B shape)": ("gemma4_moe", "gemma4", {}),
    "gemma4, per-layer inputs + KV-shared layers (E2B shape)": ("gemma4_e", "gemma4", {}),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "family_vs_llama_cpp.json"))
    args = ap.parse_args()
    from helpers.build import greedy, pipeline
    from helpers.gguf_export import export_gguf
    from helpers.qwen_tokenizer import gguf_tokenizer_metadata_from_hf
    from helpers.tiny import make_tiny_model
    from llama_cpp import ensure_built

    simple = ensure_built(targets=("llama-simple",)) / "llama-simple"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, (kind, family, overrides)) in enumerate(VARIANTS.items()):
            overrides = dict(overrides)
            seed = overrides.pop("seed", 0)
            src = make_tiny_model(kind, Path(tmp) / f"m{i}", seed=seed, **overrides)
            path = export_gguf(src, Path(tmp) / f"m{i}.gguf", family,
                               gguf_tokenizer_metadata_from_hf(src, pre="smollm"))
            pipe = pipeline(path)
            ours = pipe.tokenizer.decode(greedy(pipe, pipe.tokenizer.encode(PROMPT), max_tokens=args.tokens))
            res = subprocess.run([str(simple), "-m", str(path), "-n", str(args.tokens), PROMPT],
                                 capture_output=True, text=True, check=True)
            theirs = res.stdout.strip().removeprefix(PROMPT)
            rows.append({"variant": label, "ours": ours, "llama_cpp": theirs, "equal": ours.strip() == theirs.strip()})
            print(f"| {label} | {'equal' if rows[-1]['equal'] else 'DIFFERENT'} |")
    out = {"date": time.strftime("%Y-%m-%d"), "tokens": args.tokens, "prompt": PROMPT, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
