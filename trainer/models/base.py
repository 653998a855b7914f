"""The model-adapter protocol: everything model-family specific the runtime needs.

The runtime depends only on this surface: the actor (train model, LoRA targets, never-trained
parameters), the loop and rollout (requests, trajectory checks, replay) and the native engine (its modules,
prompt encoding, latent layout, velocity, decode). docs/architecture.md lists it with its callers. A new family is a new adapter class chosen by
--model-adapter-path (a dotpath), plus its task string in GENERATION_TASKS.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence, runtime_checkable

# Only tasks with a working replay path are listed here.
GENERATION_TASKS = ("t2i",)


#: the prefix of the unconditional entries of a true-CFG conditions dict
NEGATIVE_PREFIX = "negative_"


def module_device_dtype(module: Any) -> tuple[Any, Any]:
    """(device, compute dtype) of a transformer for a replay's inputs: the device of its first
    floating parameter (a DTensor's local shard under FSDP2) and, under FSDP2 mixed precision,
    the policy's param_dtype (the dtype its weights are gathered and computed in: the actor
    passes inputs uncast, so the replay casts them), else that parameter's dtype. (cpu, None)
    when it has none."""
    import torch

    policy_dtype = None
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        FSDPModule = ()
    if isinstance(module, FSDPModule):
        policy = getattr(module._get_fsdp_state(), "_mp_policy", None)
        policy_dtype = getattr(policy, "param_dtype", None)
    for p in module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.is_floating_point():
            return local.device, policy_dtype or local.dtype
    return torch.device("cpu"), None


def apply_attention_policy(adapter: Any, device: Any) -> bool:
    """Turn off cuDNN's fused attention for the whole process when the family says its backward
    fails there (`cudnn_attention = False` on the adapter; absent means allowed). Process-wide on
    purpose: the engine samples with the same attention kernels the actor replays with. Only on
    CUDA; returns whether it turned the backend off."""
    import logging

    import torch

    if getattr(device, "type", device) != "cuda" or getattr(adapter, "cudnn_attention", True):
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    logging.getLogger(__name__).info("%s: cuDNN attention off for this process (flash / memory-efficient "
                                     "attention instead)", getattr(adapter, "family", type(adapter).__name__))
    return True


def with_negative(conditions: dict, negative: dict) -> dict:
    """One conditions dict for true CFG: the conditional entries as they are plus every
    unconditional entry under NEGATIVE_PREFIX + its name. Both dicts hold [B, ...] tensors."""
    return {**conditions, **{NEGATIVE_PREFIX + k: v for k, v in negative.items()}}


def split_negative(conditions: dict) -> tuple[dict, dict]:
    """Inverse of with_negative: (conditional entries, unconditional entries under their plain
    names). An entry whose name starts with NEGATIVE_PREFIX is always an unconditional one."""
    pos = {k: v for k, v in conditions.items() if not k.startswith(NEGATIVE_PREFIX)}
    neg = {k[len(NEGATIVE_PREFIX):]: v for k, v in conditions.items() if k.startswith(NEGATIVE_PREFIX)}
    return pos, neg


def check_pipeline_dir(model_path: Any, subfolders: Sequence[str], *, family: str, family_flag: str,
                       pipeline: str, expected: Sequence[str]) -> Path:
    """The model directory as a Path, after checking it is a local directory holding
    `subfolders`. Raises FileNotFoundError naming --model-path, the family (`family`, its
    tools/make_tiny_model.py flag `family_flag`, "" for the default) and the subfolders a
    `pipeline` directory has (`expected`)."""
    path = Path(model_path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"--model-path {str(model_path)!r} is not a directory; point it at a local diffusers {family} directory "
            f"(nothing is downloaded; tools/make_tiny_model.py{family_flag} builds a tiny one)")
    missing = [s for s in subfolders if not (path / s).is_dir()]
    if missing:
        raise FileNotFoundError(
            f"--model-path {str(path)!r} has no {', '.join(s + '/' for s in missing)} subfolder: not a diffusers "
            f"{pipeline} directory (expected model_index.json, {', '.join(s + '/' for s in expected)})")
    return path


@dataclass(frozen=True)
class GeometryBounds:
    """What a model directory can draw, read from its JSON configs (no weights): each family's
    `geometry_bounds(model_path)` fills it, `geometry_problems` checks a geometry against it.

    multiple: height and width must be multiples of it (VAE scale factor x the latent packing /
    patch size), or None when unknown; max_size: the largest height or width in pixels, or None
    when the family has no such limit; max_sequence_length: the most text tokens the family's
    pipeline encodes; why_multiple / why_max: the configs and values those numbers come from."""

    multiple: int | None = None
    max_size: int | None = None
    max_sequence_length: int | None = None
    why_multiple: str = ""
    why_max: str = ""


def read_config_json(model_path: Any, sub: str) -> dict | None:
    """`<model_path>/<sub>/config.json` as a dict, or None when it is absent or unreadable (loading
    the model reports that, naming the file)."""
    import json

    try:
        data = json.loads((Path(model_path) / sub / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return None
    return data if isinstance(data, dict) else None


def geometry_problems(adapter: Any, model_path: Any, height: int | None, width: int | None,
                      max_sequence_length: int | None = None) -> list[str]:
    """Why `model_path` cannot draw height x width with `max_sequence_length` text tokens, as one
    line per problem naming the --sampling-config key or the flag, the largest value the model
    supports and the config it comes from; [] when it can (or when the adapter, a class or an
    instance, has no `geometry_bounds`). Reads JSON only: preflight and the tools run it before
    any weights load, where diffusers would otherwise fail after minutes of loading."""
    bounds_of = getattr(adapter, "geometry_bounds", None)
    if bounds_of is None:
        return []
    b: GeometryBounds = bounds_of(model_path)
    cls = adapter if isinstance(adapter, type) else type(adapter)
    name = f"{cls.__module__}.{cls.__qualname__}"
    problems = []
    for key, value in (("height", height), ("width", width)):
        if value is None:
            continue
        if b.max_size is not None and value > b.max_size:
            problems.append(f"--sampling-config {key} {value} is more than --model-path {model_path} can draw: "
                            f"{b.why_max} allow at most {b.max_size} pixels; use {key} <= {b.max_size}")
        elif b.multiple and value % b.multiple:
            lower = max(b.multiple, value - value % b.multiple)
            problems.append(f"--sampling-config {key} {value} is not a multiple of {b.multiple} ({b.why_multiple} "
                            f"of --model-path {model_path}); use e.g. {lower}")
    if max_sequence_length is not None and b.max_sequence_length is not None and \
            max_sequence_length > b.max_sequence_length:
        problems.append(f"--max-sequence-length {max_sequence_length} is more than {name} allows "
                        f"({b.max_sequence_length} text tokens, its pipeline's limit); use at most "
                        f"{b.max_sequence_length}")
    return problems


class ModelFilesError(ValueError):
    """A model directory's files contradict each other; the message names the file to fix."""


