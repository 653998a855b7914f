"""Where a scorer runs (`--reward-runtime`) and how a rollout's images reach it.

- `cpu`: built and run in this process with device "cpu".
- `colocate`: built and run in this process on the engine's device, sharing the card while the
  actor is offloaded.
- `remote`: every batch is POSTed to `--reward-endpoint` (trainer.rewards.remote).

The device is the scorer's constructor argument and nothing else: a scorer places every tensor
and module it holds on the device it is given (every shipped one does), and the manager changes
no process-wide state (torch.cuda, the environment) to steer a scorer that would pick a device by
itself.

A manager is built once by whoever scores (the trainer at start-up, before the policy loads; a
tool at its start) and held for the run: the scorer's weights load once, when it is built, and
nothing is looked up per rollout.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from trainer.config import RewardConfig
from trainer.rewards.base import (
    ImageBatch,
    RewardError,
    ScorerUnavailable,
    build_scorer,
    check_scores,
    metadata_list,
    resolve_scorer_path,
    scorer_options,
)

RUNTIMES = ("colocate", "cpu", "remote")

logger = logging.getLogger(__name__)

#: images per scorer call when the caller does not say
DEFAULT_SCORE_BATCH_SIZE = 32


@dataclass
class ScoreOutput:
    """Raw scores of a batch of images, in input order."""

    components: dict[str, torch.Tensor]  # component -> fp32 CPU [B]; NaN = not scored
    score_time: float  # seconds spent inside the scorer (or the HTTP exchange) only
    num_samples: int
    #: candidates the scorer could not score, by reason (from scorers that report them)
    failures: dict[str, int] = field(default_factory=dict)

    def failure_metrics(self) -> dict[str, float]:
        """reward/failed_candidates_<reason> (this rank's share)."""
        return {f"reward/failed_candidates_{r}": float(n) for r, n in sorted(self.failures.items())}


class RewardManager:
    """A scorer placed according to `runtime`, scoring in batches of `batch_size`."""

    def __init__(
        self,
        runtime: str,
        scorer_path: str | None = None,
        model_path: str | None = None,
        device: str | torch.device = "cpu",
        endpoint: str | None = None,
        batch_size: int = DEFAULT_SCORE_BATCH_SIZE,
        remote_timeout_s: float = 120.0,
        remote_max_retries: int = 3,
        remote_backoff_s: float = 1.0,
        scorer_options: dict[str, Any] | None = None,
        remote_startup_wait_s: float | None = None,
    ):
        if runtime not in RUNTIMES:
            raise ValueError(f"--reward-runtime={runtime!r} must be one of {RUNTIMES}")
        if batch_size < 1:
            raise ValueError(f"reward batch_size must be >= 1, got {batch_size}")
        self.scorer_path = scorer_path = resolve_scorer_path(scorer_path)
        self.batch_size = int(batch_size)
        if runtime == "remote":
            from trainer.rewards.remote import RemoteScorer

            if not endpoint:
                raise ValueError("--reward-runtime=remote needs --reward-endpoint (e.g. http://host:8000/score)")
            self.device = "remote"
            wait = {} if remote_startup_wait_s is None else {"startup_wait_s": remote_startup_wait_s}
            self.scorer = RemoteScorer(endpoint, remote_timeout_s, remote_max_retries, remote_backoff_s, **wait)
            return
        if not scorer_path:
            raise ValueError(
                f"--reward-runtime={runtime} needs --reward-scorer-path "
                "(e.g. pickscore or trainer.rewards.pickscore.PickScoreScorer)"
            )
        #: the device the scorer was built on: "cpu" under `cpu`, the engine's under `colocate`
        self.device = "cpu" if runtime == "cpu" else str(device)
        self.scorer = build_scorer(scorer_path, model_path, self.device, scorer_options)

    @property
    def components(self) -> tuple[str, ...]:
        """Declared components (for `remote`, asked from the server with a GET)."""
        return tuple(self.scorer.components)

    def score(
        self,
        images: Any,
        prompts: Sequence[str],
        metadata: Sequence[dict] | None = None,
        batch_size: int | None = None,
    ) -> ScoreOutput:
        """Score every image against its prompt, `batch_size` images per scorer call.

        images: anything ImageBatch.from_any takes (the engine's [B, 3, H, W] / list of [3, H, W]
        float tensors in [0, 1], PIL images, uint8 arrays); converted once here.
        Returns fp32 CPU [B] per component. A component a batch did not return is NaN for that
        batch's images (it fails their groups, visibly). A scorer that cannot be reached
        (ScorerUnavailable: a remote endpoint through its retries) fails this call's remaining
        candidates without trying it again, counted as reward/failed_candidates_unavailable: an
        outage costs failed groups, and --reward-max-failed-rollouts decides when the run stops.
        """
        batch = media_batch(images, scorer_tracks(self.scorer), self.scorer_path or self.device)
        n = len(batch)
        prompts = [str(p) for p in prompts]
        if len(prompts) != n:
            raise ValueError(f"got {len(prompts)} prompts for {n} images")
        md = metadata_list(metadata, n)
        bs = int(batch_size or self.batch_size)
        parts: list[tuple[int, int, dict[str, torch.Tensor]]] = []
        score_time = 0.0
        unavailable = 0
        for start in range(0, n, bs):
            stop = min(start + bs, n)
            t0 = time.perf_counter()
            try:
                raw = self.scorer.score(batch.slice(start, stop), prompts[start:stop], md[start:stop])
            except ScorerUnavailable as e:  # the rest stays NaN: one outage is not waited out per batch
                unavailable = n - start
                logger.warning("%s; the %d candidates from here on score NaN and their groups fail "
                               "(reward/failed_candidates_unavailable; --reward-max-failed-rollouts such rollouts "
                               "in a row stop the run)", e, unavailable)
                break
            finally:
                score_time += time.perf_counter() - t0
            source = f"scorer {self.scorer_path or self.device}"
            parts.append((start, stop, check_scores(raw, stop - start, source)))
        names = sorted({name for _, _, s in parts for name in s} | (set(self.components) if unavailable else set()))
        out = {name: torch.full((n,), float("nan"), dtype=torch.float32) for name in names}
        for start, stop, s in parts:
            for name, t in s.items():
                out[name][start:stop] = t
        pop = getattr(self.scorer, "pop_failures", None)
        failures = pop() if pop else {}
        if unavailable:
            failures["unavailable"] = failures.get("unavailable", 0) + unavailable
        return ScoreOutput(components=out, score_time=score_time, num_samples=n, failures=failures)


def scorer_tracks(scorer: Any) -> tuple[str, ...]:
    """The media track a scorer requires: its `required_tracks`, for a remote scorer the server's
    (its GET answer), ("image",) when it declares none."""
    info = getattr(scorer, "info", None)
    if callable(info) and hasattr(scorer, "endpoint"):
        tracks = info().get("required_tracks")
        if isinstance(tracks, list) and all(isinstance(t, str) for t in tracks):
            return tuple(tracks)
    return tuple(getattr(scorer, "required_tracks", ("image",)))


def media_batch(media: Any, tracks: tuple[str, ...], source: str) -> Any:
    """The rollout's media as the batch a scorer of `tracks` takes: a VideoBatch for a video scorer,
    else an ImageBatch. Videos (one [F, 3, H, W] tensor per candidate, the t2v task's) given to an
    image scorer raise RewardError naming the fix (preflight refuses that configuration first)."""
    if "video" in tracks:
        from trainer.rewards.video import VideoBatch

        return VideoBatch.from_any(media)
    if isinstance(media, torch.Tensor) and media.dim() == 5 or \
            isinstance(media, (list, tuple)) and media and isinstance(media[0], torch.Tensor) and media[0].dim() == 4:
        raise RewardError(f"scorer {source} scores images, but this task's candidates are videos: score their "
                          "frames with --reward-scorer-path framewise --reward-frame-scorer <that scorer>, or use a "
                          "video scorer (video_ocr, temporal_consistency, video_vlm_judge)")
    return ImageBatch.from_any(media)


def reward_manager_from_config(reward: RewardConfig, device: str | torch.device = "cpu", *,
                               scorer_path: str | None = None, model_path: str | None = None,
                               **kwargs: Any) -> RewardManager:
    """A new RewardManager from the run's reward section (reward_runtime, reward_scorer_path,
    reward_model_path, reward_endpoint, and the scorer's own config_fields); the scorer is built now.

    With `scorer_path` (a held-out --eval-reward-scorers entry, with its own `model_path`) the
    scorer runs in this process: on `device` under --reward-runtime colocate, else on the CPU.
    Other kwargs (batch_size, remote_*) go to RewardManager."""
    runtime = reward.reward_runtime or "cpu"
    if scorer_path is not None:
        runtime = "colocate" if runtime == "colocate" else "cpu"
    else:
        scorer_path, model_path = reward.reward_scorer_path, reward.reward_model_path
    if runtime != "remote":
        kwargs.setdefault("scorer_options", scorer_options(scorer_path, reward))
    return RewardManager(runtime, scorer_path, model_path, device, reward.reward_endpoint, **kwargs)


__all__ = [
    "RUNTIMES",
    "RewardError",
    "RewardManager",
    "ScoreOutput",
    "reward_manager_from_config",
]
