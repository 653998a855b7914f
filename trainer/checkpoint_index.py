"""What a checkpoint directory holds, read without torch: preflight uses it before anything loads.

A checkpoint iteration counts only when its directory carries COMMITTED (written last, after
every rank confirmed its part). The latest_checkpointed_iteration.txt markers are a hint for
humans and scripts: they are written after COMMITTED, so they can lag behind it, and a damaged
marker never stops a resume (the directories are scanned instead).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

COMMITTED = "COMMITTED"
LATEST = "latest_checkpointed_iteration.txt"
ITER_PREFIX = "iter_"


def iteration_dir(save_root: str | os.PathLike, task: str, iteration: int) -> Path:
    return Path(save_root) / task / f"{ITER_PREFIX}{iteration:07d}"


def _iteration_of(d: Path) -> int | None:
    if not (d.is_dir() and d.name.startswith(ITER_PREFIX)):
        return None
    tail = d.name[len(ITER_PREFIX):]
    return int(tail) if tail.isdigit() else None


def iteration_dirs(save_root: str | os.PathLike, task: str) -> dict[int, bool]:
    """{iteration: committed?} of every iter_* directory under <save>/<task>/."""
    task_dir = Path(save_root) / task
    if not task_dir.is_dir():
        return {}
    out = {}
    for d in task_dir.iterdir():
        it = _iteration_of(d)
        if it is not None:
            out[it] = (d / COMMITTED).is_file()
    return out


def committed_iterations(save_root: str | os.PathLike, task: str) -> list[int]:
    """Iterations under <save>/<task>/ that carry a COMMITTED marker, ascending."""
    return sorted(it for it, ok in iteration_dirs(save_root, task).items() if ok)


def read_marker(path: Path) -> str | None:
    """The marker's text, or None when absent. Undecodable bytes come back as U+FFFD, so a
    damaged marker reads as "not a number" instead of raising."""
    try:
        return path.read_bytes().decode("utf-8", errors="replace").strip()
    except FileNotFoundError:
        return None


def latest_committed_iteration(load_root: str | os.PathLike, task: str) -> int | None:
    """The iteration resume continues from: the newest COMMITTED directory; a marker naming
    anything else is reported and ignored. None when there is nothing to resume."""
    committed = committed_iterations(load_root, task)
    marker = Path(load_root) / task / LATEST
    text = read_marker(marker)
    if text is not None and (not text.isdigit() or int(text) not in committed):
        logger.warning("%s names %r, which is not a committed iteration; using the newest committed one (%s)",
                       marker, text[:40], committed[-1] if committed else None)
    return committed[-1] if committed else None


def task_dir_root(load_root: str | os.PathLike) -> Path | None:
    """The checkpoint directory that `load_root` is a task directory of (its parent, where
    iter_* directories lie directly in `load_root`: `<save>/<task>` given for `<save>`), else None."""
    root = Path(load_root)
    try:
        inside = [d for d in root.iterdir() if d.is_dir()]
    except OSError:
        return None
    return root.absolute().parent if any(_iteration_of(d) is not None for d in inside) else None


def describe_load_dir(load_root: str | os.PathLike, task: str) -> str:
    """Why `load_root` holds nothing to resume for `task`, for an error message: what is there."""
    root = Path(load_root)
    found = iteration_dirs(root, task)
    if found:
        return (f"{len(found)} iteration director{'y' if len(found) == 1 else 'ies'} under {root / task} "
                f"but none carries {COMMITTED} (every save was interrupted)")
    if any(_iteration_of(d) is not None for d in root.iterdir()):
        return (f"iter_* directories directly in {root}: that is a task directory; pass its parent "
                f"({root.parent}) to --load")
    entries = sorted(p.name + ("/" if p.is_dir() else "") for p in root.iterdir())
    shown = ", ".join(entries[:8]) + (", ..." if len(entries) > 8 else "")
    return f"no {task}/iter_* directory; it holds {shown or 'nothing'}"
