"""Leftovers of processes that were killed before they could clean up (a shared-memory
name, a worker's socket folder): each is named with its creator's pid, and the next
process of ours that creates one removes those whose creator is gone."""
from __future__ import annotations

import os
import re
from typing import Callable


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process; not a pid: leave it
        pass
    return True


def sweep(directory: str, pattern: re.Pattern, remove: Callable[[str], None]) -> None:
    """``remove(path)`` for each name in ``directory`` that ``pattern`` matches (group 1:
    the creator's pid) whose creator has exited; live creators and other names are left
    alone, and a removal that fails (gone meanwhile, not ours) is skipped."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        m = pattern.fullmatch(name)
        if m and not pid_alive(int(m.group(1))):
            try:
                remove(os.path.join(directory, name))
            except OSError:
                pass
