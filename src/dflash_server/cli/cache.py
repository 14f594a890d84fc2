"""``dflash-server cache ls|stats|clear --kv-cache-dir DIR``: inspect the disk prefix cache
without loading a model."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from ..errors import UserError


def add_parser(sub) -> None:
    p = sub.add_parser("cache", help="inspect or clear the disk prefix cache")
    p.add_argument("action", choices=["ls", "stats", "clear"])
    p.add_argument("--kv-cache-dir", required=True)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def _files(root: Path):
    from ..cache.disk_format import SUFFIX, SnapshotFormatError, read_header

    for model_dir in sorted(d for d in root.iterdir() if d.is_dir()):
        for f in sorted(model_dir.glob(f"*{SUFFIX}")):
            try:
                rec = read_header(f, None)
                tokens, ok = rec["position"], True
            except SnapshotFormatError:
                tokens, ok = None, False
            st = f.stat()
            yield {"model": model_dir.name, "file": f.name, "tokens": tokens, "bytes": st.st_size,
                   "modified": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(st.st_mtime)), "valid": ok}


def run(args) -> int:
    root = Path(args.kv_cache_dir)
    if not root.is_dir():
        raise UserError(f"{root}: no such directory")
    rows = list(_files(root))
    if args.action == "clear":
        for d in (d for d in root.iterdir() if d.is_dir()):
            shutil.rmtree(d)
        print(f"removed {len(rows)} snapshot files")
        return 0
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
