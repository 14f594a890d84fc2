"""On-disk snapshot format: one safetensors file per prefix snapshot.

Tensors are the flat snapshot dict (``ls<k>.kv_k.<layer>``, ``ls<k>.ssm.<layer>``, ...,
``logits``, ``dflash.k.<i>``); the safetensors metadata (string -> string) carries a JSON
record: format version, model fingerprint, token ids, position, last token and the tensor
layout, so a file can be validated from its header alone. Files are written to a temporary
name in the same directory and renamed into place (atomic on POSIX), so a crash leaves
either the old state or the complete new file.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

FORMAT = "dflash-prefix-snapshot"
VERSION = 2  # 2: sha256 of the tensor data in the record
SUFFIX = ".snap.safetensors"


class SnapshotFormatError(ValueError):
    pass


def layout_of(tensors: dict[str, torch.Tensor]) -> dict[str, list]:
    return {k: [str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in sorted(tensors.items())}


def data_hash(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's raw bytes in name order: flipped data bytes, which the
    safetensors header cannot notice, make a file a miss instead of wrong output."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(name.encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


# no snapshot is longer than a context; a record holding more ids is not one of ours
MAX_TOKENS = 1 << 22


# safetensors' dtype names
ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}


def write_safetensors(f, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Stream ``tensors`` in the safetensors format (an 8-byte little-endian header length,
    the JSON header padded to 8 bytes, then each tensor's bytes in header order) into the
    open binary file ``f``: no copy of the whole file in memory, and no temporary file of
    safetensors' own naming beside ours (``save_file`` writes one, which a crash left behind
    under a name the cache does not know)."""
    header, at, parts = {}, 0, []
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        if t.dtype not in ST_DTYPES:
            raise ValueError(f"snapshot tensor {name}: dtype {t.dtype} has no safetensors name")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + n]}
        parts.append(t)
        at += n
    header["__metadata__"] = metadata
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    f.write(len(head).to_bytes(8, "little"))
    f.write(head)
    for t in parts:
        if t.numel():
            f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


def write_snapshot(path: Path, tensors: dict[str, torch.Tensor], token_ids, fingerprint: str) -> int:
    """Write atomically: to ``.<name>.<pid>.tmp`` beside it (created exclusively, links not
    followed), then renamed into place; a crash leaves only that name, which the next start
    and ``cache clear`` remove. Returns the file size. Raises OSError (e.g. disk full)."""
    record = {"format": FORMAT, "version": VERSION, "fingerprint": fingerprint,
              "token_ids": [int(t) for t in token_ids], "position": len(token_ids),
              "last_token": int(token_ids[-1]) if len(token_ids) else None, "layout": layout_of(tensors),
              "sha256": data_hash(tensors)}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            write_safetensors(f, tensors, {"dflash": json.dumps(record)})
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path.stat().st_size


def read_header(path: Path, fingerprint: str | None) -> dict:
    """The JSON record of a snapshot file, validated (format, version, fingerprint, layout
    against the tensors actually present)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            names = set(f.keys())
    except Exception as e:
        raise SnapshotFormatError(f"unreadable ({type(e).__name__})") from None
    try:
        record = json.loads(meta["dflash"])
    except (KeyError, ValueError):
        raise SnapshotFormatError("no dflash metadata") from None
    if not isinstance(record, dict):
        raise SnapshotFormatError("bad record")
    if record.get("format") != FORMAT or record.get("version") != VERSION:
        raise SnapshotFormatError(f"format {record.get('format')} v{record.get('version')}, "
                                  f"expected {FORMAT} v{VERSION}")
    if fingerprint is not None and record.get("fingerprint") != fingerprint:
        raise SnapshotFormatError("written by a different model configuration")
    ids = record.get("token_ids")
    if not isinstance(ids, list) or not ids or len(ids) > MAX_TOKENS or record.get("position") != len(ids) \
            or not all(type(t) is int and 0 <= t < 2 ** 31 for t in ids):
        raise SnapshotFormatError("bad token ids / position")
    layout = record.get("layout")
    if not isinstance(layout, dict) or not all(
            isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) and isinstance(v[1], list)
            and all(type(d) is int and d >= 0 for d in v[1]) for v in layout.values()):
        raise SnapshotFormatError("bad tensor layout")
    if set(layout) != names:
        raise SnapshotFormatError("tensor names do not match the recorded layout")
    return record


def read_tensors(path: Path, record: dict) -> dict[str, torch.Tensor]:
    """Load every tensor and check it against the recorded layout."""
    out = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for name, (dtype, shape) in record["layout"].items():
                t = f.get_tensor(name)
                if str(t.dtype).removeprefix("torch.") != dtype or list(t.shape) != shape:
                    raise SnapshotFormatError(f"tensor {name} does not match its recorded layout")
                out[name] = t
    except SnapshotFormatError:
        raise
    except Exception as e:
        raise SnapshotFormatError(f"unreadable tensor data ({type(e).__name__})") from None
    if data_hash(out) != record.get("sha256"):
        raise SnapshotFormatError("tensor data does not match its checksum")
    return out
