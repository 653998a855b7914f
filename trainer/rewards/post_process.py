"""From a rollout's images to one advantage per candidate.

    post_process = score (manager, in batches)  ->  compute_advantages

compute_advantages, on raw components [G * n] (group-major: group g is [g*n, (g+1)*n)):
  1. A group fails when any required or weighted component is non-finite (NaN from a scorer
     that could not score, a null from a remote one) for any of its candidates. Failed groups
     are left out of the update (`valid` is False for their candidates) and counted
     (reward/failed_groups): a candidate is never trained on a made-up zero. A required or
     weighted component the scorer did not return at all is a configuration error and raises.
  2. Each weighted component is normalised within its prompt group over the valid groups
     (trainer.flow_grpo.normalize_grouped, std_mode group / batch / none) and the weighted sum
     is taken (combine_component_advantages).
  3. With adv_clip_max > 0 (--adv-clip-max), every advantage is clamped to
     [-adv_clip_max, adv_clip_max] and the clamped share of valid candidates is logged
     (reward/adv_clipped_fraction); the metrics below are those of the clamped advantages.
  4. The batch is degenerate when the advantage variance over valid candidates is < 1e-6
     (or nothing is valid): there is nothing to learn from it.

In a multi-rank job each rank scores its own candidates; `gather_scores` assembles the global
[G * n] vectors (small: one float per candidate and component) before compute_advantages, so
every rank computes identical advantages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from trainer.config import RunConfig
from trainer.flow_grpo import STD_MODES, combine_component_advantages
from trainer.rewards.base import RewardError

#: advantage variance below which a batch is flagged degenerate (reward/degenerate)
DEGENERATE_VARIANCE = 1e-6


@dataclass
class RewardResult:
    """Everything the update and the logger need from one rollout's rewards."""

    advantages: torch.Tensor  # fp32 [G*n]; 0 where not valid (never use those: see `valid`)
    valid: torch.Tensor  # bool [G*n]; False for every candidate of a failed group
    components: dict[str, torch.Tensor]  # raw scores, fp32 [G*n], NaN where not scored
    failed_groups: list[int]  # group indices left out of the update
    metrics: dict[str, float]  # reward/* series (docs/rewards.md, "Metrics", lists them)
    degenerate: bool  # advantage variance < DEGENERATE_VARIANCE, or no valid group
    weights: dict[str, float] = field(default_factory=dict)  # the component weights trained on


def resolve_std_mode(
    std_mode: str | None, disable_std_normalization: bool = False, group_size: int | None = None
) -> str:
    """The std divisor to use after per-group centering.

    `std_mode` (--generative-advantage-std-mode) wins when set; unset, it follows the legacy
    switch: --disable-grpo-std-normalization -> "none" (Dr.GRPO), else "group". An explicit
    "group"/"batch" together with --disable-grpo-std-normalization contradicts itself and raises.
    With group_size == 1 there is no group std to divide by: "none".
    """
    if std_mode is not None and std_mode not in STD_MODES:
        raise ValueError(f"--generative-advantage-std-mode={std_mode!r} must be one of {STD_MODES}")
    if std_mode is None:
        std_mode = "none" if disable_std_normalization else "group"
    elif disable_std_normalization and std_mode != "none":
        raise ValueError(
            f"--disable-grpo-std-normalization contradicts --generative-advantage-std-mode={std_mode}; "
            "drop one of them (std mode 'none' is what the flag means)"
        )
    if group_size == 1:
        return "none"
    return std_mode


def _stats(prefix: str, values: torch.Tensor, out: dict[str, float]) -> None:
    """mean / std (population) / min / max of the finite entries; nothing if there are none."""
    v = values[torch.isfinite(values)].double()
    if v.numel() == 0:
        return
    out[f"{prefix}_mean"] = float(v.mean())
    out[f"{prefix}_std"] = float(v.std(unbiased=False)) if v.numel() > 1 else 0.0
    out[f"{prefix}_min"] = float(v.min())
    out[f"{prefix}_max"] = float(v.max())


def resolve_weights(components: Mapping[str, Any], required_components: Sequence[str] | None = None,
                    component_weights: Mapping[str, float] | None = None) -> dict[str, float]:
    """The components trained on and their weights: --reward-component-weights when given, else
    1.0 for every required component, or, with none required, for every component."""
    if component_weights:
        return {k: float(v) for k, v in component_weights.items()}
    return {k: 1.0 for k in (list(required_components or []) or sorted(components))}


