"""Where each layer range of the target lives: parsing and validating placement flags."""
from __future__ import annotations

import re
from dataclasses import dataclass

REMOTE = "remote:"
_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?|mps|xpu(:\d+)?)$")


@dataclass(frozen=True)
class ShardSpec:
    device: str
    begin: int
    end: int

    @property
    def num_layers(self) -> int:
        return self.end - self.begin


def parse_devices(text: str) -> list[str]:
    devices = [d.strip() for d in text.split(",")]
    for d in devices:
        if not d:
            raise ValueError(f"--target-devices {text!r}: empty device name")
        if not _DEVICE_RE.match(d.removeprefix(REMOTE)):
            raise ValueError(f"--target-devices: unknown device {d!r} (use cpu, cuda:N, mps or xpu, or "
                             "remote:<device> for a layer group in a shard-worker process)")
    remote = [d.startswith(REMOTE) for d in devices]
    if remote[0]:
        raise ValueError("--target-devices: the first device must be local (it embeds the tokens); "
                         "put remote: devices after the local ones")
    if any(remote[i] and not remote[i + 1] for i in range(len(devices) - 1)):
        raise ValueError("--target-devices: one local group followed by one remote group "
                         "(e.g. cpu,remote:cpu,remote:cpu); a local device after a remote one is not supported")
    return devices


def is_remote(device: str) -> bool:
    return device.startswith(REMOTE)


def split_local_remote(shards: list[ShardSpec]) -> tuple[list[ShardSpec], list[ShardSpec]]:
    """(local shards, remote shards with the remote: prefix removed from the device)."""
    local = [s for s in shards if not is_remote(s.device)]
    remote = [ShardSpec(s.device.removeprefix(REMOTE), s.begin, s.end) for s in shards if is_remote(s.device)]
    return local, remote


def parse_split(text: str) -> list[float]:
    try:
        weights = [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--target-layer-split {text!r}: expected comma-separated positive numbers") from None
    for w in weights:
        if not w > 0:  # also rejects NaN
            raise ValueError(f"--target-layer-split {text!r}: every weight must be > 0")
    return weights


def plan_placement(num_layers: int, devices: list[str], split: list[float] | None = None,
                   together: tuple[tuple[int, int], ...] = ()) -> list[ShardSpec]:
    """Contiguous layer ranges proportional to ``split`` (equal if None), one per device,
    each at least one layer. ``together``: inclusive layer ranges better kept on one shard
    (Gemma 4's KV-shared layers and their sources: split apart, K/V rows cross the boundary
    every forward); a boundary inside one moves to its nearer end where that leaves every
    shard a layer, else it stays."""
    n = len(devices)
    if n == 0:
        raise ValueError("no target devices given")
    if split is None:
        split = [1.0] * n
    if len(split) != n:
        raise ValueError(f"--target-layer-split has {len(split)} weights for {n} target devices")
    if n > num_layers:
        raise ValueError(f"{n} shards for a model with only {num_layers} layers: each shard needs a layer")
    total = sum(split)
    bounds, acc = [0], 0.0
    for i, w in enumerate(split[:-1]):
        acc += w
        b = round(num_layers * acc / total)
        lo, hi = bounds[-1] + 1, num_layers - (n - 1 - i)
        bounds.append(min(max(b, lo), hi))
    bounds.append(num_layers)
    for k in range(1, n):
        b = bounds[k]
        for lo, hi in together:
            if lo < b <= hi:  # a boundary inside: before the range, or after it, whichever is nearer
                b = lo if (b - lo <= hi + 1 - b and lo > bounds[k - 1]) or hi + 1 >= bounds[k + 1] else hi + 1
        if bounds[k - 1] < b < bounds[k + 1] and not any(lo < b <= hi for lo, hi in together):
            bounds[k] = b
    return [ShardSpec(devices[i], bounds[i], bounds[i + 1]) for i in range(n)]
