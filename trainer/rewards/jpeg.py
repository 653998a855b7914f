"""JPEG compressibility / incompressibility rewards (DDPO's "aesthetic-free" toy rewards).

size_kb = len(JPEG(image, quality=95)) / 1000
compressibility = -size_kb  (prefers flat, low-detail images)
incompressibility = +size_kb  (prefers busy, high-frequency images)

Neither depends on the prompt and neither needs weights; both run on the CPU (PIL's encoder).
"""

from __future__ import annotations

import io

import torch

from trainer.rewards.base import ImageBatch

#: JPEG quality used to measure the size (DDPO's value)
JPEG_QUALITY = 95


def jpeg_size_kb(pil_image, quality: int = JPEG_QUALITY) -> float:
    """Size in kB (1000 bytes) of `pil_image` encoded as JPEG at `quality`."""
    buf = io.BytesIO()
    pil_image.save(buf, format="JPEG", quality=quality)
    return buf.tell() / 1000.0


class _JpegScorer:
    required_tracks = ("image",)
    _sign = 1.0
    components: tuple[str, ...] = ()

    def __init__(self, model_path: str | None = None, device: str = "cpu"):
        # No weights; the encoder is PIL's on the CPU whatever `device` is.
        del model_path, device

    def score(self, images: ImageBatch, prompts: list[str], metadata: list[dict]) -> dict[str, torch.Tensor]:
        sizes = torch.tensor([jpeg_size_kb(im) for im in images.pil], dtype=torch.float32)
        return {self.components[0]: self._sign * sizes}

    __call__ = score


class JpegCompressibilityScorer(_JpegScorer):
    """Component "jpeg_compressibility" = -JPEG size in kB (quality 95)."""

    components = ("jpeg_compressibility",)
    _sign = -1.0


class JpegIncompressibilityScorer(_JpegScorer):
    """Component "jpeg_incompressibility" = +JPEG size in kB (quality 95)."""

    components = ("jpeg_incompressibility",)
    _sign = 1.0
