"""Video artifacts a person can watch: one animated WebP per candidate beside the group's
sidecar, and a frame-strip PNG where a viewer cannot play video (TensorBoard's image tab).

Layout (trainer/artifacts.py's, one more file kind per candidate)::

    <root>/<task>/rollout_<7 digits>/group_<8 digits>_sample_<4 digits>.webp

so retention (`prune_stale_artifacts`) and the stale-attempt clean-up (`prepare_rollout_dir`)
treat videos exactly as images: they live and die with their rollout directory.

Why animated WebP. Pillow, already a dependency, encodes it with no new package; MP4 would need
imageio-ffmpeg (a ~68 MB ffmpeg binary in the wheel) or PyAV (FFmpeg libraries, ~30-60 MB), a
native decoder/encoder surface this project does not otherwise carry. WebP plays in every
current browser and in VS Code / most image viewers, loops, and at quality 80 a 33-frame 240 x 416
clip of smooth content is tens of KB. The encoding is deterministic: the same frames, fps and
quality give the same bytes (libwebp has no timestamps or randomness in its output), which the
tests pin. One property to know: the WebP animation encoder stores consecutive identical frames
as one frame of the summed duration, so a clip with repeated frames may hold fewer frames than
it was given; the playing time (sum of durations) is always exactly num_frames / fps.

TensorBoard can only play video through moviepy (not a dependency); `frame_strip` lays a few
evenly spaced frames side by side as one image for `add_image` instead, and `view_strip` sizes
such a strip for a person to read: a few frames, each at a height a caption sits under.
"""

from __future__ import annotations

import io
from pathlib import Path

import torch

from trainer.artifacts import atomic_write_bytes, quantize_uint8, rollout_dir, write_png
from trainer.video import sample_frame_indices

#: Wan2.1 generates at 16 frames per second (its sample_fps; diffusers' examples export at 16)
DEFAULT_FPS = 16
#: lossy WebP quality (0-100); 80 keeps a generated clip watchable at a few KB per frame
DEFAULT_QUALITY = 80
#: libwebp's largest canvas side
WEBP_MAX_SIDE = 16383
#: a clip as TensorBoard shows it (view_strip): this many evenly spaced frames, each brought to a
#: height in VIEW_HEIGHT (a 32 px tiny clip enlarged to 128, a 240 x 416 one shrunk to 128 x 222)
#: and at most VIEW_MAX_WIDTH wide, so a frame is readable and a strip holds at most 4 x 128 x 256
#: pixels
VIEW_FRAMES = 4
VIEW_HEIGHT = (128, 128)
VIEW_MAX_WIDTH = 256


def video_name(group_index: int, slot: int) -> str:
    return f"group_{int(group_index):08d}_sample_{int(slot):04d}.webp"


def video_path(root, task: str, rollout_id: int, group_index: int, slot: int, *, eval: bool = False) -> Path:
    """<root>/<task>/rollout_<id>/group_<g>_sample_<k>.webp (eval: under <root>/eval/<task>)."""
    return rollout_dir(root, task, rollout_id, eval=eval) / video_name(group_index, slot)


def _check_frames(frames: torch.Tensor, what: str) -> None:
    if not isinstance(frames, torch.Tensor) or frames.dim() != 4 or frames.shape[1] != 3 or frames.shape[0] < 1:
        shape = tuple(frames.shape) if isinstance(frames, torch.Tensor) else type(frames).__name__
        raise ValueError(f"{what}: frames must be a float tensor [F >= 1, 3, H, W] in [0, 1], got {shape}")
    if not torch.isfinite(frames).all():
        raise ValueError(f"{what}: frames hold NaN or inf values; the decoder output is broken, not a video")


def frames_to_uint8(frames: torch.Tensor) -> torch.Tensor:
    """[F, 3, H, W] float in [0, 1] -> [F, H, W, 3] uint8 (clamped, rounded), on CPU; the same
    quantisation as the PNG writer's."""
    _check_frames(frames, "frames_to_uint8")
    return quantize_uint8(frames.float()).permute(0, 2, 3, 1).cpu().contiguous()


def frame_durations_ms(num_frames: int, fps: float) -> list[int]:
    """Integer per-frame durations (WebP stores milliseconds) whose running sum stays within half a
    millisecond of the exact i * 1000 / fps: 16 fps gives 62, 63, 63, 62, ... instead of 62 ms
    throughout (which would play 0.8% fast)."""
    if not (isinstance(fps, (int, float)) and not isinstance(fps, bool) and 0 < fps <= 1000):
        raise ValueError(f"fps must be a number in (0, 1000], got {fps!r}")
    edges = [round(i * 1000.0 / fps) for i in range(int(num_frames) + 1)]
    return [max(1, b - a) for a, b in zip(edges, edges[1:])]


