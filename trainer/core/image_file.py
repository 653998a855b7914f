"""Opening an image file that came from outside the run: only the accepted formats, and the size
bounded from the header before a pixel is decoded.

Pillow identifies a file by its bytes, not its name, and some of its plugins hand the file to
another program (an EPS file is rendered by Ghostscript when its pixels are loaded) or parse
formats nobody here means to read. So every untrusted image file (an edit's source, a folder
tools/score.py scores, the media tools/inspect_data.py decodes, the PNGs tools/demo_grid.py
reads) is opened through `open_image`, which lets Pillow try only ACCEPTED_FORMATS' decoders and
refuses what is larger than its bounds from the header, so a decompression bomb or an animation
of thousands of frames is refused before it costs memory.

No torch here: the data tools and preflight use it before anything heavy is imported.
"""

from __future__ import annotations

import io
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

#: the Pillow formats an untrusted image file may have; a file of any other format (by its bytes,
#: whatever its name) is refused before any decoder but these runs
ACCEPTED_FORMATS = ("PNG", "JPEG", "WEBP")
#: ACCEPTED_FORMATS as the messages name them
ACCEPTED_NAMES = "PNG, JPEG or WebP"
#: the most pixels (width x height) of one image or frame: the reward server's per-image bound
MAX_IMAGE_PIXELS = 4096 * 4096
#: frames read from one video file (an animated WebP, the format rollouts write): 4x Wan2.1's 81,
#: so a file cannot make a tool hold unbounded frames
MAX_VIDEO_FRAMES = 324
#: pixels (frames x width x height) decoded from one video file: two 81-frame 720 x 1280 videos,
#: about 450 MB as uint8 RGB, checked from the header before a frame is decoded
MAX_VIDEO_PIXELS = 2 * 81 * 720 * 1280


class ImageFileError(ValueError):
    """An image file refused by its format, its header's size, or its decoder; the message names
    the file."""


@dataclass(frozen=True)
class ImageHeader:
    """What an image file's header says, read without decoding its pixels."""

    format: str
    width: int
    height: int
    #: frames of an animation (animated WebP / APNG), 1 for a still image
    frames: int

    @property
    def pixels(self) -> int:
        """width x height x frames: what decoding every frame as RGB costs, x 3 bytes."""
        return self.width * self.height * self.frames


def _fp(source: Any) -> Any:
    return io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else os.fspath(source)


#: leading bytes of the accepted formats, to tell a damaged file from one of another format
_SIGNATURES = ((b"\x89PNG\r\n\x1a\n", "PNG"), (b"\xff\xd8\xff", "JPEG"))


def _signature(source: Any) -> str | None:
    """The accepted format `source`'s first bytes claim, or None."""
    try:
        if isinstance(source, (bytes, bytearray)):
            head = bytes(source[:12])
        else:
            with open(source, "rb") as f:
                head = f.read(12)
    except OSError:
        return None
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WebP"
    return next((fmt for magic, fmt in _SIGNATURES if head.startswith(magic)), None)


def _label(source: Any, name: Any) -> str:
    if name is not None:
        return os.fspath(name)
    return "image" if isinstance(source, (bytes, bytearray)) else os.fspath(source)


@contextmanager
def open_image(source: Any, name: Any = None, *, max_pixels: int = MAX_IMAGE_PIXELS,
               max_frames: int | None = None, max_total_pixels: int | None = None) -> Iterator[Any]:
    """The PIL image of `source` (a path or the file's bytes), header read and checked, pixels not
    yet decoded; `name` names it in errors (default: the path). ImageFileError when its bytes are
    not one of ACCEPTED_FORMATS, a frame has more than `max_pixels` pixels, it has more than
    `max_frames` frames, or frames x pixels exceeds `max_total_pixels` (None: not checked; a caller
    that decodes only the first frame leaves both unset)."""
    from PIL import Image, UnidentifiedImageError

    name = _label(source, name)
    try:
        im = Image.open(_fp(source), formats=ACCEPTED_FORMATS)
    except UnidentifiedImageError:
        claimed = _signature(source)
        if claimed:
            raise ImageFileError(f"{name} does not decode (it starts as a {claimed} file but its header is "
                                 "damaged)") from None
        raise ImageFileError(f"{name} is not a {ACCEPTED_NAMES} image (the accepted formats, judged by the "
                             "file's bytes, whatever its name); convert it to PNG") from None
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - a header the decoder refuses names the file
        raise ImageFileError(f"{name} does not decode as an image ({type(e).__name__}: {e})") from None
    with im:
        header = header_of(im)
        if header.width * header.height > max_pixels:
            raise ImageFileError(f"{name} is {header.width}x{header.height}, more than {max_pixels} pixels; "
                                 "downscale it")
        if max_total_pixels is not None and header.pixels > max_total_pixels:
            raise ImageFileError(f"{name} holds {header.frames} frames of {header.width}x{header.height}, "
                                 f"{header.pixels} pixels in all, more than {max_total_pixels}")
        if max_frames is not None and header.frames > max_frames:
            raise ImageFileError(f"{name} holds {header.frames} frames, more than {max_frames}")
        yield im


def header_of(im: Any) -> ImageHeader:
    """The ImageHeader of an opened PIL image (nothing decoded)."""
    return ImageHeader(str(im.format), int(im.width), int(im.height), int(getattr(im, "n_frames", 1) or 1))


def decode_rgb(source: Any, name: Any = None, *, max_pixels: int = MAX_IMAGE_PIXELS) -> Any:
    """The RGB PIL image of `source`'s first frame, fully decoded (open_image's checks first).
    ImageFileError naming the file when its pixels do not decode (a truncated file)."""
    label = _label(source, name)
    with open_image(source, name, max_pixels=max_pixels) as im:
        try:
            return im.convert("RGB")
        except Exception as e:  # noqa: BLE001 - any decoder failure names the file
            raise ImageFileError(f"{label} does not decode ({type(e).__name__}: {e})") from None
