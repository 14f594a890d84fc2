"""Memory a placement needs, estimated before loading: weights (in the mode each matrix
will have: dense, int8 or int4) and preallocated attention KV, per device. Printed at load;
a GPU that cannot hold its share stops start-up with the numbers and what to change,
instead of an out-of-memory error halfway through loading.

Estimated from the stored tensors' shapes and the config (nothing is read): layer matrices
at the layers' mode, the LM head at the head's mode (a tied head is a quantized copy of the
embedding), everything else (embedding, norms, convolutions, biases) dense. int8 is one
byte per weight plus a scale per row; int4 half a byte plus a scale and an offset per 32;
the CPU's native kernels store GGUF blocks (4.5-8.5 bits) and come close to these.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

GIB = 1 << 30
GPU_RESERVE = 3 << 29  # 1.5 GiB kept free on a GPU: CUDA context, activations, allocator slack
_LAYER = re.compile(r"(?:^|\.)(?:blk|layers)\.(\d+)\.")
_HEADS = ("lm_head.weight", "output.weight")
_EMBEDS = ("model.embed_tokens.weight", "token_embd.weight")


@dataclass(frozen=True)
class DeviceNeed:
    device: str
    weights: int  # bytes
    kv: int

    @property
    def total(self) -> int:
        return self.weights + self.kv

    def describe(self) -> str:
        return f"{self.device}: weights {self.weights / GIB:.2f} GiB + KV {self.kv / GIB:.2f} GiB"


def matrix_bytes(shape: tuple[int, ...], mode: str, elt: int) -> int:
    n = 1
    for d in shape:
        n *= d
    rows = n // shape[-1] if shape else 1  # a 3-D tensor: a layer's stacked experts, matrix by matrix
    if mode == "int8" and len(shape) in (2, 3):
        return n + rows * elt
    if mode == "int4" and len(shape) in (2, 3) and shape[-1] % 32 == 0:
        return n // 2 + (n // 32) * 2 * elt
    return n * elt


def _is_matrix(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) in (2, 3) and shape[-1] % 32 == 0 and "norm" not in name and "conv" not in name


def estimate(source, shards, dtype: torch.dtype, max_ctx: int, quantize, kv_tokens: int | None = None,
             lanes: int = 1, kv_dtype: str = "auto") -> list[DeviceNeed]:
    """Per shard (in order): bytes of its weights and of its preallocated attention KV.
    ``kv_tokens``: KV rows per layer when a KV Flash pool bounds them (else ``max_ctx``);
    ``lanes``: sequence slots, each with its own KV; ``kv_dtype``: the KV cache's type."""
    from .. import kernels
    from ..layers.attention import cache_dtype

    cfg = source.config
    layer_mode, head_mode = (quantize, quantize) if isinstance(quantize, str) else quantize
    elt = torch.empty((), dtype=dtype).element_size()
    shapes = source.tensor_shapes()
    tied = not any(h in shapes for h in _HEADS)
    out = []
    for k, sh in enumerate(shards):
        first, last = k == 0, k == len(shards) - 1
        weights = 0
        for name, shape in shapes.items():
            m = _LAYER.search(name)
            if m is not None:
                if sh.begin <= int(m.group(1)) < sh.end:
                    weights += matrix_bytes(shape, layer_mode if _is_matrix(name, shape) else "dense", elt)
            elif name in _HEADS:
                weights += matrix_bytes(shape, head_mode, elt) if last else 0
            elif name in _EMBEDS:
                weights += (matrix_bytes(shape, "dense", elt) if first else 0) + \
                    (matrix_bytes(shape, head_mode, elt) if last and tied else 0)
            elif last:  # the final norm and other top-level tensors
                weights += matrix_bytes(shape, "dense", elt)
        device = sh.device.removeprefix("remote:")
        kind = device.split(":")[0]  # (whether the native attention reads a CPU cache: built or not)
        native = kind == "cpu" and kernels.enabled() and kernels.load()
        kv_elt = cache_dtype(kv_dtype, kind, dtype, native).itemsize
        width = sum(cfg.layer_kv_heads(i) * cfg.layer_head_dim(i) for i in range(sh.begin, sh.end)
                    if cfg.layer_types[i] != "linear_attention" and cfg.kv_source(i) is None)
        kv = 2 * width * (kv_tokens or max_ctx) * kv_elt * lanes
        out.append(DeviceNeed(sh.device, weights, kv))
    return out


def check_fits(needs: list[DeviceNeed], free: dict[str, int]) -> None:
    """Raise ValueError (with the numbers and the ways out) when a GPU's share does not fit
    its free memory less a reserve. ``free``: free bytes per local GPU device name."""
    per_device: dict[str, int] = {}
    for n in needs:
        if n.device in free:
            per_device[n.device] = per_device.get(n.device, 0) + n.total
    for dev, need in per_device.items():
        room = free[dev] - GPU_RESERVE
        if need > room:
            parts = "; ".join(n.describe() for n in needs if n.device == dev)
            raise ValueError(
                f"the model does not fit on {dev}: it needs ~{need / GIB:.1f} GiB ({parts}) but "
                f"{free[dev] / GIB:.1f} GiB is free and {GPU_RESERVE / GIB:.1f} GiB stays in reserve; use a "
                f"smaller --max-ctx, --kvflash auto (bounded KV), --quantize int4, or split the layers over "
                f"more devices (--target-devices cuda:0,cuda:1 or cuda:0,cpu)")


def gpu_free(needs: list[DeviceNeed]) -> dict[str, int]:
    """Free memory of each local CUDA device among the needs."""
    out = {}
    for n in needs:
        if n.device.startswith("cuda") and n.device not in out:
            out[n.device] = torch.cuda.mem_get_info(torch.device(n.device))[0]
    return out


def host_available() -> int:
    """Bytes of host memory available to new allocations (Linux MemAvailable; else the
    physical total)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
