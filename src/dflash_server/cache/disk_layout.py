"""What belongs to the disk cache inside ``--kv-cache-dir``, so nothing else is ever touched.

::

    <root>/.dflash-cache                               marker: a dflash-server cache lives here
    <root>/<fingerprint>/.dflash-cache                 marker: snapshots of one model configuration
    <root>/<fingerprint>/<32 hex>.snap.safetensors     a snapshot (name = hash of its token ids)
    <root>/<fingerprint>/.<32 hex>.snap.safetensors.<pid>.tmp   a write in progress

The root may be any folder the user names (a home folder, a shared 1777 ``/tmp``): the
server sets modes only on folders it creates, never removes anything but the names
above, and a folder it did not set up (no marker, no snapshot folder) is refused by
``cache clear`` rather than emptied. Folders written before markers existed are still
recognised: a 20-hex-digit fingerprint folder holding snapshot files.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from .disk_format import SUFFIX

MARKER = ".dflash-cache"
MARKER_TEXT = "dflash-server prefix cache: `dflash-server cache clear` removes the snapshot files here\n"
SNAPSHOT_RE = re.compile(r"[0-9a-f]{32}" + re.escape(SUFFIX))
TMP_RE = re.compile(r"\.[0-9a-f]{32}" + re.escape(SUFFIX) + r"\.\d+\.tmp")
FINGERPRINT_RE = re.compile(r"[0-9a-f]{20}")


class NotACache(ValueError):
    pass


def _entries(folder: Path) -> list[os.DirEntry]:
    with os.scandir(folder) as it:
        return list(it)


def snapshot_files(folder: Path) -> list[Path]:
    """Snapshot files of one model folder (regular files with the cache's names only)."""
    return sorted(Path(e.path) for e in _entries(folder)
                  if SNAPSHOT_RE.fullmatch(e.name) and e.is_file(follow_symlinks=False))


def temp_files(folder: Path) -> list[Path]:
    return [Path(e.path) for e in _entries(folder) if TMP_RE.fullmatch(e.name) and e.is_file(follow_symlinks=False)]


def _is_model_dir(entry: os.DirEntry) -> bool:
    if not entry.is_dir(follow_symlinks=False):
        return False
    path = Path(entry.path)
    if (path / MARKER).is_file():
        return True
    try:
        return bool(FINGERPRINT_RE.fullmatch(entry.name)) and bool(snapshot_files(path))
    except OSError:
        return False


def model_dirs(root: Path) -> list[Path]:
    """The fingerprint folders under ``root`` that the cache wrote (never a symlink)."""
    return sorted(Path(e.path) for e in _entries(root) if _is_model_dir(e))


def check_root(root: Path) -> None:
    """Raise NotACache unless ``root`` is empty or holds a cache (marker or snapshot folder)."""
    if not root.is_dir():
        raise NotACache(f"{root}: no such directory")
    if (root / MARKER).is_file() or not _entries(root) or model_dirs(root):
        return
    raise NotACache(f"{root} is not a dflash-server cache (no {MARKER} marker and no snapshot folders); "
                    "nothing was changed. Point --kv-cache-dir at the folder given to `serve --kv-cache-dir`")


def clear(root: Path) -> tuple[int, int, list[Path]]:
    """Remove the cache's own files: snapshot and temporary files in its model folders,
    their markers, then each folder if that left it empty. Returns (files removed, folders
    removed, other files left in model folders). Raises NotACache first if ``root`` is not one."""
    check_root(root)
    files = dirs = 0
    kept: list[Path] = []
    for folder in model_dirs(root):
        for f in snapshot_files(folder) + temp_files(folder):
            f.unlink(missing_ok=True)
            files += 1
        others = [Path(e.path) for e in _entries(folder) if e.name != MARKER]
        if others:
            kept.extend(others)
            continue
        (folder / MARKER).unlink(missing_ok=True)
        folder.rmdir()
        dirs += 1
    return files, dirs, kept


def _mkdir_private(path: Path) -> bool:
    """Create ``path`` (mode 0700) if missing; True when this call created it."""
    try:
        path.mkdir(mode=0o700)
        return True
    except FileExistsError:
        return False


def _mark(folder: Path) -> None:
    marker = folder / MARKER
    if not marker.exists():
        marker.write_text(MARKER_TEXT)


def open_model_dir(root: Path, fingerprint: str) -> tuple[Path, bool]:
    """The folder of one model configuration under ``root``: (path, writable). Creates what
    is missing with private modes; an existing folder keeps its owner and mode. Raises
    OSError with a message that names the fix when the cache cannot be used at all."""
    if root.exists() and not root.is_dir():
        raise OSError(f"{root} is not a directory")
    if not root.exists():
        try:
            root.parent.mkdir(parents=True, exist_ok=True)
            _mkdir_private(root)
        except OSError as e:
            raise OSError(f"cannot create {root} ({e.strerror or e}); create it or choose another "
                          "--kv-cache-dir") from None
    if not os.access(root, os.R_OK | os.X_OK):
        raise OSError(f"cannot read {root} (permission denied); give this user read access or choose "
                      "another --kv-cache-dir")
    folder = root / fingerprint
    writable = os.access(root, os.W_OK | os.X_OK)
    if not folder.exists():
        if not writable:
            return folder, False  # read-only and nothing for this model: an empty cache
        _mkdir_private(folder)
    elif not folder.is_dir():
        raise OSError(f"{folder} is not a directory; remove it or choose another --kv-cache-dir")
    elif not os.access(folder, os.R_OK | os.X_OK):
        raise OSError(f"cannot read {folder} (permission denied); give this user read access or choose "
                      "another --kv-cache-dir")
    writable = os.access(folder, os.W_OK | os.X_OK)
    if writable:
        try:
            _mark(folder)
            if os.access(root, os.W_OK | os.X_OK):
                _mark(root)
        except OSError:
            writable = False
    return folder, writable
