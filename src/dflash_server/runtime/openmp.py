"""OpenMP spin-wait for a local + remote split on one host (imports nothing heavy: the
setting must be in the environment before torch loads libgomp).

The two processes take turns on the same cores. After each parallel region libgomp's
threads spin before they sleep: 300,000 iterations by default (milliseconds), so the idle
process keeps a core the busy one needs. Too short a spin is bad too: the threads fall
asleep between the ops of one step and every op pays a wake-up. Measured on 2 cores (AMD
EPYC VM, 2026-11-23; default model, 2 threads per process; decode steps alternating
between the placements inside one run, so machine drift hits both alike; median step per
run, several runs per setting):

    GOMP_SPINCOUNT      unsplit step   local + remote step   remote vs unsplit
    3,000               40-55 ms       46-48 ms              0.91-1.00x (both slow)
    10,000              36-37 ms       39-41 ms              0.91-0.92x
    30,000              32-35 ms       34-38 ms              0.90-0.96x
    100,000             34-35 ms       39-41 ms              0.86-0.88x
    300,000 (default)   35-40 ms       46-53 ms              0.76x
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
