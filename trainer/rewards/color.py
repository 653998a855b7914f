"""A prompt-conditioned colour reward: how much of the image is the colour the prompt names.

The prompt names a colour from a fixed palette (`color_palette()`); the target colour c is the
palette colour whose name occurs first in the prompt (whole words, case-insensitive), or
metadata["color"] when given. With every pixel p in [0, 1]^3 (RGB):

    color = mean_pixels exp(-||p - c||^2 / (2 sigma^2)),   sigma = COLOR_SIGMA = 0.5

in (0, 1]: 1 for an image entirely of colour c. sigma is half the RGB cube's side, so the kernel
never saturates: a mid-grey pixel still scores 0.22 against red and a blue one 0.02, and moving
any pixel towards c always raises the reward. That smoothness is what lets a tiny random model
learn it from a few dozen rollouts; the prompt dependence is what makes the model condition on
its text. A prompt that names no palette colour scores NaN, which fails its group (counted in
reward/failed_groups), rather than a silent 0.

`ObjectColorScorer` (component "object_color") asks the same of the object rather than of the
whole image, for images of one object on a plain background (the demo's): the background colour
b is the per-channel median of the image's one-pixel border, the object is the set F of pixels
p with ||p - b|| > OBJECT_THRESHOLD = 0.3, and

    object_color = sum_{p in F} exp(-||p - c||^2 / (2 s^2)) / max(|F|, OBJECT_MIN_AREA * H * W)

with s = OBJECT_SIGMA = 0.5 and OBJECT_MIN_AREA = 0.1. It is 1 for an object entirely of colour
c covering at least a tenth of the image, and close to 0 for an object of another palette colour
(yellow against red: 0.14), so a person can check the figure by looking at the picture. The
floor on the area keeps a policy from scoring by shrinking the object to a few right pixels; an
empty image scores 0.

It also reports "color_match", the yes/no a person gives looking at the picture: 1 when more
than half of the object (of max(|F|, OBJECT_MIN_AREA * H * W) pixels) is nearer to c than to any
other of HUES, the six saturated corners of the RGB cube (plus c itself if it is not one), else
0. The comparison is among hues only because a small model's colours are washed out: its red is
pinkish and would be lost to a nearer off-palette anchor (purple, orange, white), though a person
calls it red. Its batch mean is the fraction of images whose shape is the named colour: for a
model that paints one of the six at random whatever the prompt says, 1/6. Being
a step function it gives no gradient of closeness, so it is for reading (give it no
--reward-component-weights entry and it is logged but not trained on).

No weights; runs on the CPU tensors of the batch.
"""

from __future__ import annotations

import math
import re

import torch

from trainer.rewards.base import ImageBatch

#: kernel width in RGB units (see the module docstring)
COLOR_SIGMA = 0.5
#: object_color's kernel width, background distance and minimum area (module docstring)
OBJECT_SIGMA = 0.5
OBJECT_THRESHOLD = 0.3
OBJECT_MIN_AREA = 0.1

# Saturated, well separated RGB anchors; order is the order prompts cycle through.
_PALETTE: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.0, 0.0),
    "green": (0.0, 1.0, 0.0),
    "blue": (0.0, 0.0, 1.0),
    "yellow": (1.0, 1.0, 0.0),
    "cyan": (0.0, 1.0, 1.0),
    "magenta": (1.0, 0.0, 1.0),
    "orange": (1.0, 0.5, 0.0),
    "purple": (0.5, 0.0, 0.5),
    "white": (1.0, 1.0, 1.0),
    "black": (0.0, 0.0, 0.0),
}

#: the six saturated corners of the RGB cube, the anchors of color_match (module docstring)
HUES = ("red", "green", "blue", "yellow", "cyan", "magenta")

_COLOR_RE = re.compile(r"\b(" + "|".join(_PALETTE) + r")\b", re.IGNORECASE)

_DEFAULT_SUBJECTS = ("ball", "cube", "car", "flower", "bird", "house", "cup", "kite")


def color_palette() -> dict[str, tuple[float, float, float]]:
    """The palette: colour name -> RGB in [0, 1] (a copy; insertion order is stable)."""
    return dict(_PALETTE)


def color_prompts(n: int, subjects: tuple[str, ...] = _DEFAULT_SUBJECTS) -> list[str]:
    """n deterministic prompts "a <colour> <subject>", cycling through every palette colour
    before repeating one, so any n >= len(palette) covers the whole palette evenly."""
    names = list(_PALETTE)
    return [f"a {names[i % len(names)]} {subjects[(i // len(names)) % len(subjects)]}" for i in range(n)]


