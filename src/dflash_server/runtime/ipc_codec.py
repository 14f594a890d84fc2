"""Wire format of the shard-worker protocol: msgpack headers + raw tensor bytes, no pickle.

A message is a ZeroMQ multipart: frame 0 is a msgpack map (the header), the other frames
carry tensor bytes inline. Tensors may instead live in a shared-memory area (one host),
in which case the header gives their offset. Every tensor is described by
``{"name", "dtype", "shape", "nbytes", "frame" | "offset"}`` and checked on receipt: known
dtype, bounded rank and sizes, byte count equal to the product of the shape, location
inside the frame or the area. Anything else is a ``ProtocolError``.
"""
from __future__ import annotations

import math

import msgpack
import numpy as np
import torch

PROTOCOL_VERSION = 2  # 2: tree verify (forward "tree", rollback_tree)
MAX_HEADER_BYTES = 1 << 20
MAX_TENSORS = 4096
MAX_RANK = 6

DTYPES = {"f64": torch.float64, "f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "i64": torch.int64,
          "i32": torch.int32, "u8": torch.uint8}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class ProtocolError(Exception):
    """A message that does not follow the protocol (malformed, oversized, wrong version)."""


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 CPU view of ``t``'s bytes (copies only if it is not contiguous on CPU)."""
    if t.requires_grad or t.device.type != "cpu" or not t.is_contiguous():
        t = t.detach().to("cpu").contiguous()  # only then: each torch call costs tens of us on a cold decode step
    return t.reshape(-1).view(torch.uint8)


def tensor_spec(name: str, t: torch.Tensor) -> dict:
    if t.dtype not in DTYPE_NAMES:
        raise ProtocolError(f"tensor {name}: dtype {t.dtype} cannot be sent")
    return {"name": name, "dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
            "nbytes": t.numel() * t.element_size()}


def check_spec(spec, max_bytes: int) -> tuple[str, torch.dtype, tuple[int, ...], int]:
    """Validate one tensor description from a peer; returns (name, dtype, shape, nbytes)."""
    if not isinstance(spec, dict):
        raise ProtocolError("tensor spec is not a map")
    name, dtype, shape, nbytes = spec.get("name"), spec.get("dtype"), spec.get("shape"), spec.get("nbytes")
    if not isinstance(name, str) or not 0 < len(name) <= 256:
        raise ProtocolError("tensor name missing or too long")
    if dtype not in DTYPES:
        raise ProtocolError(f"tensor {name}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or len(shape) > MAX_RANK or \
            not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in shape):
        raise ProtocolError(f"tensor {name}: bad shape {shape!r}")
    dt = DTYPES[dtype]
    want = math.prod(shape) * dt.itemsize
    if not isinstance(nbytes, int) or nbytes != want:
        raise ProtocolError(f"tensor {name}: {nbytes!r} bytes for shape {shape} {dtype} (expected {want})")
    if nbytes > max_bytes:
        raise ProtocolError(f"tensor {name}: {nbytes} bytes exceeds the limit of {max_bytes}")
    return name, dt, tuple(shape), nbytes


def from_bytes(buf, offset: int, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int) -> torch.Tensor:
    """A fresh tensor holding ``nbytes`` of ``buf`` at ``offset`` (always a copy: the
    buffer is reused by the next message)."""
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    flat = np.frombuffer(buf, dtype=np.uint8, count=nbytes, offset=offset).copy()
    return torch.from_numpy(flat).view(dtype).reshape(shape)


def pack_header(header: dict) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def unpack_header(frame: bytes) -> dict:
    if len(frame) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(frame)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(frame, raw=False, strict_map_key=True, max_bin_len=MAX_HEADER_BYTES,
                                 max_str_len=MAX_HEADER_BYTES, max_array_len=1 << 16, max_map_len=1 << 16)
    except Exception as e:  # noqa: BLE001 - msgpack raises several types for bad input
        raise ProtocolError(f"undecodable header: {type(e).__name__}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not a map")
    if header.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {header.get('v')!r}; this side speaks {PROTOCOL_VERSION}")
    tensors = header.get("tensors", [])
    if not isinstance(tensors, list) or len(tensors) > MAX_TENSORS:
        raise ProtocolError("bad tensor list")
    return header


def encode(header: dict, tensors: dict[str, torch.Tensor], area=None) -> list:
    """Frames for ``header`` plus ``tensors``: into ``area`` (a SharedArea) when given and
    everything fits, else inline frames."""
    specs, frames = [], []
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    use_area = area is not None and 0 < total <= area.size
    offset = 0
    for name, t in tensors.items():
        spec = tensor_spec(name, t)
        data = raw_bytes(t)
        if use_area:
            spec["offset"] = offset
            area.write(offset, data)
            offset += spec["nbytes"]
        else:
            spec["frame"] = len(frames) + 1
            frames.append(data.numpy())
        specs.append(spec)
    header = dict(header, v=PROTOCOL_VERSION, tensors=specs)
    return [pack_header(header), *frames]


def decode(frames: list, area=None, max_bytes: int = 1 << 34) -> tuple[dict, dict[str, torch.Tensor]]:
    """Inverse of ``encode``; every tensor is validated and copied out."""
    if not frames:
        raise ProtocolError("empty message")
    header = unpack_header(bytes(frames[0]))
    out: dict[str, torch.Tensor] = {}
    for spec in header.get("tensors", []):
        name, dt, shape, nbytes = check_spec(spec, max_bytes)
        if name in out:
            raise ProtocolError(f"tensor {name} sent twice")
        if "frame" in spec:
            k = spec["frame"]
            if not isinstance(k, int) or not 1 <= k < len(frames):
                raise ProtocolError(f"tensor {name}: no frame {k!r}")
            buf = frames[k].buffer if hasattr(frames[k], "buffer") else frames[k]
            if len(buf) != nbytes:
                raise ProtocolError(f"tensor {name}: frame has {len(buf)} bytes, spec says {nbytes}")
            out[name] = from_bytes(buf, 0, dt, shape, nbytes)
        elif "offset" in spec:
            off = spec["offset"]
            if area is None:
                raise ProtocolError(f"tensor {name}: shared memory was not negotiated")
            if not isinstance(off, int) or off < 0 or off + nbytes > area.size:
                raise ProtocolError(f"tensor {name}: offset {off!r} + {nbytes} outside the shared area")
            out[name] = area.read(off, dt, shape, nbytes)
        else:
            raise ProtocolError(f"tensor {name}: no location")
    return header, out
