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
    """The per-image statistics of the module docstring for one uint8 [H, W, 3] image."""
    from PIL import Image

    x = image.astype(np.float32) / 255.0
    mx, mn = x.max(axis=2), x.min(axis=2)
    sat = np.where(mx > 0, (mx - mn) / np.maximum(mx, _EPS), 0.0)
    q = (image >> 4).astype(np.int32)
    counts = np.bincount((q[..., 0] * 256 + q[..., 1] * 16 + q[..., 2]).ravel(), minlength=4096)
    p = counts[counts > 0] / counts.sum()
    lum = x @ np.array([0.299, 0.587, 0.114], dtype=np.float32)
    dx, dy = np.abs(np.diff(lum, axis=1))[:-1, :], np.abs(np.diff(lum, axis=0))[:, :-1]
    lap = np.abs(4 * lum[1:-1, 1:-1] - lum[:-2, 1:-1] - lum[2:, 1:-1] - lum[1:-1, :-2] - lum[1:-1, 2:])
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="JPEG", quality=95)
    h, w = image.shape[:2]
    return {
        "dark_fraction": float((mx < 16 / 255).mean()),
        "saturated_fraction": float(((sat > 0.9) & (mx > 0.25)).mean()),
        "color_entropy": float(-(p * np.log2(p)).sum()),
        "edge_density": float(((dx + dy) > 0.1).mean()) if dx.size else 0.0,
        "high_freq_energy": float(lap.mean()) if lap.size else 0.0,
        "jpeg_bytes_per_pixel": buf.tell() / float(h * w),
    }


def thumbnail(image: np.ndarray) -> np.ndarray:
    """16x16 RGB in [0, 1], flattened (the diversity figure's representation)."""
    from PIL import Image

    small = Image.fromarray(image).resize((THUMB, THUMB), Image.BILINEAR)
    return (np.asarray(small, dtype=np.float32) / 255.0).reshape(-1)


def per_image_statistics(images: Sequence[np.ndarray]) -> dict[str, torch.Tensor]:
    """{statistic: fp32 [B]} plus "thumb_<i>" columns of the thumbnails, so that the whole dict
    travels through the same per-candidate gather as the reward components."""
    rows = [image_statistics(a) for a in images]
    out = {k: torch.tensor([r[k] for r in rows], dtype=torch.float32) for k in STATS}
    thumbs = torch.from_numpy(np.stack([thumbnail(a) for a in images])) if images else torch.zeros(0, 3 * THUMB ** 2)
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


def rollout_watch_metrics(watch: HackingWatch, images, indices: Sequence[int], total: int, group_size: int,
                          reward) -> dict[str, float]:
    """Collective (every rank calls it): this rank's images -> gathered statistics -> the rule.
    Returns reward/stat_<name> (the rollout's means) and the watch's reward/* figures."""
    from trainer.rewards.base import ImageBatch
    from trainer.rewards.post_process import gather_scores

    local = per_image_statistics(ImageBatch.from_any(images).uint8)
    means, stds = rollout_statistics(gather_scores(local, indices, total), group_size)
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
