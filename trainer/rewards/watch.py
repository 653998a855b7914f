"""The reward-hacking watch: cheap image statistics on every rollout, held-out scores at eval,
and one rule that says when the trained reward has probably stopped meaning what it should.

Statistics, per image (uint8 RGB, x = value / 255), then averaged over the rollout:
  dark_fraction        pixels whose brightest channel is < 16 / 255 (blanked, black backgrounds)
  saturated_fraction   pixels with HSV saturation > 0.9 and value > 0.25 (over-saturated colour)
  color_entropy        entropy in bits of the 4-bit-per-channel colour histogram (0 .. 12)
  edge_density         pixels whose luminance gradient |dx| + |dy| exceeds 0.1 (grid artifacts, noise)
  high_freq_energy     mean |4-neighbour Laplacian| of the luminance (fine-grained texture)
  jpeg_bytes_per_pixel JPEG size at quality 95 / (H * W)
and per prompt group
  group_diversity      mean pairwise RMS distance between the group's 16x16 thumbnails (mode collapse -> 0)

The rule (HackingWatch.update, once per rollout; thresholds are the --hacking-* flags):
  baseline   the first B = --hacking-baseline-rollouts rollouts: each statistic's mean and its
             per-image (per-group for diversity) std; the trained reward's mean and its mean
             within-group std; for each held-out eval score, the first eval's mean and per-image std.
  rising     mean trained reward over the last B rollouts - baseline mean > --hacking-reward-rise
             x baseline within-group std (the trained reward is the weighted sum of the
             weighted components' means).
  drift      a statistic: |mean - baseline mean| / baseline std > --hacking-stat-threshold;
             a held-out score (its latest eval): (baseline - latest) / baseline std > --hacking-heldout-drop.
  suspect    rising and at least one drift, on --hacking-patience consecutive rollouts (after the
             baseline): reward/hacking_suspect = 1 and the drifting signals are named.
Stds below 1e-6 count as 1e-6, so a statistic that did not vary at all in the baseline flags any move.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import torch

STATS = ("dark_fraction", "saturated_fraction", "color_entropy", "edge_density", "high_freq_energy",
         "jpeg_bytes_per_pixel")
DIVERSITY = "group_diversity"
THUMB = 16
_EPS = 1e-6


def image_statistics(image: np.ndarray) -> dict[str, float]:
    """The per-image statistics of the module docstring for one uint8 [H, W, 3] image: the numpy
    reference that `pixel_statistics` (batched, torch) must reproduce.

    Every float step is float32 and one IEEE operation at a time (no fused or reordered
    arithmetic, thresholds cast to float32), so the torch version makes the same rounding at
    every step and the thresholded counts agree pixel for pixel."""
    x = image.astype(np.float32) / np.float32(255.0)
    mx, mn = x.max(axis=2), x.min(axis=2)
    sat = np.where(mx > 0, (mx - mn) / np.maximum(mx, np.float32(_EPS)), np.float32(0.0))
    q = (image >> 4).astype(np.int32)
    counts = np.bincount((q[..., 0] * 256 + q[..., 1] * 16 + q[..., 2]).ravel(), minlength=4096)
    p = counts[counts > 0] / counts.sum()
    lum = _luminance(x[..., 0], x[..., 1], x[..., 2], _LUMA)
    dx, dy = np.abs(np.diff(lum, axis=1))[:-1, :], np.abs(np.diff(lum, axis=0))[:, :-1]
    lap = np.abs(4 * lum[1:-1, 1:-1] - lum[:-2, 1:-1] - lum[2:, 1:-1] - lum[1:-1, :-2] - lum[1:-1, 2:])
    h, w = image.shape[:2]
    return {
        "dark_fraction": float((mx < _DARK).mean()),
        "saturated_fraction": float(((sat > _SAT) & (mx > _VALUE)).mean()),
        "color_entropy": float(-(p * np.log2(p)).sum()),
        "edge_density": float(((dx + dy) > _EDGE).mean()) if dx.size else 0.0,
        "high_freq_energy": float(lap.mean()) if lap.size else 0.0,
        "jpeg_bytes_per_pixel": jpeg_size(image) / float(h * w),
    }


# thresholds as float32 values, the dtype both implementations compare in
_DARK, _SAT, _VALUE, _EDGE = (np.float32(v) for v in (16 / 255, 0.9, 0.25, 0.1))
_LUMA = tuple(np.float32(v) for v in (0.299, 0.587, 0.114))


def _luminance(r, g, b, weights):
    """0.299 r + 0.587 g + 0.114 b (weights: those three as float32 scalars of r's kind), as three
    products and two sums left to right: written out rather than as a matrix product, whose BLAS
    kernel may fuse or reorder them, so numpy and torch round alike."""
    return r * weights[0] + g * weights[1] + b * weights[2]


def jpeg_size(image: np.ndarray) -> int:
    """Bytes of the uint8 [H, W, 3] image as a PIL JPEG at quality 95."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="JPEG", quality=95)
    return buf.tell()


def thumbnail(image: np.ndarray) -> np.ndarray:
    """16x16 RGB in [0, 1], flattened (the diversity figure's representation)."""
    from PIL import Image

    small = Image.fromarray(image).resize((THUMB, THUMB), Image.BILINEAR)
    return (np.asarray(small, dtype=np.float32) / 255.0).reshape(-1)


#: pixels per chunk of `pixel_statistics`. On a GPU: bounds its temporaries (~40 bytes a pixel)
#: beside the models. On the CPU: small enough that a chunk's float planes stay in cache, which
#: is what makes these memory-bound operations fast there (measured ~5x against one big batch).
_CHUNK_PIXELS = {"cpu": 1 << 18, "other": 1 << 23}


def pixel_statistics(images: torch.Tensor) -> dict[str, torch.Tensor]:
    """dark_fraction, saturated_fraction, color_entropy, edge_density and high_freq_energy of the
    module docstring for a batch: uint8 [B, 3, H, W] on any device -> {name: fp32 CPU [B]}.

    Computed where the images are (the GPU in a run), only the B-row results move. The same
    float32 operations in the same order as `image_statistics`, so the counts (dark, saturated,
    edge) are identical; the histogram is one bincount over b * 4096 + colour; the entropy
    (float64) and the Laplacian mean (float32 sum) differ from numpy's only by summation order.
    On the CPU it runs on one intra-op thread (see `_one_cpu_thread`)."""
    if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"expected uint8 images [B, 3, H, W], got {images.dtype} {tuple(images.shape)}")
    b, _, h, w = images.shape
    cpu = images.device.type == "cpu"
    step = max(1, _CHUNK_PIXELS["cpu" if cpu else "other"] // max(1, h * w))
    with _one_cpu_thread(cpu):
        rows = [_pixel_statistics(images[i:i + step]) for i in range(0, b, step)]
        out = {k: torch.cat([r[k] for r in rows]) if rows else torch.zeros(0) for k in _PIXEL_STATS}
    return {k: v.to("cpu", torch.float32) for k, v in out.items()}


@contextlib.contextmanager
def _one_cpu_thread(active: bool):
    """torch's intra-op threads set to 1 for the block (restored after) when `active`.

    The chunks' operations are too small for a parallel region to pay off, and where cores are
    shared (CPU ranks, a busy host) every region's barrier waits for a descheduled thread:
    measured on a loaded 2-core host, 32 images at 384 x 384 took 0.45-1.8 s on 2 threads and
    0.09 s on 1."""
    saved = torch.get_num_threads()
    if not active or saved == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


_PIXEL_STATS = STATS[:5]


def _pixel_statistics(u8: torch.Tensor) -> dict[str, torch.Tensor]:
    b, _, h, w = u8.shape
    f32 = torch.float32

    def scalar(v) -> torch.Tensor:  # a float32 operand, so every comparison and product is float32
        return torch.tensor(float(v), dtype=f32, device=u8.device)

    # max / min on the uint8 values, then /255: the conversion is exact and monotone, so this is
    # numpy's max of the converted values
    mx = u8.amax(dim=1).to(f32) / scalar(255.0)
    mn = u8.amin(dim=1).to(f32) / scalar(255.0)
    sat = torch.where(mx > 0, (mx - mn) / torch.maximum(mx, scalar(_EPS)), scalar(0.0))
    n = float(h * w)
    out = {"dark_fraction": (mx < scalar(_DARK)).flatten(1).sum(1).double() / n,
           "saturated_fraction": ((sat > scalar(_SAT)) & (mx > scalar(_VALUE))).flatten(1).sum(1).double() / n}
    del sat, mn
    q = (u8 >> 4).long()
    idx = (q[:, 0] * 256 + q[:, 1] * 16 + q[:, 2]).flatten(1)
    idx += torch.arange(b, device=u8.device).unsqueeze(1) * 4096
    counts = torch.bincount(idx.flatten(), minlength=b * 4096).view(b, 4096).double()
    del q, idx
    p = counts / counts.sum(1, keepdim=True)
    out["color_entropy"] = -torch.where(p > 0, p * torch.log2(p), torch.zeros_like(p)).sum(1)
    x = [u8[:, c].to(f32) / scalar(255.0) for c in range(3)]
    lum = _luminance(*x, [scalar(v) for v in _LUMA])
    del x
    if h > 1 and w > 1:
        dx = (lum[:, :, 1:] - lum[:, :, :-1]).abs()[:, :-1, :]
        dy = (lum[:, 1:, :] - lum[:, :-1, :]).abs()[:, :, :-1]
        out["edge_density"] = ((dx + dy) > scalar(_EDGE)).flatten(1).sum(1).double() / float((h - 1) * (w - 1))
        del dx, dy
    else:
        out["edge_density"] = torch.zeros(b, dtype=torch.float64, device=u8.device)
    if h > 2 and w > 2:
        c = lum[:, 1:-1, 1:-1]
        lap = (4 * c - lum[:, :-2, 1:-1] - lum[:, 2:, 1:-1] - lum[:, 1:-1, :-2] - lum[:, 1:-1, 2:]).abs()
        out["high_freq_energy"] = lap.flatten(1).mean(1)
    else:
        out["high_freq_energy"] = torch.zeros(b, dtype=f32, device=u8.device)
    return out


def _encode_one(a: np.ndarray) -> tuple[float, np.ndarray]:
    """(jpeg_bytes_per_pixel, thumbnail) of one uint8 [H, W, 3] array. Serial on purpose: on a
    2-core host a thread pool saved ~5 ms of ~40 ms for 32 encodes at 384 x 384, and beside the
    pixel statistics it cost more than that (the two contend for the GIL between torch ops)."""
    return jpeg_size(a) / float(a.shape[0] * a.shape[1]), thumbnail(a)


def per_image_statistics(images: "Sequence[np.ndarray] | torch.Tensor") -> dict[str, torch.Tensor]:
    """{statistic: fp32 [B]} plus "thumb_<i>" columns of the thumbnails, so that the whole dict
    travels through the same per-candidate gather as the reward components.

    images: uint8 [H, W, 3] numpy arrays (stacked into one batch when their shapes agree, one
    batch each otherwise), or one uint8 tensor [B, 3, H, W] on any device (its pixel statistics
    computed there; the JPEG encodes and thumbnails take its HWC copy on the CPU)."""
    if isinstance(images, torch.Tensor):
        if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"expected uint8 images [B, 3, H, W], got {images.dtype} {tuple(images.shape)}")
        batches = [images]
        arrays = list(images.permute(0, 2, 3, 1).contiguous().cpu().numpy())
    else:
        arrays = list(images)
        for i, a in enumerate(arrays):
            if a.dtype != np.uint8 or a.ndim != 3 or a.shape[2] != 3:
                raise ValueError(f"image {i}: expected uint8 [H, W, 3], got {a.dtype} {tuple(a.shape)}")
        groups = [arrays] if len({a.shape for a in arrays}) == 1 else [[a] for a in arrays]
        batches = [torch.from_numpy(np.stack(g)).permute(0, 3, 1, 2) for g in groups]
    cols = [pixel_statistics(t) for t in batches]
    rows = [_encode_one(a) for a in arrays]
    out = {k: torch.cat([c[k] for c in cols]) if cols else torch.zeros(0) for k in _PIXEL_STATS}
    out["jpeg_bytes_per_pixel"] = torch.tensor([r[0] for r in rows], dtype=torch.float32)
    thumbs = torch.from_numpy(np.stack([r[1] for r in rows])) if rows else torch.zeros(0, 3 * THUMB ** 2)
    out = {k: out[k] for k in STATS}
    for i in range(thumbs.shape[1]):
        out[f"thumb_{i:03d}"] = thumbs[:, i].contiguous()
    return out


