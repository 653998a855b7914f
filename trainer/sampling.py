"""Sampling geometry: the `--sampling-config` keys, the trained SDE steps, the sigma schedule
and the per-candidate seeds.

Importable without torch (the config preflight imports it and must stay light): only the
functions that return tensors (`initial_noise`, `step_noise`, `transformer_timestep`) import
torch, lazily.

Seeds. A candidate's x_T and its per-step SDE noise are a pure function of
(generation_seed, sample_id, step): the seed is derived with sha256 (never Python's salted
hash()) and the draw is made on CPU with its own torch.Generator, so the same candidate gets
the same noise on any rank, device or batch composition. The values are bit-identical for one
torch build; torch does not promise identical CPU randn streams across releases.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

SDE_TYPES = ("sde", "dance", "cps", "wan")
SAMPLE_ID_MODES = ("metadata", "positional", "group_index")

_FLAG = "--sampling-config"


# ---------------------------------------------------------------------------- invariants
#
# What any rollout must satisfy, each decided here once. The config parser, preflight, the
# model adapter's build_rollout_request and the engines' check_request all ask these functions;
# each returns None when the value is fine, else the problem as a phrase the caller prefixes
# with what it is checking.


def guidance_scale_problem(guidance_scale: Any) -> str | None:
    """None when a rollout may sample at `guidance_scale`, else what it must be and why, phrased
    to follow the value ("guidance_scale is 0.5, but " + problem).

    1.0 is no guidance (one positive-conditioned forward); > 1 is true classifier-free guidance:
    the conditional and unconditional rows of a candidate run in one DiT forward, the step uses
    the combined velocity, and the replay runs the same two-row forward (gradients through both).
    Below 1 would extrapolate toward the negative prompt, which no recipe means.
    """
    if _is_number(guidance_scale) and float(guidance_scale) >= 1.0:
        return None
    return "must be a number >= 1.0 (1.0 = no guidance; > 1 = true CFG with negative_prompt)"


def trained_steps_problem(steps: Sequence[int], num_inference_steps: int) -> str | None:
    """None when `steps` (trained step indices) is non-empty and inside [0, num_inference_steps),
    else the problem. Generation injects SDE noise and records a transition only at trained
    steps, so a rollout without one has nothing to train on. Also the range rule of any step
    list (sde_pool)."""
    if not steps:
        return ("the trained SDE step set is empty (empty sde_indices: no step gets SDE noise or a recorded "
                f"transition); set sde_indices, or num_sde_steps (with sde_pool or sde_timestep_fraction) in {_FLAG}, "
                'e.g. "sde_indices": [1, 3, 5]')
    n = int(num_inference_steps)
    bad = [int(i) for i in steps if not 0 <= int(i) < n]
    if bad:
        return f"step indices {bad} are outside [0, num_inference_steps={n})"
    return None


#: why step 0 cannot be trained under sde_type "sde"
_STEP_ZERO_WHY = ("under sde_type=\"sde\" step 0 (sigma == 1) is only finite through the sigma_max clamp, "
                  "which is not what the sampler used")


def step_zero_problem(steps: Sequence[int], sde_type: str) -> str | None:
    """None unless `steps` trains step 0 under sde_type "sde", else the problem.

    At step 0 sigma == 1 and the "sde" coefficient eta * sqrt(sigma / (1 - sigma)) divides by
    zero; it is finite only through the arbitrary sigma_max clamp, which is not what the sampler
    used (measured: std 7.0 vs ~2.92, with the mean's sample coefficient changing sign). "dance"
    has a constant coefficient and no singularity there, and "cps" takes its std from the next
    sigma (sigma_next * sin(eta * pi / 2)), which is regular at step 0.
    """
    if sde_type != "sde" or 0 not in {int(i) for i in steps}:
        return None
    return (f"trained SDE step 0 under sde_type 'sde' is singular ({_STEP_ZERO_WHY}): use e.g. sde_indices "
            "[1,3,5] / sde_pool [1,2,3,4,5], or sde_type 'dance'")


#: why the last step cannot be trained under sde_type "cps"
_LAST_STEP_WHY = ("under sde_type \"cps\" the last step ends at sigma 0, where the CPS std sigma_next * sin(eta * pi / 2) "
                  "is 0: the step injects no noise, so it has no exploration to reward and no policy gradient")


def last_step_problem(steps: Sequence[int], sde_type: str, num_inference_steps: int) -> str | None:
    """None unless `steps` trains the last step (num_inference_steps - 1) under sde_type "cps",
    else the problem (`_LAST_STEP_WHY`). "sde" and "dance" keep a positive std there."""
    last = int(num_inference_steps) - 1
    if sde_type != "cps" or last not in {int(i) for i in steps}:
        return None
    return f"trains the last step {last} under sde_type 'cps' ({_LAST_STEP_WHY})"


def sigma_count_problem(sigmas: Sequence[float], num_inference_steps: int) -> str | None:
    """None when `sigmas` is a schedule for `num_inference_steps` steps (N + 1 values, the
    terminal 0 included, as sigma_schedule returns), else the problem."""
    n = int(num_inference_steps)
    if len(sigmas) == n + 1:
        return None
    return f"{len(sigmas)} sigmas for {n} steps; a schedule holds num_inference_steps + 1 = {n + 1} (terminal 0 included)"


class SamplingConfigError(ValueError):
    """An invalid `--sampling-config` object: every problem at once.

    `problems` holds one line per problem, each naming `--sampling-config` and the key;
    `keys` the keys those lines are about (preflight re-parses without them, so a trained
    step 0 is still reported next to an unrelated bad key).
    """

    def __init__(self, problems: list[str], keys: set[str]):
        self.problems = list(problems)
        self.keys = frozenset(keys)
        n = len(self.problems)
        super().__init__(f"invalid {_FLAG} ({n} problem{'s' if n > 1 else ''}):\n  " + "\n  ".join(self.problems))


@dataclass
class SamplingConfig:
    """Every `--sampling-config` key with its default (Relax's table).

    Build it with `parse_sampling_config`, which validates every key; constructing the class
    directly skips validation.
    """

    #: output resolution in pixels; must be a multiple of vae_scale_factor * patch_size (16
    #: for Qwen-Image). The true latent grid is rebuilt from these, never from a sequence length.
    height: int = 384
    width: int = 384
    #: denoising steps generated per image (all of them run; only the trained subset is replayed)
    num_inference_steps: int = 12
    #: 1.0 = no guidance; > 1 = true CFG (guidance_scale_problem): conditional and unconditional
    #: rows in one DiT forward, in the rollout and in the replay alike
    guidance_scale: float = 1.0
    #: a two-expert model's (Wan2.2 A14B) CFG scale for its low-noise expert's steps (WanPipeline's
    #: guidance_scale_2); null: guidance_scale. Applies only under CFG (guidance_scale > 1), and
    #: only to a two-expert --model-path
    guidance_scale_2: float | None = None
    #: the unconditional prompt of true CFG (QwenImagePipeline's default is " "); unused at 1.0
    negative_prompt: str = " "
    #: rescale the combined CFG velocity to the conditional velocity's norm per token, as
    #: diffusers' QwenImagePipeline does; unused at guidance 1.0
    cfg_renorm: bool = True
    #: SDE noise level (>= 0; > 0 when any step is trained). Used by both the sampler and the
    #: replay, so the two Gaussians are the same by construction
    eta: float = 0.7
    #: clamp used for sigma == 1 in the "sde" coefficient; leave it alone (step 0 is rejected)
    sigma_max: float = 0.99
    #: "sde": FlowGRPO's eta * sqrt(sigma / (1 - sigma)); "dance": DanceGRPO's constant eta;
    #: "cps": FlowGRPO's coefficients-preserving sampler, std = sigma_next * sin(eta * pi / 2)
    #: (needs 0 < eta <= 1; never trains the last step, whose std is 0); "wan": FlowGRPO's Wan2.1
    #: sampler, g = eta * sigmas[1] * sigma (eta 1 is FlowGRPO's; sigma_max is unused: the
    #: schedule's second sigma takes its place; needs num_inference_steps >= 2)
    sde_type: str = "sde"
    #: use the driver's own FlowMatch sigma schedule (sigma_schedule) for generation
    driver_sigmas: bool = True
    #: the driver supplies x_T and the per-step noise from (generation_seed, sample_id, step);
    #: false falls back to an engine seed of generation_seed + group_index * group_size + slot
    driver_xt: bool = True
    #: override for the x_T latent shape; default [latent_channels, *latent_grid(height, width)]
    init_noise_latent_shape: list[int] | None = None
    #: how a candidate's stable id is built (make_sample_id): metadata / positional / group_index
    sample_id_mode: str = "metadata"
    #: redraw num_sde_steps trained steps per rollout from sde_pool (seeded by the rollout id)
    sde_resample_per_rollout: bool = False
    #: candidate steps for the per-rollout redraw; default: the sde_timestep_fraction window
    sde_pool: list[int] | None = None
    #: explicit trained steps (sorted, de-duplicated); the fallback when there is no redraw,
    #: e.g. for evaluation (rollout_id None)
    sde_indices: list[int] | None = None
    #: number of trained steps: the redraw size, or stride-spaced picks inside the window
    num_sde_steps: int = 0
    #: [lo, hi] normalised window of the schedule: steps range(int(lo*N), int(hi*N))
    sde_timestep_fraction: list[float] = field(default_factory=lambda: [0.0, 1.0])
    #: FlowGRPO's SDE window: train this many CONTIGUOUS steps, the window start redrawn every
    #: rollout (seeded by the rollout id), every other step ODE; 0 = off. Replaces
    #: sde_indices / sde_pool / num_sde_steps / sde_resample_per_rollout (an error with them)
    sde_window_size: int = 0
    #: [lo, hi) step range the window lies in: start drawn from lo .. hi - sde_window_size;
    #: null = FlowGRPO's [0, num_inference_steps // 2). Evaluation (rollout_id None) uses start lo
    sde_window_range: list[int] | None = None
    #: frames per candidate: 1 (an image) for image families; a video family (--generation-task
    #: t2v) needs 4k + 1 (5, 9, ..., 33, 81: its VAE encodes the first frame alone, then groups
    #: of 4), checked by preflight against trainer.video's geometry rules
    num_frames: int = 1

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of every key (lists copied)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def fingerprint(self) -> str:
        """sha256 hex digest of the sorted, compact JSON of `to_dict()`: equal configs give
        equal fingerprints on every machine and Python version. Keys added after the first
        release (`_LATER_KEYS`) are left out while at their defaults, so a config that does
        not use them keeps the fingerprint its artifacts already carry."""
        d = self.to_dict()
        for key, default in _LATER_KEYS.items():
            if d.get(key) == default:
                del d[key]
        blob = json.dumps(d, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()


_KEYS = tuple(f.name for f in dataclasses.fields(SamplingConfig))
#: keys added after the first release, with their defaults (left out of the fingerprint there)
_LATER_KEYS = {"sde_window_size": 0, "sde_window_range": None, "negative_prompt": " ", "cfg_renorm": True,
               "num_frames": 1, "guidance_scale_2": None}
#: the window keys and what they cannot be combined with
_WINDOW_KEYS = ("sde_window_size", "sde_window_range")


def window_range(cfg: "SamplingConfig") -> list[int]:
    """The [lo, hi) step range of the SDE window: `sde_window_range`, or FlowGRPO's default
    [0, num_inference_steps // 2)."""
    if cfg.sde_window_range is not None:
        return [int(cfg.sde_window_range[0]), int(cfg.sde_window_range[1])]
    return [0, int(cfg.num_inference_steps) // 2]


# ---------------------------------------------------------------------------- parsing


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_number(v) -> bool:
    return (_is_int(v) or isinstance(v, (float, np.floating))) and math.isfinite(float(v))


def _int_list(v) -> list[int] | None:
    if isinstance(v, (list, tuple)) and all(_is_int(x) for x in v):
        return [int(x) for x in v]
    return None


def _fraction_window(fraction, num_inference_steps: int) -> list[int]:
    lo, hi = fraction
    return list(range(int(lo * num_inference_steps), int(hi * num_inference_steps)))


def parse_sampling_config(d: Mapping[str, Any] | str | SamplingConfig | None) -> SamplingConfig:
    """`--sampling-config` (a dict, a JSON object string, or None for all defaults) ->
    a validated SamplingConfig.

    Every problem is collected and raised as ONE SamplingConfigError (a ValueError), one line
    per problem, each naming `--sampling-config` and the key: unknown keys (with a did-you-mean), wrong types, and bad
    values (sde_type, sample_id_mode, eta < 0, non-positive sizes, a fraction that is not
    0 <= lo < hi <= 1, step indices outside [0, num_inference_steps), a redraw larger than its
    pool, ...). Trained step 0 is NOT an error here; preflight asks
    `trainable_step_zero_routes` for that.
    """
    if d is None:
        return SamplingConfig()
    if isinstance(d, SamplingConfig):
        d = d.to_dict()
    if isinstance(d, str):
        try:
            d = json.loads(d)
        except json.JSONDecodeError as e:
            raise ValueError(f"{_FLAG} is not valid JSON ({e}); pass a JSON object such as "
                             '\'{"num_inference_steps": 12, "eta": 0.7}\'') from None
    if not isinstance(d, Mapping):
        raise ValueError(f"{_FLAG} must be a JSON object (a dict of keys), got {type(d).__name__}")

    errors: list[str] = []
    bad_keys: set[str] = set()

    def err(key: str, msg: str) -> None:
        errors.append(f"{_FLAG} key '{key}': {msg}")
        bad_keys.add(key)

    for key in d:
        if key not in _KEYS:
            close = difflib.get_close_matches(str(key), _KEYS, n=1, cutoff=0.6)
            hint = f" (did you mean '{close[0]}'?)" if close else f"; known keys: {', '.join(_KEYS)}"
            err(str(key), f"unknown key{hint}")

    out: dict[str, Any] = {}
    ok: set[str] = set()  # keys whose value passed its own check (cross-checks need them)

    def take(key: str, check) -> None:
        if key not in d:
            ok.add(key)
            return
        value = d[key]
        problem, converted = check(value)
        if problem:
            got = json.dumps(value) if _jsonable(value) else repr(value)
            err(key, problem.format(got=got) if "{got}" in problem else f"{problem}, got {got}")
        else:
            out[key] = converted
            ok.add(key)

    def pos_int(v):
        return (None, int(v)) if _is_int(v) and v > 0 else ("must be a positive integer", None)

    def nonneg_int(v):
        return (None, int(v)) if _is_int(v) and v >= 0 else ("must be an integer >= 0", None)

    def boolean(v):
        return (None, v) if isinstance(v, bool) else ("must be true or false", None)

    def choice(options):
        def check(v):
            if isinstance(v, str) and v in options:
                return None, v
            return "must be one of " + " / ".join(f'"{o}"' for o in options), None
        return check

    def guidance(v):
        problem = guidance_scale_problem(v)
        return (problem, None) if problem else (None, float(v))

    def eta(v):
        return (None, float(v)) if _is_number(v) and v >= 0 else ("must be a number >= 0", None)

    def sigma_max(v):
        if _is_number(v) and 0.0 < float(v) < 1.0:
            return None, float(v)
        return "must be a number with 0 < sigma_max < 1 (default 0.99; leave it alone)", None

    def latent_shape(v):
        lst = _int_list(v) if v is not None else None
        if v is None:
            return None, None
        if lst and all(x > 0 for x in lst):
            return None, lst
        return "must be null or a non-empty list of positive integers, e.g. [16, 48, 48]", None

    def step_list(name):
        def check(v):
            if v is None:
                return None, None
            lst = _int_list(v)
            if not lst:
                return (f"must be null or a non-empty list of integer step indices "
                        f"(use null, not [], for no {name})"), None
            return None, lst
        return check

    def fraction(v):
        if (isinstance(v, (list, tuple)) and len(v) == 2 and all(_is_number(x) for x in v)
                and 0.0 <= float(v[0]) < float(v[1]) <= 1.0):
            return None, [float(v[0]), float(v[1])]
        return "must be [lo, hi] with 0 <= lo < hi <= 1", None

    take("height", pos_int)
    take("width", pos_int)
    take("num_inference_steps", pos_int)
    take("guidance_scale", guidance)
    take("guidance_scale_2", lambda v: (None, None) if v is None else guidance(v))
    take("negative_prompt", lambda v: (None, v) if isinstance(v, str) else ("must be a string (\" \" by default)", None))
    take("cfg_renorm", boolean)
    take("eta", eta)
    take("sigma_max", sigma_max)
    take("sde_type", choice(SDE_TYPES))
    take("driver_sigmas", boolean)
    take("driver_xt", boolean)
    take("init_noise_latent_shape", latent_shape)
    take("sample_id_mode", choice(SAMPLE_ID_MODES))
    take("sde_resample_per_rollout", boolean)
    take("sde_pool", step_list("pool"))
    take("sde_indices", step_list("trained steps"))
    take("num_sde_steps", nonneg_int)
    take("sde_timestep_fraction", fraction)
    take("sde_window_size", nonneg_int)
    take("num_frames", pos_int)

    def step_range(v):
        if v is None:
            return None, None
        lst = _int_list(v)
        if lst is not None and len(lst) == 2 and 0 <= lst[0] < lst[1]:
            return None, lst
        return "must be null or [lo, hi] step indices with 0 <= lo < hi (hi exclusive)", None

    take("sde_window_range", step_range)

    cfg = SamplingConfig(**out)
    n = cfg.num_inference_steps
    if "num_inference_steps" in ok:
        for key in ("sde_pool", "sde_indices"):
            lst = getattr(cfg, key)
            problem = trained_steps_problem(lst, n) if key in ok and lst is not None else None
            if problem:
                err(key, problem)
                ok.discard(key)
        if "sde_pool" in ok and cfg.sde_pool is not None and len(set(cfg.sde_pool)) != len(cfg.sde_pool):
            err("sde_pool", f"has repeated steps {cfg.sde_pool}; a redraw would train one step twice")
            ok.discard("sde_pool")

    cross = {"num_inference_steps", "sde_pool", "sde_indices", "num_sde_steps",
             "sde_timestep_fraction", "sde_resample_per_rollout", "eta"}
    if cross <= ok:
        window = _fraction_window(cfg.sde_timestep_fraction, n)
        frac = cfg.sde_timestep_fraction
        window_desc = f"the sde_timestep_fraction window {frac} over {n} steps = steps {window}"
        if cfg.sde_resample_per_rollout:
            pool = cfg.sde_pool if cfg.sde_pool is not None else window
            pool_desc = f"sde_pool {cfg.sde_pool}" if cfg.sde_pool is not None else window_desc
            if cfg.num_sde_steps < 1:
                err("num_sde_steps", "must be >= 1 when sde_resample_per_rollout is true "
                    "(it is the number of steps redrawn per rollout)")
            elif cfg.num_sde_steps > len(pool):
                err("num_sde_steps", f"{cfg.num_sde_steps} steps cannot be drawn without replacement "
                    f"from {pool_desc}; lower num_sde_steps or widen the pool")
        if cfg.sde_indices is None and cfg.num_sde_steps > len(window):
            err("num_sde_steps", f"{cfg.num_sde_steps} stride-spaced steps do not fit in "
                f"{window_desc}; lower num_sde_steps, widen sde_timestep_fraction or set sde_indices")
        trains = (cfg.sde_indices is not None or cfg.num_sde_steps > 0 or cfg.sde_window_size > 0)
        if trains and cfg.eta == 0.0:
            err("eta", "is 0 while SDE steps are trained; a deterministic step has no "
                "transition log-prob. Use eta > 0 (the recipes use 0.7)")

    if "sde_type" in ok and "eta" in ok and cfg.sde_type == "cps" and cfg.eta > 1.0:
        err("eta", f"is {cfg.eta}, but under sde_type 'cps' eta is the noise level in (0, 1]: the std is "
            "sigma_next * sin(eta * pi / 2), which falls again above 1 (FlowGRPO's recipes use 0.7-0.8)")
    _check_window(cfg, d, ok, err)
    if {"sde_type", "num_inference_steps"} <= ok and cfg.sde_type == "cps" and not errors:
        for line in _last_step_routes(cfg):
            err(line[0], line[1])

    if errors:
        raise SamplingConfigError(errors, bad_keys)
    return cfg


def _check_window(cfg: SamplingConfig, d: Mapping[str, Any], ok: set[str], err) -> None:
    """The SDE window's own rules: a range inside the schedule that holds the window, and no
    other way of choosing the trained steps beside it (two step sets would leave which one a
    rollout trains to the order of the checks)."""
    if not {"sde_window_size", "sde_window_range", "num_inference_steps"} <= ok:
        return
    n, size = cfg.num_inference_steps, cfg.sde_window_size
    if size == 0:
        if cfg.sde_window_range is not None:
            err("sde_window_range", "has no effect without sde_window_size > 0; set sde_window_size "
                'or drop sde_window_range, e.g. "sde_window_size": 2')
        return
    if cfg.sde_window_range is not None and cfg.sde_window_range[1] > n:
        err("sde_window_range", f"{cfg.sde_window_range} ends after the last step: hi must be <= "
            f"num_inference_steps={n}")
        return
    lo, hi = window_range(cfg)
    if hi - lo < size:
        src = "sde_window_range" if cfg.sde_window_range is not None else "the default sde_window_range [0, N // 2)"
        err("sde_window_size", f"a window of {size} steps does not fit in {src} = steps [{lo}, {hi}) "
            f"over {n} steps; lower sde_window_size or widen sde_window_range")
    clashes = [(k, bad) for k, bad in (
        ("sde_indices", cfg.sde_indices is not None),
        ("sde_pool", cfg.sde_pool is not None),
        ("num_sde_steps", cfg.num_sde_steps > 0),
        ("sde_resample_per_rollout", cfg.sde_resample_per_rollout),
    ) if bad and k in d]
    for key, _ in clashes:
        err(key, f"cannot be combined with sde_window_size={size}: the window is the trained step set "
            "(redrawn per rollout, start lo at evaluation); drop one of the two")


def _reachable_steps(cfg: SamplingConfig) -> list[tuple[str, list[int]]]:
    """(key, the steps it can make a rollout train) for every route by which a step is trained:
    sde_indices (always reachable: the evaluation fallback), the redraw's sde_pool, the
    sde_timestep_fraction window when something picks from it, and the SDE window's range."""
    n = cfg.num_inference_steps
    routes: list[tuple[str, list[int]]] = []
    if cfg.sde_window_size > 0:
        lo, hi = window_range(cfg)
        return [("sde_window_range", list(range(lo, min(hi, n))))]
    if cfg.sde_indices is not None:
        routes.append(("sde_indices", list(cfg.sde_indices)))
    if cfg.sde_resample_per_rollout and cfg.sde_pool is not None:
        routes.append(("sde_pool", list(cfg.sde_pool)))
    window = _fraction_window(cfg.sde_timestep_fraction, n)
    if cfg.num_sde_steps > 0 and cfg.sde_resample_per_rollout and cfg.sde_pool is None:
        routes.append(("sde_timestep_fraction", window))  # the redraw's pool
    elif cfg.num_sde_steps > 0 and cfg.sde_indices is None and cfg.num_sde_steps <= len(window):
        k = cfg.num_sde_steps  # the stride-spaced picks (resolve_sde_indices, rule 3)
        routes.append(("sde_timestep_fraction", [window[(j * len(window)) // k] for j in range(k)]))
    return routes


def _last_step_routes(cfg: SamplingConfig) -> list[tuple[str, str]]:
    """(key, problem) for every route that can train the last step under sde_type "cps"."""
    out = []
    for key, steps in _reachable_steps(cfg):
        problem = last_step_problem(steps, cfg.sde_type, cfg.num_inference_steps)
        if problem:
            out.append((key, f"can train steps {steps}, which {problem}; keep the trained steps below "
                        f"{cfg.num_inference_steps - 1}"))
    return out


def _jsonable(v) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


def _as_config(sampling_config, num_inference_steps: int | None = None) -> SamplingConfig:
    if isinstance(sampling_config, SamplingConfig):
        return sampling_config
    d = dict(sampling_config or {})
    if num_inference_steps is not None:
        d.setdefault("num_inference_steps", num_inference_steps)
    return parse_sampling_config(d)


# ---------------------------------------------------------------------------- trained steps


def resolve_sde_indices(
    sampling_config: Mapping[str, Any] | SamplingConfig,
    num_inference_steps: int,
    rollout_id: int | None,
) -> list[int]:
    """The trained (and noise-injected) SDE step indices for one rollout, in this order:

    0. `sde_window_size` k > 0: the contiguous window range(start, start + k) inside
       [lo, hi) = `window_range(cfg)`, start = np.random.default_rng(rollout_id).integers(lo,
       hi - k + 1) (uniform, as FlowGRPO's randint(lo, hi - k)), or start = lo at evaluation
       (rollout_id None); the window keys exclude every other way below;
    1. `sde_resample_per_rollout` and rollout_id is not None: pool = `sde_pool` or the fraction
       window; sorted(np.random.default_rng(rollout_id).choice(pool, size=num_sde_steps,
       replace=False)) -- reproducible, identical on every rank with no communication;
    2. else `sde_indices`: sorted, de-duplicated (also the evaluation fallback, rollout_id None);
    3. else `num_sde_steps > 0`: window = range(int(lo*N), int(hi*N)) for
       `sde_timestep_fraction` [lo, hi]; window[floor(k * len(window) / num_sde_steps)] for
       k < num_sde_steps (e.g. [0.0, 0.5] over 12 steps, 3 steps -> [0, 2, 4]);
    4. else [] (packing a trajectory with no trained step must then fail loudly).

    `sampling_config` is a SamplingConfig or a raw dict (validated; a missing
    num_inference_steps is taken from the argument). N = `num_inference_steps`.
    """
    cfg = _as_config(sampling_config, num_inference_steps)
    n = int(num_inference_steps)
    if n < 1:
        raise ValueError(f"num_inference_steps must be >= 1, got {n}")
    window = _fraction_window(cfg.sde_timestep_fraction, n)

    if cfg.sde_window_size > 0:
        k = int(cfg.sde_window_size)
        lo, hi = window_range(cfg)
        if not (0 <= lo and hi <= n and hi - lo >= k):
            raise ValueError(f"{_FLAG}: a window of sde_window_size={k} steps does not fit in "
                             f"sde_window_range [{lo}, {hi}) over {n} steps")
        if rollout_id is None:
            start = lo
        else:
            if not _is_int(rollout_id) or rollout_id < 0:
                raise ValueError(f"rollout_id must be an integer >= 0 (it seeds the window), got {rollout_id!r}")
            start = int(np.random.default_rng(int(rollout_id)).integers(lo, hi - k + 1))
        return list(range(start, start + k))
    if cfg.sde_resample_per_rollout and rollout_id is not None:
        pool = list(cfg.sde_pool) if cfg.sde_pool is not None else window
        if not 1 <= cfg.num_sde_steps <= len(pool):
            raise ValueError(f"{_FLAG}: cannot draw num_sde_steps={cfg.num_sde_steps} steps from pool {pool}")
        problem = trained_steps_problem(pool, n)
        if problem:
            raise ValueError(f"{_FLAG} key 'sde_pool': {problem}")
        if not _is_int(rollout_id) or rollout_id < 0:
            raise ValueError(f"rollout_id must be an integer >= 0 (it seeds the redraw), got {rollout_id!r}")
        picked = np.random.default_rng(int(rollout_id)).choice(pool, size=cfg.num_sde_steps, replace=False)
        return sorted(int(i) for i in picked)
    if cfg.sde_indices is not None:
        out = sorted({int(i) for i in cfg.sde_indices})
        problem = trained_steps_problem(out, n)
        if problem:
            raise ValueError(f"{_FLAG} key 'sde_indices': {problem}")
        return out
    if cfg.num_sde_steps > 0:
        k_total = cfg.num_sde_steps
        if k_total > len(window):
            raise ValueError(f"{_FLAG}: num_sde_steps={k_total} does not fit in the window {window}")
        return [window[(k * len(window)) // k_total] for k in range(k_total)]
    return []


def trainable_step_zero_routes(cfg: SamplingConfig | Mapping[str, Any] | None) -> list[str]:
    """One human-readable line per route by which a rollout can train step 0 under
    sde_type="sde" (see `step_zero_problem`); [] when there is none, and always [] for "dance".

    Routes: explicit `sde_indices` (always reachable: it is the evaluation fallback), `sde_pool`
    (when `sde_resample_per_rollout` draws from it), the derived `sde_timestep_fraction`
    window (when it is the redraw pool, or when num_sde_steps picks from it), and the SDE
    window's range (`sde_window_size` > 0 with lo == 0). Preflight turns each line into an error.
    """
    if not isinstance(cfg, SamplingConfig):
        cfg = parse_sampling_config(cfg)
    n = cfg.num_inference_steps
    fix = f"; {_STEP_ZERO_WHY}"
    routes: list[str] = []
    if cfg.sde_window_size > 0:
        lo, hi = window_range(cfg)
        if step_zero_problem([lo], cfg.sde_type):
            src = "" if cfg.sde_window_range is not None else " (the default [0, num_inference_steps // 2))"
            routes.append(f"{_FLAG} keys 'sde_window_size' / 'sde_window_range': the window of "
                          f"{cfg.sde_window_size} steps in [{lo}, {hi}){src} can start at step 0{fix}. "
                          f"Start the range at 1, e.g. \"sde_window_range\": [1, {max(hi, 1 + cfg.sde_window_size)}].")
        return routes
    if cfg.sde_indices is not None and step_zero_problem(cfg.sde_indices, cfg.sde_type):
        routes.append(f"{_FLAG} key 'sde_indices' {cfg.sde_indices} trains step 0{fix}. "
                      "Drop 0, e.g. \"sde_indices\": [1, 3, 5].")
    if cfg.sde_resample_per_rollout and cfg.sde_pool is not None and step_zero_problem(cfg.sde_pool, cfg.sde_type):
        routes.append(f"{_FLAG} key 'sde_pool' {cfg.sde_pool} lets the per-rollout redraw pick step 0{fix}. "
                      "Drop 0, e.g. \"sde_pool\": [1, 2, 3, 4, 5].")
    window = _fraction_window(cfg.sde_timestep_fraction, n)
    users = []
    if cfg.sde_resample_per_rollout and cfg.sde_pool is None and cfg.num_sde_steps > 0:
        users.append("the per-rollout redraw uses it as its pool (sde_pool is null)")
    if cfg.sde_indices is None and cfg.num_sde_steps > 0:
        picks = resolve_sde_indices(dataclasses.replace(cfg, sde_resample_per_rollout=False), n, None)
        users.append(f"num_sde_steps={cfg.num_sde_steps} picks {picks} from it")
    if users and step_zero_problem(window, cfg.sde_type):
        routes.append(
            f"{_FLAG} key 'sde_timestep_fraction' {cfg.sde_timestep_fraction} over {n} steps starts at "
            f"step 0 and {' and '.join(users)}{fix}. Start the fraction above 1/num_inference_steps "
            f"(> {1.0 / n:.4g}) or set sde_pool / sde_indices without 0."
        )
    return routes


# ---------------------------------------------------------------------------- geometry


def latent_grid(height: int, width: int, vae_scale_factor: int = 8, patch_size: int = 2) -> tuple[int, int]:
    """Latent spatial size (h, w) = (height // vae_scale_factor, width // vae_scale_factor).

    height and width must be multiples of vae_scale_factor * patch_size (16 for Qwen-Image;
    8 for the tiny test VAE whose factor is 4): the pipeline would otherwise silently round
    the image size down, and the packed 2x2 patches would not tile the latent.
    """
    m = vae_scale_factor * patch_size
    bad = [f"{name}={v}" for name, v in (("height", height), ("width", width))
           if not _is_int(v) or v <= 0 or v % m != 0]
    if bad:
        raise ValueError(
            f"{_FLAG}: {', '.join(bad)} must be a positive multiple of {m} "
            f"(vae_scale_factor {vae_scale_factor} x patch_size {patch_size}), e.g. {max(m, 384 // m * m)}"
        )
    return height // vae_scale_factor, width // vae_scale_factor


def image_seq_len(height: int, width: int, vae_scale_factor: int = 8, patch_size: int = 2) -> int:
    """Number of packed image tokens, (h / patch) * (w / patch) for (h, w) = latent_grid(...):
    what QwenImagePipeline feeds calculate_shift (576 at 384x384)."""
    h, w = latent_grid(height, width, vae_scale_factor, patch_size)
    return (h // patch_size) * (w // patch_size)


def init_noise_shape(cfg: Any, latent_channels: int = 16, vae_scale_factor: int = 8,
                     patch_size: int = 2) -> list[int]:
    """Per-candidate x_T shape: `init_noise_latent_shape` if set, else
    [latent_channels, *latent_grid(height, width)] (the VAE's z_dim channels, unpacked).

    cfg: a SamplingConfig or an engine RolloutRequest (both carry height, width and
    init_noise_latent_shape)."""
    if cfg.init_noise_latent_shape is not None:
        return [int(v) for v in cfg.init_noise_latent_shape]
    return [int(latent_channels), *latent_grid(cfg.height, cfg.width, vae_scale_factor, patch_size)]


def load_scheduler_config(model_path: str) -> dict[str, Any]:
    """Read <model_path>/scheduler/scheduler_config.json (the model's own schedule settings)."""
    path = os.path.join(model_path, "scheduler", "scheduler_config.json")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ValueError(f"--model-path {model_path!r} has no scheduler/scheduler_config.json; "
                         "point it at a diffusers-format model directory") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None


def calculate_shift(image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096,
                    base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """Resolution-dependent shift mu: linear in image_seq_len through (base_seq_len, base_shift)
    and (max_seq_len, max_shift). Same formula and defaults as QwenImagePipeline's."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    b = base_shift - m * base_seq_len
    return image_seq_len * m + b


_UNSUPPORTED_SCHEDULER_FLAGS = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas")


def _check_flow_match_scheduler(cfg: Mapping[str, Any]) -> None:
    """Raise ValueError unless the scheduler config is a FlowMatchEulerDiscreteScheduler without
    the sigma conversions this sampler does not implement."""
    cls = cfg.get("_class_name", "FlowMatchEulerDiscreteScheduler")
    if cls != "FlowMatchEulerDiscreteScheduler":
        raise ValueError(f"scheduler {cls!r} is not supported: the SDE sampler assumes FlowMatchEulerDiscreteScheduler "
                         "(scheduler/scheduler_config.json)")
    on = [k for k in _UNSUPPORTED_SCHEDULER_FLAGS if cfg.get(k)]
    if on:
        raise ValueError(f"scheduler_config.json sets {on}, which this sampler does not implement")


def sigma_schedule(scheduler_config: Mapping[str, Any], num_inference_steps: int, image_seq_len: int) -> list[float]:
    """The N + 1 sigmas (terminal 0 included) that QwenImagePipeline +
    FlowMatchEulerDiscreteScheduler use for this scheduler config, N = num_inference_steps.

    sigmas = linspace(1, 1/N, N) as float32; then
      use_dynamic_shifting: mu = calculate_shift(image_seq_len, base_image_seq_len,
          max_image_seq_len, base_shift, max_shift) and the time shift
          "exponential": e^mu / (e^mu + (1/s - 1)),  "linear": mu / (mu + (1/s - 1));
      else the static shift: shift * s / (1 + (shift - 1) * s);
    then, if shift_terminal is set, the stretch 1 - (1 - s) * (1 - shift_terminal) / (1 - s[-1]);
    then a terminal 0. Computed in float32 in the scheduler's order so the values are the
    scheduler's float32 sigmas exactly (returned as python floats). Missing keys take the
    scheduler's / pipeline's defaults. sigmas[0] is exactly 1.0 under every shift.
    """
    cfg = dict(scheduler_config)
    _check_flow_match_scheduler(cfg)
    n = int(num_inference_steps)
    if n < 1:
        raise ValueError(f"num_inference_steps must be >= 1, got {n}")

    sigmas = np.linspace(1.0, 1.0 / n, n).astype(np.float32)
    return _shifted_schedule(sigmas, cfg, image_seq_len)


def scheduler_sigma_schedule(scheduler_config: Mapping[str, Any], num_inference_steps: int,
                             image_seq_len: int) -> list[float]:
    """The N + 1 sigmas (terminal 0 included) of FlowMatchEulerDiscreteScheduler.set_timesteps(N)
    when the pipeline passes no sigmas of its own: what StableDiffusion3Pipeline samples with.

    The scheduler's construction keeps sigma_max = s(1) and sigma_min = s(1/T) of its training
    grid (T = num_train_timesteps, float32; under a static shift s(x) = shift * x / (1 + (shift -
    1) * x), else s(x) = x); set_timesteps then takes linspace(sigma_max * T, sigma_min * T, N) / T
    in float64 and applies the shift AGAIN (the static one, or the dynamic time shift at
    mu = calculate_shift(image_seq_len, ...)), then the terminal stretch if shift_terminal is set,
    rounds to float32 and appends 0. That double application of the static shift is the SD3
    pipelines' schedule; sigma_schedule (explicit linspace(1, 1/N, N) sigmas) is Qwen-Image's and
    FLUX's. Values are the scheduler's float32 sigmas exactly (as python floats); missing keys take
    the scheduler's defaults.
    """
    cfg = dict(scheduler_config)
    _check_flow_match_scheduler(cfg)
    n = int(num_inference_steps)
    if n < 1:
        raise ValueError(f"num_inference_steps must be >= 1, got {n}")
    t_train = int(cfg.get("num_train_timesteps", 1000))
    shift = cfg.get("shift", 1.0)
    dynamic = bool(cfg.get("use_dynamic_shifting", False))
    grid = np.linspace(1, t_train, t_train, dtype=np.float32)[::-1] / np.float32(t_train)  # float32, like torch
    if not dynamic:
        grid = (np.float32(shift) * grid / (np.float32(1) + np.float32(shift - 1) * grid)).astype(np.float32)
    sigma_max, sigma_min = float(grid[0]), float(grid[-1])
    sigmas = np.linspace(sigma_max * t_train, sigma_min * t_train, n) / t_train  # float64, as set_timesteps
    return _shifted_schedule(sigmas, cfg, image_seq_len)


def _shifted_schedule(sigmas: np.ndarray, cfg: Mapping[str, Any], image_seq_len: int) -> list[float]:
    """The scheduler's shift of N base sigmas, then its terminal stretch, as float32, plus the
    terminal 0: the dynamic time shift at mu = calculate_shift(image_seq_len, ...) when
    use_dynamic_shifting, else the static shift * s / (1 + (shift - 1) * s); then, if
    shift_terminal is set, 1 - (1 - s) * (1 - shift_terminal) / (1 - s[-1]). Computed in the
    dtype of `sigmas` (float32 for sigma_schedule, float64 for scheduler_sigma_schedule, as the
    pipelines do); raises on a non-finite result."""
    n = len(sigmas)
    if cfg.get("use_dynamic_shifting", False):
        mu = calculate_shift(image_seq_len, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                             cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
        kind = cfg.get("time_shift_type", "exponential")
        if kind == "exponential":
            sigmas = math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1) ** 1.0)
        elif kind == "linear":
            sigmas = mu / (mu + (1 / sigmas - 1) ** 1.0)
        else:
            raise ValueError(f"scheduler time_shift_type {kind!r} must be 'exponential' or 'linear'")
    else:
        shift = cfg.get("shift", 1.0)
        sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    terminal = cfg.get("shift_terminal")
    if terminal:
        one_minus = 1 - sigmas
        scale = one_minus[-1] / (1 - terminal)
        with np.errstate(divide="ignore", invalid="ignore"):  # N == 1 -> 0/0, reported below
            sigmas = 1 - (one_minus / scale)
    sigmas = np.asarray(sigmas, dtype=np.float32)
    if not np.all(np.isfinite(sigmas)):
        # e.g. shift_terminal with N == 1: the stretch divides by 1 - sigma[-1] == 0
        raise ValueError(f"the scheduler config gives non-finite sigmas for num_inference_steps={n}: "
                         f"{sigmas.tolist()}; use more steps")
    return [float(v) for v in sigmas] + [0.0]


def timesteps_from_sigmas(sigmas, num_train_timesteps: int = 1000) -> list[float]:
    """Scheduler timesteps t = sigma * num_train_timesteps (float32, elementwise: pass the N
    step sigmas, i.e. sigma_schedule(...)[:-1], to get the scheduler's N timesteps).

    QwenImagePipeline calls the transformer with `timestep = t.to(latents.dtype) / 1000`, i.e.
    the sigma again, but rounded through the model dtype (bf16 in a bf16 engine): see
    `transformer_timestep`. The SDE math itself uses the float32 sigmas.
    """
    t = np.asarray(sigmas, dtype=np.float32) * np.float32(num_train_timesteps)
    return [float(x) for x in t]


def transformer_timestep(timesteps, dtype=None, batch_size: int | None = None):
    """The `timestep` argument QwenImagePipeline passes to the transformer: the scheduler
    timestep cast to the latents' dtype, then divided by 1000. torch, lazily imported."""
    import torch

    t = torch.as_tensor(timesteps, dtype=torch.float32)
    if batch_size is not None and t.dim() == 0:
        t = t.expand(batch_size)
    if dtype is not None:
        t = t.to(dtype)
    return t / 1000


# ---------------------------------------------------------------------------- seeds


def _seed_from(*parts) -> int:
    blob = "\x1f".join(str(p) for p in parts).encode("utf-8")
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "big") & ((1 << 63) - 1)


def _check_seed_args(generation_seed, sample_id) -> None:
    if not _is_int(generation_seed):
        raise TypeError(f"--generation-seed must be an integer, got {generation_seed!r}")
    if not isinstance(sample_id, str) or not sample_id:
        raise TypeError(f"sample_id must be a non-empty string, got {sample_id!r}")


def candidate_seed(generation_seed: int, sample_id: str) -> int:
    """63-bit seed of one candidate's x_T: the first 8 bytes of
    sha256("flowgrpo-xt" | generation_seed | sample_id), masked to 63 bits."""
    _check_seed_args(generation_seed, sample_id)
    return _seed_from("flowgrpo-xt", int(generation_seed), sample_id)


def rollout_generation_seed(generation_seed: int, rollout_id: int) -> int:
    """The generation seed of training rollout `rollout_id`: sha256 of the base seed and the
    rollout id, 63 bits.

    A prompt drawn again in a later rollout (every epoch; every rollout on a small prompt set)
    then explores fresh x_T and SDE noise instead of replaying the same few candidates forever,
    while a candidate stays a pure function of (seed, rollout id, sample id, step), identical on
    any rank, device or batch, and after a resume. Evaluation keeps the base seed, so its figure
    is comparable across rollouts."""
    if not _is_int(rollout_id) or rollout_id < 0:
        raise ValueError(f"rollout_id must be an integer >= 0, got {rollout_id!r}")
    return _seed_from("flowgrpo-rollout", int(generation_seed), str(int(rollout_id)))


def step_seed(generation_seed: int, sample_id: str, step: int) -> int:
    """63-bit seed of one candidate's SDE noise at denoising step `step` (sha256 of the
    candidate seed and the step), independent of candidate_seed's stream."""
    if not _is_int(step) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    return _seed_from("flowgrpo-step", candidate_seed(generation_seed, sample_id), int(step))


def _randn(shape, seed: int):
    import torch

    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return torch.randn(tuple(int(s) for s in shape), generator=g, dtype=torch.float32, device="cpu")


def initial_noise(shape, generation_seed: int, sample_id: str):
    """x_T of one candidate: standard normal, `shape` (no batch dim), fp32 on CPU, drawn with a
    CPU torch.Generator seeded with candidate_seed(generation_seed, sample_id). Move / cast it
    after drawing; never draw on the device (device RNG streams differ)."""
    return _randn(shape, candidate_seed(generation_seed, sample_id))


def step_noise(shape, generation_seed: int, sample_id: str, step: int):
    """The SDE noise eps of one candidate at step `step`: fp32 on CPU, seeded with
    step_seed(generation_seed, sample_id, step)."""
    return _randn(shape, step_seed(generation_seed, sample_id, step))


def make_sample_id(mode: str, group_index: int, slot: int, metadata: Mapping[str, Any] | None = None) -> str:
    """A candidate's stable id, which drives its x_T and per-step noise.

    "metadata":               f"prompt:{prompt_id or sample_id or group_index}:sample:{slot}"
                              (prompt_id / sample_id read from the prompt's metadata), so a
                              prompt keeps its noise wherever it lands in the data order;
    "positional"/"group_index": f"prompt:{group_index}:sample:{slot}".
    Only the `sample_id_mode` key of --sampling-config selects the mode: Relax's
    RELAX_NATIVE_GENERATION_SAMPLE_ID_MODE environment override is not supported.
    """
    if mode not in SAMPLE_ID_MODES:
        raise ValueError(f"{_FLAG} key 'sample_id_mode' must be one of {SAMPLE_ID_MODES}, got {mode!r}")
    key = group_index
    if mode == "metadata":
        md = metadata or {}
        key = md.get("prompt_id") or md.get("sample_id") or group_index
    return f"prompt:{key}:sample:{slot}"
