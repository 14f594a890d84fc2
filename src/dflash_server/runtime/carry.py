"""What crosses a stage boundary beside the hidden state, on the wire to a shard worker.

Gemma 4 E2B / E4B: the per-layer inputs the first stage made, and the K/V rows a source
layer wrote this forward for KV-shared layers on a later stage (``LocalStage._carry``).
"""
from __future__ import annotations

import torch

CARRY_KINDS = ("full", "sliding")  # the share keys of KV-shared layers (Attention.share_key)


def carry_tensors(carry: dict | None) -> dict[str, torch.Tensor]:
    """A stage boundary's carry (``StageOutput.carry``) as named tensors for the worker."""
    out = {}
    if not carry:
        return out
    if carry.get("per_layer") is not None:
        out["carry.per_layer"] = carry["per_layer"]
    for key, (k, v) in (carry.get("kv") or {}).items():
        out[f"carry.k.{key}"], out[f"carry.v.{key}"] = k, v
    return out


def carry_from_tensors(tensors: dict[str, torch.Tensor]) -> dict | None:
    """The inverse of ``carry_tensors`` (a worker's side); names outside it are refused."""
    out: dict = {}
    for name, t in tensors.items():
        if not name.startswith("carry."):
            continue
        if name == "carry.per_layer":
            out["per_layer"] = t
            continue
        part, _, key = name[len("carry."):].partition(".")
        if part not in ("k", "v") or key not in CARRY_KINDS or f"carry.{'v' if part == 'k' else 'k'}.{key}" not in tensors:
            raise ValueError(f"unknown or unpaired carry tensor {name!r}")
        if part == "k":
            out.setdefault("kv", {})[key] = (t, tensors[f"carry.v.{key}"])
    return out or None