def group_diversity(thumbs: torch.Tensor, group_size: int) -> torch.Tensor:
    """Mean pairwise RMS distance within each group: thumbs [G*n, D] -> [G] (0 for n == 1)."""
    g = thumbs.double().view(-1, group_size, thumbs.shape[-1])
    if group_size < 2:
        return torch.zeros(g.shape[0], dtype=torch.float64)
    d = torch.cdist(g, g) / thumbs.shape[-1] ** 0.5
    return d.sum(dim=(1, 2)) / (group_size * (group_size - 1))


def rollout_statistics(per_image: Mapping[str, torch.Tensor], group_size: int) -> tuple[dict[str, float], dict[str, float]]:
    """Global per-image columns (after the gather) -> ({stat: mean}, {stat: std}) incl. diversity."""
    means, stds = {}, {}
    for k in STATS:
        v = per_image[k].double()
        means[k], stds[k] = float(v.mean()), float(v.std(unbiased=False))
    thumbs = torch.stack([per_image[k] for k in sorted(per_image) if k.startswith("thumb_")], dim=1)
    div = group_diversity(thumbs, group_size)
    means[DIVERSITY], stds[DIVERSITY] = float(div.mean()), float(div.std(unbiased=False))
    return means, stds


@dataclass
class WatchSettings:
    baseline_rollouts: int = 5
    reward_rise: float = 0.5
    stat_threshold: float = 3.0
    heldout_drop: float = 1.0
    patience: int = 2

    @classmethod
    def from_config(cls, reward) -> "WatchSettings":
        return cls(int(reward.hacking_baseline_rollouts), float(reward.hacking_reward_rise),
                   float(reward.hacking_stat_threshold), float(reward.hacking_heldout_drop), int(reward.hacking_patience))


