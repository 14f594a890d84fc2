"""The GPU check: every capability once on a device, through the real CLI, with the
equivalences that must hold there too. Run by ``benchmarks/gpu_check.sh`` on a machine with
a GPU (it also runs on ``--device cpu``, which is how it is tried where there is none).

    python benchmarks/gpu_check.py [--device cuda] [--max-tokens 64] [--out FILE]

Checks (each one `dflash-server generate --json` in a fresh process, the built-in model,
greedy): decode dense (`--quantize none`, bf16 and fp32) and quantized (`auto`: on CUDA the
GGUF's 4-bit layers through aten's int4 kernel), with CUDA graphs (the default) and without
(`--cuda-graphs off`: the eager step), DFlash and DDTree with the shipped draft == plain, an in-process
split device + cpu == unsplit, the disk prefix cache (a second process restores what the
first wrote: == the first's text, and less prefill), KV Flash (`--kvflash auto`) == plain, and the prefill speed of a ~3k-token document.
A failing check is recorded (return code, the end of stderr) and the rest still run.
Writes JSON (default ``$OUT/gpu_check.json``, else ``benchmarks/results/gpu_check.json``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Name the capital of France, then list three facts about it."


LONG_TEXT = ("The quarterly survey covered forty sites along the northern coast. Water temperature rose "
             "at most sites, salinity stayed level, and the count of nesting birds fell by a fifth where "
             "new housing reached the shore. The team recommends two more years of monthly samples. ")


def run(device: str, max_tokens: int, *extra: str, prompt: str | None = PROMPT) -> dict:
    cmd = [sys.executable, "-m", "dflash_server", "generate", "--json", "--device", device,
           *(["--chat", prompt] if prompt is not None else []),
           "--max-tokens", str(max_tokens), "--ignore-eos", *extra]
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    out = {"args": list(extra), "rc": r.returncode, "wall_s": round(time.perf_counter() - t, 2),
           "memory_line": next((ln for ln in r.stderr.splitlines() if "memory estimate" in ln), None)}
    if r.returncode != 0:
        out["stderr_tail"] = r.stderr[-3000:]
        return out
    res = json.loads(r.stdout.strip().splitlines()[-1])
    out.update(text=res.get("text"), token_ids=res.get("token_ids"), timings=res.get("timings"),
               spec=res.get("spec") or res.get("extra", {}).get("spec"), cuda_graphs=res.get("cuda_graphs"))
    return out


def same(a: dict | None, b: dict | None) -> dict | None:
    """Whether two runs gave the same tokens, and how many leading tokens they share (None
    where one did not run or failed)."""
    if a is None or b is None or a.get("rc") or b.get("rc"):
        return None
    x, y = a.get("token_ids") or [], b.get("token_ids") or []
    common = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
    return {"equal": x == y, "common_prefix": common, "of": max(len(x), len(y))}


def pair(checks: dict, a: str, b: str) -> dict | None:
    return same(checks.get(a), checks.get(b))


def write(out: str, dev: str, n: int, checks: dict, equal: dict | None = None) -> dict:
    summary = {"device": dev, "torch": torch.__version__, "cuda": torch.version.cuda,
               "gpu": torch.cuda.get_device_name(0) if dev.startswith("cuda") and torch.cuda.is_available() else None,
               "machine": platform.machine(), "date": time.strftime("%Y-%m-%d"), "max_tokens": n,
               "failed": [k for k, v in checks.items() if v.get("rc")], "equal": equal or {}, "checks": checks}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(summary, indent=2))
    return summary


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-tokens", type=int, default=128)
    default_out = Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else \
        ROOT / "benchmarks" / "results" / "gpu_check.json"
    ap.add_argument("--out", default=str(default_out))
    args = ap.parse_args()
    dev, n = args.device, args.max_tokens
    fp32 = ("--quantize", "none", "--dtype", "fp32")
    second = f"{dev},cpu" if dev != "cpu" else "cpu,cpu"
    cache = tempfile.mkdtemp()
    doc = Path(tempfile.mkdtemp()) / "doc.txt"   # prefill speed: a ~3k-token document
    doc.write_text("Summarise this report in one line.\n\n" + LONG_TEXT * 24)
    plan = {"decode_quantized": (n,), "decode_quantized_no_graphs": (n, "--cuda-graphs", "off"),
            "decode_dense": (n, "--quantize", "none"), "decode_dense_fp32": (n, *fp32),
            "decode_dense_fp32_no_graphs": (n, *fp32, "--cuda-graphs", "off"),
            "dflash": (n, "--draft", "default"), "dflash_fp32": (n, "--draft", "default", *fp32),
            "dflash_no_lookup": (n, "--draft", "default", "--lookup", "0"),
            "lookup": (n, "--lookup", "5"),   # prompt lookup alone (off by default on a GPU: unmeasured)
            "ddtree": (n, "--draft", "default", "--ddtree", "--lookup", "0"),
            "split": (n, "--target-devices", second), "split_fp32": (n, "--target-devices", second, *fp32),
            "prefix_cache_write": (n, "--kv-cache-dir", cache), "prefix_cache_restore": (n, "--kv-cache-dir", cache),
            "kvflash": (n, "--kvflash", "auto"), "prefill_long": (16, "--chat-file", str(doc)),
            "compile_quantized": (n, "--compile"), "compile_dense": (n, "--compile", "--quantize", "none")}
    only = [k for k in os.environ.get("GPU_CHECK_RUNS", "").split(",") if k]   # a subset, by name
    unknown = [k for k in only if k not in plan]
    if unknown:
        sys.exit(f"GPU_CHECK_RUNS: unknown runs {unknown}; known: {', '.join(plan)}")
    checks: dict[str, dict] = {}
    for name, (tokens, *extra) in plan.items():
        if only and name not in only:
            continue
        checks[name] = run(dev, tokens, *extra, prompt=None if name == "prefill_long" else PROMPT)
        write(args.out, dev, n, checks)   # after each run: a check cut short keeps what it ran
    c = checks
    # On a GPU, kernels are not row-invariant (cuBLAS picks by shape): bf16 verify blocks and
    # plain steps may part after many tokens, so each pair also says how far they agree.
    pairs = {"graphs == no graphs (default)": pair(c, "decode_quantized", "decode_quantized_no_graphs"),
             "graphs == no graphs (fp32)": pair(c, "decode_dense_fp32", "decode_dense_fp32_no_graphs"),
             "dflash == plain (default)": pair(c, "dflash", "decode_quantized"),
             "dflash == plain (fp32)": pair(c, "dflash_fp32", "decode_dense_fp32"),
             "dflash without lookup == plain (default)": pair(c, "dflash_no_lookup", "decode_quantized"),
             "lookup alone == plain (default)": pair(c, "lookup", "decode_quantized"),
             "ddtree == plain (default)": pair(c, "ddtree", "decode_quantized"),
             "split == unsplit (default)": pair(c, "split", "decode_quantized"),
             "split == unsplit (fp32)": pair(c, "split_fp32", "decode_dense_fp32"),
             "restart from disk == first run": pair(c, "prefix_cache_restore", "prefix_cache_write"),
             "kvflash == plain": pair(c, "kvflash", "decode_quantized"),
             "compile == eager (default)": pair(c, "compile_quantized", "decode_quantized"),
             "compile == eager (dense)": pair(c, "compile_dense", "decode_dense")}
    equal = {k: v for k, v in pairs.items() if v is not None}
    summary = write(args.out, dev, n, checks, equal)
    for k, v in checks.items():
        tm = v.get("timings") or {}
        print(f"{k:24s} rc={v['rc']} decode_tok_s={tm.get('decode_tokens_per_s')} "
              f"prefill_s={tm.get('prefill_s')} graphs={v.get('cuda_graphs')}")
    print(json.dumps(equal))
    sys.exit(1 if summary["failed"] else 0)


if __name__ == "__main__":
    main()
