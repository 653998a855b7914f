"""Learning-rate schedule, counted in optimizer steps (not rollouts).

The actor takes --num-updates-per-batch optimizer steps per rollout, so a warmup of W iterations is
W optimizer steps. The step counter is saved with the checkpoint (lr_scheduler_steps) so warmup
does not restart on resume.
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine")


def lr_at_step(step: int, *, lr: float, min_lr: float = 0.0, warmup_iters: int = 0,
               decay_iters: int | None = None, schedule: str = "constant") -> float:
    """Learning rate for 0-based optimizer step `step`.

    warmup (step < warmup_iters): lr * (step + 1) / warmup_iters, so the first step is not 0.
    after warmup, with t = step - warmup_iters and D = decay_iters (None/0: no decay):
      constant: lr (min_lr and decay_iters ignored)
      linear:   min_lr + (lr - min_lr) * (1 - min(t, D) / D)
      cosine:   min_lr + (lr - min_lr) * 0.5 * (1 + cos(pi * min(t, D) / D))
    After D decay steps the rate stays at min_lr.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"--fsdp-lr-scheduler must be one of {SCHEDULES}, got {schedule!r}")
    if step < 0:
        raise ValueError(f"optimizer step must be >= 0, got {step}")
    if warmup_iters and step < warmup_iters:
        return lr * (step + 1) / warmup_iters
    if schedule == "constant" or not decay_iters:
        return lr
    t = min(step - warmup_iters, decay_iters)
    frac = t / decay_iters
    if schedule == "linear":
        return min_lr + (lr - min_lr) * (1.0 - frac)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * frac))
