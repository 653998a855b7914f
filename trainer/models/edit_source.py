"""Source images of an editing record: opened once, bounded, and resized by one rule.

The engine encodes a source at the candidate's output size (height x width) through the VAE, and
the loop hands the scorers the very same pixels (`source_pixels`), so a preservation reward
compares the edit with what the model was conditioned on, not with another resize of the file.
"""

from __future__ import annotations

import io
import os
import stat
from dataclasses import dataclass
from typing import Any

# the metadata keys of an editing candidate's sources, and how a sidecar records them, are the
# prompt records' contract (trainer.data); the families and the rollout read them from here too
from trainer.data import SOURCE_PATHS_KEY, SOURCE_REFS_KEY, recorded_metadata  # noqa: F401

#: the largest source accepted, in pixels: a decompression bomb is refused before it is decoded
MAX_SOURCE_PIXELS = 4096 * 4096

#: the longest side of a source over its shortest: Qwen-Image-Edit shows the VL encoder the source
#: at ~384 x 384 pixels of the same aspect, sides rounded to 32 (edit_geometry.area_dimensions),
#: and Qwen2-VL's image processor refuses an aspect over 200:1; up to about 275:1 the rounded
#: sides stay within it, so 200:1 holds for every family (FLUX.1-Kontext resizes to the output)
MAX_SOURCE_ASPECT = 200

#: the largest source file read, in bytes. A source is read whole, once, and hashed and decoded
#: from those bytes, so its size is bounded before it is read (a 4096 x 4096 RGBA image at 16 bits
#: a channel is 128 MiB uncompressed; no image within MAX_SOURCE_PIXELS needs more)
MAX_SOURCE_BYTES = 256 << 20


@dataclass(frozen=True)
class Source:
    """A source file read once: its content key (core.media_key's "sha256:<hex>" of the bytes,
    what the engine's condition cache keys it by) and its RGB PIL image, both from the same bytes,
    so the key always names the pixels the model was shown even if the file changes meanwhile."""

    path: str
    key: str
    image: Any


def read_source_bytes(path: str | os.PathLike) -> bytes:
    """The bytes of a source file, from one open. FileNotFoundError naming the file when it is
    gone; ValueError naming it when it is no regular file (a FIFO, a device, a /proc file) or holds
    more than MAX_SOURCE_BYTES (checked from its size before reading, and by reading at most one
    byte more, for a file that grows meanwhile)."""
    from trainer.core.media_key import media_file_problem

    path = os.fspath(path)
    problem = os.path.exists(path) and media_file_problem(path, max_bytes=1 << 62)  # the size: below
    if problem:  # a /proc file, a FIFO or a device is refused from its status, never read
        raise ValueError(f"source image {problem}")
    try:  # non-blocking: a FIFO swapped in since is refused below rather than waited on
        f = open(path, "rb", opener=lambda p, flags: os.open(p, flags | os.O_NONBLOCK))
    except FileNotFoundError:
        raise FileNotFoundError(f"source image {path} does not exist; check the record's images with "
                                "tools/inspect_data.py --decode-media") from None
    with f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"source image {path} is not a regular file")
        size = st.st_size
        data = f.read(MAX_SOURCE_BYTES + 1) if size <= MAX_SOURCE_BYTES else b""
    if size > MAX_SOURCE_BYTES or len(data) > MAX_SOURCE_BYTES:
        raise ValueError(f"source image {path} is {max(size, len(data))} bytes, more than {MAX_SOURCE_BYTES}; "
                         "downscale or recompress it (tools/prepare_data.py keeps the file as it is)")
    return data


def geometry_problem(width: int, height: int) -> str | None:
    """Why no rollout can use a width x height source, or None: more than MAX_SOURCE_PIXELS pixels,
    or a longer side more than MAX_SOURCE_ASPECT times the shorter one."""
    if width * height > MAX_SOURCE_PIXELS:
        return f"is {width}x{height}, more than {MAX_SOURCE_PIXELS} pixels; downscale it"
    if max(width, height) > MAX_SOURCE_ASPECT * min(width, height):
        return (f"is {width}x{height}, an aspect ratio over {MAX_SOURCE_ASPECT}:1 that the edit families' "
                "condition resize cannot take; crop it")
    return None


def _check_geometry(im: Any, path: str) -> None:
    why = geometry_problem(im.width, im.height)
    if why:
        raise ValueError(f"source image {path} {why} (tools/prepare_data.py keeps the file as it is)")


def decode_source(data: bytes, path: str | os.PathLike) -> Any:
    """The RGB PIL image of a source file's bytes `data`, fully decoded; `path` names it in
    errors. ValueError naming it when it is not one of image_file.ACCEPTED_FORMATS, does not
    decode, or its header's size fails geometry_problem (checked before the pixels are decoded)."""
    from trainer.core.image_file import ImageFileError, open_image

    path = os.fspath(path)
    try:
        with open_image(data, f"source image {path}", max_pixels=MAX_SOURCE_PIXELS) as im:
            _check_geometry(im, path)
            return im.convert("RGB")
    except ImageFileError as e:
        raise ValueError(f"{e}; check it with tools/inspect_data.py --decode-media") from None
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - any decoder failure names the file
        raise ValueError(f"source image {path} does not decode ({type(e).__name__}: {e}); check it with "
                         "tools/inspect_data.py --decode-media") from None


