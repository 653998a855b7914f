"""The DiffusionNFT math (negative-aware fine-tuning on the forward process): the optimality
probability of a reward, the forward noising, the implicit positive / negative policies around
the old policy, their loss and the old policy's soft-update schedule.

Pure torch, no framework imports; the actor's NFT update (`Actor.nft_train_step`) is built from
these alone, so every formula has one definition and a test against an independent reference.

Conventions (as trainer.flow_grpo)
----------------------------------
- Flow matching with x_sigma = (1 - sigma) * x0 + sigma * eps; the model predicts v = eps - x0,
  so x0 = x_sigma - sigma * v.
- x0 / eps / velocities are [B, ...] (Qwen-Image: packed [B, seq, 64]); sigma is a float, a 0-d
  or a [B] tensor broadcast over every non-batch dim.
- Everything is computed in fp32 whatever the input dtype: the loss is a ratio of two squared
  errors of similar size (the adaptive weight), and bf16 keeps 3 significant digits of each.

Nothing here needs the rollout's per-step log-probs, so a rollout may use any sampler; only the
clean final latents and the conditioning enter the update.
"""

from __future__ import annotations

import math

import torch

#: how the update draws its training sigmas (`draw_train_sigmas`)
TIMESTEP_DISTRIBUTIONS = ("schedule", "uniform")


def _batch_scalar(value, ref: torch.Tensor) -> torch.Tensor:
    """`value` (float, 0-d or [B]) as fp32 on ref's device, shaped to broadcast over ref's non-batch dims."""
    t = torch.as_tensor(value, dtype=torch.float32, device=ref.device)
    if t.dim() == 0:
        return t.reshape([1] * max(ref.dim(), 1))
    if t.dim() != 1 or t.shape[0] not in (1, ref.shape[0]):
        raise ValueError(f"sigma must be a scalar or a [B] tensor with B={ref.shape[0]}, got shape {tuple(t.shape)}")
    return t.reshape([t.shape[0]] + [1] * (ref.dim() - 1))


def _per_sample_mean(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1).mean(dim=1)