def compute_advantages(
    components: Mapping[str, torch.Tensor],
    group_size: int,
    *,
    required_components: Sequence[str] | None = None,
    component_weights: Mapping[str, float] | None = None,
    std_mode: str = "group",
    score_time: float | None = None,
    adv_clip_max: float = 0.0,
) -> RewardResult:
    """Group-normalised, weight-combined advantages (module docstring, steps 1-4).

    components: raw fp32 [G*n] per component, group-major. Weights default to 1.0 for every
    required component, or, with none required, for every component. Components without a
    weight are reported in the metrics but not trained on. adv_clip_max: 0 = no clamp.
    """
    if not (math.isfinite(adv_clip_max) and adv_clip_max >= 0):
        raise ValueError(f"--adv-clip-max must be a finite number >= 0, got {adv_clip_max}")
    if not components:
        raise RewardError("the scorer returned no reward components")
    comps = {k: torch.as_tensor(v).detach().to("cpu", torch.float32).reshape(-1) for k, v in components.items()}
    sizes = {k: v.numel() for k, v in comps.items()}
    total = next(iter(sizes.values()))
    if any(s != total for s in sizes.values()):
        raise RewardError(f"reward components have different lengths: {sizes}")
    if group_size < 1 or total % group_size != 0:
        raise ValueError(
            f"{total} scored candidates cannot be split into groups of {group_size} (--n-samples-per-prompt)"
        )
    required = list(required_components or [])
    weights = resolve_weights(comps, required, component_weights)
    used = sorted(set(required) | set(weights))
    absent = [c for c in used if c not in comps]
    if absent:
        raise RewardError(
            f"reward components {absent} (from --reward-required-components / --reward-component-weights) "
            f"were not produced by the scorer, which returned {sorted(comps)}: fix the flags or the scorer"
        )

    num_groups = total // group_size
    finite = torch.ones(num_groups, dtype=torch.bool)
    for c in used:
        finite &= torch.isfinite(comps[c]).view(num_groups, group_size).all(dim=1)
    valid_groups = finite.nonzero().flatten()
    failed_groups = (~finite).nonzero().flatten().tolist()
    valid = finite.repeat_interleave(group_size)

    advantages = torch.zeros(total, dtype=torch.float32)
    if valid_groups.numel():
        weighted = {c: comps[c].view(num_groups, group_size)[valid_groups].reshape(-1) for c in weights}
        adv_valid = combine_component_advantages(weighted, weights, group_size, std_mode)
        clipped = None
        if adv_clip_max > 0:
            clipped = float((adv_valid.abs() > adv_clip_max).float().mean())
            adv_valid = adv_valid.clamp(-adv_clip_max, adv_clip_max)
        advantages[valid] = adv_valid.float()
        variance = float(adv_valid.double().var(unbiased=False))
    else:
        adv_valid = torch.zeros(0)
        variance = 0.0
        clipped = 0.0 if adv_clip_max > 0 else None
    degenerate = valid_groups.numel() == 0 or variance < DEGENERATE_VARIANCE

    metrics: dict[str, float] = {}
    for c in sorted(comps):
        _stats(f"reward/{c}", comps[c], metrics)
    # what the advantages are normalised from: sum_c weight_c * raw_c, per candidate
    total_reward = weighted_total(comps, weights)
    _stats("reward/weighted_total", total_reward[valid], metrics)
    if adv_valid.numel():
        metrics["reward/advantage_mean"] = float(adv_valid.double().mean())
        metrics["reward/advantage_std"] = math.sqrt(variance)
    if clipped is not None:
        metrics["reward/adv_clipped_fraction"] = clipped
    metrics["reward/num_groups"] = float(valid_groups.numel())
    metrics["reward/failed_groups"] = float(len(failed_groups))
    if valid_groups.numel():
        # The key diagnostic: the spread GRPO has to learn from, on the weighted raw reward.
        raw = sum(weights[c] * comps[c].double().view(num_groups, group_size)[valid_groups] for c in weights)
        metrics["reward/group_std_mean"] = float(raw.std(dim=1, unbiased=False).mean())
        # each component's own spread, on its raw scale (weighted or not): the weighted figure
        # above says nothing about a component left out of the weights
        for c in sorted(comps):
            g = comps[c].double().view(num_groups, group_size)[valid_groups]
            ok = torch.isfinite(g).all(dim=1)
            if ok.any():
                metrics[f"reward/{c}_group_std_mean"] = float(g[ok].std(dim=1, unbiased=False).mean())
    metrics["reward/degenerate"] = 1.0 if degenerate else 0.0
    if score_time is not None:
        metrics["reward/score_time"] = float(score_time)
        metrics["reward/score_samples_per_s"] = total / score_time if score_time > 0 else float("inf")

    return RewardResult(
        advantages=advantages,
        valid=valid,
        components=comps,
        failed_groups=failed_groups,
        metrics=metrics,
        degenerate=degenerate,
        weights=weights,
    )


