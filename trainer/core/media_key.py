"""Content keys of conditioning media, and the key of a cached condition (prompt AND media).

The rollout engine encodes each distinct condition once per generate call and shares it between
the candidates that need it. For text-to-image the prompt string names a condition; for image
editing it does not: "make it red" on two source images is two conditions, and the same source
resized to two condition sizes is two as well (the VL encoder and the VAE see other pixels). So a
condition is keyed by

    ConditionKey(prompt, media = (content key of each source, in order), size = (height, width)
                 the sources are resized to, None without media)

A source's content key is "sha256:<hex>" of its file's bytes (`bytes_key`: the very key the data
tools dedup and check leakage with, trainer.data.MediaDigests, so a file is one source wherever it
lies and two files with one name are two).

The engine calls `condition_key(request.prompt, its sources' keys, condition size)` where it keys
its per-call condition cache by the prompt string for text-to-image, and the same with the negative
prompt under true CFG: an edit model's unconditional branch sees the source image too, so the
negative condition is per source, not one per call.
"""

from __future__ import annotations

import functools
import hashlib
import os
import stat
from dataclasses import dataclass
from typing import BinaryIO, Iterable

#: bytes read at a time when hashing a media file (memory stays bounded whatever its size)
HASH_CHUNK = 1 << 20

#: the largest media file (a source image, a video) a data tool reads or hashes, in bytes. No
#: image a family can take comes near it (the engine reads at most 256 MiB of a source); it bounds
#: the time one named file can cost (about a second of hashing) and keeps a file that claims a huge
#: size (/proc/kcore) from being read at all
MAX_MEDIA_BYTES = 1 << 30

#: kernel pseudo-filesystems: their files say "regular" and report a size of 0 (or 4096) whatever
#: they hold, and reading one can take minutes (/proc/self/pagemap) or fail midway (/proc/self/mem)
PSEUDO_FS_ROOTS = ("/proc", "/sys")


class MediaFileError(ValueError):
    """A file named as media that is no media file: not a regular file, a /proc or /sys file,
    larger than the bound, or grown while it was read. The message names the file and says why."""


@functools.lru_cache(maxsize=1)
def _pseudo_fs_devices() -> frozenset[int]:
    devices = set()
    for root in PSEUDO_FS_ROOTS:
        try:
            devices.add(os.stat(root).st_dev)
        except OSError:
            pass
    return frozenset(devices)


def _stat_problem(st: os.stat_result, max_bytes: int) -> str | None:
    """Why a file of status `st` is no media file to read, or None."""
    mode = st.st_mode
    if not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode)
                else "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "not a regular file")
        return f"is {kind}, not a regular file"
    if st.st_dev in _pseudo_fs_devices():
        return "is a kernel pseudo-file (/proc or /sys), not a media file"
    if st.st_size > max_bytes:
        return f"is {st.st_size} bytes, more than the {max_bytes} a media file may have"
    return None


def media_file_problem(path: str | os.PathLike, max_bytes: int = MAX_MEDIA_BYTES) -> str | None:
    """Why `path` (links followed) is no media file a data tool may read, as "<path> is ...",
    or None for a regular file of at most `max_bytes` outside /proc and /sys. From its status
    alone: nothing is opened, so a FIFO cannot block."""
    path = os.fspath(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return f"{path} does not exist"
    except OSError as e:
        return f"{path} cannot be read ({e.strerror})"
    problem = _stat_problem(st, max_bytes)
    return f"{path} {problem}" if problem else None


def open_media_file(path: str | os.PathLike, max_bytes: int = MAX_MEDIA_BYTES) -> tuple[BinaryIO, int]:
    """(binary file object, size) of a media file: MediaFileError naming it unless
    media_file_problem would accept it, judged from its status before it is opened (opening a
    device can act on it) and again on the open descriptor (no window between check and read).
    Opened non-blocking, so a FIFO swapped in meanwhile is refused instead of waiting for a
    writer; OSError (FileNotFoundError, ...) as open() raises it."""
    path = os.fspath(path)
    problem = _stat_problem(os.stat(path), max_bytes)
    if problem:
        raise MediaFileError(f"{path} {problem}; a record's media must be image or video files")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        problem = _stat_problem(st, max_bytes)
        if problem:
            raise MediaFileError(f"{path} {problem}; a record's media must be image or video files")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb"), st.st_size
    except BaseException:
        os.close(fd)
        raise


def _bounded_chunks(f: BinaryIO, size: int, path: str) -> Iterable[bytes]:
    """The bytes of an open media file of `size` bytes in HASH_CHUNK pieces: never more than its
    size at open (a file grown meanwhile, or one whose size is not what it holds, is refused)."""
    left = size
    while left > 0:
        chunk = f.read(min(HASH_CHUNK, left))
        if not chunk:
            raise MediaFileError(f"{path} shrank while it was read; retry once nothing writes it")
        left -= len(chunk)
        yield chunk
    if f.read(1):
        raise MediaFileError(f"{path} holds more than the {size} bytes its size says (it grew while it was "
                             "read, or it is a pseudo-file); retry once nothing writes it")


def file_sha256(path: str | os.PathLike, max_bytes: int = MAX_MEDIA_BYTES) -> str:
    """sha256 hex of a media file's bytes, read in HASH_CHUNK pieces (open_media_file's checks
    and errors: a FIFO, a device, a /proc file or one over `max_bytes` is never read)."""
    h = hashlib.sha256()
    f, size = open_media_file(path, max_bytes)
    with f:
        for chunk in _bounded_chunks(f, size, os.fspath(path)):
            h.update(chunk)
    return h.hexdigest()


def bytes_key(data: bytes) -> str:
    """"sha256:<hex>" of a media file's bytes already in memory: its content key."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class ConditionKey:
    """What a cached condition is a function of (module docstring). Hashable; equal keys may
    share one encoded condition."""

    prompt: str
    media: tuple[str, ...] = ()
    size: tuple[int, int] | None = None


def condition_key(prompt: str, media_keys: Iterable[str] = (), size: tuple[int, int] | None = None) -> ConditionKey:
    """The cache key of the condition of `prompt` shown the sources whose content keys are
    `media_keys` (in order), resized to `size` = (height, width). Without media the size does not
    change the condition (a text encoder sees no pixels), so it is dropped: a text-only key is the
    prompt alone, as the t2i cache has it."""
    media = tuple(media_keys)
    for m in media:
        if not isinstance(m, str) or not m.startswith("sha256:"):
            raise ValueError(f"condition_key: {str(m)[:80]!r} is not a media content key (sha256:...); "
                             "turn sources into keys with bytes_key")
    if not media:
        return ConditionKey(prompt)
    if size is None or len(size) != 2 or not all(isinstance(v, int) and v > 0 for v in size):
        raise ValueError(f"condition_key: a condition with media needs the (height, width) the media are resized "
                         f"to, got {size!r}")
    return ConditionKey(prompt, media, (int(size[0]), int(size[1])))
