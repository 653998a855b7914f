"""The project's SGLang diffusion plugin (entry point group "sglang.multimodal_gen.plugins",
declared in setup.cfg), and the pieces of the SGLang engine that live inside SGLang's
request path.

SGLang loads this plugin through its own plugin mechanism (`load_plugins` /
`apply_plugin_hooks`, which the SGLang engine calls before it builds its worker). Nothing
here edits installed files; everything goes through SGLang's supported extension points:

- `register()` (the entry point): registers pure-PyTorch versions of the sgl_kernel CPU ops
  that SGLang's Qwen-Image DiT calls on CPU, but only where sgl_kernel does not provide them
  (a CPU test machine without sglang-kernel), and an AROUND hook on two SGLang functions:
  * `rollout_hooks.prepare_rollout_if_enabled`: for a request that carries a
    `TrainerRolloutSpec` in `Req.extra`, the visual-stream rollout controller becomes a
    `TrainerRolloutController` (a subclass of SGLang's FlowRolloutController);
  * `TimestepPreparationStage.forward`: such a request runs on the driver's sigma list,
    verbatim (SGLang would shift caller sigmas a second time).
  Requests without a spec (SGLang serving traffic) are untouched.
- `TrainerRolloutController`: at the trained steps, the transition is trainer.flow_grpo's
  `sde_step` ("sde" and "dance") over the request's rows, each row with its own candidate's
  per-step noise from trainer.sampling (a pure function of (generation_seed, sample_id,
  step)); it records the latents before / after, the sigma pair and the per-row log-probs.
  Every other step is SGLang's own ODE update.

A request's x_T (one row per candidate) is handed to SGLang as `Req.latents` (an input SGLang's
latent preparation accepts and packs); see trainer/engine/sglang_engine.py.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)

#: the key of a TrainerRolloutSpec in SGLang's Req.extra
SPEC_KEY = "flowgrpo_trainer_rollout"

#: SGLang targets the hooks are registered on (checked by sglang_engine.check_sglang_contract)
PREPARE_ROLLOUT_TARGET = "sglang.multimodal_gen.runtime.post_training.rollout_hooks.prepare_rollout_if_enabled"
TIMESTEP_STAGE_TARGET = ("sglang.multimodal_gen.runtime.pipelines_core.stages.timestep_preparation."
                         "TimestepPreparationStage.forward")
TEXT_POSTPROCESS_TARGET = "sglang.multimodal_gen.configs.pipeline_configs.qwen_image.qwen_image_postprocess_text"
HOOK_TARGETS = (PREPARE_ROLLOUT_TARGET, TIMESTEP_STAGE_TARGET, TEXT_POSTPROCESS_TARGET)
#: SGLang's fused norm ops whose CUDA kernels are CuTe-DSL (the `cutlass` package of
#: nvidia-cutlass-dsl); hooked only where that package is absent (see cutedsl_fallback_hook)
CUTEDSL_NORM_TARGETS = tuple(f"sglang.multimodal_gen.runtime.layers.layernorm.{cls}.forward_cuda"
                             for cls in ("_NormScaleShift", "_ScaleResidualNormScaleShift"))

#: the sgl_kernel CPU ops SGLang's Qwen-Image DiT calls on CPU (runtime/layers/layernorm.py)
CPU_OPS = {
    "fused_norm_scale_shift_cpu":
        "fused_norm_scale_shift_cpu(Tensor x, Tensor? weight, Tensor? bias, Tensor scale, Tensor shift, "
        "str norm_type, float eps) -> Tensor",
    "fused_scale_residual_norm_scale_shift_cpu":
        "fused_scale_residual_norm_scale_shift_cpu(Tensor residual, Tensor x, Tensor? gate, Tensor? weight, "
        "Tensor? bias, Tensor scale, Tensor shift, str norm_type, float eps) -> (Tensor, Tensor)",
}


# ----------------------------------------------------------------------------- CPU ops


def _norm(x: torch.Tensor, weight, bias, norm_type: str, eps: float) -> torch.Tensor:
    """LayerNorm / RMSNorm over the last dim in fp32, with the optional affine."""
    xf = x.float()
    if norm_type == "layer":
        out = torch.nn.functional.layer_norm(xf, (xf.shape[-1],), None, None, eps)
    elif norm_type == "rms":
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    else:
        raise ValueError(f"unknown norm_type {norm_type!r}")
    if weight is not None:
        out = out * weight.float()
    if bias is not None:
        out = out + bias.float()
    return out


def fused_norm_scale_shift_cpu(x, weight, bias, scale, shift, norm_type: str, eps: float) -> torch.Tensor:
    """norm(x) * (1 + scale) + shift, in x's dtype (scale / shift already expanded to x's
    [B, L, C] by SGLang's expand_scale_shift_cpu_param)."""
    out = _norm(x, weight, bias, norm_type, eps) * (1.0 + scale.float()) + shift.float()
    return out.to(x.dtype)


