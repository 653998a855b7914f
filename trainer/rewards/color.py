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

`ShapeColorScorer` (the demo's reward) asks it of one shape on a plain background, for prompts
"a <colour> <shape>" (shapes: SHAPES). Its component "named_color" is, for image pixels p in
[0, 1]^3 of an H x W image:

    background b: the per-channel median of the image's one-pixel border
    object F:     the pixels with ||p - b|| > OBJECT_THRESHOLD = 0.3; M its largest
                  8-connected component (stray specks are not the shape)
    share:        sum_{p in M} q_c(p) / max(|F|, OBJECT_MIN_AREA * H * W),
                  q_c(p) = softmax_k(-||p - h_k||^2 / (2 HUE_SIGMA^2))[c] over the six HUES h_k
    size:         min(1, OBJECT_MAX_AREA * H * W / |F|)^2
    shape:        clip((IoU(M, T) - SHAPE_IOU_ZERO) / (SHAPE_IOU_FULL - SHAPE_IOU_ZERO), 0, 1)
    named_color = share * size * shape

with HUE_SIGMA = 0.25, OBJECT_MIN_AREA = 0.1, OBJECT_MAX_AREA = 0.4, SHAPE_IOU_ZERO = 0.5 and
SHAPE_IOU_FULL = 0.7. T is the prompt's shape drawn (draw_shape) with M's area and centroid.
In words: 1 for one compact shape, no larger than 40% of the picture, entirely in the named
colour; 0 for a shape of another of the six hues, for a ragged blob or scattered pieces (IoU
<= 0.5 with the named shape) or for an empty picture. q_c is a posterior among the six hues,
not a distance to c, so a colour between two hues (orange between red and yellow) scores at
most about 1/2 for either: painting every shape one compromise colour gains nothing over a
pure hue. The size and shape factors are what keep the shape: a colour push that spreads
colour over the background, or breaks the outline, is paid for (on the demo, RL with the
colour term alone turned the shapes into blobs filling most of the picture). The demo's base
draws its shapes at IoU ~0.72 with their template on average, so full marks from 0.7 leave its
own drawing nearly unpenalised. The factor checks the outline, not the kind of shape: a circle
and a square of the same area overlap at ~0.83, a circle and a triangle at ~0.70, so at 32x32
those are not told apart (the base already draws the shape it is asked for; the reward is
about the colour). A prompt that names no shape drops the shape factor; one that names no
palette colour scores NaN.

Two more components are for reading (give them no --reward-component-weights entry):
"color_match", the yes/no a person gives looking at the picture, 1 when more than half of
max(|F|, OBJECT_MIN_AREA * H * W) is in M and nearest to c among the HUES and the object is no
larger than OBJECT_MAX_AREA of the picture (for a model that paints one of the six hues at
random, 1/6 on average); and "shape_iou", IoU(M, T) itself (0 when the prompt names no shape).

No weights; runs on the CPU tensors of the batch.
"""

from __future__ import annotations

import math
import re

import torch

from trainer.rewards.base import ImageBatch

#: kernel width in RGB units (see the module docstring)
COLOR_SIGMA = 0.5
#: ShapeColorScorer's constants (module docstring)
HUE_SIGMA = 0.25
OBJECT_THRESHOLD = 0.3
OBJECT_MIN_AREA = 0.1
OBJECT_MAX_AREA = 0.4
SHAPE_IOU_ZERO = 0.5
SHAPE_IOU_FULL = 0.7

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

#: the six saturated corners of the RGB cube, among which ShapeColorScorer reads a colour
HUES = ("red", "green", "blue", "yellow", "cyan", "magenta")
#: the shapes ShapeColorScorer knows; draw_shape draws them (tools/make_demo_base.py's data too)
SHAPES = ("circle", "square", "triangle")

_COLOR_RE = re.compile(r"\b(" + "|".join(_PALETTE) + r")\b", re.IGNORECASE)

_SHAPE_RE = re.compile(r"\b(" + "|".join(SHAPES) + r")\b", re.IGNORECASE)

_DEFAULT_SUBJECTS = ("ball", "cube", "car", "flower", "bird", "house", "cup", "kite")


def color_palette() -> dict[str, tuple[float, float, float]]:
    """The palette: colour name -> RGB in [0, 1] (a copy; insertion order is stable)."""
    return dict(_PALETTE)


def color_prompts(n: int, subjects: tuple[str, ...] = _DEFAULT_SUBJECTS) -> list[str]:
    """n deterministic prompts "a <colour> <subject>", cycling through every palette colour
    before repeating one, so any n >= len(palette) covers the whole palette evenly."""
    names = list(_PALETTE)
    return [f"a {names[i % len(names)]} {subjects[(i // len(names)) % len(subjects)]}" for i in range(n)]


def metadata_color(metadata: dict | None) -> str | None:
    """metadata["color"] lower-cased when set (ValueError unless it is a palette name), else None:
    an explicit colour in a sample's metadata outranks any colour word in its prompt."""
    if metadata and metadata.get("color"):
        name = str(metadata["color"]).lower()
        if name not in _PALETTE:
            raise ValueError(f"metadata color {name!r} is not in the palette {list(_PALETTE)}")
        return name
    return None


def target_color(prompt: str, metadata: dict | None = None) -> str | None:
    """The palette colour a prompt asks for: metadata["color"] if set, else the first palette
    word in the prompt; None if neither names one."""
    name = metadata_color(metadata)
    if name is not None:
        return name
    m = _COLOR_RE.search(prompt or "")
    return m.group(1).lower() if m else None


def color_reward(image: torch.Tensor, rgb: tuple[float, float, float], sigma: float = COLOR_SIGMA) -> float:
    """mean over pixels of exp(-||p - rgb||^2 / (2 sigma^2)); image fp32 [3, H, W] in [0, 1]."""
    c = torch.tensor(rgb, dtype=torch.float32).view(3, 1, 1)
    d2 = (image.float() - c).pow(2).sum(dim=0)
    return float(torch.exp(-d2 / (2.0 * sigma * sigma)).mean())


def target_shape(prompt: str) -> str | None:
    """The first word of SHAPES in the prompt (whole words, case-insensitive), or None."""
    m = _SHAPE_RE.search(prompt or "")
    return m.group(1).lower() if m else None


def draw_shape(shape: str, rgb: tuple[float, float, float], size: int, cx: float, cy: float,
               radius: float) -> torch.Tensor:
    """[3, size, size] fp32 in [0, 1]: `shape` of colour `rgb` on black, centred at (cx, cy)
    pixels with half-extent `radius` (a circle of that radius; a square of side 1.6 radius; an
    upright triangle from radius above the centre to 0.75 radius below it, 2 radius wide at its
    base). Pixel centres sit at integer + 0.5."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; one of {SHAPES}")
    c = torch.arange(size, dtype=torch.float32) + 0.5
    y, x = torch.meshgrid(c - cy, c - cx, indexing="ij")
    if shape == "circle":
        inside = x * x + y * y <= radius * radius
    elif shape == "square":
        inside = (x.abs() <= 0.8 * radius) & (y.abs() <= 0.8 * radius)
    else:
        top, bottom = -radius, 0.75 * radius
        inside = (y >= top) & (y <= bottom) & (x.abs() <= radius * (y - top) / (bottom - top))
    return inside.float().unsqueeze(0) * torch.tensor(rgb, dtype=torch.float32).view(3, 1, 1)


def shape_template(shape: str, area: float, cx: float, cy: float, size: int) -> torch.Tensor:
    """[size, size] bool: `shape` as draw_shape draws it, with `area` pixels and its centroid at
    (cx, cy) (a triangle's centroid sits radius / 6 below draw_shape's centre)."""
    if shape == "circle":
        radius = math.sqrt(area / math.pi)
    elif shape == "square":
        radius = math.sqrt(area) / 1.6
    else:
        radius = math.sqrt(area / 1.75)
        cy -= radius / 6
    return draw_shape(shape, (1.0, 1.0, 1.0), size, cx, cy, radius)[0] > 0


def object_mask(image: torch.Tensor, threshold: float = OBJECT_THRESHOLD) -> torch.Tensor:
    """[H, W] bool: the pixels farther than `threshold` (RGB distance) from the background, the
    per-channel median of the image's one-pixel border; image fp32 [3, H, W] in [0, 1]."""
    img = image.float()
    border = torch.cat([img[:, 0], img[:, -1], img[:, 1:-1, 0], img[:, 1:-1, -1]], dim=1)  # [3, perimeter]
    background = border.median(dim=1).values.view(3, 1, 1)
    return (img - background).pow(2).sum(dim=0).sqrt() > threshold


def largest_component(mask: torch.Tensor) -> torch.Tensor:
    """[H, W] bool: the largest 8-connected component of `mask` (ties: the one holding the
    lowest pixel index); an empty mask comes back empty. Labels spread by 3x3 max-pooling until
    they settle: at most one pass per pixel of the longest path, a few dozen on a 32x32 image."""
    if not mask.any():
        return mask.clone()
    h, w = mask.shape
    keep = mask.float()
    labels = torch.arange(h * w, 0, -1, dtype=torch.float32).view(h, w) * keep  # unique, > 0 inside
    while True:
        spread = torch.nn.functional.max_pool2d(labels[None, None], 3, stride=1, padding=1)[0, 0] * keep
        if torch.equal(spread, labels):
            break
        labels = spread
    ids, counts = labels[mask].unique(return_counts=True)
    best = counts == counts.max()
    return labels == ids[best].max()


def shape_iou(mask: torch.Tensor, shape: str) -> float:
    """IoU of `mask` with shape_template(shape) of the same area and centroid; 0 when empty."""
    if not mask.any():
        return 0.0
    ys, xs = mask.nonzero(as_tuple=True)
    t = shape_template(shape, float(mask.sum()), float(xs.float().mean()) + 0.5, float(ys.float().mean()) + 0.5,
                       mask.shape[0])
    return float((t & mask).sum()) / float((t | mask).sum())


def hue_posterior(pixels: torch.Tensor, name: str, sigma: float = HUE_SIGMA) -> torch.Tensor:
    """[N] q_c(p): the softmax over HUES of -||p - h||^2 / (2 sigma^2), at hue `name`, for
    pixels [N, 3] fp32 in [0, 1]. `name` may be a palette colour outside HUES: it then joins
    the anchors."""
    names = [name] + [h for h in HUES if h != name]
    anchors = torch.tensor([_PALETTE[n] for n in names], dtype=torch.float32)
    return torch.softmax(-torch.cdist(pixels.float(), anchors).pow(2) / (2.0 * sigma * sigma), dim=1)[:, 0]


def shape_color_scores(image: torch.Tensor, color: str, shape: str | None) -> dict[str, float]:
    """named_color, color_match and shape_iou of one image fp32 [3, H, W] in [0, 1] for the
    palette colour `color` and the shape `shape` (None: no shape factor; module docstring)."""
    mask = object_mask(image)
    main = largest_component(mask)
    n_obj, total = float(mask.sum()), mask.numel()
    floor = max(n_obj, OBJECT_MIN_AREA * total)
    pixels = image.float().permute(1, 2, 0)[main]  # [|M|, 3]
    share = float(hue_posterior(pixels, color).sum()) / floor
    size = min(1.0, OBJECT_MAX_AREA * total / max(n_obj, 1.0)) ** 2
    iou = shape_iou(main, shape) if shape is not None else 0.0
    shape_f = 1.0 if shape is None else min(1.0, max(0.0, (iou - SHAPE_IOU_ZERO) / (SHAPE_IOU_FULL - SHAPE_IOU_ZERO)))
    names = [color] + [h for h in HUES if h != color]
    anchors = torch.tensor([_PALETTE[n] for n in names], dtype=torch.float32)
    hits = float((torch.cdist(pixels, anchors).argmin(dim=1) == 0).sum()) if len(pixels) else 0.0
    match = float(hits > 0.5 * floor and n_obj <= OBJECT_MAX_AREA * total)
    return {"named_color": share * size * shape_f, "color_match": match, "shape_iou": iou}


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


class ShapeColorScorer:
    """Components "named_color" (trained), "color_match" and "shape_iou" (read): one shape of the
    named kind in the named colour on a plain background (module docstring). Short name: none;
    use the dotpath trainer.rewards.color.ShapeColorScorer."""

    components = ("named_color", "color_match", "shape_iou")
    required_tracks = ("image",)

    def __init__(self, model_path: str | None = None, device: str = "cpu"):
        del model_path, device  # no weights; ~10 ms of CPU per 32x32 image

    def score(self, images: ImageBatch, prompts: list[str], metadata: list[dict]) -> dict[str, torch.Tensor]:
        out: dict[str, list[float]] = {c: [] for c in self.components}
        for img, prompt, md in zip(images.float_tensors, prompts, metadata):
            color = target_color(prompt, md)
            scores = dict.fromkeys(self.components, math.nan) if color is None else \
                shape_color_scores(img, color, target_shape(prompt))
            for c in self.components:
                out[c].append(scores[c])
        return {c: torch.tensor(v, dtype=torch.float32) for c, v in out.items()}

    __call__ = score
