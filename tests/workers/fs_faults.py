"""File-system faults for tests: a directory nobody can write in, root included."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from typing import Iterator


@contextlib.contextmanager
def read_only(path: str | os.PathLike) -> Iterator[None]:
    """Within the block nothing can be created in or removed from `path`.

    Permission bits do not stop root (CI containers often run as root), so as root the
    directory is made immutable (chattr +i, ext4/xfs); otherwise its write bit is removed.
    """
    path = os.fspath(path)
    if os.geteuid() == 0:
        if shutil.which("chattr") is None:
            raise RuntimeError("running as root without chattr: cannot make a directory read-only")
        subprocess.run(["chattr", "+i", path], check=True)
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", path], check=True)
        return
    mode = os.stat(path).st_mode
    os.chmod(path, mode & ~0o222)
    try:
        yield
    finally:
        os.chmod(path, mode)
