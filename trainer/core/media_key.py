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

import hashlib
import os
from dataclasses import dataclass
from typing import Iterable

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