@dataclass
class HackingWatch:
    """The rule of the module docstring. Feed it every rollout's figures with `update`; it is a
    pure function of what it was fed, so every rank that feeds the same figures agrees."""

    settings: WatchSettings = field(default_factory=WatchSettings)
    rewards: list[float] = field(default_factory=list)
    reward_spread: list[float] = field(default_factory=list)
    stats: list[dict[str, float]] = field(default_factory=list)
    stat_stds: list[dict[str, float]] = field(default_factory=list)
    heldout_base: dict[str, tuple[float, float]] = field(default_factory=dict)
    heldout_latest: dict[str, float] = field(default_factory=dict)
    streak: int = 0
    signals: list[str] = field(default_factory=list)

    def observe_eval(self, means: Mapping[str, float], stds: Mapping[str, float]) -> None:
        """Held-out eval scores (name -> mean, per-image std); the first eval of each is its baseline."""
        for name, mean in means.items():
            if not np.isfinite(mean):
                continue
            self.heldout_base.setdefault(name, (float(mean), max(float(stds.get(name, 0.0)), _EPS)))
            self.heldout_latest[name] = float(mean)

    def update(self, trained_reward: float, within_group_std: float, stat_means: Mapping[str, float] | None = None,
               stat_stds: Mapping[str, float] | None = None) -> dict[str, float]:
        """One rollout's trained reward (weighted raw mean), its mean within-group std and the
        image statistics; returns the reward/* watch metrics. `signals` names what drifted."""
        s = self.settings
        self.rewards.append(float(trained_reward))
        self.reward_spread.append(float(within_group_std))
        self.stats.append(dict(stat_means or {}))
        self.stat_stds.append(dict(stat_stds or {}))
        b = s.baseline_rollouts
        out: dict[str, float] = {}
        if len(self.rewards) <= b:
            out["reward/hacking_suspect"] = 0.0
            return out
        base_r = float(np.mean(self.rewards[:b]))
        spread = max(float(np.mean(self.reward_spread[:b])), _EPS)
        rise = (float(np.mean(self.rewards[-b:])) - base_r) / spread
        out["reward/watch_trained_rise"] = rise
        drifts: dict[str, float] = {}
        for k in self.stats[0]:
            base = float(np.mean([st[k] for st in self.stats[:b]]))
            std = max(float(np.mean([st.get(k, 0.0) for st in self.stat_stds[:b]])), _EPS)
            drifts[k] = (self.stats[-1][k] - base) / std
            out[f"reward/watch_drift_{k}"] = drifts[k]
        signals = [k for k, d in drifts.items() if abs(d) > s.stat_threshold]
        for name, (base, std) in self.heldout_base.items():
            drop = (base - self.heldout_latest[name]) / std
            out[f"reward/watch_heldout_drop_{name.replace('/', '_')}"] = drop
            if drop > s.heldout_drop:
                signals.append(f"held-out {name}")
        suspect = rise > s.reward_rise and bool(signals)
        self.streak = self.streak + 1 if suspect else 0
        self.signals = signals if suspect else []
        out["reward/hacking_suspect"] = 1.0 if self.streak >= s.patience else 0.0
        return out

    @property
    def suspect(self) -> bool:
        return self.streak >= self.settings.patience

    def message(self) -> str:
        return (f"reward hacking suspected: the trained reward keeps rising (+{self.rewards[-1] - self.rewards[0]:.4g} "
                f"since rollout 0) while {', '.join(self.signals)} moved past its threshold for "
                f"{self.streak} consecutive rollouts (docs/rewards.md, 'Watching for reward hacking')")


