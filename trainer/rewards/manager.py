"""Where a scorer runs (`--reward-runtime`) and how a rollout's images reach it.

- `cpu`: built and run in this process with device "cpu"; while it is built and while it scores,
  torch.cuda.is_available() reports False, so libraries that pick a device by themselves stay on
  the CPU too. (CUDA_VISIBLE_DEVICES is not touched: in a process whose engine already uses the
  GPU it would change nothing, and before that it would hide the GPU from the engine for good.)
- `colocate`: built and run in this process on the engine's device, sharing the card while the
  actor is offloaded.
- `remote`: every batch is POSTed to `--reward-endpoint` (trainer.rewards.remote).

A manager is cached per (scorer path, model path, runtime, device, endpoint), so a scorer's
weights load once per process, not once per rollout.
"""

from __future__ import annotations

import contextlib
import threading
import time
import json
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from trainer.rewards.base import (
    ImageBatch,
    RewardError,
    build_scorer,
    check_scores,
    metadata_list,
    resolve_scorer_path,
    scorer_options,
)

RUNTIMES = ("colocate", "cpu", "remote")

#: images per scorer call when the caller does not say
DEFAULT_SCORE_BATCH_SIZE = 32


@contextlib.contextmanager
def cuda_hidden() -> Iterator[None]:
    """Within the block torch.cuda.is_available() is False and device_count() is 0."""
    is_available, device_count = torch.cuda.is_available, torch.cuda.device_count
    torch.cuda.is_available = lambda: False
    torch.cuda.device_count = lambda: 0
    try:
        yield
    finally:
        torch.cuda.is_available, torch.cuda.device_count = is_available, device_count


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
    ):
        if runtime not in RUNTIMES:
            raise ValueError(f"--reward-runtime={runtime!r} must be one of {RUNTIMES}")
        if batch_size < 1:
            raise ValueError(f"reward batch_size must be >= 1, got {batch_size}")
        self.runtime = runtime
        self.scorer_path = scorer_path = resolve_scorer_path(scorer_path)
        self.model_path = model_path
        self.batch_size = int(batch_size)
        if runtime == "remote":
            from trainer.rewards.remote import RemoteScorer

            if not endpoint:
                raise ValueError("--reward-runtime=remote needs --reward-endpoint (e.g. http://host:8000/score)")
            self.device = "remote"
            self.scorer = RemoteScorer(endpoint, remote_timeout_s, remote_max_retries, remote_backoff_s)
            return
        if not scorer_path:
            raise ValueError(
                f"--reward-runtime={runtime} needs --reward-scorer-path "
                "(e.g. pickscore or trainer.rewards.pickscore.PickScoreScorer)"
            )
        self.device = "cpu" if runtime == "cpu" else str(device)
        with self._placement():
            self.scorer = build_scorer(scorer_path, model_path, self.device, scorer_options)

    def _placement(self):
        return cuda_hidden() if self.runtime == "cpu" else contextlib.nullcontext()

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
        batch's images (it fails their groups, visibly).
        """
        batch = ImageBatch.from_any(images)
        n = len(batch)
        prompts = [str(p) for p in prompts]
        if len(prompts) != n:
            raise ValueError(f"got {len(prompts)} prompts for {n} images")
        md = metadata_list(metadata, n)
        bs = int(batch_size or self.batch_size)
        parts: list[tuple[int, int, dict[str, torch.Tensor]]] = []
        score_time = 0.0
        for start in range(0, n, bs):
            stop = min(start + bs, n)
            t0 = time.perf_counter()
            with self._placement():
                raw = self.scorer.score(batch.slice(start, stop), prompts[start:stop], md[start:stop])
            score_time += time.perf_counter() - t0
            source = f"scorer {self.scorer_path or self.device}"
            parts.append((start, stop, check_scores(raw, stop - start, source)))
        names = sorted({name for _, _, s in parts for name in s})
        out = {name: torch.full((n,), float("nan"), dtype=torch.float32) for name in names}
        for start, stop, s in parts:
            for name, t in s.items():
                out[name][start:stop] = t
        pop = getattr(self.scorer, "pop_failures", None)
        return ScoreOutput(components=out, score_time=score_time, num_samples=n, failures=pop() if pop else {})


_CACHE: dict[tuple, RewardManager] = {}
_CACHE_LOCK = threading.Lock()


def get_reward_manager(
    runtime: str,
    scorer_path: str | None = None,
    model_path: str | None = None,
    device: str | torch.device = "cpu",
    endpoint: str | None = None,
    **kwargs: Any,
) -> RewardManager:
    """The process-wide manager for this configuration, built on first use.

    Keyed by (scorer_path, model_path, runtime, device, endpoint, scorer_options); `cpu` ignores
    `device` and `remote` ignores everything but the endpoint, so equivalent configurations share
    one manager. Other kwargs (batch_size, remote_*) apply only when the manager is first built.
    """
    scorer_path = resolve_scorer_path(scorer_path)
    if runtime == "remote":
        key = (None, None, runtime, None, endpoint, None)
    else:
        options = json.dumps(kwargs.get("scorer_options") or {}, sort_keys=True, default=str)
        key = (scorer_path, model_path, runtime, "cpu" if runtime == "cpu" else str(device), None, options)
    with _CACHE_LOCK:
        manager = _CACHE.get(key)
        if manager is None:
            manager = RewardManager(runtime, scorer_path, model_path, device, endpoint, **kwargs)
            _CACHE[key] = manager
        return manager


def reward_manager_from_config(reward: Any, device: str | torch.device = "cpu", *, scorer_path: str | None = None,
                               model_path: str | None = None, **kwargs: Any) -> RewardManager:
    """get_reward_manager from a config's reward section (duck-typed: reward_runtime,
    reward_scorer_path, reward_model_path, reward_endpoint, and the scorer's own config_fields).

    With `scorer_path` (a held-out --eval-reward-scorers entry, with its own `model_path`) the
    scorer runs in this process: on `device` under --reward-runtime colocate, else on the CPU."""
    runtime = getattr(reward, "reward_runtime", "cpu") or "cpu"
    if scorer_path is not None:
        runtime = "colocate" if runtime == "colocate" else "cpu"
    else:
        scorer_path, model_path = getattr(reward, "reward_scorer_path", None), getattr(reward, "reward_model_path", None)
    if runtime != "remote":
        kwargs.setdefault("scorer_options", scorer_options(scorer_path, reward))
    return get_reward_manager(
        runtime,
        scorer_path,
        model_path,
        device,
        getattr(reward, "reward_endpoint", None),
        **kwargs,
    )


def clear_reward_manager_cache() -> None:
    """Drop every cached manager (tests; or to free a colocated scorer's memory)."""
    with _CACHE_LOCK:
        _CACHE.clear()


__all__ = [
    "RUNTIMES",
    "RewardError",
    "RewardManager",
    "ScoreOutput",
    "clear_reward_manager_cache",
    "cuda_hidden",
    "get_reward_manager",
    "reward_manager_from_config",
]