def encode_webp(frames: torch.Tensor, *, fps: float = DEFAULT_FPS, quality: int = DEFAULT_QUALITY,
                lossless: bool = False) -> bytes:
    """An animated, looping WebP of `frames` [F, 3, H, W] (float in [0, 1]) at `fps`.

    Deterministic: equal frames and settings give equal bytes. lossless=True stores every pixel
    exactly (several times larger for generated content)."""
    from PIL import Image

    _check_frames(frames, "encode_webp")
    h, w = int(frames.shape[2]), int(frames.shape[3])
    if max(h, w) > WEBP_MAX_SIDE:
        raise ValueError(f"encode_webp: a WebP frame side is at most {WEBP_MAX_SIDE} px, got {h} x {w}")
    if not (isinstance(quality, int) and 0 <= quality <= 100):
        raise ValueError(f"encode_webp: quality must be an integer in [0, 100], got {quality!r}")
    arr = frames_to_uint8(frames).numpy()
    images = [Image.fromarray(a, mode="RGB") for a in arr]
    buf = io.BytesIO()
    # method 4 is libwebp's default speed/size trade-off; spelled out so the bytes do not follow a
    # changed Pillow default
    images[0].save(buf, format="WEBP", save_all=True, append_images=images[1:],
                   duration=frame_durations_ms(len(images), fps), loop=0, quality=quality, method=4,
                   lossless=bool(lossless))
    return buf.getvalue()


def write_video(path, frames: torch.Tensor, *, fps: float = DEFAULT_FPS, quality: int = DEFAULT_QUALITY,
                lossless: bool = False, overwrite: bool = False) -> Path:
    """Atomically write `frames` [F, 3, H, W] as an animated WebP at `path` (never a partial file
    under its real name; an existing file is refused unless `overwrite`)."""
    data = encode_webp(frames, fps=fps, quality=quality, lossless=lossless)
    return atomic_write_bytes(path, data, overwrite=overwrite)


def frame_strip(frames: torch.Tensor, *, count: int = 8, gap: int = 2) -> torch.Tensor:
    """`count` evenly spaced frames (first and last included; every frame when there are fewer)
    side by side, `gap` white pixels apart: a float [3, H, n * W + (n - 1) * gap] image in [0, 1]
    for TensorBoard's add_image or a PNG."""
    _check_frames(frames, "frame_strip")
    if not (isinstance(gap, int) and gap >= 0):
        raise ValueError(f"frame_strip: gap must be an integer >= 0, got {gap!r}")
    picks = [frames[i].detach().float().clamp(0, 1).cpu() for i in sample_frame_indices(int(frames.shape[0]),
                                                                                        count=count)]
    if gap:
        spacer = torch.ones(3, frames.shape[2], gap)
        picks = [t for p in picks for t in (p, spacer)][:-1]
    return torch.cat(picks, dim=2)


def write_frame_strip(path, frames: torch.Tensor, *, count: int = 8, gap: int = 2, overwrite: bool = False) -> Path:
    """Atomically write frame_strip(frames) as an 8-bit RGB PNG."""
    return write_png(path, frame_strip(frames, count=count, gap=gap), overwrite=overwrite)


def view_size(height: int, width: int, *, heights: tuple[int, int] = VIEW_HEIGHT,
              max_width: int = VIEW_MAX_WIDTH) -> tuple[int, int]:
    """(h, w) of a height x width frame as view_strip shows it: the height brought into `heights`
    (enlarged when below, shrunk when above), then both shrunk if the width passes `max_width`;
    the aspect ratio is kept (to the pixel)."""
    scale = min(max(heights[0] / height, 1.0), heights[1] / height)
    scale = min(scale, max_width / width)
    return max(1, round(height * scale)), max(1, round(width * scale))


def view_strip(frames: torch.Tensor, *, count: int = VIEW_FRAMES, gap: int = 2) -> torch.Tensor:
    """frame_strip of `count` frames, each resized to view_size first: a float [3, h, n * w +
    (n - 1) * gap] image in [0, 1]. Enlarging is nearest-neighbour, so a tiny clip's pixels stay
    as they are; shrinking averages (area), so detail does not alias."""
    _check_frames(frames, "view_strip")
    h, w = view_size(int(frames.shape[2]), int(frames.shape[3]))
    picks = frames[sample_frame_indices(int(frames.shape[0]), count=count)].detach().float().clamp(0, 1).cpu()
    if (h, w) != tuple(picks.shape[-2:]):
        mode = "nearest-exact" if h >= picks.shape[2] else "area"
        picks = torch.nn.functional.interpolate(picks, size=(h, w), mode=mode).clamp(0, 1)
    return frame_strip(picks, count=len(picks), gap=gap)