def trained_reward(reward) -> tuple[float, float]:
    """(mean weighted raw reward over the valid candidates, mean within-group std of it) of a
    RewardResult; NaN when no group was valid."""
    valid = reward.valid
    if not bool(valid.any()) or not reward.weights:
        return float("nan"), float("nan")
    total = sum(w * reward.components[c].double() for c, w in reward.weights.items())
    return float(total[valid].mean()), float(reward.metrics.get("reward/group_std_mean", float("nan")))


def _as_uint8_batch(images) -> "torch.Tensor | list[np.ndarray]":
    """The loop's candidates -> what per_image_statistics takes, quantised as the PNG writer does.

    Float tensors ([B, 3, H, W], or a list of [3, H, W] of one shape) are quantised where they
    are and stay there as one uint8 [B, 3, H, W] batch; anything else (mixed shapes, PIL images,
    uint8 arrays) goes through ImageBatch.from_any to uint8 [H, W, 3] arrays."""
    from trainer.artifacts import quantize_uint8
    from trainer.rewards.base import ImageBatch

    if isinstance(images, torch.Tensor) and images.ndim == 4 and images.shape[1] == 3:
        return quantize_uint8(images)
    if (isinstance(images, (list, tuple)) and images and all(isinstance(t, torch.Tensor) for t in images)
            and images[0].ndim == 3 and images[0].shape[0] == 3 and len({tuple(t.shape) for t in images}) == 1
            and len({t.device for t in images}) == 1):
        return torch.stack([quantize_uint8(t) for t in images])
    return ImageBatch.from_any(images).uint8


