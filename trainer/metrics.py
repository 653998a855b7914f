"""Metrics: TensorBoard scalars and images, a one-line console summary per rollout.

Every series shares one x-axis, the rollout id. Only rank 0 writes; the other ranks hold a
logger that does nothing, so call sites need no rank checks.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

logger = logging.getLogger(__name__)

# What the console line shows, in order, when present (name in the line, series name).
_CONSOLE = (
    ("loss", "train/loss"),
    ("clip", "train/clip_fraction"),
    ("kl", "train/approx_kl"),
    ("gnorm", "train/grad_norm"),
    ("lr", "train/lr"),
    ("ver", "train/policy_version"),
    ("step_s", "perf/step_time"),
)


class MetricsLogger:
    """TensorBoard under `log_dir` on rank 0; a no-op elsewhere."""

    def __init__(self, log_dir: str | Path | None, rank: int = 0, console_keys: Sequence[tuple[str, str]] = _CONSOLE):
        self.enabled = rank == 0 and log_dir is not None
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.console_keys = console_keys
        self.history: list[dict[str, float]] = []
        self._writer = None
        if self.enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._writer = SummaryWriter(str(self.log_dir))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items() if _is_number(v)}
        self.history.append({"step": step, **clean})
        for name, value in clean.items():
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def log_image_grid(self, step: int, tag: str, images: Sequence[Any], captions: Sequence[str]) -> None:
        """A grid of candidate images ([3, H, W] floats in [0, 1]) with their captions as text."""
        if not self.enabled or not images:
            return
        grid = image_grid(images)
        self._writer.add_image(tag, grid, step, dataformats="HWC")
        self._writer.add_text(tag + "/captions", "\n\n".join(f"{i}: {c}" for i, c in enumerate(captions)), step)
        self._writer.flush()

    def console_line(self, rollout_id: int, metrics: dict[str, Any], components: Sequence[str] = ()) -> str:
        parts = [f"rollout {rollout_id}"]
        keys = [(c, f"reward/{c}_mean") for c in components] + list(self.console_keys)
        for short, key in keys:
            if key in metrics and _is_number(metrics[key]):
                v = float(metrics[key])
                parts.append(f"{short}={v:.4g}")
        failed = metrics.get("reward/failed_groups")
        if _is_number(failed) and float(failed) > 0:
            # a failed group trains nothing: the line must not look like a healthy step
            total = float(failed) + float(metrics.get("reward/num_groups", 0) or 0)
            parts.insert(1, f"FAILED groups={int(failed)}/{int(total)}")
        return " | ".join(parts)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _is_number(v: Any) -> bool:
    try:
        float(v)
    except (TypeError, ValueError):
        return False
    return True


def image_grid(images: Sequence[Any], cols: int | None = None) -> np.ndarray:
    """Tile [3, H, W] float images (torch or numpy, values in [0, 1]) into one HWC uint8 array."""
    arrs = []
    for im in images:
        a = im.detach().float().cpu().numpy() if hasattr(im, "detach") else np.asarray(im, dtype=np.float32)
        arrs.append(np.clip(a.transpose(1, 2, 0) * 255.0 + 0.5, 0, 255).astype(np.uint8))
    h = max(a.shape[0] for a in arrs)
    w = max(a.shape[1] for a in arrs)
    cols = cols or min(len(arrs), 4)
    rows = (len(arrs) + cols - 1) // cols
    out = np.zeros((rows * h, cols * w, 3), dtype=np.uint8)
    for i, a in enumerate(arrs):
        r, c = divmod(i, cols)
        out[r * h: r * h + a.shape[0], c * w: c * w + a.shape[1]] = a
    return out


def read_scalars(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """All scalar series of a TensorBoard directory: {tag: [(step, value), ...]}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def mean_over(values: Iterable[float]) -> float:
    vals = list(values)
    return float(sum(vals) / len(vals)) if vals else float("nan")