def load_checked_transformer(model_cls: Any, path: Path, dtype: Any = None) -> Any:
    """`model_cls.from_pretrained(<path>/transformer)`, local files only, eval mode; `dtype` None
    keeps the stored dtype. Weights the files lack, have extra or shape differently raise
    ModelFilesError naming the config: diffusers leaves such weights on the meta device and only
    warns, and the first use then fails with "Cannot copy out of meta tensor", which names nothing."""
    kwargs: dict[str, Any] = {"subfolder": "transformer", "local_files_only": True}
    if dtype is not None:
        kwargs["dtype"] = dtype
    model, info = model_cls.from_pretrained(str(path), output_loading_info=True, **kwargs)
    problems = [f"{len(info[k])} {what}, e.g. {sorted(info[k])[:3]}" for k, what in (
        ("missing_keys", "weights the config needs are absent from the files"),
        ("unexpected_keys", "weights in the files have no place in the config"),
        ("mismatched_keys", "weights have another shape than the config says")) if info.get(k)]
    if problems:
        raise ModelFilesError(f"{path / 'transformer' / 'config.json'} does not match the weight files in "
                              f"{path / 'transformer'}: {'; '.join(problems)}. Restore the config.json that was "
                              "saved with these weights (or the weights of this config)")
    return model.eval()