def optimality_probability(advantages: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """The optimality probability r in [0, 1] of each candidate from its group-normalised
    advantage A [B]:

        r = clamp(clip(A, -c, c) / (2 c) + 1/2, 0, 1),     c = adv_clip_max > 0

    so A = 0 (an average sample of its group) gives r = 1/2 (no preference), A >= c gives 1
    (wholly positive), A <= -c gives 0 (wholly negative). Returns [B] fp32, detached (r is a
    target weight, not a function of the policy).
    """
    c = float(adv_clip_max)
    if not (math.isfinite(c) and c > 0):
        raise ValueError(f"adv_clip_max must be a finite number > 0 for the optimality probability, got {adv_clip_max} "
                         "(--adv-clip-max)")
    a = advantages.detach().float().reshape(-1)
    return torch.clamp(torch.clamp(a, -c, c) / (2.0 * c) + 0.5, 0.0, 1.0)


def forward_noise(x0: torch.Tensor, noise: torch.Tensor, sigma) -> torch.Tensor:
    """The forward process at noise level sigma: x_sigma = (1 - sigma) * x0 + sigma * noise.

    x0 / noise [B, ...] (noise a standard normal draw), sigma float / 0-d / [B] in [0, 1].
    Returns [B, ...] fp32.
    """
    x = x0.float()
    s = _batch_scalar(sigma, x)
    return (1.0 - s) * x + s * noise.float()


def implicit_velocities(v_theta: torch.Tensor, v_old: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The implicit positive and negative policies around the old one:

        v_+ = (1 - beta) * v_old + beta * v_theta
        v_- = (1 + beta) * v_old - beta * v_theta

    (v_+ + v_- = 2 v_old: the two are mirror images about the old policy). v_theta [B, ...]
    carries the gradient; v_old is detached. Returns (v_+, v_-), [B, ...] fp32.
    """
    b = float(beta)
    vt = v_theta.float()
    vo = v_old.detach().float()
    return (1.0 - b) * vo + b * vt, (1.0 + b) * vo - b * vt


def adaptive_x0_loss(x_t: torch.Tensor, sigma, velocity: torch.Tensor, x0: torch.Tensor,
                     min_weight: float = 1e-5) -> torch.Tensor:
    """The per-sample x0-prediction error, normalised by its own size:

        x0_hat = x_t - sigma * velocity
        w      = max(mean |x0_hat - x0|, min_weight)          (detached, per sample)
        loss   = mean((x0_hat - x0)^2) / w                    (means over every non-batch dim)

    Dividing by the (detached) mean absolute error makes every sample's gradient of comparable
    size whatever its noise level, the adaptive weighting of the DiffusionNFT recipe. w is
    computed in fp64 (a mean over ~1e6 elements). Returns [B] fp32, differentiable w.r.t.
    `velocity`.
    """
    xt = x_t.float()
    s = _batch_scalar(sigma, xt)
    err = xt - s * velocity.float() - x0.float()
    with torch.no_grad():
        w = _per_sample_mean(err.detach().double().abs()).clamp(min=float(min_weight)).float()
    return _per_sample_mean(err * err) / w


def nft_loss(v_theta: torch.Tensor, v_old: torch.Tensor, x_t: torch.Tensor, x0: torch.Tensor, sigma,
             r: torch.Tensor, beta: float, adv_clip_max: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DiffusionNFT objective of one drawn noise level, mean over the B samples:

        (v_+, v_-) = implicit_velocities(v_theta, v_old, beta)
        L = c / beta * mean_B( r * adaptive_x0_loss(x_t, sigma, v_+, x0)
                               + (1 - r) * adaptive_x0_loss(x_t, sigma, v_-, x0) ),   c = adv_clip_max

    A high-reward sample (r -> 1) pulls the positive policy, and so v_theta, towards its clean
    latents; a low-reward one (r -> 0) pulls the negative policy there, i.e. pushes v_theta away
    by the mirror image. The 1 / beta keeps the gradient w.r.t. v_theta of order 1 for any beta
    (the policies move by beta * v_theta); c is the recipe's constant loss scale.

    v_theta / v_old / x_t / x0 [B, ...], sigma float or [B], r [B] in [0, 1]. Returns (loss 0-d
    fp32, stats) with detached 0-d fp32 stats: positive_loss, negative_loss (their B means),
    old_deviation (mean (v_theta - v_old)^2), r_mean.
    """
    b = float(beta)
    if not (math.isfinite(b) and b > 0):
        raise ValueError(f"beta must be a finite number > 0, got {beta} (--nft-beta)")
    r = r.detach().float().reshape(-1).to(x_t.device)
    if r.shape[0] != x_t.shape[0]:
        raise ValueError(f"r must be [B] with B={x_t.shape[0]}, got {tuple(r.shape)}")
    v_pos, v_neg = implicit_velocities(v_theta, v_old, b)
    pos = adaptive_x0_loss(x_t, sigma, v_pos, x0)
    neg = adaptive_x0_loss(x_t, sigma, v_neg, x0)
    loss = (r * pos + (1.0 - r) * neg).mean() * (float(adv_clip_max) / b)
    with torch.no_grad():
        dv = v_theta.detach().float() - v_old.detach().float()
        stats = {"positive_loss": pos.detach().mean(), "negative_loss": neg.detach().mean(),
                 "old_deviation": (dv * dv).mean(), "r_mean": r.mean()}
    return loss, stats


def old_policy_decay(step: int, flat: int, rate: float, cap: float) -> float:
    """The old policy's soft-update decay after `step` optimizer steps:

        decay = 0                              for step < flat
                min((step - flat) * rate, cap)  otherwise

    and the old policy then becomes  old <- decay * old + (1 - decay) * theta  (decay 0: a copy,
    i.e. on-policy). Starting at 0 lets the early, fast-moving policy drag the old one along;
    the cap bounds how far behind it may lag. A python float in [0, cap].
    """
    if step < 0 or flat < 0 or rate < 0 or not (0.0 <= cap < 1.0):
        raise ValueError(f"old-policy decay needs step, flat, rate >= 0 and 0 <= cap < 1, got "
                         f"step={step} flat={flat} rate={rate} cap={cap} (--nft-old-decay-*)")
    if step < flat:
        return 0.0
    return min((step - flat) * float(rate), float(cap))


def draw_train_sigmas(schedule: torch.Tensor, n: int, k: int, generator: torch.Generator,
                      distribution: str = "schedule") -> torch.Tensor:
    """The k training noise levels of each of n samples, [n, k] fp32 (CPU), drawn from `generator`.

    "schedule": k DISTINCT entries of the rollout's step sigmas `schedule` [N] (the sampler's
      own grid, terminal 0 excluded), a fresh random permutation per sample (k <= N): what the
      DiffusionNFT recipe trains on, so the loss sees the noise levels the sampler visits.
    "uniform": k independent draws from U(min(schedule), max(schedule)).
    Deterministic given the generator's state, so a resumed run draws the same levels.
    """
    sched = torch.as_tensor(schedule, dtype=torch.float32).reshape(-1).cpu()
    if distribution not in TIMESTEP_DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {TIMESTEP_DISTRIBUTIONS}, got {distribution!r} "
                         "(--nft-timestep-distribution)")
    if sched.numel() == 0 or k < 1 or n < 0:
        raise ValueError(f"need a non-empty schedule and k >= 1, got {sched.numel()} sigmas and k={k}")
    if distribution == "schedule":
        if k > sched.numel():
            raise ValueError(f"cannot draw {k} distinct sigmas from a {sched.numel()}-step schedule "
                             "(--nft-timestep-fraction)")
        idx = torch.stack([torch.randperm(sched.numel(), generator=generator)[:k] for _ in range(n)]) \
            if n else torch.zeros(0, k, dtype=torch.long)
        return sched[idx]
    lo, hi = float(sched.min()), float(sched.max())
    return lo + (hi - lo) * torch.rand(n, k, generator=generator)


def nft_candidate_seed(round_seed: int, candidate_id: int) -> int:
    """The seed of one candidate's training draws (its sigmas and noises) in a round seeded
    `round_seed`: keyed by the candidate's global id, so the draws do not depend on which rank or
    micro-batch holds it (the world size decides who computes, not what)."""
    return (int(round_seed) * 1_000_003 + int(candidate_id) * 7919 + 17) % (2 ** 63)


def num_train_timesteps(num_inference_steps: int, fraction: float) -> int:
    """K, the noise levels trained per sample: floor(N * fraction), at least 1 (N = 10 steps at
    the recipe's 0.99 give 9)."""
    if not (0.0 < fraction <= 1.0):
        raise ValueError(f"--nft-timestep-fraction must be in (0, 1], got {fraction}")
    return max(1, int(num_inference_steps * fraction))


def ode_rollout_sampling(sampling):
    """The sampling config an nft rollout uses: `sampling` (a trainer.sampling.SamplingConfig)
    with every step deterministic and only the last one recorded.

    The last step is recorded under sde_type "cps", whose std at sigma_next = 0 is exactly 0 and
    whose mean there, x - sigma * v, is the Euler ODE step to 0 bit for bit (x + v * (0 - sigma)):
    so the whole rollout is the ODE sampler, any engine that records trained steps returns the
    clean final latents as that column's next_latents, and no engine change is needed. The
    recorded log-prob is unused. Height, width, step count, seeds and sample ids are kept.
    """
    import dataclasses

    n = int(sampling.num_inference_steps)
    return dataclasses.replace(sampling, sde_type="cps", eta=1.0, sde_indices=[n - 1], sde_pool=None,
                               num_sde_steps=0, sde_resample_per_rollout=False, sde_window_size=0,
                               sde_window_range=None)