def source_problem(path: str | os.PathLike) -> str | None:
    """Why the source file `path` cannot be used, from its size and its header only (no pixel is
    decoded: cheap enough for every source of a prompt file before a run), or None: missing, over
    MAX_SOURCE_BYTES, no regular file (core.media_key.media_file_problem: judged from its status,
    never opened), not an accepted format, or a size geometry_problem refuses."""
    from trainer.core.media_key import media_file_problem

    path = os.fspath(path)
    problem = media_file_problem(path, MAX_SOURCE_BYTES)
    if problem:
        return problem.removeprefix(path + " ")
    return header_problem(path)


def header_problem(source: str | os.PathLike | bytes) -> str | None:
    """Why a source (its path or its file's bytes) cannot be used, from its header only, or None:
    not one of image_file.ACCEPTED_FORMATS, a header the decoder refuses, or geometry_problem."""
    from trainer.core.image_file import ImageFileError, open_image

    try:
        with open_image(source, "it", max_pixels=MAX_SOURCE_PIXELS) as im:
            return geometry_problem(im.width, im.height)
    except ImageFileError as e:
        return str(e).removeprefix("it ")
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"


def source_file_problems(ds: Any) -> list[str]:
    """"file:line: source image PATH <why>" for every source of the PromptDataset `ds` that
    source_problem refuses, each file's header read once (no pixel decoded)."""
    seen: dict[str, str | None] = {}
    out = []
    for rec, line in zip(ds.records, ds.lines):
        for p in rec.images:
            if p not in seen:
                seen[p] = source_problem(p)
            if seen[p]:
                out.append(f"{ds.path}:{line}: source image {p} {seen[p]}")
    return out


def open_source_image(path: str | os.PathLike) -> Any:
    """The RGB PIL image of a source file, fully read (read_source_bytes, then decode_source:
    their errors)."""
    return decode_source(read_source_bytes(path), path)


def load_source(path: str | os.PathLike) -> Source:
    """The Source of a file: read once (read_source_bytes), its content key hashed from and its
    image decoded from those bytes (decode_source); their errors."""
    from trainer.core.media_key import bytes_key

    path = os.fspath(path)
    data = read_source_bytes(path)
    return Source(path, bytes_key(data), decode_source(data, path))


def resized_source(image: Any, height: int, width: int) -> Any:
    """`image` resized to width x height with Lanczos (diffusers' VaeImageProcessor.resize, the
    stock edit pipelines' resize for the VAE input); unchanged when it has that size."""
    from PIL import Image

    if image.size == (int(width), int(height)):
        return image
    return image.resize((int(width), int(height)), resample=Image.Resampling.LANCZOS)


def image_pixels(image: Any, height: int, width: int) -> Any:
    """uint8 [height, width, 3] numpy array of a source's RGB PIL image as the engine's VAE saw it
    (resized_source)."""
    import numpy as np

    return np.asarray(resized_source(image, height, width), dtype=np.uint8).copy()


def source_pixels(path: str | os.PathLike, height: int, width: int) -> Any:
    """uint8 [height, width, 3] numpy array of the source file as the engine's VAE saw it."""
    return image_pixels(open_source_image(path), height, width)


def with_source_pixels(metadata: list[dict], sizes: list[tuple[int, int]], key: str,
                       sources: dict[str, Source] | None = None) -> list[dict]:
    """Copies of the candidates' metadata with `key` (the rewards' SOURCE_IMAGES_KEY) holding the
    uint8 pixels of their SOURCE_PATHS_KEY files at each candidate's (height, width), each file
    decoded once per call and the array shared by the candidates of its record, and the paths
    themselves left out (a remote scorer is sent metadata: it gets the pixels, never this host's
    file names); metadata without sources is returned as it is.

    sources: path -> the Source the engine read for this rollout (NativeEngine.last_sources):
    a path found there is not read again, its pixels are the engine's image resized by the same
    rule, so the scorers see what the model was shown even if the file changed since."""
    sources = sources or {}
    cache: dict[tuple[str, int, int], Any] = {}
    out = []
    for md, (h, w) in zip(metadata, sizes):
        paths = (md or {}).get(SOURCE_PATHS_KEY)
        if not paths:
            out.append({k: v for k, v in md.items() if k != SOURCE_REFS_KEY} if md else md)
            continue
        pixels = []
        for p in paths:
            if (p, h, w) not in cache:
                cache[p, h, w] = image_pixels(sources[p].image, h, w) if p in sources else source_pixels(p, h, w)
            pixels.append(cache[p, h, w])
        out.append({**{k: v for k, v in md.items() if k not in (SOURCE_PATHS_KEY, SOURCE_REFS_KEY)}, key: pixels})
    return out
