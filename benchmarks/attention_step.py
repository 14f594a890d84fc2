"""The native attention step alone: one call of T rows (1, 8, 16) at position 256 over an
fp32 cache, SmolLM2-135M's heads (9 query / 3 kv heads of 64), microseconds per call (best of
7 loops of 200 calls):

    python benchmarks/attention_step.py [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from dflash_server import kernels


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    kernels.load()
    torch.set_num_threads(a.threads)
    nh, nkv, hd, start, max_ctx = 9, 3, 64, 256, 1024
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(1, nkv, max_ctx, hd, generator=g), torch.randn(1, nkv, max_ctx, hd, generator=g)
    res = {}
    for T in (1, 8, 16):
        qkv = torch.randn(1, T, (nh + 2 * nkv) * hd, generator=g)
        cos, sin = torch.randn(T, hd, generator=g), torch.randn(T, hd, generator=g)
        for _ in range(50):
            torch.ops.dflash.attention_step(qkv, cos, sin, kc, vc, start, nh, nkv, 0.125)
        best = float("inf")
        for _ in range(7):
            t = time.perf_counter()
            for _ in range(200):
                torch.ops.dflash.attention_step(qkv, cos, sin, kc, vc, start, nh, nkv, 0.125)
            best = min(best, (time.perf_counter() - t) / 200 * 1e6)
        res[T] = round(best, 1)
    print(json.dumps({"threads": a.threads, "us_per_call": res}))


if __name__ == "__main__":
    main()
