"""Where a decode step's time goes on a device: the built-in model, one token at a time,
eager (the default path) — wall time per step against the device's busy time, and the ops
and kernels one step runs. Run by benchmarks/gpu_check.sh; also runs on --device cpu.

    python benchmarks/gpu_profile.py [--device cuda] [--dtype bf16] [--quantize none] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from helpers.build import pipeline  # noqa: E402

from dflash_server.weights.default_model import default_model_path  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--quantize", default="none")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    pipe = pipeline(default_model_path(), devices=[a.device], quantize=a.quantize,
                    dtype=torch.bfloat16 if a.dtype == "bf16" else torch.float32, max_ctx=1024)
    ids = pipe.tokenizer.encode("Name the capital of France, then list three facts about it.")
    pipe.reset()
    pipe.prefill(ids)
    pos, tok = len(ids), ids[-1]
    for _ in range(8):                      # warm-up (first kernels, allocator)
        tok = int(pipe.forward([tok], pos).logits[-1].argmax())
        pos += 1
    sync()
    t = time.perf_counter()
    for _ in range(a.steps):
        tok = int(pipe.forward([tok], pos).logits[-1].argmax())
        pos += 1
    step_ms = (time.perf_counter() - t) * 1000 / a.steps
    # the same steps without the host waiting for each token (queue depth shows launch cost)
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        out = pipe.forward([tok], pos)
        int(out.logits[-1].argmax())
        sync()
    ka = prof.key_averages()
    ops = sum(e.count for e in ka if e.key.startswith("aten::"))
    dev_us = sum(getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0) for e in ka)
    kernels = sum(e.count for e in ka if (getattr(e, "self_device_time_total", 0) or 0) > 0 and not e.key.startswith("aten::"))
    top = sorted(ka, key=lambda e: -e.count)[:25]
    res = {"device": str(dev), "gpu": torch.cuda.get_device_name(0) if dev.type == "cuda" else None,
           "dtype": a.dtype, "quantize": a.quantize, "step_ms": round(step_ms, 3),
           "tok_s": round(1000 / step_ms, 1), "aten_ops_per_step": ops, "device_kernels_per_step": kernels,
           "device_busy_ms_per_step": round(dev_us / 1000, 3),
           "top_ops": [(e.key, e.count, round(e.cpu_time_total / 1000, 3)) for e in top]}
    print(json.dumps({k: v for k, v in res.items() if k != "top_ops"}))
    print(prof.key_averages().table(sort_by="count", row_limit=30))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
