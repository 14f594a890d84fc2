"""OpenMP spin-wait for a local + remote split on one host (imports nothing heavy: the
setting must be in the environment before torch loads libgomp).

The two processes take turns on the same cores. After each parallel region libgomp's
threads spin before they sleep: 300,000 iterations by default (milliseconds), so the idle
process keeps a core the busy one needs. Too short a spin is bad too: the threads fall
asleep between the ops of one step and every op pays a wake-up. Measured on 2 cores (AMD
EPYC VM, 2026-11-23; default model, 2 threads per process; greedy decode steps of the two
placements alternating one by one inside a run, so machine drift hits both alike; median
of 100-200 steps per run, 2-3 runs per setting; "alone": runs of unsplit by itself):

    GOMP_SPINCOUNT      unsplit step              local + remote step   remote vs unsplit
    3,000               44-90 ms (alone 40-55)    46-93 ms              0.91-1.00x (both slow)
    10,000              36-37 ms                  39-41 ms              0.91-0.92x
    30,000              32-35 ms (alone 33-43)    34-38 ms              0.90-0.96x
    100,000             34-35 ms                  39-41 ms              0.86-0.88x
    300,000 (default)   35-40 ms (alone 28-38)    46-53 ms              0.76x

Alternating every step flatters the split (unsplit loses the cache reuse between its own
steps); whole generations at 30,000 (benchmarks/split.py) give 0.82-0.89x.

``serve`` uses it too: its event loop thread (SSE writes) shares the cores with the engine's
OpenMP threads. Measured 2026-11-24 (default model, 2 threads, ``--parallel 4``, 128-token
greedy streams, two alternating rounds): concurrency 4, 283-289 tok/s at the default vs
292-317 at 30,000; concurrency 1, 150-151 vs 157-159.
"""
from __future__ import annotations

import os
import sys

SPLIT_SPINCOUNT = "30000"


def tune_for_split(env: dict | None = None) -> None:
    """Set GOMP_SPINCOUNT (unless the user did) in ``env`` (default: this process's
    environment, which only helps while torch is not imported yet)."""
    if env is None:
        if "torch" in sys.modules:
            return
        env = os.environ
    env.setdefault("GOMP_SPINCOUNT", SPLIT_SPINCOUNT)
