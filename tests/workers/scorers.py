"""Scorers that misbehave on purpose, loaded by dotpath (--reward-scorer-path) in fault tests."""

from __future__ import annotations

import torch


class NeverFiniteScorer:
    """Declares the colour component but never produces a finite score for it."""

    components = ("color",)
    required_tracks = ("image",)

    def __init__(self, model_path: str | None = None, device: str = "cpu"):
        self.device = device

    def score(self, images, prompts, metadata):
        return {"color": torch.full((len(prompts),), float("nan"))}

    __call__ = score