def target_color(prompt: str, metadata: dict | None = None) -> str | None:
    """The palette colour a prompt asks for: metadata["color"] if set, else the first palette
    word in the prompt; None if neither names one."""
    if metadata and metadata.get("color"):
        name = str(metadata["color"]).lower()
        if name not in _PALETTE:
            raise ValueError(f"metadata color {name!r} is not in the palette {list(_PALETTE)}")
        return name
    m = _COLOR_RE.search(prompt or "")
    return m.group(1).lower() if m else None


def _kernel(image: torch.Tensor, rgb: tuple[float, float, float], sigma: float) -> torch.Tensor:
    """[H, W] exp(-||p - rgb||^2 / (2 sigma^2)) of image [3, H, W]."""
    c = torch.tensor(rgb, dtype=torch.float32).view(3, 1, 1)
    d2 = (image.float() - c).pow(2).sum(dim=0)
    return torch.exp(-d2 / (2.0 * sigma * sigma))


def color_reward(image: torch.Tensor, rgb: tuple[float, float, float], sigma: float = COLOR_SIGMA) -> float:
    """mean over pixels of exp(-||p - rgb||^2 / (2 sigma^2)); image fp32 [3, H, W] in [0, 1]."""
    return float(_kernel(image, rgb, sigma).mean())


def object_mask(image: torch.Tensor, threshold: float = OBJECT_THRESHOLD) -> torch.Tensor:
    """[H, W] bool: the pixels farther than `threshold` (RGB distance) from the background, the
    per-channel median of the image's one-pixel border; image fp32 [3, H, W] in [0, 1]."""
    img = image.float()
    border = torch.cat([img[:, 0], img[:, -1], img[:, 1:-1, 0], img[:, 1:-1, -1]], dim=1)  # [3, perimeter]
    background = border.median(dim=1).values.view(3, 1, 1)
    return (img - background).pow(2).sum(dim=0).sqrt() > threshold


def object_color_reward(image: torch.Tensor, rgb: tuple[float, float, float], sigma: float = OBJECT_SIGMA,
                        threshold: float = OBJECT_THRESHOLD, min_area: float = OBJECT_MIN_AREA) -> float:
    """sum over object pixels of exp(-||p - rgb||^2 / (2 sigma^2)) / max(#object, min_area * H * W)
    (module docstring); image fp32 [3, H, W] in [0, 1]."""
    mask = object_mask(image, threshold)
    floor = min_area * mask.numel()
    return float(_kernel(image, rgb, sigma)[mask].sum() / max(float(mask.sum()), floor))


def object_color_match(image: torch.Tensor, name: str, threshold: float = OBJECT_THRESHOLD,
                       min_area: float = OBJECT_MIN_AREA) -> float:
    """1.0 when more than half of the object (area floored at min_area * H * W) has palette
    colour `name` as its nearest of HUES (and `name`), else 0.0 (module docstring)."""
    mask = object_mask(image, threshold)
    names = [name] + [h for h in HUES if h != name]
    anchors = torch.tensor([_PALETTE[n] for n in names], dtype=torch.float32)  # [K, 3], `name` first
    pixels = image.float().permute(1, 2, 0)[mask]  # [|F|, 3]
    hits = float((torch.cdist(pixels, anchors).argmin(dim=1) == 0).sum())
    return float(hits > 0.5 * max(float(mask.sum()), min_area * mask.numel()))


class ColorScorer:
    """Component "color": the prompt-named colour's share of the image (module docstring)."""

    components = ("color",)
    required_tracks = ("image",)

    def __init__(self, model_path: str | None = None, device: str = "cpu"):
        del model_path, device  # no weights; a handful of CPU ops per image

    def score(self, images: ImageBatch, prompts: list[str], metadata: list[dict]) -> dict[str, torch.Tensor]:
        out = []
        for img, prompt, md in zip(images.float_tensors, prompts, metadata):
            name = target_color(prompt, md)
            out.append(math.nan if name is None else color_reward(img, _PALETTE[name]))
        return {"color": torch.tensor(out, dtype=torch.float32)}

    __call__ = score


class ObjectColorScorer:
    """Component "object_color": how much of the object is the colour the prompt names, for one
    object on a plain background (module docstring). Short name: none; use the dotpath
    trainer.rewards.color.ObjectColorScorer."""

    components = ("object_color", "color_match")
    required_tracks = ("image",)

    def __init__(self, model_path: str | None = None, device: str = "cpu"):
        del model_path, device  # no weights

    def score(self, images: ImageBatch, prompts: list[str], metadata: list[dict]) -> dict[str, torch.Tensor]:
        closeness, match = [], []
        for img, prompt, md in zip(images.float_tensors, prompts, metadata):
            name = target_color(prompt, md)
            closeness.append(math.nan if name is None else object_color_reward(img, _PALETTE[name]))
            match.append(math.nan if name is None else object_color_match(img, name))
        return {"object_color": torch.tensor(closeness, dtype=torch.float32),
                "color_match": torch.tensor(match, dtype=torch.float32)}

    __call__ = score
