"""Scorers loaded by dotpath (--reward-scorer-path, --eval-reward-scorers) in tests: ones that
misbehave on purpose, a plain function, and one that records when it is built and called."""

from __future__ import annotations

import json
import os

import torch

#: the file CountingScorer appends its events to (one JSON object a line)
COUNTING_LOG_ENV = "COUNTING_SCORER_LOG"


class NeverFiniteScorer:
    """Declares the colour component but never produces a finite score for it."""

    components = ("color",)
    required_tracks = ("image",)

    def __init__(self, model_path: str | None = None, device: str = "cpu"):
        self.device = device

    def score(self, images, prompts, metadata):
        return {"color": torch.full((len(prompts),), float("nan"))}

    __call__ = score


def redness(images, prompts, metadata):
    """A plain function as a scorer: the red channel's mean in [0, 1], minus the others'."""
    return [float(a[..., 0].mean() - a[..., 1:].mean()) / 255 for a in images.uint8]


class CountingScorer:
    """Component "counted" (the image mean); appends {"event": "built" | "score", ...} to the file
    named by $COUNTING_SCORER_LOG, so a test can count builds and calls in another process."""

    components = ("counted",)
    required_tracks = ("image",)

    def __init__(self, model_path: str | None = None, device: str = "cpu"):
        self._log({"event": "built", "device": str(device)})

    def _log(self, event: dict) -> None:
        with open(os.environ[COUNTING_LOG_ENV], "a") as f:
            f.write(json.dumps({**event, "pid": os.getpid()}) + "\n")

    def score(self, images, prompts, metadata):
        self._log({"event": "score", "images": len(images)})
        return {"counted": torch.tensor([float(a.mean()) / 255 for a in images.uint8])}

    __call__ = score
