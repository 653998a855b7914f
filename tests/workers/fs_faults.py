"""File-system faults for tests: a directory nobody can write in, root included; checkpoint shard
writes that fail."""

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


@contextlib.contextmanager
def failing_shard_writes() -> Iterator[None]:
    """Within the block every DCP shard write of this process raises OSError, as a full or
    vanished disk would: save_checkpoint's writer (torch.distributed.checkpoint.FileSystemWriter,
    looked up when it saves) is swapped for one whose write_data fails."""
    import torch.distributed.checkpoint as dcp

    real = dcp.FileSystemWriter

    class FailingWriter(real):
        def write_data(self, plan, planner):
            raise OSError("simulated failure while writing shards")

    dcp.FileSystemWriter = FailingWriter
    try:
        yield
    finally:
        dcp.FileSystemWriter = real
