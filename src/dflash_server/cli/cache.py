"""``dflash-server cache ls|stats|clear --kv-cache-dir DIR``: inspect or clear the disk
prefix cache without loading a model.

Only the cache's own files are ever read or removed (``cache.disk_layout``); a folder that
is not a cache is refused with a message, whatever it holds. ``ls`` and ``stats`` check
each file's tensor data against its checksum, as a server would before using it
(``--quick``: headers only).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from ..errors import UserError


def add_parser(sub) -> None:
    p = sub.add_parser("cache", help="inspect or clear the disk prefix cache")
    p.add_argument("action", choices=["ls", "stats", "clear"])
    p.add_argument("--kv-cache-dir", required=True)
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true", help="ls/stats: check headers only, not the tensor data")
    p.set_defaults(func=run)


def _check(path: Path, quick: bool) -> tuple[int | None, bool]:
    from ..cache.disk_format import SnapshotFormatError, read_header, read_tensors

    try:
        rec = read_header(path, None)
        if not quick:
            read_tensors(path, rec)  # layout and sha256 of the data
        return rec["position"], True
    except (SnapshotFormatError, OSError):
        return None, False


def _files(root: Path, quick: bool):
    from ..cache.disk_layout import model_dirs, snapshot_files

    for model_dir in model_dirs(root):
        for f in snapshot_files(model_dir):
            tokens, ok = _check(f, quick)
            try:
                st = f.stat()
            except FileNotFoundError:  # evicted by a running server meanwhile
                continue
            yield {"model": model_dir.name, "file": f.name, "tokens": tokens, "bytes": st.st_size,
                   "modified": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(st.st_mtime)), "valid": ok}


def run(args) -> int:
    from ..cache.disk_layout import NotACache, check_root, clear

    root = Path(args.kv_cache_dir)
    try:
        check_root(root)
        if args.action == "clear":
            files, dirs, kept = clear(root)
            if args.json:
                print(json.dumps({"dir": str(root), "removed_files": files, "removed_model_dirs": dirs,
                                  "kept": [str(k) for k in kept]}))
                return 0
            print(f"removed {files} snapshot files and {dirs} model folders from {root}")
            if kept:
                print(f"left {len(kept)} files that are not the cache's, e.g. {kept[0]}")
            return 0
    except NotACache as e:
        raise UserError(str(e)) from None
    except OSError as e:
        raise UserError(f"--kv-cache-dir {root}: {e}") from None
    rows = list(_files(root, args.quick))
    if args.action == "stats":
        models = {}
        for r in rows:
            m = models.setdefault(r["model"], {"files": 0, "bytes": 0, "tokens": 0, "invalid": 0})
            m["files"] += 1
            m["bytes"] += r["bytes"]
            m["tokens"] += r["tokens"] or 0
            m["invalid"] += not r["valid"]
        out = {"dir": str(root), "files": len(rows), "bytes": sum(r["bytes"] for r in rows), "models": models}
        print(json.dumps(out, indent=None if args.json else 2))
        return 0
    if args.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            print(f"{r['model']}  {r['file'][:16]}..  {r['tokens'] if r['valid'] else 'INVALID':>8} tokens  "
                  f"{r['bytes'] / 2**20:8.1f} MiB  {r['modified']}")
    return 0