def standard_rollout_request(prompt: str, *, group_index: int, slot: int, sample_id: str, sampling: Any,
                             sde_indices: list[int], sigmas: list[float], generation_seed: int,
                             metadata: dict | None = None):
    """One candidate as an engine RolloutRequest under the shared invariants of trainer.sampling
    (what every family's build_rollout_request checks; a family adds its own checks first).

    Raises ValueError when guidance_scale < 1.0, when the trained-step set is empty, out of
    range, or trains step 0 under sde_type "sde", and when `sigmas` is not
    num_inference_steps + 1 values. guidance_scale > 1 carries the sampling config's
    negative_prompt and cfg_renorm (true CFG).
    """
    from trainer.engine.base import RolloutRequest
    from trainer.sampling import (guidance_scale_problem, sigma_count_problem, step_zero_problem,
                                  trained_steps_problem)

    guidance = float(getattr(sampling, "guidance_scale", 1.0))
    n = int(sampling.num_inference_steps)
    steps = sorted({int(i) for i in sde_indices})
    sde_type = getattr(sampling, "sde_type", "sde")
    for where, problem in (
        (f"--sampling-config guidance_scale is {guidance}, but", guidance_scale_problem(guidance)),
        (f"trained SDE steps {steps}:", trained_steps_problem(steps, n)),
        (f"trained SDE steps {steps}:", step_zero_problem(steps, sde_type)),
        ("sigmas:", sigma_count_problem(sigmas, n)),
    ):
        if problem:
            raise ValueError(f"{where} {problem}")
    shape = getattr(sampling, "init_noise_latent_shape", None)
    return RolloutRequest(
        prompt=prompt,
        group_index=int(group_index),
        slot=int(slot),
        sample_id=str(sample_id),
        height=int(sampling.height),
        width=int(sampling.width),
        num_inference_steps=n,
        sigmas=[float(s) for s in sigmas],
        sde_indices=steps,
        eta=float(sampling.eta),
        sde_type=sde_type,
        sigma_max=float(getattr(sampling, "sigma_max", 0.99)),
        guidance_scale=guidance,
        negative_prompt=str(getattr(sampling, "negative_prompt", " ")),
        cfg_renorm=bool(getattr(sampling, "cfg_renorm", True)),
        generation_seed=int(generation_seed),
        metadata=dict(metadata or {}),
        init_noise_latent_shape=None if shape is None else [int(v) for v in shape],
    )


