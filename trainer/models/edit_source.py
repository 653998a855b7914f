"""Source images of an editing record: opened once, bounded, and resized by one rule.

The engine encodes a source at the candidate's output size (height x width) through the VAE, and
the loop hands the scorers the very same pixels (`source_pixels`), so a preservation reward
compares the edit with what the model was conditioned on, not with another resize of the file.
"""

from __future__ import annotations

import os
from typing import Any

#: the prompt-metadata key under which an editing candidate carries its source files (absolute
#: paths, record order): the sidecar's reference to the sources, and where the loop reads the
#: pixels the scorers get under SOURCE_IMAGES_KEY
SOURCE_PATHS_KEY = "source_paths"

#: the largest source accepted, in pixels: a decompression bomb is refused before it is decoded
MAX_SOURCE_PIXELS = 4096 * 4096


def open_source_image(path: str | os.PathLike) -> Any:
    """The RGB PIL image of a source file, fully read. FileNotFoundError naming the file when it
    is gone; ValueError naming it when it does not decode or has more than MAX_SOURCE_PIXELS
    pixels (checked from its header, before the pixels are decoded)."""
    from PIL import Image

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"source image {path} does not exist; check the record's images with "
                                "tools/inspect_data.py --decode-media")
    try:
        with Image.open(path) as im:
            if im.width * im.height > MAX_SOURCE_PIXELS:
                raise ValueError(f"source image {path} is {im.width}x{im.height}, more than {MAX_SOURCE_PIXELS} "
                                 "pixels; downscale it (tools/prepare_data.py keeps the file as it is)")
            return im.convert("RGB")
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - any decoder failure names the file
        raise ValueError(f"source image {path} does not decode ({type(e).__name__}: {e}); check it with "
                         "tools/inspect_data.py --decode-media") from None


def resized_source(image: Any, height: int, width: int) -> Any:
    """`image` resized to width x height with Lanczos (diffusers' VaeImageProcessor.resize, the
    stock edit pipelines' resize for the VAE input); unchanged when it has that size."""
    from PIL import Image

    if image.size == (int(width), int(height)):
        return image
    return image.resize((int(width), int(height)), resample=Image.Resampling.LANCZOS)


def source_pixels(path: str | os.PathLike, height: int, width: int) -> Any:
    """uint8 [height, width, 3] numpy array of the source file as the engine's VAE saw it."""
    import numpy as np

    return np.asarray(resized_source(open_source_image(path), height, width), dtype=np.uint8).copy()


def with_source_pixels(metadata: list[dict], sizes: list[tuple[int, int]], key: str) -> list[dict]:
    """Copies of the candidates' metadata with `key` (the rewards' SOURCE_IMAGES_KEY) holding the
    uint8 pixels of their SOURCE_PATHS_KEY files at each candidate's (height, width), each file
    decoded once per call and the array shared by the candidates of its record, and the paths
    themselves left out (a remote scorer is sent metadata: it gets the pixels, never this host's
    file names); metadata without sources is returned as it is."""
    cache: dict[tuple[str, int, int], Any] = {}
    out = []
    for md, (h, w) in zip(metadata, sizes):
        paths = (md or {}).get(SOURCE_PATHS_KEY)
        if not paths:
            out.append(md)
            continue
        pixels = []
        for p in paths:
            if (p, h, w) not in cache:
                cache[p, h, w] = source_pixels(p, h, w)
            pixels.append(cache[p, h, w])
        out.append({**{k: v for k, v in md.items() if k != SOURCE_PATHS_KEY}, key: pixels})
    return out