def fused_scale_residual_norm_scale_shift_cpu(residual, x, gate, weight, bias, scale, shift, norm_type: str,
                                              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(r) * (1 + scale) + shift, r) with r = residual + x * gate (gate None: 1)."""
    r = residual + (x if gate is None else x * gate)
    out = _norm(r, weight, bias, norm_type, eps) * (1.0 + scale.float()) + shift.float()
    return out.to(x.dtype), r


_IMPLS = {"fused_norm_scale_shift_cpu": fused_norm_scale_shift_cpu,
          "fused_scale_residual_norm_scale_shift_cpu": fused_scale_residual_norm_scale_shift_cpu}
_LIBRARY: Any = None  # keeps the torch.library registration alive


def missing_cpu_ops() -> list[str]:
    """The CPU ops of CPU_OPS that torch.ops.sgl_kernel does not have."""
    ns = torch.ops.sgl_kernel
    return [name for name in CPU_OPS if not hasattr(ns, name)]


def register_cpu_ops() -> list[str]:
    """Register the pure-PyTorch versions of the missing CPU ops; returns their names."""
    global _LIBRARY
    missing = missing_cpu_ops()
    if not missing:
        return []
    if _LIBRARY is None:
        _LIBRARY = torch.library.Library("sgl_kernel", "FRAGMENT")
    for name in missing:
        _LIBRARY.define(CPU_OPS[name])
        _LIBRARY.impl(name, _IMPLS[name], "CPU")
    log.info("registered pure-PyTorch sgl_kernel CPU ops: %s", missing)
    return missing


# ----------------------------------------------------------------------------- rollout pieces


@dataclass
class TrainerRolloutSpec:
    """What one SGLang request must sample exactly as the trainer replays it.

    One request carries one or more candidates (rows of SGLang's batch, in its sample order);
    row b is candidate (generation_seeds[b], sample_ids[b]). sigmas: the driver's N + 1 sigmas
    (terminal 0 included), used verbatim. The noise of trained step i for row b is
    trainer.sampling.step_noise(shape, generation_seeds[b], sample_ids[b], i). `records` is filled
    during the run: per trained step, (step, latents before [B, ...], latents after [B, ...],
    sigma, sigma_next, log_probs [B]).
    """

    sample_ids: list[str]
    generation_seeds: list[int]
    sigmas: list[float]
    sde_indices: list[int]
    eta: float
    sde_type: str
    sigma_max: float
    latent_dtype: torch.dtype
    records: list[dict[str, Any]] = field(default_factory=list)
    used_sigmas: list[float] | None = None

    def __post_init__(self):
        if len(self.sample_ids) != len(self.generation_seeds) or not self.sample_ids:
            raise ValueError(f"a rollout spec needs one generation seed per candidate; got {len(self.sample_ids)} "
                             f"sample ids and {len(self.generation_seeds)} seeds")


def spec_of(batch) -> TrainerRolloutSpec | None:
    extra = getattr(batch, "extra", None)
    return extra.get(SPEC_KEY) if isinstance(extra, dict) else None


def _controller_base():
    from sglang.multimodal_gen.runtime.post_training.flow_rollout_controller import FlowRolloutController

    return FlowRolloutController


def make_controller_class():
    """TrainerRolloutController, built lazily (sglang is an optional import)."""
    base = _controller_base()

    class TrainerRolloutController(base):
        """SGLang's FlowRolloutController with the trainer's transition at the trained steps."""

        spec: TrainerRolloutSpec

        @classmethod
        def from_upstream(cls, ctrl, spec: TrainerRolloutSpec):
            obj = cls.__new__(cls)
            obj.__dict__.update(ctrl.__dict__)
            obj.spec = spec
            return obj

        def flow_sde_sampling(self, batch, model_output, sample, current_sigma, next_sigma, step_index):
            from trainer.flow_grpo import sde_step
            from trainer.sampling import step_noise

            spec = self.spec
            if step_index not in spec.sde_indices:
                # SGLang's own ODE update (the controller's sde_type is "ode" for these requests)
                return super().flow_sde_sampling(batch, model_output, sample, current_sigma, next_sigma,
                                                 step_index)
            rows = len(spec.sample_ids)
            if model_output.shape[0] != rows:
                raise ValueError(f"SGLang batched {model_output.shape[0]} rows, the trainer's request holds {rows} "
                                 "candidates")
            s, s_next = spec.sigmas[step_index], spec.sigmas[step_index + 1]
            # the driver's schedule must be the one SGLang steps on (see the timestep hook)
            if abs(float(current_sigma) - s) > 1e-6 or abs(float(next_sigma) - s_next) > 1e-6:
                raise RuntimeError(f"SGLang stepped sigma {float(current_sigma)} -> {float(next_sigma)} at step "
                                   f"{step_index}, the driver's schedule has {s} -> {s_next}")
            x = sample.to(spec.latent_dtype)  # the latents as the trajectory records them
            shape = tuple(x.shape[1:])
            noise = torch.stack([step_noise(shape, seed, sid, step_index)
                                 for seed, sid in zip(spec.generation_seeds, spec.sample_ids)])
            x_next, logp = sde_step(x, model_output, s, s_next, spec.eta, noise.to(x.device), spec.sde_type,
                                    spec.sigma_max, out_dtype=spec.latent_dtype)
            spec.records.append({"step": step_index, "latents": x.detach().cpu().clone(),
                                 "next_latents": x_next.detach().cpu().clone(), "sigma": s, "sigma_next": s_next,
                                 "log_probs": logp.detach().float().cpu().clone()})
            # SGLang's log-prob bookkeeping (it reads one value per row and step); mean = sum / count
            count = float(x[0].numel())
            self.append_local_rollout_log_probs(logp.float() * count, logp.new_full((rows,), count).float())
            return x_next.float()

    return TrainerRolloutController


_CONTROLLER_CLASS = None


def controller_class():
    global _CONTROLLER_CLASS
    if _CONTROLLER_CLASS is None:
        _CONTROLLER_CLASS = make_controller_class()
    return _CONTROLLER_CLASS


def prepare_rollout_hook(original, *args, **kwargs):
    """AROUND prepare_rollout_if_enabled: swap in the trainer's controller for spec requests."""
    from sglang.multimodal_gen.runtime.post_training.rollout_hooks import VISUAL_STREAM

    result = original(*args, **kwargs)
    batch = kwargs.get("batch", args[0] if args else None)
    spec = spec_of(batch)
    if spec is not None:
        ctrl = batch.rollout_controllers.get(VISUAL_STREAM)
        if ctrl is None:
            raise RuntimeError("SGLang built no visual-stream rollout controller for a trainer rollout request")
        batch.rollout_controllers[VISUAL_STREAM] = controller_class().from_upstream(ctrl, spec)
    return result


def timestep_stage_hook(original, stage, batch, server_args, *args, **kwargs):
    """AROUND TimestepPreparationStage.forward: a spec request runs on the driver's sigmas
    verbatim. SGLang's stage would pass them through its scheduler's dynamic shift (mu) a
    second time; here the rollout scheduler is set up by the stage as usual and then given
    the driver's grid, checked."""
    spec = spec_of(batch)
    if spec is None:
        return original(stage, batch, server_args, *args, **kwargs)
    batch.sigmas = None  # let the stage build its own grid and scheduler first
    out = original(stage, batch, server_args, *args, **kwargs)
    scheduler = out.scheduler
    n = len(spec.sigmas) - 1
    if tuple(scheduler.sigmas.shape) != (n + 1,):
        raise RuntimeError(f"SGLang's rollout scheduler holds {tuple(scheduler.sigmas.shape)} sigmas, the driver "
                           f"sends {n + 1}")
    device = scheduler.sigmas.device
    sig = torch.tensor(spec.sigmas, dtype=torch.float32, device=device)
    scheduler.sigmas = sig
    scheduler.timesteps = sig[:-1] * float(scheduler.config.num_train_timesteps)
    out.timesteps = scheduler.timesteps
    out.sigmas = [float(s) for s in spec.sigmas[:-1]]
    spec.used_sigmas = [float(s) for s in sig.tolist()]
    return out


#: the Qwen-Image text window the engine sets: (template prefix tokens to drop, tokens kept)
_TEXT_WINDOW: dict[str, int] = {}


def set_text_window(drop_idx: int, max_sequence_length: int) -> None:
    """Drop `drop_idx` template-prefix tokens (computed from the model's tokenizer, as the native
    engine does: 34 for the real Qwen-Image tokenizer, which SGLang hard-codes) and keep at
    most `max_sequence_length` prompt tokens (Qwen-Image's 512 window)."""
    _TEXT_WINDOW.update(drop_idx=int(drop_idx), max_sequence_length=int(max_sequence_length))


def qwen_image_template() -> str:
    """SGLang's Qwen-Image prompt template (the text its tokenizer sees)."""
    from sglang.multimodal_gen.configs.pipeline_configs.qwen_image import qwen_image_preprocess_text

    return qwen_image_preprocess_text("{}")


def text_postprocess_hook(original, outputs, _text_inputs, drop_idx=34, return_attention_mask=False):
    """AROUND qwen_image_postprocess_text: the engine's text window (see set_text_window)."""
    if _TEXT_WINDOW and drop_idx == 34:  # 34 is Qwen-Image's t2i default; the edit variant passes 64
        drop_idx = _TEXT_WINDOW["drop_idx"]
    out = original(outputs, _text_inputs, drop_idx=drop_idx, return_attention_mask=return_attention_mask)
    keep = _TEXT_WINDOW.get("max_sequence_length")
    if not keep:
        return out
    if isinstance(out, torch.Tensor):
        return out[:, :keep] if out.dim() == 3 and out.shape[1] > keep else out
    # SGLang's text encoding stage asks for return_attention_mask=True on the positive prompt and
    # gets a TextConditioningOutput (a frozen dataclass): its mask and lengths are cut with it
    embeds = getattr(out, "prompt_embeds", None)
    if isinstance(embeds, torch.Tensor) and embeds.dim() == 3 and embeds.shape[1] > keep:
        mask, lens = out.prompt_embeds_mask, out.prompt_seq_lens
        out = dataclasses.replace(out, prompt_embeds=embeds[:, :keep],
                                  prompt_embeds_mask=None if mask is None else mask[:, :keep],
                                  prompt_seq_lens=None if lens is None else [min(int(n), keep) for n in lens])
    return out


def register_hooks() -> None:
    from sglang.multimodal_gen.runtime.platforms.plugins import HookRegistry, HookType

    HookRegistry.register(PREPARE_ROLLOUT_TARGET, prepare_rollout_hook, HookType.AROUND)
    HookRegistry.register(TIMESTEP_STAGE_TARGET, timestep_stage_hook, HookType.AROUND)
    HookRegistry.register(TEXT_POSTPROCESS_TARGET, text_postprocess_hook, HookType.AROUND)


def cutedsl_available() -> bool:
    """The CuTe-DSL package SGLang's fused CUDA norm kernels are written in is importable (a
    spec lookup, nothing imported)."""
    import importlib.util

    return importlib.util.find_spec("cutlass") is not None


def cutedsl_fallback_hook(original, self, *args, **kwargs):
    """AROUND the fused norms' forward_cuda where nvidia-cutlass-dsl is not installed: their
    PyTorch forward_native, the path SGLang itself takes for widths its kernel does not cover
    (hidden % 256 != 0, e.g. the tiny test model). Same math, fp32 statistics, unfused."""
    return self.forward_native(*args, **kwargs)


def register_cutedsl_fallbacks() -> list[str]:
    """On a CUDA machine without nvidia-cutlass-dsl, SGLang's Qwen-Image DiT at real width (3072,
    a multiple of 256) would import `cutlass` at its first fused norm and fail the request: route
    those two ops to their native forward instead, once, with a warning. Returns the targets."""
    import torch
    from sglang.multimodal_gen.runtime.platforms.plugins import HookRegistry, HookType

    if not torch.cuda.is_available() or cutedsl_available():
        return []
    for target in CUTEDSL_NORM_TARGETS:
        HookRegistry.register(target, cutedsl_fallback_hook, HookType.AROUND)
    log.warning("nvidia-cutlass-dsl is not installed: SGLang's fused norm / scale-shift ops run their "
                "PyTorch forward (same math, unfused); install nvidia-cutlass-dsl for SGLang's own kernels")
    return list(CUTEDSL_NORM_TARGETS)


def unapplied_hooks() -> list[str]:
    """The trainer's hook targets SGLang has not patched (after apply_plugin_hooks)."""
    from sglang.multimodal_gen.runtime.platforms.plugins import HookRegistry

    return [t for t in HOOK_TARGETS if t not in HookRegistry._patched]


def register() -> None:
    """The entry point SGLang calls once per process (plugins.load_plugins)."""
    register_cpu_ops()
    register_hooks()
    register_cutedsl_fallbacks()
