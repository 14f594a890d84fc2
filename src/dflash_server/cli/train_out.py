"""Which folders ``train-draft`` may write into: its own, never a user's.

``--out`` receives the draft (``config.json``, ``model.safetensors``), its checkpoints
(``checkpoint/``, replaced through ``checkpoint.tmp`` / ``checkpoint.old``), the log and the
summary, and by default the datasets (``data/``, ``text-data/``). A folder is taken only if
it is missing or empty, or already a train-draft output: it carries the marker written when
the command first took it, or (outputs made before the marker existed) a checkpoint's
``state.json``, a dataset manifest or a summary naming a draft. The ``--model`` folder (or a
folder holding it or inside it) is never taken, and a file of the command's own name that is
a symbolic link is refused rather than written through. A ``--data`` / ``--text-data``
folder is taken if empty or holding a dataset manifest.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import UserError

MARKER = ".dflash-train-draft"
MARKER_TEXT = "dflash-server train-draft output: the command replaces its own files here\n"
# what the command writes in --out (datasets in data/ and text-data/ unless --data names others)
OWN = ("config.json", "model.safetensors", "checkpoint", "checkpoint.tmp", "checkpoint.old", "train_log.jsonl",
       "train_summary.json", "data", "text-data", MARKER)
MANIFEST = "dataset.json"


def _legacy_output(out: Path) -> bool:
    """A train-draft output written before the marker: a checkpoint, a dataset or a summary of ours."""
    if (out / "checkpoint" / "state.json").is_file() or (out / "data" / MANIFEST).is_file() \
            or (out / "text-data" / MANIFEST).is_file():
        return True
    try:
        return "draft" in json.loads((out / "train_summary.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def _overlaps(a: Path, b: Path) -> bool:
    return a == b or a in b.parents or b in a.parents


def claim_out(out: Path, model: Path | None, write: bool) -> None:
    """Refuse (UserError, nothing changed) an ``--out`` that is not train-draft's to write;
    ``write``: mark it as ours (creating it) when it is."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: not a folder")
    try:
        where = out.resolve()
    except (OSError, RuntimeError) as e:   # a symlink loop: RuntimeError before Python 3.13
        raise UserError(f"--out {out}: {e}") from None
    if model is not None and _overlaps(where, model.resolve()):
        raise UserError(f"--out {out}: is, holds or lies in the --model folder {model}; train-draft writes its "
                        f"draft there: choose another folder")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file() and not _legacy_output(out):
        raise UserError(f"--out {out}: a folder holding other files, not a train-draft output; nothing was changed "
                        f"(choose an empty or new folder)")
    for name in OWN:
        if (out / name).is_symlink():
            raise UserError(f"--out {out}: {name} is a symbolic link; train-draft replaces its own files there and "
                            f"does not write through links")
    if write:
        out.mkdir(parents=True, exist_ok=True)
        if not (out / MARKER).is_file():
            (out / MARKER).write_text(MARKER_TEXT)


def claim_data(data: Path, flag: str, model: Path | None) -> None:
    """Refuse a dataset folder that holds other files than a dataset (or is the model's)."""
    if data.exists() and not data.is_dir():
        raise UserError(f"{flag} {data}: not a folder")
    if model is not None and _overlaps(data.resolve(), model.resolve()):
        raise UserError(f"{flag} {data}: is, holds or lies in the --model folder {model}")
    if (data / MANIFEST).is_symlink():
        raise UserError(f"{flag} {data}: {MANIFEST} is a symbolic link")
    if data.is_dir() and any(data.iterdir()) and not (data / MANIFEST).is_file():
        raise UserError(f"{flag} {data}: a folder holding other files, not a dataset; nothing was changed")
