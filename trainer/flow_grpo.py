"""The FlowGRPO math: one Flow-SDE transition, its log-prob, the clipped objective and the
group-normalised advantages.

Pure torch, no framework imports (only the torch-free `trainer.sampling` for the sde_type names). This module is the single source of truth shared by the
rollout engine (which samples with `sde_step` / `ode_step`) and the actor (which replays a
recorded transition with `replay_transition_logp`), so that the first on-policy update sees a
ratio of exactly 1.

Conventions
-----------
- Flow matching with x_sigma = (1 - sigma) * x_0 + sigma * noise; the model predicts the
  velocity v = dx/dsigma, and a denoising step goes from `sigma` to `sigma_next < sigma`, so
  dt = sigma_next - sigma < 0.
- `latents` / `velocity` / `next_latents` are [B, ...] (Qwen-Image: packed [B, seq, 64]).
- `sigma` / `sigma_next` are python floats, 0-d tensors or [B] tensors; they are broadcast over
  every non-batch dim.
- Every function computes in fp32 whatever the input dtype: the per-element log-prob is a
  difference of large, nearly equal terms (|x' - mean|^2 / 2 std^2 against log std), and bf16
  loses ~3e-4 of it (measured: a bf16 rollout replayed in fp32), the size of the PPO clip range.
- The log-prob of a transition depends on sde_type (`transition_log_prob`): "sde" and "dance"
  use the full Gaussian log-density; "cps" uses FlowGRPO's CPS score -(x' - mean)^2 (no
  1 / (2 std^2), no constants). Both are MEANS over the non-batch elements. The sampler and
  the replay call the same function, so the first update's ratio is exactly 1 either way.
"""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple

import torch

from trainer.sampling import SDE_TYPES  # the --sampling-config vocabulary, one definition (torch-free)

STD_MODES = ("group", "batch", "none")

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


def _as_batch_scalar(value, ref: torch.Tensor) -> torch.Tensor:
    """`value` (float, 0-d or [B] tensor) as fp32 on ref's device, shaped [B or 1, 1, ..., 1]
    so that it broadcasts over every non-batch dim of `ref`."""
    t = torch.as_tensor(value, dtype=torch.float32, device=ref.device)
    if t.dim() == 0:
        return t.reshape([1] * max(ref.dim(), 1))
    if t.dim() != 1 or (ref.dim() > 0 and t.shape[0] not in (1, ref.shape[0])):
        raise ValueError(
            f"sigma must be a scalar or a [B] tensor with B={ref.shape[0] if ref.dim() else 1}, "
            f"got shape {tuple(t.shape)}"
        )
    return t.reshape([t.shape[0]] + [1] * (ref.dim() - 1))


def _check_sde_type(sde_type: str) -> None:
    if sde_type not in SDE_TYPES:
        raise ValueError(f"sde_type must be one of {SDE_TYPES}, got {sde_type!r} (--sampling-config key 'sde_type')")


def sde_std_dev_t(sigma, eta: float, sde_type: str = "sde", sigma_max: float = 0.99) -> torch.Tensor:
    """The SDE diffusion coefficient g(sigma), fp32, same shape as `sigma`.

    "sde" (FlowGRPO):  g = eta * sqrt(sigma / (1 - s)), s = sigma_max where sigma == 1 else sigma.
        The clamp only keeps g finite at sigma == 1 (step 0); it is not what a sampler that
        never divides by zero would use, which is why preflight rejects a trained step 0.
    "dance" (DanceGRPO): g = eta, constant.
    "wan" (FlowGRPO's Wan2.1 sampler): g = eta * (sigma_min + (sigma_max - sigma_min) * sigma)
        with sigma_max the schedule's second sigma (sigmas[1], which the request carries in its
        sigma_max) and sigma_min its terminal 0, i.e. g = eta * sigma_max * sigma: linear in
        sigma, finite at sigma == 1 (step 0 trains). eta = 1 is FlowGRPO's (it has no knob).
    "cps" has no diffusion coefficient: its std is a function of the NEXT sigma
    (`cps_transition_moments`), so asking for g under "cps" is a mistake and raises.
    """
    _check_sde_type(sde_type)
    if sde_type == "cps":
        raise ValueError("sde_type 'cps' has no diffusion coefficient g(sigma); its std is "
                         "sigma_next * sin(eta * pi / 2), see cps_transition_moments")
    sigma = torch.as_tensor(sigma, dtype=torch.float32)
    if sde_type == "dance":
        return torch.full_like(sigma, float(eta))
    if sde_type == "wan":
        return wan_std_dev_t(sigma, float(sigma_max), 0.0) * float(eta)
    s = torch.where(sigma == 1.0, torch.full_like(sigma, float(sigma_max)), sigma)
    return float(eta) * torch.sqrt(sigma / (1.0 - s))


