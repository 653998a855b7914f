"""Content keys of conditioning media, and the key of a cached condition (prompt AND media).

The rollout engine encodes each distinct condition once per generate call and shares it between
the candidates that need it. For text-to-image the prompt string names a condition; for image
editing it does not: "make it red" on two source images is two conditions, and the same source
resized to two condition sizes is two as well (the VL encoder and the VAE see other pixels). So a
condition is keyed by

    ConditionKey(prompt, media = (content key of each source, in order), size = (height, width)
                 the sources are resized to, None without media)

A source's content key is "sha256:<hex>" of its file's bytes (the very key the data tools dedup
and check leakage with, trainer.data.MediaDigests, so a file is one source wherever it lies and
two files with one name are two), or "pixels:<hex>" of an already decoded uint8 image (its shape
and bytes). Keys of one run should use one form per source: the two forms of one image differ.

The engine calls `condition_key(request.prompt, request media, condition size)` where it keys its
per-call condition cache today by the prompt string, and the same with the negative prompt under
true CFG: an edit model's unconditional branch sees the source image too, so the negative
condition is per source, not one per call.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any, Iterable

#: bytes read at a time when hashing a media file (memory stays bounded whatever its size)
HASH_CHUNK = 1 << 20


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 hex of a file's bytes, read in HASH_CHUNK pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def bytes_key(data: bytes) -> str:
    """"sha256:<hex>" of a media file's bytes already in memory: the key MediaKeys.key gives that
    file, without reading it again."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def pixels_key(array: Any) -> str:
    """"pixels:<sha256 hex>" of a decoded image: its dtype, shape and bytes (numpy uint8 [H, W, 3]
    or anything with .numpy(): a CPU tensor)."""
    import numpy as np

    a = np.ascontiguousarray(array.numpy() if hasattr(array, "numpy") else array)
    h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
    h.update(a.tobytes())
    return "pixels:" + h.hexdigest()


@dataclass(frozen=True)
class ConditionKey:
    """What a cached condition is a function of (module docstring). Hashable; equal keys may
    share one encoded condition."""

    prompt: str
    media: tuple[str, ...] = ()
    size: tuple[int, int] | None = None


class MediaKeys:
    """Content keys of media files, each file read once while it is unchanged: a file's key is
    cached under (path, size, mtime), so a rollout that shows one source to a group, rollout
    after rollout, reads it once; a file rewritten in place is read again. At most `max_entries`
    files are remembered (the oldest forgotten first)."""

    def __init__(self, max_entries: int = 65536):
        self.max_entries = int(max_entries)
        self._keys: dict[tuple[str, int, int], str] = {}

    def key(self, source: Any) -> str:
        """A source's content key: a path (str / PathLike) -> "sha256:<hex>" of its bytes; a
        decoded image -> pixels_key. FileNotFoundError naming the path when it is gone."""
        if isinstance(source, (str, os.PathLike)):
            path = os.path.abspath(os.fspath(source))
            st = os.stat(path)
            stamp = (path, st.st_size, st.st_mtime_ns)
            if stamp not in self._keys:
                if len(self._keys) >= self.max_entries:
                    self._keys.pop(next(iter(self._keys)))
                self._keys[stamp] = "sha256:" + file_sha256(path)
            return self._keys[stamp]
        return pixels_key(source)

    def condition_key(self, prompt: str, media: Iterable[Any] = (),
                      size: tuple[int, int] | None = None) -> ConditionKey:
        """condition_key with each source turned into its content key (paths read once)."""
        return condition_key(prompt, [self.key(m) for m in media], size)


def condition_key(prompt: str, media_keys: Iterable[str] = (), size: tuple[int, int] | None = None) -> ConditionKey:
    """The cache key of the condition of `prompt` shown the sources whose content keys are
    `media_keys` (in order), resized to `size` = (height, width). Without media the size does not
    change the condition (a text encoder sees no pixels), so it is dropped: a text-only key is the
    prompt alone, as the t2i cache has it."""
    media = tuple(media_keys)
    for m in media:
        if not isinstance(m, str) or not m.startswith(("sha256:", "pixels:")):
            raise ValueError(f"condition_key: {str(m)[:80]!r} is not a media content key (sha256:... / pixels:...); "
                             "turn sources into keys with MediaKeys.key")
    if not media:
        return ConditionKey(prompt)
    if size is None or len(size) != 2 or not all(isinstance(v, int) and v > 0 for v in size):
        raise ValueError(f"condition_key: a condition with media needs the (height, width) the media are resized "
                         f"to, got {size!r}")
    return ConditionKey(prompt, media, (int(size[0]), int(size[1])))