def weighted_total(components: Mapping[str, torch.Tensor], weights: Mapping[str, float]) -> torch.Tensor:
    """sum_c weights[c] * components[c]: fp32 [N] per candidate (NaN where a weighted component is),
    the one reward the advantages are computed from, before any normalisation."""
    total = None
    for c, w in weights.items():
        term = float(w) * torch.as_tensor(components[c]).detach().double().reshape(-1)
        total = term if total is None else total + term
    return total.float()


def post_process(
    images: Any,
    prompts: Sequence[str],
    metadata: Sequence[dict] | None = None,
    *,
    group_size: int,
    manager: Any,
    required_components: Sequence[str] | None = None,
    component_weights: Mapping[str, float] | None = None,
    std_mode: str = "group",
    batch_size: int | None = None,
    adv_clip_max: float = 0.0,
) -> RewardResult:
    """Score a whole rollout in one process and compute its advantages.

    images / prompts / metadata: G*n candidates, group-major (the group's prompt repeated n
    times). manager: a RewardManager (or anything with .score(images, prompts, metadata,
    batch_size) -> ScoreOutput).
    """
    out = manager.score(images, prompts, metadata, batch_size=batch_size)
    return compute_advantages(
        out.components,
        group_size,
        required_components=required_components,
        component_weights=component_weights,
        std_mode=std_mode,
        score_time=out.score_time,
        adv_clip_max=adv_clip_max,
    )


def post_process_from_config(
    cfg: RunConfig,
    images: Any,
    prompts: Sequence[str],
    metadata: Sequence[dict] | None = None,
    *,
    manager: Any = None,
    group_size: int | None = None,
    device: str | torch.device = "cpu",
) -> RewardResult:
    """post_process with every setting read from the run config: cfg.reward
    (reward_runtime, reward_scorer_path, reward_model_path, reward_endpoint,
    reward_required_components, reward_component_weights), cfg.grpo
    (generative_advantage_std_mode, disable_grpo_std_normalization, adv_clip_max) and, unless group_size is
    given, cfg.rollout.n_samples_per_prompt.

    manager: the RewardManager to score with; pass the one you hold when scoring more than once.
    Unset, one is built from cfg.reward for this call (its scorer loads now), `device` being the
    engine's (used by colocate)."""
    from trainer.rewards.manager import reward_manager_from_config

    reward, grpo = cfg.reward, cfg.grpo
    if group_size is None:
        group_size = int(cfg.rollout.n_samples_per_prompt)
    std_mode = resolve_std_mode(grpo.generative_advantage_std_mode, bool(grpo.disable_grpo_std_normalization),
                                group_size)
    return post_process(
        images,
        prompts,
        metadata,
        group_size=group_size,
        manager=manager if manager is not None else reward_manager_from_config(reward, device),
        required_components=reward.reward_required_components,
        component_weights=reward.reward_component_weights,
        std_mode=std_mode,
        adv_clip_max=float(grpo.adv_clip_max or 0.0),
    )


def gather_scores(
    local: Mapping[str, torch.Tensor], indices: torch.Tensor | Sequence[int], total: int, group: Any = None
) -> dict[str, torch.Tensor]:
    """Assemble every rank's scores into global [total] vectors (collective: every rank calls it).

    local: this rank's scores, fp32 [k] per component, for the global candidate positions
    `indices` [k]. Each position must be scored by exactly one rank (else RewardError). A
    component one rank lacks is NaN at that rank's positions (its groups then fail). One
    all_reduce of a [C + 1, total] tensor: zeros everywhere but the owner's slot, so the sum is
    the owner's value, NaN included.
    """
    import torch.distributed as dist

    from trainer.distributed import collective_device

    idx = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
    names_per_rank: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(names_per_rank, sorted(local), group=group)
    names = sorted({n for ns in names_per_rank for n in ns})
    buf = torch.zeros(len(names) + 1, total, dtype=torch.float32)
    for row, name in enumerate(names):
        if name in local:
            values = torch.as_tensor(local[name]).detach().to("cpu", torch.float32).reshape(-1)
            if values.numel() != idx.numel():
                raise RewardError(
                    f"component {name!r}: {values.numel()} scores for {idx.numel()} candidate positions"
                )
            buf[row, idx] = values
        else:
            buf[row, idx] = float("nan")
    buf[-1, idx] = 1.0
    buf = buf.to(collective_device(group))
    dist.all_reduce(buf, group=group)
    buf = buf.cpu()
    owners = buf[-1]
    if not torch.equal(owners, torch.ones(total)):
        bad = (owners != 1).nonzero().flatten()[:8].tolist()
        raise RewardError(
            f"reward gather: candidate positions {bad} were scored by {owners[bad].tolist()} ranks, "
            "expected exactly 1 (each rank must pass the global positions of the candidates it scored)"
        )
    return {name: buf[row].clone() for row, name in enumerate(names)}
