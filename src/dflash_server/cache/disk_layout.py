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

In a shared root anyone can create the (predictable) fingerprint folder first, so a model
folder is used only if it is this user's, or root's and writable by nobody else (an
administrator's read-only cache); another user's folder is ignored with a warning, never
read (its snapshots would be trusted as this model's state). Symlinks are never followed:
markers are created with O_NOFOLLOW, folders are cleared through their own descriptor.
"""
from __future__ import annotations

import os
import re
import stat
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
    try:
        if not entry.is_dir(follow_symlinks=False):
            return False
        path = Path(entry.path)
        if (path / MARKER).is_file():
            return True
        return bool(FINGERPRINT_RE.fullmatch(entry.name)) and bool(snapshot_files(path))
    except OSError:  # another user's private folder, or gone meanwhile: not ours to list
        return False


def trusted(st: os.stat_result, euid: int | None = None) -> bool:
    """A folder this user may take snapshots from: its own, or root's and writable by root only."""
    euid = os.geteuid() if euid is None else euid
    return st.st_uid == euid or (st.st_uid == 0 and not st.st_mode & 0o022)


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
    """Remove the cache's own files: snapshot and temporary files in this user's model
    folders, their markers, then each folder if that left it empty. Returns (files
    removed, folders removed, other files left). Raises NotACache first if ``root`` is not
    one. Each folder is cleared through a descriptor opened without following symlinks,
    so a folder swapped for a link meanwhile cannot redirect the removals."""
    check_root(root)
    files = dirs = 0
    kept: list[Path] = []
    for folder in model_dirs(root):
        try:
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            kept.append(folder)
            continue
        try:
            if os.fstat(fd).st_uid != os.geteuid():
                kept.append(folder)  # another user's: theirs to clear
                continue
            for name in os.listdir(fd):
                if (SNAPSHOT_RE.fullmatch(name) or TMP_RE.fullmatch(name)) and stat.S_ISREG(
                        os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                    os.unlink(name, dir_fd=fd)
                    files += 1
            others = [n for n in os.listdir(fd) if n != MARKER]
            if others:
                kept.extend(folder / n for n in others)
                continue
            if MARKER in os.listdir(fd):
                os.unlink(MARKER, dir_fd=fd)
        finally:
            os.close(fd)
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
    """Create the marker unless something (anything, a link included) has that name."""
    try:
        fd = os.open(folder / MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(MARKER_TEXT)


def open_model_dir(root: Path, fingerprint: str) -> tuple[Path, str]:
    """The folder of one model configuration under ``root`` and how to use it: "rw", "ro"
    (read its snapshots, write nothing) or "off" (another user's folder: ignore it).
    Creates what is missing with private modes; an existing folder keeps its owner and
    mode. Raises OSError with a message that names the fix when the cache cannot be used."""
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
    if not os.path.lexists(folder):
        if not writable:
            return folder, "ro"  # read-only and nothing for this model: an empty cache
        _mkdir_private(folder)
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(f"{folder} is not a directory; remove it or choose another --kv-cache-dir")
    if not trusted(st):
        return folder, "off"
    if not os.access(folder, os.R_OK | os.X_OK):
        raise OSError(f"cannot read {folder} (permission denied); give this user read access or choose "
                      "another --kv-cache-dir")
    mode = "rw" if os.access(folder, os.W_OK | os.X_OK) else "ro"
    if mode == "rw":
        try:
            _mark(folder)
            if os.access(root, os.W_OK | os.X_OK):
                _mark(root)
        except OSError:
            mode = "ro"
    return folder, mode
