"""Source-image geometry of the edit families, as the stock diffusers pipelines compute it.

The edit adapters (Qwen-Image-Edit-Plus, FLUX.1-Kontext) must resize the source, lay out the
condition tokens and number their positions exactly as QwenImageEditPlusPipeline /
FluxKontextPipeline do, or a model trained here samples differently in the stock pipeline. These
are those rules as pure functions, checked against the pipelines in tests/test_edit_geometry.py.

Qwen-Image-Edit-Plus (diffusers 0.42): a source of aspect r = width / height is resized twice,
to an area A at the same aspect, each side rounded to a multiple of 32:

    w = round(sqrt(A r) / 32) * 32,   h = round(sqrt(A r) / r / 32) * 32

with A = 384^2 for the image the VL text encoder sees and A = 1024^2 for the one the VAE encodes
(the pipeline's module constants; a recipe may choose others). The DiT's `img_shapes` for one
sample lists the target first, then each source, as (frames = 1, latent h / 2, latent w / 2)
token grids; the condition tokens follow the target tokens in the sequence, and the velocity is
the DiT output over the first h w / 4 tokens only.

FLUX.1-Kontext: the source keeps its own size rounded down to a multiple of 16 (vae scale 8 x
patch 2), or with auto-resize is first replaced by the preferred Kontext resolution whose aspect is
nearest; its packed tokens follow the target's, with position ids (1, row, col) where the target's
are (0, row, col).
"""

from __future__ import annotations

import math

#: QwenImageEditPlusPipeline's CONDITION_IMAGE_SIZE and VAE_IMAGE_SIZE (pixel areas)
QWEN_EDIT_CONDITION_AREA = 384 * 384
QWEN_EDIT_VAE_AREA = 1024 * 1024
#: FluxKontextPipeline's PREFERRED_KONTEXT_RESOLUTIONS, (width, height)
KONTEXT_PREFERRED_RESOLUTIONS = (
    (672, 1568), (688, 1504), (720, 1456), (752, 1392), (800, 1328), (832, 1248), (880, 1184), (944, 1104),
    (1024, 1024), (1104, 944), (1184, 880), (1248, 832), (1328, 800), (1392, 752), (1456, 720), (1504, 688),
    (1568, 672),
)


def area_dimensions(area: int, aspect: float, multiple: int = 32) -> tuple[int, int]:
    """(width, height) of `area` pixels at `aspect` = width / height, each rounded to the nearest
    multiple of `multiple` (the module docstring's formula)."""
    if area <= 0 or aspect <= 0:
        raise ValueError(f"area and aspect must be positive, got {area}, {aspect}")
    width = math.sqrt(area * aspect)
    height = width / aspect
    return round(width / multiple) * multiple, round(height / multiple) * multiple


def qwen_edit_source_sizes(width: int, height: int, condition_area: int = QWEN_EDIT_CONDITION_AREA,
                           vae_area: int = QWEN_EDIT_VAE_AREA) -> dict[str, tuple[int, int]]:
    """{"condition": (w, h) the VL encoder sees, "vae": (w, h) the VAE encodes} for a width x
    height source."""
    aspect = width / height
    return {"condition": area_dimensions(condition_area, aspect), "vae": area_dimensions(vae_area, aspect)}


def qwen_edit_img_shapes(height: int, width: int, vae_sizes: list[tuple[int, int]],
                         vae_scale_factor: int) -> list[tuple[int, int, int]]:
    """One sample's img_shapes: the height x width target, then each source at its VAE size
    (w, h), as (1, latent rows / 2, latent cols / 2) (2 x 2 patches)."""
    f = vae_scale_factor * 2
    return [(1, height // f, width // f), *((1, h // f, w // f) for w, h in vae_sizes)]


def kontext_source_size(width: int, height: int, vae_scale_factor: int = 8,
                        auto_resize: bool = True) -> tuple[int, int]:
    """(w, h) FluxKontextPipeline resizes a width x height source to: the nearest-aspect preferred
    resolution with auto_resize, else its own size; rounded down to multiples of 2 x vae_scale_factor."""
    if auto_resize:
        aspect = width / height
        _, width, height = min((abs(aspect - w / h), w, h) for w, h in KONTEXT_PREFERRED_RESOLUTIONS)
    m = vae_scale_factor * 2
    return width // m * m, height // m * m


def kontext_position_ids(rows: int, cols: int, first: float):
    """float32 [rows * cols, 3] position ids of a packed token grid: (first, row, col) row-major;
    first = 0 for the target, 1 for the source."""
    import torch

    ids = torch.zeros(rows, cols, 3)
    ids[..., 0] = first
    ids[..., 1] = torch.arange(rows)[:, None]
    ids[..., 2] = torch.arange(cols)[None, :]
    return ids.reshape(rows * cols, 3)