def wan_std_dev_t(sigma, sigma_max: float, sigma_min: float = 0.0) -> torch.Tensor:
    """FlowGRPO's Wan2.1 diffusion coefficient, fp32, same shape as `sigma`:
    std_dev_t = sigma_min + (sigma_max - sigma_min) * sigma, where its sampler takes
    sigma_max = scheduler.sigmas[1] and sigma_min = scheduler.sigmas[-1] (the terminal 0 of
    every schedule here). The transition mean and std are then the "sde" type's with g = std_dev_t."""
    sigma = torch.as_tensor(sigma, dtype=torch.float32)
    return float(sigma_min) + (float(sigma_max) - float(sigma_min)) * sigma


def flow_sde_transition_moments(
    latents: torch.Tensor,
    velocity: torch.Tensor,
    sigma,
    sigma_next,
    eta: float,
    sde_type: str = "sde",
    sigma_max: float = 0.99,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std of the Gaussian Flow-SDE transition x_sigma -> x_sigma_next.

    With dt = sigma_next - sigma (< 0) and g = sde_std_dev_t(sigma, eta, sde_type, sigma_max):
        mean = latents * (1 + g^2 * dt / (2 sigma))
               + velocity * (1 + g^2 * (1 - sigma) / (2 sigma)) * dt
        std  = g * sqrt(-dt)
    Shapes: latents / velocity [B, ...] -> mean [B, ...] fp32, std [B or 1, 1, ..., 1] fp32
    (broadcastable against mean). sigma must be > 0: the last step ends at 0, it never starts
    there. sde_type "cps" takes `cps_transition_moments` instead (sigma_max unused).
    """
    if sde_type == "cps":
        return cps_transition_moments(latents, velocity, sigma, sigma_next, eta)
    x = latents.float()
    v = velocity.float()
    s = _as_batch_scalar(sigma, x)
    s_next = _as_batch_scalar(sigma_next, x)
    dt = s_next - s
    g = sde_std_dev_t(s, eta, sde_type, sigma_max)
    g2 = g * g
    mean = x * (1.0 + g2 * dt / (2.0 * s)) + v * (1.0 + g2 * (1.0 - s) / (2.0 * s)) * dt
    std = g * torch.sqrt(-dt)
    return mean, std


def cps_transition_moments(
    latents: torch.Tensor,
    velocity: torch.Tensor,
    sigma,
    sigma_next,
    eta: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std of FlowGRPO's coefficients-preserving (CPS) transition x_sigma -> x_sigma_next.

    With std = sigma_next * sin(eta * pi / 2) (eta is the noise level, 0 < eta <= 1):
        x0_hat  = latents - sigma * velocity               (the predicted clean sample)
        eps_hat = latents + velocity * (1 - sigma)         (the predicted noise)
        mean    = x0_hat * (1 - sigma_next) + eps_hat * sqrt(sigma_next^2 - std^2)
    so mean + std * noise keeps x_sigma_next = (1 - sigma_next) x0 + sigma_next eps in
    distribution: the noise coefficients add up to sigma_next in quadrature. std <= sigma_next
    always (sin <= 1); the radicand is clamped at 0 only against fp32 rounding at eta == 1.
    std is 0 at the last step (sigma_next == 0): that step is deterministic, and preflight
    refuses to train it. Shapes and dtype as `flow_sde_transition_moments`; step 0
    (sigma == 1) is regular here.
    """
    x = latents.float()
    v = velocity.float()
    s = _as_batch_scalar(sigma, x)
    s_next = _as_batch_scalar(sigma_next, x)
    std = s_next * math.sin(float(eta) * math.pi / 2.0)
    x0_hat = x - s * v
    eps_hat = x + v * (1.0 - s)
    mean = x0_hat * (1.0 - s_next) + eps_hat * torch.sqrt(torch.clamp(s_next * s_next - std * std, min=0.0))
    return mean, std


def per_sample_mean(elem: torch.Tensor) -> torch.Tensor:
    """[B, ...] per-element terms -> [B]: the MEAN over every non-batch dim (FlowGRPO's
    convention for log-probs and KLs, so their scale does not depend on the resolution)."""
    if elem.dim() <= 1:
        return elem.reshape(-1)
    return elem.mean(dim=tuple(range(1, elem.dim())))


def cps_log_prob(next_latents: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """FlowGRPO's CPS log-prob of the (detached) `next_latents`: per element -(x' - mean)^2,
    then the MEAN over every non-batch dim. Returns [B] fp32.

    Not a normalised density: FlowGRPO drops the 1 / (2 std^2) scale and the constants, so the
    PPO log-ratio is a plain squared-distance difference whose size does not blow up as std
    shrinks towards the end of the schedule. This is the convention FlowGRPO's clip ranges are
    tuned for; it is used by the sampler and by the replay alike.
    """
    return per_sample_mean(-((next_latents.detach().float() - mean.float()) ** 2))


def transition_log_prob(next_latents: torch.Tensor, mean: torch.Tensor, std: torch.Tensor,
                        sde_type: str = "sde") -> torch.Tensor:
    """The log-prob [B] fp32 the sampler records and the replay recomputes for sde_type:
    `cps_log_prob` for "cps", the Gaussian `flow_sde_log_prob` for "sde" and "dance"."""
    _check_sde_type(sde_type)
    if sde_type == "cps":
        return cps_log_prob(next_latents, mean)
    return flow_sde_log_prob(next_latents, mean, std)


def flow_sde_log_prob(next_latents: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Gaussian log-density of the (detached) `next_latents` under N(mean, std^2), fp32.

    Per element: -(x' - mean)^2 / (2 std^2) - log std - log sqrt(2 pi); then the MEAN (not the
    sum) over every non-batch dim, as FlowGRPO does, so the log-prob scale does not depend on
    the resolution. Returns [B] fp32. Gradients flow through `mean` (and `std`), never through
    `next_latents`: the sample is data, not a function of the policy.
    """
    x = next_latents.detach().float()
    mean = mean.float()
    std = std.float()
    return per_sample_mean(-((x - mean) ** 2) / (2.0 * std * std) - torch.log(std) - _LOG_SQRT_2PI)


def replay_transition_logp(
    latents: torch.Tensor,
    next_latents: torch.Tensor,
    velocity: torch.Tensor,
    sigma,
    sigma_next,
    eta: float,
    sde_type: str = "sde",
    sigma_max: float = 0.99,
) -> torch.Tensor:
    """Log-prob [B] (fp32) of a recorded transition latents -> next_latents, given the
    velocity the policy being trained predicts at the recorded `latents`.

    The same moments and density as the sampler (`sde_step`), so a replay through the
    rollout's weights reproduces the recorded log-prob exactly in fp32. Differentiable
    w.r.t. `velocity`.
    """
    mean, std = flow_sde_transition_moments(latents, velocity, sigma, sigma_next, eta, sde_type, sigma_max)
    return transition_log_prob(next_latents, mean, std, sde_type)


class TransitionMoments(NamedTuple):
    """What one replay forward gives the KL to a reference policy: log-probs [B, S] fp32, the
    transition means [B, S, ...] fp32 and stds [B, S] fp32."""

    logp: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor


def replay_columns_moments(latents: torch.Tensor, next_latents: torch.Tensor, velocity: torch.Tensor,
                           sigma: torch.Tensor, sigma_next: torch.Tensor, b: int, s: int, *, eta: float,
                           sde_type: str, sigma_max: float) -> TransitionMoments:
    """`replay_columns_logp` with the transition mean and std of the same forward (TransitionMoments)."""
    mean, std = flow_sde_transition_moments(latents, velocity, sigma, sigma_next, eta, sde_type, sigma_max)
    logp = transition_log_prob(next_latents, mean, std, sde_type)

    def cols(t: torch.Tensor) -> torch.Tensor:  # [S * B, ...] -> [B, S, ...]
        return t.view(s, b, *t.shape[1:]).transpose(0, 1)

    std = std.reshape(std.shape[0], -1)[:, 0].expand(s * b) if std.dim() else std.expand(s * b)
    return TransitionMoments(cols(logp), cols(mean), cols(std))


def replay_columns_logp(latents: torch.Tensor, next_latents: torch.Tensor, velocity: torch.Tensor,
                        sigma: torch.Tensor, sigma_next: torch.Tensor, b: int, s: int, *, eta: float,
                        sde_type: str, sigma_max: float) -> torch.Tensor:
    """Log-probs [B, S] (fp32) of S trained-step columns of B candidates replayed in one forward,
    its rows column-major (row k * B + i = candidate i at column k): latents / next_latents /
    velocity [S * B, ...], sigma / sigma_next [S * B]; eta, sde_type and sigma_max are the
    trajectory's own sampler settings. The math is replay_transition_logp's, so every family's
    one-forward replay shares it."""
    return replay_transition_logp(latents, next_latents, velocity, sigma, sigma_next, eta, sde_type,
                                  sigma_max).view(s, b).transpose(0, 1)


def sde_step(
    latents: torch.Tensor,
    velocity: torch.Tensor,
    sigma,
    sigma_next,
    eta: float,
    noise: torch.Tensor,
    sde_type: str = "sde",
    sigma_max: float = 0.99,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampler's stochastic step: next = mean + std * noise, with (mean, std) from
    `flow_sde_transition_moments`; returns (next_latents, log_prob [B] fp32), the log-prob
    being `transition_log_prob` of sde_type (the one the replay uses).

    Computed in fp32; next_latents is returned in fp32 unless `out_dtype` is given. With
    `out_dtype` (e.g. the engine's bf16), next_latents is rounded to it FIRST and the log-prob
    is that of the rounded value, i.e. of exactly what the trajectory records, so a replay of
    the recorded tensors reproduces it. `noise` is a standard normal draw shaped like latents.
    """
    mean, std = flow_sde_transition_moments(latents, velocity, sigma, sigma_next, eta, sde_type, sigma_max)
    next_latents = mean + std * noise.float()
    if out_dtype is not None:
        next_latents = next_latents.to(out_dtype)
    return next_latents, transition_log_prob(next_latents, mean, std, sde_type)


def ode_step(latents: torch.Tensor, velocity: torch.Tensor, sigma, sigma_next) -> torch.Tensor:
    """Deterministic Euler step: latents + velocity * (sigma_next - sigma), in fp32, [B, ...].

    What FlowMatchEulerDiscreteScheduler.step does (it also upcasts to fp32); used at every
    step that is not trained.
    """
    x = latents.float()
    s = _as_batch_scalar(sigma, x)
    s_next = _as_batch_scalar(sigma_next, x)
    return x + velocity.float() * (s_next - s)


def transition_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL(N(mean, std^2) || N(ref_mean, std^2)) of one Flow-SDE transition, per candidate, fp32.

    The policy and the reference share the transition std (it depends only on the schedule and
    eta), so the closed form is |mean - ref_mean|^2 / (2 std^2) per element; as for the log-prob,
    the MEAN over every non-batch dim is taken (FlowGRPO's kl_loss), so its scale does not depend
    on the resolution. mean / ref_mean [B, ...], std broadcastable [B or 1, 1, ..., 1]. Returns
    [B]; gradients flow through `mean` only (the reference is a constant).
    """
    diff = mean.float() - ref_mean.detach().float()
    return per_sample_mean(diff * diff / (2.0 * std.detach().float() ** 2))


def grpo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped objective per (sample, trained step), mean-reduced over both axes.

    logp / old_logp: [B, S] (one column per trained SDE step; [B] is taken as S = 1);
    advantages: [B]. With r = exp(logp - old_logp):
        loss = mean_{B x S} max(-A r, -A clip(r, 1 - eps_clip, 1 + (eps_clip_high or eps_clip)))
    Keeping the steps as separate columns (instead of summing log-probs over steps) means one
    step leaving the clip band does not zero the gradient of the others.

    Returns (loss 0-d fp32, stats) where stats are detached 0-d fp32 tensors (no host sync):
    clip_fraction (share of entries with r outside the clip band), approx_kl (mean of
    (r - 1) - log r, >= 0), ratio_mean, ratio_std (population), ratio_min, ratio_max.
    """
    logp, old_logp, adv = _check_logp_pair(logp, old_logp, advantages)
    return _clipped_objective(logp - old_logp, adv, eps_clip, eps_clip_high)


def _check_logp_pair(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp [B, S] fp32, old_logp [B, S] fp32 detached, advantages [B] fp32 detached), checked."""
    logp = logp.float()
    old_logp = old_logp.detach().float()
    if logp.dim() == 1:
        logp = logp[:, None]
    if old_logp.dim() == 1:
        old_logp = old_logp[:, None]
    if logp.shape != old_logp.shape or logp.dim() != 2:
        raise ValueError(f"logp and old_logp must both be [B, S], got {tuple(logp.shape)} and {tuple(old_logp.shape)}")
    adv = advantages.detach().float().reshape(-1)
    if adv.shape[0] != logp.shape[0]:
        raise ValueError(f"advantages must be [B] with B={logp.shape[0]}, got {tuple(advantages.shape)}")
    return logp, old_logp, adv


def _clipped_objective(log_ratio: torch.Tensor, adv: torch.Tensor, eps_clip: float, eps_clip_high: float | None,
                       step_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped surrogate of `grpo_clip_loss` from a log-ratio [B, S]; step_weight [B, S] or
    [S] (None: 1) multiplies each entry before the mean."""
    lo = 1.0 - float(eps_clip)
    hi = 1.0 + float(eps_clip_high or eps_clip)  # None (or 0) -> symmetric
    ratio = torch.exp(log_ratio)
    a = adv[:, None]
    unclipped = -a * ratio
    clipped = -a * torch.clamp(ratio, lo, hi)
    per_entry = torch.maximum(unclipped, clipped)
    if step_weight is not None:
        per_entry = per_entry * step_weight.detach().float().to(per_entry.device)
    loss = per_entry.mean()

    with torch.no_grad():
        r = ratio.detach()
        stats = {
            "clip_fraction": ((r < lo) | (r > hi)).float().mean(),
            "approx_kl": ((r - 1.0) - log_ratio.detach()).mean(),
            "ratio_mean": r.mean(),
            "ratio_std": r.std(unbiased=False),
            "ratio_min": r.min(),
            "ratio_max": r.max(),
        }
    return loss, stats


def guard_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mean: torch.Tensor, old_mean: torch.Tensor,
                    std: torch.Tensor) -> torch.Tensor:
    """GRPO-Guard's normalised log-ratio of Gaussian Flow-SDE transitions, [B, S] fp32:

        b     = mean_elems (mean - old_mean)^2 / (2 std^2)      (the ratio-mean bias)
        log r = (logp - old_logp + b) * std

    With x' = old_mean + std * z the recorded sample, logp - old_logp = mean(z * dmu) / std - b
    (dmu = mean - old_mean): its expectation over z is -b < 0, so the plain ratio drifts below 1
    by an amount that grows as std shrinks towards the end of the schedule, and its spread
    scales with 1 / std. Adding b centres it at 0 and multiplying by std puts every step on the
    same scale (log r = mean(z * dmu)), so one clip range fits every trained step.

    logp / old_logp [B, S] (the Gaussian log-prob, sde_type "sde" or "dance": the MEAN over the
    latent elements, as flow_sde_log_prob), mean / old_mean [B, S, ...] transition means, std
    [B, S] (the transition std of each column, g(sigma) * sqrt(-dt)). Gradients flow through
    logp and mean.
    """
    lp, olp = logp.float(), old_logp.detach().float()
    if lp.dim() == 1:
        lp, olp = lp[:, None], olp[:, None]
    s = std.detach().float().reshape(lp.shape)
    d = mean.float() - old_mean.detach().float()
    bias = (d * d).reshape(lp.shape[0], lp.shape[1], -1).mean(dim=2) / (2.0 * s * s)
    return (lp - olp + bias) * s


def guard_step_weight(sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
    """GRPO-Guard's per-step gradient weight 1 / (sigma - sigma_next) = 1 / (-dt), fp32, the shape
    of sigma ([B, S]). The normalised log-ratio carries a factor std = g * sqrt(-dt) in its
    gradient; this weight evens out what each denoising step contributes to the update."""
    dt = torch.as_tensor(sigma, dtype=torch.float32) - torch.as_tensor(sigma_next, dtype=torch.float32)
    if bool((dt <= 0).any()):
        raise ValueError("guard_step_weight needs sigma > sigma_next at every trained step")
    return 1.0 / dt


def grpo_guard_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, mean: torch.Tensor, old_mean: torch.Tensor,
                         std: torch.Tensor, advantages: torch.Tensor, eps_clip: float,
                         eps_clip_high: float | None = None,
                         step_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped objective of `grpo_clip_loss` on GRPO-Guard's normalised ratio:

        r    = exp(guard_log_ratio(logp, old_logp, mean, old_mean, std))
        loss = mean_{B x S} w * max(-A r, -A clip(r, 1 - eps_clip, 1 + (eps_clip_high or eps_clip)))

    w = step_weight [B, S] (`guard_step_weight`; None: 1). Shapes as `guard_log_ratio`,
    advantages [B]. The normalised log-ratio is of the size of the latents' change per step
    (~1e-5 .. 1e-3), so its clip range is far below FlowGRPO's. Returns (loss, stats) as
    `grpo_clip_loss` (the stats describe the normalised ratio).
    """
    logp, old_logp, adv = _check_logp_pair(logp, old_logp, advantages)
    return _clipped_objective(guard_log_ratio(logp, old_logp, mean, old_mean, std), adv, eps_clip, eps_clip_high,
                              step_weight)


def normalize_grouped(
    rewards: torch.Tensor, group_size: int, std_mode: str = "group", eps: float = 1e-6
) -> torch.Tensor:
    """GRPO advantages from rewards [G * n], group-major (group g is rewards[g*n:(g+1)*n]).

    Each reward minus its group's mean, then divided by
      "group": that group's std + eps, "batch": the std of all rewards + eps, "none": nothing
    (population std, unbiased=False). Returns [G * n] fp32.
    """
    if std_mode not in STD_MODES:
        raise ValueError(f"std_mode must be one of {STD_MODES}, got {std_mode!r} (--generative-advantage-std-mode)")
    r = rewards.detach().float().reshape(-1)
    if group_size < 1 or r.numel() % group_size != 0:
        raise ValueError(
            f"{r.numel()} rewards cannot be split into groups of {group_size} "
            "(--n-samples-per-prompt must divide the number of rewards)"
        )
    g = r.reshape(-1, group_size)
    centered = g - g.mean(dim=1, keepdim=True)
    if std_mode == "group":
        centered = centered / (g.std(dim=1, unbiased=False, keepdim=True) + eps)
    elif std_mode == "batch":
        centered = centered / (r.std(unbiased=False) + eps)
    return centered.reshape(-1)


def combine_component_advantages(
    components: Mapping[str, torch.Tensor],
    weights: Mapping[str, float],
    group_size: int,
    std_mode: str = "group",
) -> torch.Tensor:
    """Normalise every reward component within its prompt group (`normalize_grouped`), then
    return the weighted sum  sum_c weights[c] * normalize_grouped(components[c]), [G * n] fp32.

    Every component needs a weight and every weight a component: an unweighted component
    silently dropped from the advantage would be a reward nobody trains on.
    """
    if not components:
        raise ValueError("no reward components to combine")
    missing = sorted(set(components) - set(weights))
    extra = sorted(set(weights) - set(components))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"components without a weight: {missing}")
        if extra:
            parts.append(f"weights for components the scorer did not produce: {extra}")
        raise ValueError("--reward-component-weights does not match the reward components: " + "; ".join(parts))
    total = None
    for name in sorted(components):
        term = float(weights[name]) * normalize_grouped(components[name], group_size, std_mode)
        total = term if total is None else total + term
    return total
