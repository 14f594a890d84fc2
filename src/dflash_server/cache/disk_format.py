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
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

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


def write_snapshot(path: Path, tensors: dict[str, torch.Tensor], token_ids, fingerprint: str) -> int:
    """Write atomically; returns the file size. Raises OSError (e.g. disk full)."""
    record = {"format": FORMAT, "version": VERSION, "fingerprint": fingerprint,
              "token_ids": [int(t) for t in token_ids], "position": len(token_ids),
              "last_token": int(token_ids[-1]) if len(token_ids) else None, "layout": layout_of(tensors),
              "sha256": data_hash(tensors)}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        try:
            save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp),
                      metadata={"dflash": json.dumps(record)})
        except SafetensorError as e:   # its I/O errors (a full disk, a removed folder) are not OSErrors
            raise OSError(f"safetensors: {e}") from None
        os.chmod(tmp, 0o600)
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
    if record.get("format") != FORMAT or record.get("version") != VERSION:
        raise SnapshotFormatError(f"format {record.get('format')} v{record.get('version')}, "
                                  f"expected {FORMAT} v{VERSION}")
    if fingerprint is not None and record.get("fingerprint") != fingerprint:
        raise SnapshotFormatError("written by a different model configuration")
    ids = record.get("token_ids")
    if not isinstance(ids, list) or not ids or record.get("position") != len(ids):
        raise SnapshotFormatError("bad token ids / position")
    if set(record.get("layout", {})) != names:
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