@runtime_checkable
class GenerativeModelAdapter(Protocol):
    family: str
    supported_tasks: tuple[str, ...]
    #: module-name suffixes LoRA is applied to when --lora-target-modules is unset
    lora_target_modules: tuple[str, ...]

    def load_train_model(self, model_path: str, *, dtype: Any = None, revision: str | None = None) -> Any:
        """Load only the trainable transformer (frozen text encoder / VAE belong to the engine)."""

    def build_rollout_request(self, prompt: str, *, group_index: int, slot: int, sample_id: str,
                              sampling: Any, sde_indices: list[int], sigmas: list[float],
                              generation_seed: int, metadata: dict | None = None) -> Any:
        """Turn one candidate into an engine RolloutRequest; guidance_scale != 1.0 raises."""

    def validate_trajectory(self, traj: Any) -> None:
        """Raise ValueError when an engine's trajectory.Trajectory does not fit this family (its
        generic shape checks, Trajectory.validate, plus the family's latent layout and conditions)."""

    def replay_transition(self, transformer: Any, batch: Any, step: int, sampling: Any) -> Any:
        """Log-prob [B] (fp32) of the recorded transition of trained-step column `step` of a
        Trajectory, recomputed through `transformer` with the same math the sampler used."""

    def replay_transitions(self, transformer: Any, batch: Any, sampling: Any) -> Any:
        """Log-probs [B, S] (fp32) of every trained-step column at once (what the update calls);
        equal to S replay_transition calls up to batch-size-dependent rounding."""

    def never_trained_param_names(self, model: Any) -> list[str]:
        """Parameters (wrapper-free model names) of the train model whose output the family
        discards, so they can never receive a gradient; the actor freezes exactly these. [] when
        there are none."""

    # -- the engine's side (engine/native.py is generic over these) ----------------------------
    #
    # Conditioning travels as a dict of named tensors, never as a fixed tuple: Qwen-Image's is
    # {"prompt_embeds", "prompt_embeds_mask"}, SD3's {"prompt_embeds", "pooled_prompt_embeds"}.
    # A per-prompt dict holds rows without the batch dimension; a batch dict holds [B, ...]
    # tensors and becomes the Trajectory's `conditions`; true CFG adds the unconditional
    # conditioning under the same names prefixed "negative_". A token sequence X padded to a
    # common length carries its mask as X_mask [B, T] int64 (Trajectory.cat pads by that rule).

    #: text tokens the prompt encoder keeps when the engine is given no max_sequence_length
    max_sequence_length: int
    # optional: cudnn_attention = False turns cuDNN's fused attention off in the training process
    # (apply_attention_policy), for a family whose attention backward fails there
    # optional: a classmethod geometry_bounds(model_path) -> GeometryBounds, read from the model
    # directory's JSON configs only: what it can draw, checked before any weights load
    # (geometry_problems)

    def load_rollout_modules(self, model_path: str, *, dtype: Any, device: Any) -> dict[str, Any]:
        """The frozen pipeline from a local directory: "transformer", "vae", "text_encoder" (one
        nn.Module; a family with several encoders returns an nn.ModuleDict of them), "tokenizer"
        (whatever the prompt encoder takes) and "scheduler_config" (a dict), modules already on
        `device` in `dtype`."""

    def prompt_encoder(self, transformer: Any, vae: Any, text_encoder: Any, tokenizer: Any,
                       scheduler_config: dict) -> Any:
        """A callable encode(prompts, device, max_sequence_length) -> dict name -> [B, ...] tensor:
        the conditioning of each prompt encoded as the family's pipeline encodes it (masks, if
        any, int64 with 1 = real token)."""

    def batch_conditions(self, rows: Any) -> dict[str, Any]:
        """Per-candidate condition dicts (each entry without the batch dimension, as one row of
        the prompt encoder's output) -> one batch dict of [B, ...] tensors (the family decides
        which entries are padded and carries their masks)."""

    def sigma_schedule(self, scheduler_config: dict, num_inference_steps: int, height: int, width: int,
                       vae_scale_factor: int) -> list[float]:
        """The N + 1 sigmas (terminal 0 included) the family's pipeline samples with at height x
        width, bit-exact with its scheduler (float32 values as python floats)."""

    def latent_geometry(self, vae: Any) -> tuple[int, int]:
        """(vae_scale_factor, latent channels) of the VAE."""

    def initial_latents(self, x_t: Any, transformer: Any, height: int, width: int, vae_scale_factor: int) -> Any:
        """Unpacked x_T [B, C, h, w] -> the DiT's input layout; raises if the shape does not fit."""

    def velocity(self, transformer: Any, x: Any, t: Any, conditions: dict[str, Any], height: int, width: int,
                 vae_scale_factor: int) -> Any:
        """The DiT's velocity for latents x at scheduler timesteps t [B] fp32 (sigma x
        num_train_timesteps) under a batch conditions dict: the call replay makes too."""

    def guided_velocity(self, transformer: Any, x: Any, t: Any, conditions: dict[str, Any], height: int, width: int,
                        vae_scale_factor: int, guidance_scale: float, renorm: bool) -> Any:
        """True-CFG velocity (guidance_scale > 1): `conditions` holds the conditional entries and
        their "negative_" partners; conditional and unconditional rows in one forward, combined;
        the call replay makes too."""

    def decode(self, vae: Any, latents: Any, height: int, width: int, vae_scale_factor: int) -> Any:
        """Final latents -> images [B, 3, H, W] float32 in [0, 1] on CPU."""

    # -- misc ------------------------------------------------------------------------------

    def artifact_tracks(self) -> tuple[str, ...]:
        """Media tracks a rollout produces (e.g. ("image",))."""

    def weight_name_map(self, name: str) -> str:
        """Map a training-side parameter name to the engine's name."""