def local_watch_statistics(images) -> dict[str, torch.Tensor]:
    """This rank's half of rollout_watch_metrics, with no collective in it: its images' columns
    (per_image_statistics). The training loop runs it on a worker thread beside the update.

    images: float [3, H, W] tensors in [0, 1] (a list, or stacked [B, 3, H, W]) on any device,
    or what ImageBatch.from_any accepts. Float images are quantised like the PNG writer and their
    pixel statistics computed on their device, so an image scores the same here and from its PNG."""
    return per_image_statistics(_as_uint8_batch(images))


def rollout_watch_metrics(watch: HackingWatch, images, indices: Sequence[int], total: int, group_size: int,
                          reward) -> dict[str, float]:
    """Collective (every rank calls it): this rank's images -> gathered statistics -> the rule.
    Returns reward/stat_<name> (the rollout's means) and the watch's reward/* figures. images:
    as local_watch_statistics takes them."""
    return gathered_watch_metrics(watch, local_watch_statistics(images), indices, total, group_size, reward)


def gathered_watch_metrics(watch: HackingWatch, local: Mapping[str, torch.Tensor], indices: Sequence[int],
                           total: int, group_size: int, reward) -> dict[str, float]:
    """Collective: this rank's columns (local_watch_statistics) gathered over the ranks, then the
    rollout's means and the rule; what rollout_watch_metrics returns."""
    from trainer.rewards.post_process import gather_scores

    means, stds = rollout_statistics(gather_scores(dict(local), indices, total), group_size)
    r, spread = trained_reward(reward)
    m = {f"reward/stat_{k}": v for k, v in means.items()}
    if np.isfinite(r):  # a rollout with no valid group says nothing about the trend
        m.update(watch.update(r, spread, means, stds))
    return m


def parse_eval_scorers(entries: Sequence[str] | None) -> list[tuple[str, str | None]]:
    """--eval-reward-scorers entries 'name' / 'name=/model/dir' -> [(name, model_path or None)]."""
    out = []
    for e in entries or []:
        name, _, path = str(e).partition("=")
        if not name.strip():
            raise ValueError(f"--eval-reward-scorers entry {e!r}: expected 'name' or 'name=/local/model/dir'")
        out.append((name.strip(), path.strip() or None))
    return out
