"""Writing files so that a crash never leaves a partial file under its real name, and a link
planted in the output directory is never followed.

A temporary is created exclusively (O_CREAT | O_EXCL | O_NOFOLLOW) under an unpredictable name
beside its target, fsynced, renamed over the target, and the directory fsynced. O_EXCL fails on
any existing entry, a symlink included, so nothing another user placed in a shared directory can
redirect the write. New files and directories follow the process umask (0666 / 0777 & ~umask),
as a plain open() or mkdir() would.

No torch here: trainer.data and the data tools use it before anything heavy is imported.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

#: a temporary's name is "<target name>.<random hex>.tmp"; a leftover of a crash matches "<name>*.tmp"
TMP_SUFFIX = ".tmp"


def umask() -> int:
    """The process umask, read without changing it (Linux reports it in /proc/self/status)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)  # no /proc: the classic read, which sets it back at once
    os.umask(old)
    return old


def file_mode() -> int:
    """The mode open() gives a new file: 0o666 & ~umask."""
    return 0o666 & ~umask()


def dir_mode() -> int:
    """The mode mkdir() gives a new directory: 0o777 & ~umask."""
    return 0o777 & ~umask()


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or unlink in directory `path` durable (best effort where a filesystem does
    not allow opening a directory: the rename itself is still atomic)."""
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def create_exclusive(target: str | os.PathLike) -> tuple[int, Path]:
    """(fd opened for writing, path) of a new, empty temporary beside `target`.

    Never opens an existing entry: a symlink, a FIFO or a file planted under any name is an
    error of O_EXCL, and the random name makes a collision with an honest leftover unlikely."""
    target = Path(target)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(16):
        tmp = target.with_name(f"{target.name}.{secrets.token_hex(6)}{TMP_SUFFIX}")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"could not create a temporary file beside {target}: every name tried exists")


@contextmanager
def atomic_writer(target: str | os.PathLike) -> Iterator[BinaryIO]:
    """Yield a binary file; when the block ends without an error it is fsynced and renamed over
    `target` (replacing it), then the directory is fsynced. On any error, the temporary is
    removed and nothing changed under `target`."""
    target = Path(target)
    fd, tmp = create_exclusive(target)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        raise
    fsync_dir(target.parent)


def follow_umask(root: str | os.PathLike) -> None:
    """Give every file and directory under `root` (itself included; links untouched) the mode a
    plain open() / mkdir() would: libraries that create 0600 files (safetensors) and mkdtemp's
    0700 would otherwise make a model directory unreadable to the group the umask admits."""
    fmode, dmode = file_mode(), dir_mode()
    for dirpath, _, filenames in os.walk(root):
        os.chmod(dirpath, dmode)
        for name in filenames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                os.chmod(path, fmode)


@contextmanager
def staged_dir(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh directory beside `target` (".<name>.partial-<random>": an unpredictable name,
    so nothing planted beside it is followed); when the block ends without an error its tree
    follows the umask and it replaces `target` (an existing `target` is removed only then, so an
    interrupted build never leaves a half-written directory under the real name). On any error it
    is removed and `target` is untouched. The caller decides whether replacing is allowed."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        yield staging
        follow_umask(staging)  # mkdtemp's 0700 and safetensors' 0600 would hide the contents from the group
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def fsync_tree(root: str | os.PathLike) -> int:
    """fsync every regular file and directory under `root` (symlinks are not followed), deepest
    first, so that a rename of `root` into place publishes complete contents. Returns the count
    of files synced."""
    count = 0
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                continue
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            count += 1
        fsync_dir(dirpath)
    return count
