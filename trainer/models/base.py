"""The model-adapter protocol and the family base class.

The runtime depends only on the protocol (`GenerativeModelAdapter`): the actor (train model, LoRA
targets, never-trained parameters), the loop and rollout (requests, trajectory checks, replay) and
the native engine (its modules, prompt encoding, latent layout, velocity, decode).
docs/architecture.md lists it with its callers. `FamilyAdapter` implements the part every family
shares (the request, the replay, the packed latent layout, the weight names), so a family writes
only what is its own: loading, prompt encoding, the schedule, the DiT call (`velocity`) and the
decode. A new family is a new adapter class chosen by --model-adapter-path (a dotpath), plus its
task string in GENERATION_TASKS.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence, runtime_checkable

import torch

from trainer.config import GENERATION_TASKS  # noqa: F401  (the adapters' tasks; defined torch-free there)
from trainer.sampling import SamplingConfig
from trainer.trajectory import Geometry, RolloutRequest, SamplerSettings, Trajectory

#: the attention projections of both streams of a joint (MMDiT) block, as diffusers names them:
#: the image stream's to_q / to_k / to_v / to_out.0 and the text stream's add_*_proj / to_add_out.
#: Every shipped family's default LoRA target list (FlowGRPO's)
ATTENTION_LORA_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)


#: the prefix of the unconditional entries of a true-CFG conditions dict
NEGATIVE_PREFIX = "negative_"


def module_device_dtype(module: Any) -> tuple[Any, Any]:
    """(device, compute dtype) of a transformer for a replay's inputs: the device of its first
    floating parameter (a DTensor's local shard under FSDP2) and, under FSDP2 mixed precision,
    the policy's param_dtype (the dtype its weights are gathered and computed in: the actor
    passes inputs uncast, so the replay casts them), else that parameter's dtype. (cpu, None)
    when it has none."""
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


def load_checked_transformer(model_cls: Any, path: Path, dtype: Any = None, subfolder: str = "transformer") -> Any:
    """`model_cls.from_pretrained(<path>/<subfolder>)`, local files only, eval mode; `dtype` None
    keeps the stored dtype. Weights the files lack, have extra or shape differently raise
    ModelFilesError naming the config: diffusers leaves such weights on the meta device and only
    warns, and the first use then fails with "Cannot copy out of meta tensor", which names nothing."""
    kwargs: dict[str, Any] = {"subfolder": subfolder, "local_files_only": True}
    if dtype is not None:
        kwargs["dtype"] = dtype
    model, info = model_cls.from_pretrained(str(path), output_loading_info=True, **kwargs)
    problems = [f"{len(info[k])} {what}, e.g. {sorted(info[k])[:3]}" for k, what in (
        ("missing_keys", "weights the config needs are absent from the files"),
        ("unexpected_keys", "weights in the files have no place in the config"),
        ("mismatched_keys", "weights have another shape than the config says")) if info.get(k)]
    if problems:
        raise ModelFilesError(f"{path / subfolder / 'config.json'} does not match the weight files in "
                              f"{path / subfolder}: {'; '.join(problems)}. Restore the config.json that was "
                              "saved with these weights (or the weights of this config)")
    return model.eval()


def refuse_cfg_renorm(guidance_scale: float, cfg_renorm: bool, pipeline: str) -> None:
    """Raise ValueError when cfg_renorm is asked for under true CFG (guidance_scale > 1): that
    rescale is QwenImagePipeline's, and `pipeline` (the family's diffusers pipeline) has none. The
    families without it call this when building a request and again in their velocity (a
    trajectory recorded elsewhere can carry the setting)."""
    if float(guidance_scale) > 1.0 and cfg_renorm:
        raise ValueError(f"--sampling-config cfg_renorm is true, but {pipeline}'s CFG has no rescale (it is "
                         "QwenImagePipeline's); set cfg_renorm false for this family")


def standard_rollout_request(prompt: str, *, group_index: int, slot: int, sample_id: str,
                             sampling: SamplingConfig, sde_indices: list[int], sigmas: list[float],
                             generation_seed: int, metadata: dict | None = None) -> RolloutRequest:
    """One candidate as an engine RolloutRequest under the shared invariants of trainer.sampling
    (what every family's build_rollout_request checks; a family adds its own checks first).

    Raises ValueError when guidance_scale < 1.0, when the trained-step set is empty, out of
    range, or trains step 0 under sde_type "sde", and when `sigmas` is not
    num_inference_steps + 1 values. guidance_scale > 1 carries the sampling config's
    negative_prompt and cfg_renorm (true CFG).
    """
    from trainer.sampling import guidance_scale_problem, sigma_count_problem, step_zero_problem, trained_steps_problem

    guidance = float(sampling.guidance_scale)
    n = int(sampling.num_inference_steps)
    steps = sorted({int(i) for i in sde_indices})
    sde_type = sampling.sde_type
    for where, problem in (
        (f"--sampling-config guidance_scale is {guidance}, but", guidance_scale_problem(guidance)),
        (f"trained SDE steps {steps}:", trained_steps_problem(steps, n)),
        (f"trained SDE steps {steps}:", step_zero_problem(steps, sde_type)),
        ("sigmas:", sigma_count_problem(sigmas, n)),
        ("--sampling-config sde_type \"wan\":", "needs num_inference_steps >= 2 (its noise scale is the schedule's "
         "second sigma)" if sde_type == "wan" and n < 2 else None),
    ):
        if problem:
            raise ValueError(f"{where} {problem}")
    # FlowGRPO's Wan SDE scales its noise by the schedule's second sigma: the request (and so
    # the trajectory the replay reads) carries it as sigma_max
    sigma_max = float(sigmas[1]) if sde_type == "wan" else float(sampling.sigma_max)
    shape = sampling.init_noise_latent_shape
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
        sigma_max=sigma_max,
        guidance_scale=guidance,
        negative_prompt=str(sampling.negative_prompt),
        cfg_renorm=bool(sampling.cfg_renorm),
        generation_seed=int(generation_seed),
        metadata=dict(metadata or {}),
        init_noise_latent_shape=None if shape is None else [int(v) for v in shape],
        num_frames=int(getattr(sampling, "num_frames", 1)),
    )


@runtime_checkable
class GenerativeModelAdapter(Protocol):
    """What the runtime calls on a family (docs/architecture.md has the table with the callers;
    FamilyAdapter implements the shared members and documents each).

    Conditioning travels as a dict of named tensors, never as a fixed tuple: Qwen-Image's is
    {"prompt_embeds", "prompt_embeds_mask"}, SD3's {"prompt_embeds", "pooled_prompt_embeds"}. A
    per-prompt dict holds rows without the batch dimension; a batch dict holds [B, ...] tensors
    and becomes the Trajectory's `conditions`; true CFG adds the unconditional conditioning under
    the same names prefixed "negative_". A token sequence X padded to a common length carries its
    mask as X_mask [B, T] int64 (Trajectory.cat pads by that rule). Optional: cudnn_attention =
    False turns cuDNN's fused attention off in the training process (apply_attention_policy)."""

    family: str
    #: module-name suffixes LoRA is applied to when --lora-target-modules is unset
    lora_target_modules: tuple[str, ...]
    #: text tokens the prompt encoder keeps when the engine is given no max_sequence_length
    max_sequence_length: int
    # optional: a classmethod geometry_bounds(model_path) -> GeometryBounds, read from the model
    # directory's JSON configs only: what it can draw, checked before any weights load
    # (geometry_problems; an adapter without one is not checked)

    # -- the actor's and the loop's side ----------------------------------------------------

    def load_train_model(self, model_path: str, *, dtype: Any = None, revision: str | None = None) -> Any:
        """Only the trainable transformer (frozen text encoder / VAE belong to the engine)."""

    def never_trained_param_names(self, model: Any) -> list[str]:
        """Wrapper-free names of parameters whose output the family discards (the actor freezes them)."""

    def build_rollout_request(self, prompt: str, *, group_index: int, slot: int, sample_id: str,
                              sampling: SamplingConfig, sde_indices: list[int], sigmas: list[float],
                              generation_seed: int, metadata: dict | None = None) -> RolloutRequest:
        """One candidate as a RolloutRequest; invalid sampling settings raise ValueError."""

    def validate_trajectory(self, traj: Trajectory) -> None:
        """Raise ValueError when an engine's Trajectory does not fit this family."""

    def replay_transitions(self, transformer: Any, batch: Trajectory) -> Any:
        """Log-probs [B, S] (fp32) of every trained-step column, with the sampler's math and call."""

    def replay_moments(self, transformer: Any, batch: Trajectory) -> Any:
        """flow_grpo.TransitionMoments of replay_transitions' forward (the KL's inputs)."""

    def replay_transition(self, transformer: Any, batch: Trajectory, step: int) -> Any:
        """Log-prob [B] (fp32) of trained-step column `step`."""

    def weight_name_map(self, name: str) -> str:
        """Training-side parameter name -> the engine's name."""

    # -- the engine's side (engine/native.py is generic over these) -------------------------

    def load_rollout_modules(self, model_path: str, *, dtype: Any, device: Any) -> dict[str, Any]:
        """"transformer", "vae", "text_encoder" (one nn.Module), "tokenizer", "scheduler_config"
        from a local directory, modules on `device` in `dtype`."""

    def prompt_encoder(self, transformer: Any, vae: Any, text_encoder: Any, tokenizer: Any,
                       scheduler_config: dict) -> Any:
        """encode(prompts, device, max_sequence_length) -> {name: [B, ...]}, as the pipeline encodes."""

    def split_prompt_batch(self, encoded: dict[str, Any]) -> list[dict[str, Any]]:
        """One prompt_encoder call's [B, ...] tensors -> B per-prompt dicts, each as a call with
        that prompt alone returns it, without the batch dimension (FamilyAdapter's default: row i)."""

    def batch_conditions(self, rows: Any) -> dict[str, Any]:
        """Per-candidate condition dicts -> one batch dict of [B, ...] tensors (padded where needed)."""

    def sigma_schedule(self, scheduler_config: dict, num_inference_steps: int, geometry: Geometry) -> list[float]:
        """The N + 1 sigmas (terminal 0 included) of the family's pipeline, bit-exact."""

    def latent_geometry(self, vae: Any) -> tuple[int, int]:
        """(vae_scale_factor, latent channels) of the VAE."""

    def initial_latents(self, x_t: Any, transformer: Any, geometry: Geometry) -> Any:
        """Unpacked x_T [B, C, h, w] -> the DiT's input layout; raises if the shape does not fit."""

    def velocity(self, transformer: Any, x: Any, t: Any, conditions: dict[str, Any], geometry: Geometry,
                 sampler: SamplerSettings, *, rollout_dtype: Any = None) -> Any:
        """The DiT's velocity at scheduler timesteps t [B] fp32 (sigma x num_train_timesteps): the
        ONE call the engine samples with and the replay recomputes. sampler.guided: true CFG, the
        conditional and "negative_" rows in one forward. rollout_dtype: the dtype the engine
        sampled in (None: x's), for a family that rounds its timestep through it."""

    def decode(self, vae: Any, latents: Any, geometry: Geometry) -> Any:
        """Final latents -> images [B, 3, H, W] float32 in [0, 1] on CPU."""


# ----------------------------------------------------------------------------- the shared part


def packed_grid(height: int, width: int, vae_scale_factor: int, patch_size: int = 2) -> tuple[int, int]:
    """(rows, cols) of 2 x 2-packed latent patches for height x width pixels:
    (H // (vsf * p), W // (vsf * p)); the DiT's sequence length is rows * cols (the
    QwenImagePipeline / FluxPipeline grid)."""
    f = int(vae_scale_factor) * patch_size
    return int(height) // f, int(width) // f


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] latents -> [B, (h/2) * (w/2), 4C]: token (i, j) holds channels c-major of the
    2 x 2 patch at rows 2i..2i+1, cols 2j..2j+1 (the pipelines' _pack_latents)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(latents: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of pack_latents: [B, rows * cols, 4C] -> [B, C, 2 * rows, 2 * cols]. Raises
    ValueError when the token count is not rows x cols."""
    b, n, c4 = latents.shape
    if n != rows * cols:
        raise ValueError(f"packed latents hold {n} tokens, expected {rows} x {cols} = {rows * cols}")
    x = latents.view(b, rows, cols, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c4 // 4, rows * 2, cols * 2)


class FamilyAdapter:
    """What every family adapter shares; a family subclasses it and writes what is its own:
    `load_train_model`, `load_rollout_modules`, `prompt_encoder`, `batch_conditions`,
    `sigma_schedule`, `latent_geometry`, `velocity`, `decode` and `check_trajectory` (plus,
    where its pipeline differs, `build_rollout_request`, `never_trained_param_names` and the
    latent layout: the default is the 2 x 2-packed token sequence [B, L, 4C]).

    The replay is here, once: it reads the sampler settings and the geometry from the trajectory
    and calls the same `velocity` the engine sampled with, so "rollout and replay share one DiT
    call" holds by construction for every family."""

    family: str = ""
    lora_target_modules: tuple[str, ...] = ATTENTION_LORA_TARGETS
    max_sequence_length: int = 512

    def __init__(self, vae_scale_factor: int | None = None):
        #: set from the model directory by load_train_model
        self.vae_scale_factor = vae_scale_factor

    def prepare_block_compile(self) -> None:
        """Called before the engine (--rollout-compile) or the actor (--fsdp-compile) compiles
        this family's DiT blocks: process-wide set-up that lets them compile well without changing
        what an eager forward computes. Nothing by default."""

    # -- loading --------------------------------------------------------------------------

    def load_train_model(self, model_path: str, *, dtype: Any = None, revision: str | None = None) -> Any:
        """Only the trainable transformer (the family's `load_transformer`; the frozen text
        encoders and VAE belong to the engine), then self.vae_scale_factor from
        <model_path>/vae/config.json (the family's `vae_scale_factor_from_config`). `revision`
        only labels the run: loading is always from the local directory."""
        import json

        model = self.load_transformer(model_path, dtype=dtype)
        cfg_path = Path(model_path) / "vae" / "config.json"
        try:
            self.vae_scale_factor = self.vae_scale_factor_from_config(json.loads(cfg_path.read_text()))
        except (OSError, ValueError, KeyError) as e:
            raise FileNotFoundError(f"cannot read the VAE's scale factor from {cfg_path} ({e}); is --model-path a "
                                    f"{self.family} model directory?") from None
        return model

    # -- rollout --------------------------------------------------------------------------

    def split_prompt_batch(self, encoded: dict[str, Any]) -> list[dict[str, Any]]:
        """Row i of every tensor of one prompt_encoder call over several prompts: what the call
        with prompt i alone returns, for encoders that pad every prompt to one fixed length (or
        none). A family whose encoder pads to the batch's longest prompt cuts each row to its
        own length."""
        n = len(next(iter(encoded.values())))
        return [{k: v[i] for k, v in encoded.items()} for i in range(n)]

    def build_rollout_request(self, prompt: str, *, group_index: int, slot: int, sample_id: str,
                              sampling: SamplingConfig, sde_indices: list[int], sigmas: list[float],
                              generation_seed: int, metadata: dict | None = None) -> RolloutRequest:
        """One candidate as an engine RolloutRequest (standard_rollout_request: raises ValueError
        for a guidance below 1, an empty / out-of-range trained-step set, a trained step 0 under
        sde_type "sde", a sigma list that is not num_inference_steps + 1 long)."""
        return standard_rollout_request(prompt, group_index=group_index, slot=slot, sample_id=sample_id,
                                        sampling=sampling, sde_indices=sde_indices, sigmas=sigmas,
                                        generation_seed=generation_seed, metadata=metadata)

    def validate_trajectory(self, traj: Trajectory) -> None:
        """Trajectory.validate, then the family's own layout and conditions (check_trajectory)."""
        traj.validate()
        self.check_trajectory(traj, traj.sample_ids[0])

    def check_trajectory(self, traj: Trajectory, who: str) -> None:
        """The family's checks of a validated trajectory (ValueError naming candidate `who`):
        here the packed layout, [B, S, L, C] with L the geometry's token grid."""
        if traj.latents.dim() != 4:
            raise ValueError(f"trajectory of {who}: latents {tuple(traj.latents.shape)} must be packed [B, S, L, C]")
        rows, cols = packed_grid(traj.height, traj.width, traj.vae_scale_factor)
        seq = int(traj.latents.shape[2])
        if seq != rows * cols:
            raise ValueError(f"trajectory of {who}: latents hold {seq} tokens but height x width = {traj.height} x "
                             f"{traj.width} with vae_scale_factor {traj.vae_scale_factor} gives {rows} x {cols}; "
                             "the engine's geometry is wrong")

    def initial_latents(self, x_t: Any, transformer: Any, geometry: Geometry) -> Any:
        """Unpacked x_T [B, C, h, w] -> the DiT's packed input [B, L, 4C], after checking the shape
        fits the geometry on this transformer (a wrong init_noise_latent_shape names itself)."""
        rows, cols = packed_grid(geometry.height, geometry.width, geometry.vae_scale_factor)
        shape = list(x_t.shape[1:])
        in_ch = int(transformer.config.in_channels)
        if len(shape) != 3 or shape[1] != 2 * rows or shape[2] != 2 * cols or shape[0] * 4 != in_ch:
            raise ValueError(f"x_T shape {shape} does not fit {geometry.height}x{geometry.width} on this model "
                             f"(expected [{in_ch // 4}, {2 * rows}, {2 * cols}]); fix --sampling-config "
                             "init_noise_latent_shape or height/width")
        return pack_latents(x_t)

    # -- replay ---------------------------------------------------------------------------

    def replay_transition(self, transformer: Any, batch: Trajectory, step: int) -> Any:
        """Log-prob [B] (fp32) of trained-step column `step` of `batch` (replay_transitions of that
        one column)."""
        return self.replay_transitions(transformer, batch.columns(step, step + 1))[:, 0]

    def replay_transitions(self, transformer: Any, batch: Trajectory) -> Any:
        """Log-probs [B, S] (fp32) of EVERY trained-step column of `batch` in one DiT forward over
        S * B rows (row k * B + i = candidate i at column k; the family's velocity doubles them
        under true CFG), instead of S forwards of B rows.

        Each row carries its own timestep, sigmas and conditioning and the DiT treats rows
        independently, so the result is that of S one-column calls up to the GEMM's
        batch-size-dependent rounding; fewer, larger launches are what make the replay fast at
        real scale. The velocity is the engine's own call (`velocity`) with the trajectory's
        geometry and sampler settings; the DiT input is the recorded latents in the module's
        parameter dtype (FSDP2 mixed precision then casts to its compute dtype) and the
        timestep is rounded through the rollout's dtype, as the sampler did: exact at equal
        dtypes. The log-prob math (flow_grpo.replay_transition_logp) runs in fp32 on the
        recorded tensors. Differentiable w.r.t. the transformer's parameters."""
        return self._replay(transformer, batch, moments=False)

    def replay_moments(self, transformer: Any, batch: Trajectory) -> Any:
        """flow_grpo.TransitionMoments (logp [B, S], transition mean [B, S, ...] fp32, std [B, S]
        fp32) of replay_transitions' forward: the KL to a reference policy."""
        return self._replay(transformer, batch, moments=True)

    def _replay(self, transformer: Any, batch: Trajectory, *, moments: bool) -> Any:
        from trainer.flow_grpo import replay_columns_logp, replay_columns_moments

        device, compute_dtype = module_device_dtype(transformer)
        lat = batch.latents
        b, s = int(lat.shape[0]), int(lat.shape[1])

        def rows(t: Any) -> Any:  # [B, S, ...] -> [S * B, ...], column-major
            return t.transpose(0, 1).reshape(s * b, *t.shape[2:])

        def tiled(t: Any) -> Any:  # [B, ...] -> [S * B, ...], column-major
            return t.repeat(s, *([1] * (t.dim() - 1)))

        # contiguous like the sampler's own latents: a strided input takes another GEMM path,
        # which in bf16 changes the velocity by an ulp and the log-prob by ~1e-4
        recorded = rows(lat).to(device).contiguous()
        next_latents = rows(batch.next_latents).to(device)
        x = recorded.to(compute_dtype or recorded.dtype)
        conditions = {k: tiled(v) for k, v in batch.conditions.items()}
        velocity = self.velocity(transformer, x, rows(batch.timesteps), conditions, batch.geometry, batch.sampler,
                                 rollout_dtype=recorded.dtype)
        sp = batch.sampler
        replay = replay_columns_moments if moments else replay_columns_logp
        return replay(recorded, next_latents, velocity, rows(batch.sigmas).to(device),
                      rows(batch.sigmas_next).to(device), b, s, eta=float(sp.eta), sde_type=sp.sde_type, sigma_max=float(sp.sigma_max))

    # -- the actor's side -----------------------------------------------------------------

    def autoencoder_kl_modules(self, path: Path, *, dtype: Any, device: Any, text_encoder: Any,
                               tokenizer: Any) -> dict[str, Any]:
        """load_rollout_modules' dict for a family with a diffusers AutoencoderKL, the text
        encoders and tokenizers already loaded: scheduler_config, then the transformer and the
        VAE, each moved to `device` as soon as it is loaded."""
        from diffusers import AutoencoderKL

        from trainer.sampling import load_scheduler_config

        return {
            "scheduler_config": load_scheduler_config(str(path)),
            "transformer": self.load_transformer(path, dtype=dtype).to(device),
            "vae": AutoencoderKL.from_pretrained(str(path), subfolder="vae", dtype=dtype,
                                                 local_files_only=True).to(device),
            "text_encoder": text_encoder,
            "tokenizer": tokenizer,
            "path": path,
        }

    def never_trained_param_names(self, model: Any) -> list[str]:
        """[]: no parameter's output is discarded (a family whose last block drops an output overrides)."""
        return []

    def weight_name_map(self, name: str) -> str:
        """Training-side parameter name -> engine name: both are diffusers names once wrapper
        segments are stripped (core.names.strip_wrapper_segments; idempotent)."""
        from trainer.core.names import strip_wrapper_segments

        return strip_wrapper_segments(name)


@dataclass(frozen=True)
class Replay:
    """The replay the actor's update calls, over an adapter: `replay(model, rows)` -> log-probs
    [b, S] fp32 of every trained-step column of the Trajectory `rows`, and
    `replay.moments(model, rows)` -> flow_grpo.TransitionMoments of the same forward (the KL).

    one_forward: all S columns in one forward of b * S rows (`replay_transitions`), else one
    forward per column (`replay_transition`, the baseline the tests compare it with)."""

    adapter: Any
    one_forward: bool = True

    def __call__(self, model: Any, rows: Trajectory) -> Any:
        if self.one_forward:
            return self.adapter.replay_transitions(model, rows)
        return torch.stack([self.adapter.replay_transition(model, rows, c) for c in range(rows.num_steps)], dim=1)

    def moments(self, model: Any, rows: Trajectory) -> Any:
        return self.adapter.replay_moments(model, rows)
