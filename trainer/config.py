"""One typed config tree for a training run, and the recipe/CLI loader.

Every field is a flag: its name is the flag name with dashes turned into
underscores (``--rollout-batch-size`` <-> ``cfg.rollout.rollout_batch_size``), and
flag names are unique across sections. Names, types and defaults follow the
reference's Configuration Reference; where this trainer deviates (the default
backend, flags that only exist for Ray machinery) docs/configuration.md records
the decision and why.

A recipe is a TOML file whose keys are flag names (dashes or underscores), at the
top level or under the section that holds them (``[rollout]``, ``[fsdp]``, ... the
groups of ``--help`` and of ``RunConfig.to_dict()``). Other tables are allowed only
where a flag's value is itself a dict (sampling-config, reward-component-weights,
resource, autoscaler-config). String values may use ``${VAR}`` /
``${VAR:-default}`` environment expansion. A run's recipe record (JSON, its
``"config"`` object) loads the same way, so a run can be started again from it. CLI
flags override the recipe. Unknown keys and flags, and keys under the wrong section,
are errors with a did-you-mean suggestion.

This module imports no torch: preflight and ``--preflight-only`` run before any
heavy import.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, packaged as tomli
    import tomli as tomllib


class ConfigError(ValueError):
    """A recipe or command line could not be turned into a RunConfig."""


def _flag(default: Any = None, help: str = "", *, factory: Any = None, hints: dict[str, str] | None = None) -> Any:
    """A dataclass field carrying its flag help text.

    A field annotated with a Literal (or an optional one) takes only those values; the parser
    refuses any other, naming the flag, the value and the choices. `hints` adds a pointer for a
    known wrong value (one Relax used, or a removed one) to that error.
    """
    meta: dict[str, Any] = {"help": help}
    if hints:
        meta["hints"] = dict(hints)
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


#: the --generation-task values: only tasks with a working replay path. Here, not in models.base
#: (which re-exports it), because models.base imports torch and the data tools, the prompt reader
#: and preflight check a task without it
GENERATION_TASKS = ("t2i", "i2i", "t2v")


# ----------------------------------------------------------------------------------------------
# Short names for the shipped implementations. Preflight never imports these modules.

DEFAULT_MODEL_ADAPTER = "trainer.models.qwen_image.QwenImageAdapter"

#: diffusers pipeline class (model_index.json "_class_name") -> the adapter of its family: the
#: preflight check that --model-path and --model-adapter-path agree, and the tools' default
#: adapter for a model directory
PIPELINE_ADAPTERS = {
    "QwenImagePipeline": "trainer.models.qwen_image.QwenImageAdapter",
    "StableDiffusion3Pipeline": "trainer.models.sd3.SD3Adapter",
    "FluxPipeline": "trainer.models.flux.FluxAdapter",
    "QwenImageEditPlusPipeline": "trainer.models.qwen_image_edit.QwenImageEditAdapter",
    "FluxKontextPipeline": "trainer.models.flux_kontext.FluxKontextAdapter",
    "WanPipeline": "trainer.models.wan.WanAdapter",
}

#: the shipped adapters of video families: --generation-task t2v needs one (and --sampling-config
#: num_frames > 1 needs t2v); the task an image family's adapter serves is t2i
VIDEO_ADAPTERS = ("trainer.models.wan.WanAdapter",)


def pipeline_class_name(model_path) -> str | None:
    """model_index.json's "_class_name" of a diffusers directory, or None when there is no
    readable model_index.json (the callers that need the directory report that themselves)."""
    import json
    from pathlib import Path

    try:
        return json.loads((Path(model_path) / "model_index.json").read_text()).get("_class_name")
    except (OSError, ValueError, AttributeError):
        return None


def adapter_for_model_dir(model_path, default: str | None = DEFAULT_MODEL_ADAPTER) -> str | None:
    """The adapter dotpath of the family `model_path`'s model_index.json names (PIPELINE_ADAPTERS),
    else `default`."""
    return PIPELINE_ADAPTERS.get(pipeline_class_name(model_path) or "", default)

ENGINE_SHORT_NAMES = {
    "native": "trainer.engine.native.NativeEngine",
    "sglang": "trainer.engine.sglang_engine.SGLangEngine",
}

SCORER_SHORT_NAMES = {
    "pickscore": "trainer.rewards.pickscore.PickScoreScorer",
    "ocr": "trainer.rewards.ocr.OcrScorer",
    "jpeg_compressibility": "trainer.rewards.jpeg.JpegCompressibilityScorer",
    "jpeg_incompressibility": "trainer.rewards.jpeg.JpegIncompressibilityScorer",
    "color": "trainer.rewards.color.ColorScorer",
    "clipscore": "trainer.rewards.clipscore.ClipScoreScorer",
    "aesthetic": "trainer.rewards.aesthetic.AestheticScorer",
    "hpsv21": "trainer.rewards.hpsv2.Hpsv21Scorer",
    "vlm_judge": "trainer.rewards.vlm_judge.VlmJudgeScorer",
    # i2i: scorers of an edit against its source (metadata["source_images"])
    "color_edit": "trainer.rewards.edit.ColorEditScorer",
    "clip_preserve": "trainer.rewards.edit.ClipPreservationScorer",
    "edit_judge": "trainer.rewards.edit.EditJudgeScorer",
    # video scorers (required_tracks ("video",)): the t2v task's
    "video_ocr": "trainer.rewards.video.VideoOcrScorer",
    "temporal_consistency": "trainer.rewards.video.TemporalConsistencyScorer",
    "video_vlm_judge": "trainer.rewards.video.VideoJudgeScorer",
    "framewise": "trainer.rewards.video.FramewiseScorer",
}

#: the model adapters of the editing families: the task they train (preflight pairs --generation-task
#: i2i with them, and t2i with the image families that are neither editing nor video)
EDIT_ADAPTERS = frozenset({
    "trainer.models.qwen_image_edit.QwenImageEditAdapter",
    "trainer.models.flux_kontext.FluxKontextAdapter",
})

#: the shipped scorers of the "video" track (a t2v run needs one; a t2i run cannot use them)
VIDEO_SCORERS = frozenset({
    "trainer.rewards.video.VideoOcrScorer",
    "trainer.rewards.video.TemporalConsistencyScorer",
    "trainer.rewards.video.VideoJudgeScorer",
    "trainer.rewards.video.FramewiseScorer",
})

#: scorers that load a model from --reward-model-path (the others need no weights)
SCORERS_NEEDING_MODEL = frozenset({
    "trainer.rewards.pickscore.PickScoreScorer",
    "trainer.rewards.clipscore.ClipScoreScorer",
    "trainer.rewards.aesthetic.AestheticScorer",
    "trainer.rewards.hpsv2.Hpsv21Scorer",
    "trainer.rewards.edit.ClipPreservationScorer",
})


def resolve_engine_path(name: str) -> str:
    """`native` / `sglang` -> the engine class dotpath; any other value is returned as given."""
    return ENGINE_SHORT_NAMES.get(name, name)


def resolve_scorer_path(name: str | None) -> str | None:
    """A scorer short name (see SCORER_SHORT_NAMES) -> its dotpath; other values unchanged."""
    if name is None:
        return None
    return SCORER_SHORT_NAMES.get(name, name)


def unknown_scorer_name(flag: str, name: str) -> str | None:
    """Why `name` names no scorer, when it is neither a short name nor shaped like a dotpath (a
    typo of a short name, most often): the message lists the short names, the closest first;
    None otherwise (a dotpath is checked where it is imported)."""
    import difflib

    if name in SCORER_SHORT_NAMES or "." in name.strip("."):
        return None
    close = difflib.get_close_matches(name, SCORER_SHORT_NAMES, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return (f"{flag} {name!r} is neither a shipped scorer's short name nor a dotpath package.module.Class; {hint}"
            f"the short names: {', '.join(sorted(SCORER_SHORT_NAMES))}")


#: the dtype names the FSDP and weight-sync flags take
DtypeName = Literal["bf16", "fp32"]


# ----------------------------------------------------------------------------------------------
# Flags that mean nothing here


@dataclass(frozen=True)
class Unsupported:
    """Why a flag kept from Relax's command line cannot be used here.

    reason: what is unsupported and what to use instead. rejected False: the flag merely has
    no effect, so setting it is a warning instead of an error.
    """

    reason: str
    rejected: bool = True


_TRACKER = "TensorBoard (--tensorboard-dir) is the only tracker here"
_SYNCHRONOUS = "training is synchronous colocate only"

#: Flags that parse, so a reference command line runs unchanged up to preflight, but mean nothing
#: here: flag -> why. Each is declared with `_unsupported(default)`; preflight reports every one
#: whose value is not its default (an empty string counts as unset), all at once: an error, or
#: a warning for those that merely have no effect. Their --help text is made from this table.
UNSUPPORTED_FLAGS: dict[str, Unsupported] = {
    # Relax's stage hooks: the stages are built into the loop
    "rollout_function_path": Unsupported("the rollout stage is built into the training loop"),
    "custom_convert_samples_to_train_data_path": Unsupported(
        "each rank replays the candidates it generated; there is no conversion step"),
    "custom_reward_post_process_path": Unsupported(
        "scoring and group normalisation are built in; choose the scorer with --reward-scorer-path"),
    # loss and batching of the token trainers
    "use_dynamic_batch_size": Unsupported(
        "diffusion latents are fixed-shape, there is no token-budget batching; use --micro-batch-size"),
    "max_tokens_per_gpu": Unsupported("there is no token-budget batching; use --micro-batch-size"),
    # Ray placement and scheduling modes
    "colocate": Unsupported("actor and engine time-share every device here (synchronous colocation is the only mode)"),
    "fully_async": Unsupported(_SYNCHRONOUS),
    "hybrid": Unsupported(_SYNCHRONOUS),
    "use_fault_tolerance": Unsupported("a failed weight sync raises on every rank; restart with --load <checkpoint dir>"),
    "autoscaler_config": Unsupported("in-process engines have no elastic scale-out"),
    # checkpoints, trackers and debug dumps
    "save_hf": Unsupported("export a committed checkpoint offline with tools/export_checkpoint.py"),
    "async_save": Unsupported("the checkpoint write is synchronous", rejected=False),
    "use_wandb": Unsupported(_TRACKER + "; to see a run in W&B, sync its event files during or after the run: "
                             "wandb sync --sync-tensorboard <tensorboard-dir>/<recipe name> (docs/training.md)"),
    "use_clearml": Unsupported(_TRACKER),
    "use_metrics_service": Unsupported(_TRACKER),
    "load_debug_rollout_data": Unsupported(
        "each rank replays the trajectories it generated; there is no rollout-data replay file"),
    "save_debug_train_data": Unsupported(
        "train data are numeric tensors plus the sidecars under --artifact-root, not token sequences",
        rejected=False),
}


def _unsupported(default: Any) -> Any:
    """The field of a flag listed in UNSUPPORTED_FLAGS (its help text is made from the table)."""
    return field(default=default, metadata={"unsupported": True})


def _default_state(default: Any) -> str:
    """How a default reads after "must stay": off / on / unset / the value."""
    if isinstance(default, bool):
        return "on" if default else "off"
    return "unset" if default is None else json.dumps(default)


def _unsupported_help(default: Any, why: Unsupported) -> str:
    if not why.rejected:
        return f"Has no effect (warned when set): {why.reason}."
    return f"Must stay {_default_state(default)}: {why.reason}."


# ----------------------------------------------------------------------------------------------
# Sections


@dataclass
class ModelConfig:
    train_backend: Literal["fsdp"] = _flag(
        "fsdp",
        "Training backend. Only 'fsdp' exists here (FSDP2 over torchrun ranks); Relax's "
        "'megatron' is rejected.",
        hints={"megatron": "only FSDP2 over torchrun ranks exists here; remove the flag or set it to fsdp"},
    )
    generation_task: str | None = _flag(
        "t2i",
        "Generation task; must be one of GENERATION_TASKS: 't2i' (the default, as in every tool), 'i2i' "
        "(image editing: an editing family, every record with its source images) or 't2v' (a video family "
        "such as Wan2.1). Also names the artifact and checkpoint subdirectory.",
    )
    model_path: str | None = _flag(
        None,
        "Local diffusers model directory (e.g. ${MODEL_DIR}/Qwen-Image); required, must exist. "
        "Nothing is downloaded.",
    )
    model_revision: str | None = _flag(
        None,
        "Optional revision label handed to the model adapter; loading is always from "
        "--model-path (nothing is fetched).",
    )
    model_adapter_path: str = _flag(
        DEFAULT_MODEL_ADAPTER,
        "Dotpath module.Class of the model adapter. Unset = the family --model-path's "
        "model_index.json names (QwenImagePipeline, StableDiffusion3Pipeline, FluxPipeline, "
        "QwenImageEditPlusPipeline, FluxKontextPipeline, WanPipeline), "
        "else Qwen-Image's. A new model family is a new adapter plus its task in GENERATION_TASKS. "
        "The module is imported: name only code you trust.",
    )


@dataclass
class RolloutConfig:
    rollout_engine_class_path: str = _flag(
        "native",
        "Rollout engine: 'native' (diffusers + our SDE sampler), 'sglang', or a module.Class "
        "dotpath (imported: name only code you trust).",
    )
    # kept for Relax's command line; UNSUPPORTED_FLAGS says why
    rollout_function_path: str | None = _unsupported(None)
    custom_convert_samples_to_train_data_path: str | None = _unsupported(None)
    custom_reward_post_process_path: str | None = _unsupported(None)
    rollout_num_gpus_per_engine: int = _flag(
        1,
        "Devices per rollout engine; must be >= 1 and divide the world size. Each rank holds "
        "its own in-process engine, so only 1 is supported here.",
    )
    rollout_batch_size: int | None = _flag(
        None,
        "Prompts per rollout (number of GRPO groups); required, >= 1.",
    )
    n_samples_per_prompt: int | None = _flag(
        None,
        "Candidates per prompt (the GRPO group size); required, >= 1 (2 or more to get any "
        "advantage signal).",
    )
    global_batch_size: int | None = _flag(
        None,
        "Candidates per rollout; must equal rollout_batch_size x n_samples_per_prompt and "
        "divide evenly over the world size. Unset = that product.",
    )
    rollout_seed: int = _flag(42, "Seed of the deterministic prompt order.")
    generation_seed: int = _flag(
        1234,
        "Base seed of every candidate's x_T and per-step noise (a pure function of this seed, "
        "the sample id and the step).",
    )
    sampling_config: dict | None = _flag(
        None,
        "Sampling geometry as a JSON object (TOML: a table); required. The command line's keys "
        "merge over the recipe's table (null removes a key; none drops the table), also one at a "
        "time: --sampling-config.num_inference_steps 10; a num_inference_steps given without trained-step keys "
        "keeps the recipe's sde_indices / sde_pool steps that still fit. Keys: height, width, "
        "num_inference_steps, guidance_scale (1.0, or > 1 for true CFG with negative_prompt and "
        "cfg_renorm), eta (set it explicitly), sde_type, "
        "sde_indices / sde_pool / num_sde_steps / sde_timestep_fraction (must never train "
        "step 0 under sde_type 'sde'), ... see docs/configuration.md.",
    )
    prompt_data: str | None = _flag(
        None, "Training prompt set (JSONL, one {\"prompt\": ...} per line); required, must exist."
    )
    media_root: str | None = _flag(
        None,
        "Directory whose files the prompt files may also name as media (source images), beside their "
        "own directory; a path outside both, symlinks followed, is refused. '/' allows any file.",
    )
    num_rollout: int | None = _flag(
        None,
        "Total number of rollouts (training steps) of the run, counted from rollout 0; required, "
        ">= 1. A total, not a count of more steps: a resume (--load) runs the rollouts after the "
        "loaded iteration up to it, so it must exceed that iteration + 1.",
    )
    engine_batch_size: int = _flag(
        0,
        "Candidates per DiT forward during rollout; must be >= 0. 0 = auto (all of a rank's "
        "candidates of a rollout at once, bounded by the engine).",
    )
    rollout_compile: bool = _flag(
        False,
        "torch.compile each repeated DiT block of the native engine (compiled over the first rollouts: "
        "a static graph, then one with the text length and batch dynamic, reused by every later rollout "
        "whatever its prompts' lengths; perf/rollout_new_graphs counts them). Pays on a GPU; the rollout then differs from the "
        "eager replay by kernel rounding (docs/PERFORMANCE.md gives the measured log-prob gap).",
    )
    rollout_precision: Literal["default", "fp8"] = _flag(
        "default",
        "Native engine DiT precision: 'default' (the actor's compute dtype) or 'fp8' (the blocks' "
        "linear layers as rowwise-scaled FP8 GEMMs; needs an FP8 GPU (compute capability >= 8.9) "
        "on CUDA). The replay stays in the actor's dtype, so fp8 rollouts are off-policy by the "
        "FP8 rounding: see docs/PERFORMANCE.md before using it. With the adapter sync of a LoRA run "
        "the engine frees the blocks' weights in the compute dtype once LoRA is in, keeping only "
        "their FP8 copies.",
    )
    sglang_attention_backend: str | None = _flag(
        None,
        "The SGLang engine's attention backend (SGLang's own names, e.g. 'torch_sdpa', 'fa'). "
        "Unset = SGLang's choice, which on a Hopper GPU is FlashAttention 3 from sglang-kernel's "
        "flash_ops library: a GPU install without that library needs 'torch_sdpa'. Only with "
        "--rollout-engine-class-path sglang.",
    )
    max_sequence_length: int | None = _flag(
        None,
        "Text tokens the prompt encoder keeps per prompt (the T5 window of SD3 / FLUX.1, to which "
        "every prompt is padded; for Qwen-Image the most kept after its template). Unset = the "
        "family's own: Qwen-Image 512, SD3 128, FLUX.1 512. >= 1, at most what the family's "
        "pipeline allows (Qwen-Image 1024, SD3 and FLUX.1 512).",
    )


@dataclass
class ArtifactConfig:
    artifact_root: str | None = _flag(
        None,
        "Root directory for trajectory sidecars and PNGs "
        "(<root>/<task>/rollout_<k>/...); required. Multi-node: must be shared storage.",
    )
    artifact_retention_rollouts: int = _flag(
        2,
        "How many rollout directories to keep; older ones are deleted at the start of each "
        "rollout. <= 0 keeps everything and grows without bound (warned).",
    )
    artifact_writer_queue: int = _flag(
        2,
        "Rollouts whose PNGs and sidecars a background thread per rank may hold while the step "
        "goes on (encoding and writing them off the critical path); must be >= 0; 0 writes them "
        "synchronously inside the rollout stage. Each held rollout costs host memory for a copy "
        "of the rank's images (fp32) and its sidecar tensors. Flushed before every checkpoint, "
        "before eval and at the end of the run; a failed write stops the run with its error.",
    )


@dataclass
class FsdpConfig:
    fsdp_trainable_mode: Literal["full", "lora"] = _flag(
        "full",
        "'full' or 'lora'; must agree with --lora-rank ('lora' needs > 0, 'full' needs 0).",
    )
    fsdp_trainable_attr: str = _flag(
        "transformer",
        "Attribute of the model bundle that holds the trainable module; everything else is "
        "frozen and lives in the rollout engine.",
    )
    fsdp_param_dtype: DtypeName = _flag(
        "bf16", "FSDP2 compute (all-gathered) parameter dtype: 'bf16' or 'fp32'."
    )
    fsdp_reduce_dtype: DtypeName = _flag("fp32", "Gradient reduction dtype: 'bf16' or 'fp32'.")
    fsdp_master_dtype: DtypeName | None = _flag(
        None,
        "Storage dtype of the trainable parameters (the optimizer's master copy): 'fp32', "
        "'bf16' or unset (keep the loaded dtype). LoRA should use 'fp32' (warned otherwise).",
    )
    no_fsdp_reshard_after_forward: bool = _flag(
        False, "Keep parameters gathered after forward (more memory, fewer all-gathers)."
    )
    fsdp_frozen_params: Literal["auto", "shard", "replicate"] = _flag(
        "auto",
        "Where the frozen parameters (a LoRA run's whole base) live: 'shard' (FSDP2 shards them with the "
        "trainable ones and gathers each block's at its forward and again at its backward), 'replicate' "
        "(whole on every rank in --fsdp-param-dtype, outside FSDP2: no gathers and no copies, for the whole "
        "frozen model's memory on each rank) or 'auto' (replicate on one rank, where a shard is the whole "
        "tensor and sharding only copies it; shard on several, and under --fsdp-cpu-offload). The values "
        "computed are the same either way.",
    )
    fsdp_activation_checkpointing: bool = _flag(
        False,
        "Recompute each transformer block in backward: the activations' memory for one more block forward each. "
        "The real model needs it unless memory is there: on one H200 holding the whole 60-block Qwen-Image model "
        "beside its FP8 engine, the LoRA step at micro-batch 8 fit without it (130.6 GB) once --replay-precision "
        "fp8-dgrad freed the actor's weights linked to the engine; before that, checkpointing every 2nd block "
        "already peaked at 142.3 GB (docs/PERFORMANCE.md).",
    )
    fsdp_activation_checkpointing_every: int = _flag(
        1,
        "With --fsdp-activation-checkpointing, recompute only the transformer blocks 0, K, 2K, ... (1: every "
        "block). The other blocks keep their activations through backward: each backward then runs (K-1)/K fewer "
        "block forwards, for the activations of the blocks left out. On one H200 holding the whole 60-block "
        "Qwen-Image model beside its FP8 engine, K=2 at micro-batch 8 fit (142.3 GB) once the engine freed its "
        "bf16 block weights, and took 0.41 s off the update (docs/PERFORMANCE.md); sharded actors have more "
        "room. Must be >= 1; above 1 it needs --fsdp-activation-checkpointing.",
    )
    fsdp_compile: bool = _flag(
        False,
        "torch.compile each repeated transformer block of the actor (inside its checkpointing "
        "and FSDP2 wrappers). Pays on a GPU; compiled over the first updates (a static graph, then one "
        "with the text length dynamic; perf/actor_new_graphs counts them).",
    )
    compile_cache_dir: str | None = _flag(
        None,
        "Directory of torch.compile's generated kernels (TORCHINDUCTOR_CACHE_DIR) for --rollout-compile and "
        "--fsdp-compile; unset: torch's default under /tmp, per user and host. Put it on storage a resumed run "
        "sees (e.g. under the run's --save) so the resume compiles from the cache instead of from scratch. The "
        "process runs the code it finds there: it, and torch's own cache when this is unset, must be owned by "
        "you and not writable by group or others, nor its parents without the sticky bit (preflight refuses it "
        "otherwise).",
    )
    replay_precision: Literal["default", "fp8", "fp8-dgrad"] = _flag(
        "default",
        "The actor's frozen LoRA base GEMMs: 'default' (the compute dtype), 'fp8' (the base layers of the "
        "LoRA-wrapped linears in the transformer blocks as rowwise-scaled FP8 GEMMs, quantized from the gathered "
        "weight at each forward, or read from the copy an FP8 engine holding the adapter already made of it; the "
        "input gradient uses the unquantized weight) or 'fp8-dgrad' (as 'fp8', and "
        "the input gradient's GEMM in FP8 too, over the forward's FP8 weight, the incoming gradient scaled per "
        "token: its rounding then reaches the LoRA gradient as well). The anchor and the replay run the "
        "same FP8 GEMMs, so the first ratio stays exactly 1; the gradients differ from 'default' by the FP8 "
        "rounding (docs/PERFORMANCE.md). --fsdp-trainable-mode lora only; needs an FP8 GPU (compute capability "
        ">= 8.9) on CUDA.",
    )
    replay_fp8_layers: Literal["lora-base", "frozen"] = _flag(
        "lora-base",
        "Which frozen linears of the transformer blocks --replay-precision fp8 / fp8-dgrad puts in FP8: "
        "'lora-base' (the base layers of the LoRA-wrapped linears) or 'frozen' (those and every other frozen "
        "block linear: with LoRA on the attention, the MLPs and the modulation; a layer without an adapter "
        "runs FP8 only on calls of 128 rows or more, so the modulation's few rows keep the compute dtype, "
        "unless it reads the FP8 engine's copy of its weight, which costs no quantization). "
        "More of the update in FP8, more FP8 rounding in the gradients (docs/PERFORMANCE.md).",
    )
    fp8_fast_accum: bool = _flag(
        False,
        "Every FP8 forward GEMM (--rollout-precision fp8's and --replay-precision fp8 / fp8-dgrad's alike, so "
        "the replay still computes what the sampler computed) with the FP8 tensor cores' fast accumulation: "
        "the sum over the input channels stays in their narrower accumulator instead of being added into fp32 "
        "every few blocks. Faster GEMMs (up to about 1.2x on Hopper) with a larger rounding error of each output "
        "(docs/PERFORMANCE.md measures both); the FP8 input gradient keeps the full accumulation. Needs an FP8 "
        "precision; no effect on CPU.",
    )
    fsdp_cpu_offload: bool = _flag(
        False,
        "FSDP2 CPU parameter offload. Rejected under --fsdp-trainable-mode lora; under full "
        "FT gradient clipping over offloaded DTensors is known to fail (warned).",
    )
    fsdp_load_wave_size: int = _flag(
        0,
        "Load the base model on at most N ranks at a time (bounds host RAM at launch); must be "
        ">= 0, 0 = all at once.",
    )
    fsdp_lr_scheduler: Literal["constant", "linear", "cosine"] = _flag(
        "constant",
        "Post-warmup learning-rate shape: 'constant' (ignores the decay flags), 'linear' or "
        "'cosine' (decay to --min-lr over --lr-decay-iters optimizer steps).",
    )
    fsdp_debug_fingerprint: bool = _flag(
        False,
        "Log an abs-sum fingerprint of the trainable weights around each step and the logp "
        "parity line. Costs a full reduction and a host sync per step.",
    )


@dataclass
class LoraConfig:
    lora_rank: int = _flag(
        0, "LoRA rank; must be > 0 exactly when --fsdp-trainable-mode lora, else 0."
    )
    lora_alpha: int = _flag(
        16,
        "LoRA alpha (scale = alpha / rank). Recorded in the checkpoint: resume refuses a "
        "different value.",
    )
    lora_dropout: float = _flag(
        0.0,
        "LoRA dropout; must be 0.0 (a stochastic forward breaks the ratio == 1 anchor of the "
        "first update).",
    )
    lora_target_modules: list[str] | None = _flag(
        None,
        "Module-name suffixes to adapt (JSON list or space separated). Unset = the model "
        "adapter's own list.",
    )
    lora_adapter_mode: bool = _flag(
        False,
        "Sync only the LoRA tensors to the engine each step (implies --weight-sync-mode "
        "adapter). Needs --fsdp-trainable-mode lora; excludes --lora-merge-mode.",
    )
    lora_merge_mode: bool = _flag(
        False,
        "Sync the full transformer with B@A folded into each base weight. Needs "
        "--fsdp-trainable-mode lora; excludes --lora-adapter-mode. Neither flag = merge.",
    )


@dataclass
class OptimConfig:
    lr: float = _flag(1e-6, "Peak AdamW learning rate; must be > 0.")
    min_lr: float = _flag(
        0.0, "Floor of the linear/cosine decay; must be in [0, --lr]."
    )
    lr_warmup_iters: int = _flag(
        0, "Linear warmup length in optimizer steps (not rollouts); must be >= 0."
    )
    lr_decay_iters: int | None = _flag(
        None,
        "Decay length in optimizer steps for linear/cosine; must be >= 1 when set. Unset = "
        "num_rollout x num_updates_per_batch.",
    )
    lr_decay_style: str | None = _flag(
        None,
        "Megatron's decay flag; has no effect here (use --fsdp-lr-scheduler). Warned when set.",
    )
    weight_decay: float = _flag(0.01, "AdamW weight decay; must be >= 0.")
    adam_beta1: float = _flag(0.9, "AdamW beta1; must be in [0, 1).")
    adam_beta2: float = _flag(0.999, "AdamW beta2; must be in [0, 1).")
    adam_eps: float = _flag(
        1e-8,
        "AdamW eps; must be > 0. Full FT uses 1e-15: per-element grads are ~1e-8, so 1e-8 "
        "would dominate the denominator.",
    )
    adam_fused: bool = _flag(
        False,
        "AdamW as torch's fused kernel (one launch for all tensors) instead of its multi-tensor default: less "
        "time per optimizer step where there are many small tensors (LoRA), the same update up to float "
        "rounding. Same optimizer state, so a checkpoint resumes with either.",
    )
    clip_grad: float = _flag(1.0, "Gradient-norm clip before each optimizer step; must be > 0.")
    ema_decay: float = _flag(
        0.0,
        "Decay of an fp32 EMA of the trainable parameters, kept sharded beside them and "
        "checkpointed; must be in [0, 1). 0 = no EMA.",
    )
    ema_update_interval: int = _flag(
        1, "Update the EMA after every N-th optimizer step; must be >= 1; needs --ema-decay > 0 when not 1."
    )


@dataclass
class GrpoConfig:
    advantage_estimator: Literal["grpo"] = _flag("grpo", "Advantage estimator; only 'grpo' is supported.")
    eps_clip: float = _flag(
        0.2, "PPO clip range; must be > 0. FlowGRPO uses a tiny one (both recipes: 1e-4)."
    )
    eps_clip_high: float | None = _flag(
        None, "Optional asymmetric upper clip; must be > 0 when set."
    )
    num_updates_per_batch: int = _flag(
        1,
        "Disjoint optimizer updates per rollout batch (a split, not a replay): update u holds the "
        "candidates whose global id is u mod this count, whatever the world size; must divide the "
        "per-rank candidate count. 1 keeps the ratio at exactly 1: use 2 or more (warned).",
    )
    micro_batch_size: int = _flag(
        1,
        "Candidates per replay forward on a rank (a memory setting: the gradient is accumulated "
        "over a rank's micro-batches, so it does not change what an update trains); must divide "
        "each update's per-rank share (global_batch_size / world / num_updates_per_batch). Keep it "
        "as large as memory allows.",
    )
    disable_grpo_std_normalization: bool = _flag(
        False,
        "Do not divide group-centred rewards by the group std (Dr.GRPO). Same as "
        "--generative-advantage-std-mode none; contradicting values are an error.",
    )
    generative_advantage_std_mode: Literal["group", "batch", "none"] | None = _flag(
        None,
        "Std divisor after per-prompt centring: 'group', 'batch' or 'none'. Unset = 'group', "
        "or 'none' with --disable-grpo-std-normalization.",
    )
    kl_coef: float = _flag(
        0.0,
        "Weight of the KL to the reference policy in the loss; >= 0, and > 0 needs --use-kl-loss. "
        "Per (sample, trained step) the closed-form KL of the two transition Gaussians (same std). "
        "LoRA only: the reference is the base with the adapter disabled.",
    )
    use_kl_loss: bool = _flag(
        False, "Add --kl-coef x KL(policy || reference) to the clipped loss; needs --kl-coef > 0 and LoRA."
    )
    adv_clip_max: float = _flag(
        0.0,
        "Clamp each advantage to [-max, max] after normalisation (FlowGRPO's adv_clip_max, 5 "
        "there); must be >= 0, 0 = off. The clipped share is logged as reward/adv_clipped_fraction.",
    )
    use_dynamic_batch_size: bool = _unsupported(False)
    max_tokens_per_gpu: int | None = _unsupported(None)
    algorithm: Literal["flowgrpo", "nft"] = _flag(
        "flowgrpo",
        "The update: 'flowgrpo' (SDE rollouts with recorded log-probs, the clipped ratio objective on "
        "replayed steps) or 'nft' (DiffusionNFT: deterministic ODE rollouts, only the clean final latents "
        "kept, a flow-matching loss on re-noised samples contrasting implicit positive and negative "
        "policies around a soft-updated old policy). nft needs --adv-clip-max > 0, guidance_scale 1.0 and "
        "the native engine, and takes no --use-kl-loss / --grpo-guard.",
    )
    nft_beta: float = _flag(
        1.0,
        "DiffusionNFT's beta: the implicit policies are old +/- beta x (theta - old); must be > 0 "
        "(the DiffusionNFT recipes: 1.0, 0.1 for OCR and multi-reward). --algorithm nft only.",
    )
    nft_timestep_fraction: float = _flag(
        0.99,
        "Noise levels trained per sample and update: floor(num_inference_steps x fraction), at least 1; "
        "in (0, 1] (DiffusionNFT: 0.99, i.e. 9 of 10 steps). Each costs one forward+backward and one "
        "old-policy forward. --algorithm nft only.",
    )
    nft_sigmas_per_forward: int = _flag(
        1,
        "Noise levels per DiT forward in the nft update and its old-policy pass: a micro-batch's K levels go "
        "through the DiT in forwards of this many levels x --micro-batch-size rows (0: all K in one), one "
        "backward per forward. More per forward: fewer, larger forwards, as FlowGRPO's replay stacks its "
        "columns, for more activation memory; the same loss and gradient up to the GEMMs' batch-size rounding. "
        ">= 0. --algorithm nft only.",
    )
    nft_timestep_distribution: Literal["schedule", "uniform"] = _flag(
        "schedule",
        "Where the training sigmas come from: 'schedule' (distinct entries of the rollout's own sigma "
        "grid, a random subset per sample: DiffusionNFT's choice) or 'uniform' (U(min, max) of that grid). "
        "Drawn from --rollout-seed and the rollout id, so a resumed run draws the same. --algorithm nft only.",
    )
    nft_old_decay_flat: int = _flag(
        0,
        "Optimizer steps before the old policy starts lagging (decay 0 = a copy of the policy until then); "
        ">= 0. DiffusionNFT: 0 (75 in its slow schedule). --algorithm nft only.",
    )
    nft_old_decay_rate: float = _flag(
        0.001,
        "Growth of the old policy's decay per optimizer step after the flat phase: decay = min((step - "
        "flat) x rate, --nft-old-decay-max); >= 0. After every update old <- decay x old + (1 - decay) x "
        "policy. DiffusionNFT: 0.001 (0.0075 in its slow schedule). --algorithm nft only.",
    )
    nft_old_decay_max: float = _flag(
        0.5,
        "Cap of the old policy's decay; in [0, 1). DiffusionNFT: 0.5 (0.999 in its slow schedule; 0 with "
        "rate 0 keeps the old policy equal to the policy). --algorithm nft only.",
    )
    old_logprob_source: Literal["replay", "rollout"] = _flag(
        "replay",
        "Where the update's pi_old log-probs come from: 'replay' (an anchor pass through the live model before "
        "any optimizer step; exact) or 'rollout' (the sampler's recorded log-probs; no anchor pass, saving the "
        "no_grad replay of updates 2..--num-updates-per-batch). Identical to 'replay' only where the sampler is "
        "the replay to the bit (eager engine in the actor's dtype, replayed at the sampler's batch: in bf16 "
        "another --micro-batch-size changes GEMM tilings, ~1e-5 nats at real width); elsewhere (--rollout-compile, "
        "--rollout-precision fp8, --replay-precision fp8 / fp8-dgrad, the sglang engine: warned) the first update's ratio is no longer exactly 1 but "
        "carries the rollout-to-replay gap, logged as train/rollout_logprob_gap_max. Not with --grpo-guard or "
        "--algorithm nft.",
    )
    grpo_guard: bool = _flag(
        False,
        "GRPO-Guard on the FlowGRPO update: the log-ratio re-centred by the transition means' drift and "
        "scaled by the transition std (one clip range fits every step), and each step's term weighted by "
        "1 / (sigma - sigma_next). Needs sde_type 'sde' or 'dance' and a clip range of the normalised "
        "ratio's size (~1e-6..1e-5, not FlowGRPO's 1e-4 of the plain one). --algorithm flowgrpo only.",
    )


@dataclass
class RewardConfig:
    reward_runtime: Literal["cpu", "colocate", "remote"] = _flag(
        "cpu",
        "Where the scorer runs: 'cpu' or 'colocate' (in this process, on CPU or on the "
        "rank's device) or 'remote' (needs --reward-endpoint).",
        hints={"dedicated": "'dedicated' was removed: use colocate"},
    )
    reward_scorer_path: str | None = _flag(
        None,
        "Scorer short name (pickscore, clipscore, aesthetic, hpsv21, vlm_judge, ocr, "
        "jpeg_compressibility, jpeg_incompressibility, color; for i2i color_edit, clip_preserve, edit_judge; "
        "for t2v video_ocr, temporal_consistency, video_vlm_judge, framewise) or module.Class dotpath "
        "(imported: name only code you trust); required unless --reward-runtime remote.",
    )
    reward_model_path: str | None = _flag(
        None,
        "Local model directory of the scorer (e.g. ${MODEL_DIR}/PickScore_v1); required and "
        "must exist for scorers that load weights (pickscore, clipscore, aesthetic, hpsv21).",
    )
    reward_required_components: list[str] | None = _flag(
        None,
        "Component names that must be present (JSON list); a missing or non-finite one fails "
        "the group. Each needs a --reward-component-weights entry.",
    )
    reward_component_weights: dict[str, float] | None = _flag(
        None,
        "{component: weight} (JSON object; TOML table) combining the group-normalised "
        "components into one advantage; weights must be finite numbers. Command-line keys merge "
        "over the recipe's (null removes a component).",
    )
    reward_endpoint: str | None = _flag(
        None,
        "HTTP endpoint of a remote scorer; required when --reward-runtime remote. Probed once "
        "at start-up, before the model loads.",
    )
    reward_max_failed_rollouts: int = _flag(
        3,
        "Stop the run (exit 1) after this many consecutive rollouts in which every group "
        "failed to score, so no update happened; must be >= 0, 0 = never stop.",
    )
    # the VLM judge (--reward-scorer-path vlm_judge): an OpenAI-compatible chat endpoint
    reward_judge_endpoint: str = _flag(
        "http://127.0.0.1:8000/v1/chat/completions",
        "Chat-completions URL of the VLM judge (vLLM / SGLang serving e.g. Qwen2.5-VL or UnifiedReward).",
    )
    reward_judge_model: str | None = _flag(
        None, "Served model name sent to the judge; unset: omitted (the server's only model)."
    )
    reward_judge_prompt_template: str = _flag(
        "You are judging an image generated from the prompt: \"{prompt}\". Rate how well the image "
        "matches the prompt and how good it looks, from 0 (worst) to 10 (best). Answer with the number only.",
        "Text sent with each image; {prompt} is replaced by the prompt (the only placeholder).",
    )
    reward_judge_score_regex: str = _flag(
        r"(-?\d+(?:\.\d+)?)", "Regex whose first match (its first group) in the answer is the score."
    )
    reward_judge_score_min: float = _flag(0.0, "Lowest score the judge gives; maps to 0. An answer below it fails.")
    reward_judge_score_max: float = _flag(10.0, "Highest score the judge gives; maps to 1. Must exceed the min.")
    reward_judge_max_concurrency: int = _flag(8, "Judge requests in flight at once (>= 1).")
    reward_judge_timeout_s: float = _flag(60.0, "Seconds one judge request may take before it is retried.")
    reward_judge_max_retries: int = _flag(
        2, "Retries of a judge request after a timeout, connection error, 429 or 5xx; then the candidate fails."
    )
    reward_judge_max_tokens: int = _flag(64, "max_tokens of the judge's answer (>= 1).")
    # an image scorer on a video's frames (--reward-scorer-path framewise, the t2v task)
    reward_frame_scorer: str = _flag(
        "ocr", "The image scorer --reward-scorer-path framewise applies to sampled frames of each video (a short "
        "name or dotpath; its --reward-model-path is the framewise scorer's)."
    )
    reward_frame_reduction: Literal["mean", "min"] = _flag(
        "mean", "How --reward-scorer-path framewise reduces a video's frame scores: 'mean' (its typical frame) or "
        "'min' (its worst sampled frame)."
    )
    reward_frame_every: int | None = _flag(
        None, "framewise: score every k-th frame (0, k, 2k, ...; k >= 1); exclusive with --reward-frame-count."
    )
    reward_frame_count: int | None = _flag(
        None, "framewise: score n evenly spaced frames, first and last included (n >= 1; 8 when neither rule is set)."
    )
    # held-out scorers and the reward-hacking watch (docs/rewards.md, "Watching for reward hacking")
    eval_reward_scorers: list[str] | None = _flag(
        None,
        "Held-out scorers computed only at eval, never trained on (JSON list of 'name' or "
        "'name=/local/model/dir', e.g. [\"aesthetic=/models/aesthetic\", \"jpeg_compressibility\"]; a name is "
        "a scorer short name or a dotpath, imported: name only code you trust); needs --eval-prompt-data. Each "
        "appears as eval/<set>/<component>_mean.",
    )
    no_hacking_watch: bool = _flag(
        False, "Skip the per-rollout image statistics and the reward/hacking_suspect rule."
    )
    hacking_baseline_rollouts: int = _flag(
        5, "Rollouts (and, for held-out scores, the first eval) that form the watch's baseline; >= 1."
    )
    hacking_reward_rise: float = _flag(
        0.5, "The trained reward counts as rising once its recent mean exceeds its baseline mean by this many "
        "baseline within-group stds (> 0)."
    )
    hacking_stat_threshold: float = _flag(
        3.0, "An image statistic is suspect once its mean moves this many baseline per-image stds from its "
        "baseline, either way (> 0)."
    )
    hacking_heldout_drop: float = _flag(
        1.0, "A held-out eval score is suspect once its mean falls this many baseline per-image stds below "
        "its baseline (> 0)."
    )
    hacking_patience: int = _flag(
        2, "Consecutive rollouts the rule must hold before reward/hacking_suspect is set (>= 1)."
    )
    stop_on_hacking: bool = _flag(
        False, "When reward/hacking_suspect is set: checkpoint (if --save) and stop with a message naming the signal."
    )


@dataclass
class SyncConfig:
    weight_sync_mode: Literal["full", "adapter"] = _flag(
        "full",
        "'full' or 'adapter'. Derived: --lora-adapter-mode implies 'adapter'; an explicit "
        "contradicting value is an error.",
    )
    weight_sync_wire_dtype: DtypeName = _flag(
        "bf16",
        "Dtype of the tensors handed to the engine: 'bf16' or 'fp32', with either engine (fp32 "
        "makes the sync exact for fp32 CPU runs).",
    )
    weight_sync_bucket_size_mb: int = _flag(
        512, "Bucket size of the gathered-weight stream in MB; must be >= 1."
    )


@dataclass
class ColocateConfig:
    # kept for Relax's command line; UNSUPPORTED_FLAGS says why
    colocate: bool = _unsupported(True)
    offload_train: bool = _flag(
        False,
        "Move the actor's parameters and optimizer state to pinned host memory during "
        "rollout; a failed release/resume is fatal.",
    )
    offload_rollout: bool = _flag(
        False,
        "Move the engine's modules to host memory during the update; a failed release/resume "
        "is fatal.",
    )
    # kept for Relax's command line; UNSUPPORTED_FLAGS says why
    fully_async: bool = _unsupported(False)
    hybrid: bool = _unsupported(False)
    actor_num_nodes: int | None = _flag(
        None,
        "Nodes of the run. With --actor-num-gpus-per-node it gives the world size outside "
        "torchrun; under another torchrun WORLD_SIZE the same recipe runs, its split reported.",
    )
    actor_num_gpus_per_node: int | None = _flag(
        None,
        "Ranks per node (torchrun --nproc-per-node) the recipe was written for. Under another "
        "torchrun WORLD_SIZE the same recipe runs, its split over the ranks reported.",
    )
    rollout_num_gpus: int | None = _flag(
        None,
        "Devices used for rollout; with colocation every rank has an engine, so when set it "
        "must equal the world size.",
    )
    resource: dict | None = _flag(
        None,
        "Reference placement, e.g. {\"actor\": [1, 8], \"rollout\": [1, 8]} (nodes, devices "
        "per node). When set, actor and rollout must be equal (colocate) and their product "
        "must equal the world size.",
    )
    # kept for Relax's command line; UNSUPPORTED_FLAGS says why
    use_fault_tolerance: bool = _unsupported(False)
    autoscaler_config: dict | None = _unsupported(None)


@dataclass
class CheckpointConfig:
    save: str | None = _flag(
        None, "Checkpoint directory (<save>/<task>/iter_<n>/); unset = no checkpoints."
    )
    load: str | None = _flag(
        None,
        "Resume from this checkpoint directory (usually the same as --save); must hold a "
        "committed checkpoint of --generation-task. Unset = start at rollout 0, which needs a "
        "--save (and TensorBoard directory) without an earlier run in it.",
    )
    ckpt_step: int | None = _flag(
        None,
        "Resume from this committed iteration of --load instead of the newest; needs --load. "
        "When --save is --load and holds newer iterations, pass a new --save (nothing is "
        "overwritten).",
    )
    save_interval: int | None = _flag(
        None, "Save every N rollouts; must be >= 1 and needs --save."
    )
    rotate_ckpt: bool = _flag(
        False,
        "Accepted for compatibility; rotation happens whenever --max-actor-ckpt-to-keep is "
        "set, which this flag then requires.",
    )
    max_actor_ckpt_to_keep: int | None = _flag(
        None,
        "Keep the newest N committed checkpoints (older ones are removed only after a new one "
        "is committed); must be >= 1. Unset = keep all.",
    )
    # kept for Relax's command line; UNSUPPORTED_FLAGS says why
    async_save: bool = _unsupported(False)
    save_hf: str | None = _unsupported(None)


@dataclass
class EvalConfig:
    eval_prompt_data: list[tuple[str, str]] = _flag(
        help="Held-out prompt sets as NAME PATH pairs (CLI: --eval-prompt-data pickscore "
        "eval.jsonl [NAME PATH ...]; TOML: a flat list or a list of pairs); files must exist. "
        "'none' drops the recipe's eval sets and turns evaluation off (the recipe's "
        "--eval-interval and --eval-reward-scorers go with them).",
        factory=list,
    )
    eval_interval: int | None = _flag(
        None, "Evaluate every N rollouts; must be >= 1 and needs --eval-prompt-data. Unset (none) = "
        "no evaluation."
    )
    n_samples_per_eval_prompt: int = _flag(
        1, "Candidates per eval prompt; must be >= 1."
    )
    eval_use_ema: bool = _flag(
        False, "Evaluate with the EMA weights (training rollouts keep the live ones); needs --ema-decay > 0."
    )
    eval_base: bool = _flag(
        False, "Also evaluate the base model before rollout 0 (logged at step 0, images under "
        "<artifact-root>/eval_base/); not on a resume; does nothing without --eval-prompt-data."
    )


@dataclass
class LoggingConfig:
    tensorboard_dir: str | None = _flag(
        None,
        "TensorBoard event directory; unset = <save>/tensorboard when --save is set, else "
        "console metrics only."
    )
    # kept for Relax's command line; UNSUPPORTED_FLAGS says why
    use_wandb: bool = _unsupported(False)
    use_clearml: bool = _unsupported(False)
    use_metrics_service: bool = _unsupported(False)


@dataclass
class DebugConfig:
    # kept for Relax's command line; UNSUPPORTED_FLAGS says why
    load_debug_rollout_data: str | None = _unsupported(None)
    save_debug_train_data: str | None = _unsupported(None)


#: section attribute -> section class, in the order help and to_dict() list them
SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "rollout": RolloutConfig,
    "artifacts": ArtifactConfig,
    "fsdp": FsdpConfig,
    "lora": LoraConfig,
    "optim": OptimConfig,
    "grpo": GrpoConfig,
    "reward": RewardConfig,
    "sync": SyncConfig,
    "colocate": ColocateConfig,
    "checkpoint": CheckpointConfig,
    "eval": EvalConfig,
    "logging": LoggingConfig,
    "debug": DebugConfig,
}


@dataclass
class RunConfig:
    """The whole run: one instance of every section.

    `explicit` holds the flag names (underscore form) that a recipe or the CLI set;
    preflight uses it where Relax distinguishes "set" from "defaulted"
    (e.g. an explicit --weight-sync-mode that contradicts --lora-adapter-mode).
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    artifacts: ArtifactConfig = field(default_factory=ArtifactConfig)
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    colocate: ColocateConfig = field(default_factory=ColocateConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    explicit: frozenset = field(default_factory=frozenset, repr=False, compare=False)

    def get(self, name: str) -> Any:
        """The value of flag `name` (underscore form), whichever section holds it."""
        return getattr(getattr(self, FLAGS[name].section), name)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """{section: {field: value}}, JSON-serialisable (pairs become 2-lists)."""
        out: dict[str, dict[str, Any]] = {}
        for sec in SECTIONS:
            obj = getattr(self, sec)
            out[sec] = {f.name: _jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return out

    def to_flags(self) -> dict[str, Any]:
        """{flag-name-with-dashes: value} over every flag: a complete recipe of this run."""
        return {name.replace("_", "-"): val for sec in self.to_dict().values() for name, val in sec.items()}

    @classmethod
    def from_dict(cls, data: dict[str, dict[str, Any]]) -> "RunConfig":
        """Inverse of to_dict(); unknown sections or fields raise ConfigError."""
        flat: dict[str, Any] = {}
        for sec, values in data.items():
            if sec not in SECTIONS:
                raise ConfigError(f"unknown config section '{sec}'{_suggest(sec, list(SECTIONS))}")
            for k, v in values.items():
                if k not in FLAGS or FLAGS[k].section != sec:
                    raise ConfigError(f"unknown field '{sec}.{k}'")
                flat[k] = _coerce_native(FLAGS[k], v, origin=f"{sec}.{k}")
        return _build(flat, explicit=frozenset())


def _jsonable(v: Any) -> Any:
    if isinstance(v, tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    return v


# ----------------------------------------------------------------------------------------------
# Flag table


@dataclass(frozen=True)
class FlagSpec:
    """One flag: where it lives and how its value is parsed.

    kind: 'int' | 'float' | 'str' | 'bool' | 'list' (list[str]) | 'dict' | 'pairs'.
    choices: the values a 'str' flag may take (from its Literal annotation), () for any;
    hints: value -> a pointer added to the error when that value is given.
    """

    name: str
    section: str
    kind: str
    optional: bool
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    hints: tuple[tuple[str, str], ...] = ()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _kind_of(tp: Any) -> tuple[str, bool, tuple[str, ...]]:
    """Map a field annotation to (kind, optional, choices)."""
    args = typing.get_args(tp)
    optional = type(None) in args and typing.get_origin(tp) is not Literal
    if optional:
        (tp,) = [a for a in args if a is not type(None)]
    origin = typing.get_origin(tp) or tp
    if origin is Literal:
        choices = typing.get_args(tp)
        if not all(isinstance(c, str) for c in choices):
            raise TypeError(f"config Literal {tp!r} must list strings")
        return "str", optional, choices
    if origin is bool:
        return "bool", optional, ()
    if origin is int:
        return "int", optional, ()
    if origin is float:
        return "float", optional, ()
    if origin is str:
        return "str", optional, ()
    if origin is dict:
        return "dict", optional, ()
    if origin is list:
        (item,) = typing.get_args(tp)
        return ("pairs" if typing.get_origin(item) is tuple else "list"), optional, ()
    raise TypeError(f"unsupported config field type {tp!r}")


def _build_flag_table() -> dict[str, FlagSpec]:
    table: dict[str, FlagSpec] = {}
    for sec, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in table:
                raise TypeError(f"flag {f.name} is declared in both {table[f.name].section} and {sec}")
            kind, optional, choices = _kind_of(hints[f.name])
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            value_hints = f.metadata.get("hints", {})
            help_text = f.metadata.get("help", "")
            if bool(f.metadata.get("unsupported")) != (f.name in UNSUPPORTED_FLAGS):
                raise TypeError(f"flag {f.name}: declare it with _unsupported() exactly when UNSUPPORTED_FLAGS lists it")
            if f.name in UNSUPPORTED_FLAGS:
                help_text = _unsupported_help(default, UNSUPPORTED_FLAGS[f.name])
            if choices and not (default in choices or (optional and default is None)):
                raise TypeError(f"flag {f.name}: default {default!r} is not one of its choices {choices}")
            if set(value_hints) & set(choices):
                raise TypeError(f"flag {f.name}: a hint names an allowed value")
            table[f.name] = FlagSpec(f.name, sec, kind, optional, default, help_text, choices,
                                     tuple(value_hints.items()))
    missing = set(UNSUPPORTED_FLAGS) - set(table)
    if missing:
        raise TypeError(f"UNSUPPORTED_FLAGS lists {sorted(missing)}, which are no flags")
    return table


#: underscore flag name -> FlagSpec, for every flag
FLAGS: dict[str, FlagSpec] = _build_flag_table()


def _suggest(name: str, candidates: list[str]) -> str:
    """' (did you mean X?)' for the closest candidate, or ''."""
    hits = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f" (did you mean '{hits[0]}'?)" if hits else ""


def _lookup(raw: str, origin: str, as_flag: bool, section: str | None = None) -> FlagSpec:
    """The flag a command-line flag or a recipe key names; a recipe key under a [section] must
    belong to it. ConfigError otherwise, with the closest name (or section) as a suggestion."""
    name = raw.replace("-", "_")
    spec = FLAGS.get(name)
    if spec is None:
        if as_flag:
            cands = [s.flag for s in FLAGS.values()]
            sugg = _suggest("--" + raw.replace("_", "-"), cands)
        else:
            key = raw.replace("_", "-")
            cands = [n.replace("_", "-") for n in FLAGS] + (list(SECTIONS) if section is None else [])
            hits = difflib.get_close_matches(key, cands, n=1, cutoff=0.6)
            other = FLAGS.get(hits[0].replace("-", "_")) if hits else None
            elsewhere = f" in [{other.section}]" if other and section and other.section != section else ""
            sugg = f" (did you mean '{hits[0]}'{elsewhere}?)" if hits else ""
        what = f"flag '--{raw}'" if as_flag else f"key '{raw}'"
        raise ConfigError(
            f"{origin}: unknown {what}{sugg}; `python -m trainer.train --help` lists every flag"
        )
    if section is not None and spec.section != section:
        raise ConfigError(f"{origin}: key '{raw}' belongs in [{spec.section}], not [{section}]")
    return spec


# ----------------------------------------------------------------------------------------------
# Value parsing

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _parse_bool(s: str) -> bool | None:
    low = s.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    return None


def _coerce_text(spec: FlagSpec, text: str, origin: str) -> Any:
    """Parse a string value (from the CLI, or a TOML string for a non-string flag)."""
    where = f"{origin}: {spec.flag}"
    if spec.optional and text.strip().lower() in ("none", "null"):
        return None
    if spec.kind == "str":
        return _checked_choice(spec, text, origin)
    if spec.kind == "int":
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"{where} expects an integer, got {text!r}") from None
    if spec.kind == "float":
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"{where} expects a number, got {text!r}") from None
    if spec.kind == "bool":
        b = _parse_bool(text)
        if b is None:
            raise ConfigError(f"{where} expects true/false, got {text!r}")
        return b
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where} expects JSON ({spec.kind}), got {text!r}: {exc}") from None
    return _coerce_native(spec, value, origin)


def _coerce_native(spec: FlagSpec, value: Any, origin: str) -> Any:
    """Check/convert an already-typed value (TOML or JSON) to the flag's type."""
    where = f"{origin}: {spec.flag}"
    if value is None:
        if spec.optional:
            return None
        raise ConfigError(f"{where} cannot be null")
    if isinstance(value, str) and spec.kind != "str":
        if spec.kind in ("list", "pairs") and not value.lstrip().startswith("["):
            value = value.split()
        else:
            return _coerce_text(spec, value, origin)
    k = spec.kind
    if k == "str":
        if not isinstance(value, str):
            raise ConfigError(f"{where} expects a string, got {value!r}")
        return _checked_choice(spec, value, origin)
    if k == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{where} expects true/false, got {value!r}")
        return value
    if k == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{where} expects an integer, got {value!r}")
        return value
    if k == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} expects a number, got {value!r}")
        return float(value)
    if k == "list":
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            raise ConfigError(f"{where} expects a list of strings, got {value!r}")
        return list(value)
    if k == "dict":
        if not isinstance(value, dict):
            raise ConfigError(f"{where} expects a JSON object / TOML table, got {value!r}")
        return dict(value)
    if k == "pairs":
        return _coerce_pairs(value, where)
    raise AssertionError(k)


def _one_of(choices: tuple[str, ...]) -> str:
    """('a',) -> "'a'"; ('a', 'b', 'c') -> "'a', 'b' or 'c'"."""
    quoted = [repr(c) for c in choices]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def _checked_choice(spec: FlagSpec, value: str, origin: str) -> str:
    """`value` if the flag takes it (any string when the flag has no choices), else ConfigError."""
    if not spec.choices or value in spec.choices:
        return value
    unset = ", or none to leave it unset" if spec.optional else ""
    hint = dict(spec.hints).get(value)
    raise ConfigError(f"{origin}: {spec.flag} {value!r} must be {_one_of(spec.choices)}{unset}"
                      + (f" ({hint})" if hint else ""))


def _coerce_pairs(value: Any, where: str) -> list[tuple[str, str]]:
    """[name, path, name, path, ...] or [[name, path], ...] -> [(name, path), ...]; 'none' -> []."""
    if value in ("none", ["none"]):
        return []
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list) and all(isinstance(x, list) for x in value):
        items = value
    elif isinstance(value, list) and all(isinstance(x, str) for x in value):
        if len(value) % 2:
            raise ConfigError(f"{where} expects NAME PATH pairs, got an odd number of values: {value!r}")
        items = [value[i : i + 2] for i in range(0, len(value), 2)]
    else:
        raise ConfigError(f"{where} expects NAME PATH pairs, got {value!r}")
    out = []
    for item in items:
        if len(item) != 2 or not all(isinstance(x, str) for x in item):
            raise ConfigError(f"{where} expects NAME PATH pairs, got {item!r}")
        out.append((item[0], item[1]))
    return out


# ----------------------------------------------------------------------------------------------
# Environment expansion

_ENV_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand_env(text: str, origin: str, env: dict[str, str] | None = None) -> str:
    """Replace ${VAR} and ${VAR:-default} in `text`; an unset VAR without default raises.

    Only the braced form is expanded, so a literal '$' elsewhere is left alone.
    """
    env = os.environ if env is None else env

    def sub(m: re.Match) -> str:
        var, default = m.group(1), m.group(2)
        val = env.get(var)
        if val is None or (val == "" and default is not None):
            if default is None:
                raise ConfigError(
                    f"{origin} uses ${{{var}}} but the environment variable {var} is not set; "
                    f"export {var}=... or pass the flag on the command line"
                )
            return default
        return val

    return _ENV_RE.sub(sub, text)


def _expand_tree(value: Any, origin: str, env: dict[str, str] | None) -> Any:
    if isinstance(value, str):
        return expand_env(value, origin, env)
    if isinstance(value, list):
        return [_expand_tree(v, origin, env) for v in value]
    if isinstance(value, dict):
        return {k: _expand_tree(v, origin, env) for k, v in value.items()}
    return value


# ----------------------------------------------------------------------------------------------
# Loading


def read_recipe(
    path: str | Path, env: dict[str, str] | None = None, skip: frozenset | set = frozenset()
) -> dict[str, Any]:
    """Parse a recipe into {underscore flag name: typed value}.

    A TOML recipe names flags (dashes or underscores) at the top level, under the [section]
    that holds them ([rollout], [fsdp], ... as --help groups them), or both. A JSON file is a
    run's recipe record (<artifact_root>/recipes/<name>-<time>.json): its "config" object,
    {section: {field: value}}, read with the same rules; its values are already resolved, so
    they are not ${VAR}-expanded.

    Keys whose flag is in `skip` (overridden on the command line) are checked for
    existence but neither expanded nor parsed, so an unset ${VAR} there is no error.
    Raises ConfigError for a missing file, bad TOML or JSON, an unknown key or section (with a
    suggestion), a key under the wrong section (naming the right one), a flag given twice
    (dash and underscore form, or flat and in its section), a table where the flag is not a
    dict, a wrong value type, a value outside the flag's choices, or an unset ${VAR}.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"recipe {path} does not exist") from None
    if path.suffix == ".json":
        tree, expand = _record_config(path, text), False
    else:
        try:
            tree, expand = tomllib.loads(text), True
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"recipe {path} is not valid TOML: {exc}") from None
    items: list[tuple[str | None, str, Any]] = []  # (section or None, key, value)
    for key, value in tree.items():
        if key in SECTIONS and isinstance(value, dict):
            items += [(key, sub, v) for sub, v in value.items()]
        else:
            items.append((None, key, value))
    out: dict[str, Any] = {}
    seen: dict[str, str] = {}
    for sec, key, value in items:
        where = f"recipe {path}" if sec is None else f"recipe {path} [{sec}]"
        label = key if sec is None else f"[{sec}] {key}"
        spec = _lookup(key, where, as_flag=False, section=sec)
        if spec.name in seen:
            raise ConfigError(f"recipe {path}: '{label}' and '{seen[spec.name]}' set the same flag {spec.flag}")
        seen[spec.name] = label
        if spec.name in skip:
            continue
        if isinstance(value, dict) and spec.kind not in ("dict", "pairs"):
            raise ConfigError(
                f"{where}: '{key}' is a table, but {spec.flag} is not a dict-valued flag; "
                "tables are only for sampling-config, reward-component-weights, resource and "
                f"autoscaler-config, and for the sections {', '.join(f'[{s}]' for s in SECTIONS)}"
            )
        if expand:
            value = _expand_tree(value, f"{where} key '{key}'", env)
        out[spec.name] = _coerce_native(spec, value, where)
    return out


def _record_config(path: Path, text: str) -> dict[str, Any]:
    """The "config" object of a recipe record (JSON), {section: {field: value}}."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"recipe {path} is not valid JSON: {exc}") from None
    config = record.get("config") if isinstance(record, dict) else None
    if not isinstance(config, dict) or not all(isinstance(v, dict) for v in config.values()):
        raise ConfigError(
            f"recipe {path} is JSON but not a recipe record (no \"config\" object of sections); a recipe is a "
            "TOML file, a record is what a run writes under <artifact_root>/recipes/"
        )
    return config


def parse_cli(argv: list[str]) -> tuple[str | None, dict[str, Any]]:
    """Split `argv` into (--config path or None, {underscore flag name: value}).

    Forms: `--flag value`, `--flag=value`; a bool flag alone means true and may take an
    explicit true/false; list flags take several values or one JSON list;
    --eval-prompt-data takes NAME PATH pairs (or none); dict flags take one JSON object, or one
    key at a time as `--flag.key value` (dict_key_value), collected into one object (over the
    flag's own value when it comes earlier on the line).
    """
    config: str | None = None
    out: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        tok = argv[i]
        if not tok.startswith("--") or tok == "--":
            raise ConfigError(f"command line: unexpected argument {tok!r}; flags look like --name value")
        name, eq, inline = tok[2:].partition("=")
        i += 1
        if name == "config":
            if eq:
                config = inline
            elif i < len(argv):
                config, i = argv[i], i + 1
            else:
                raise ConfigError("command line: --config needs a recipe path")
            continue
        name, dot, key = name.partition(".")
        spec = _lookup(name, "command line", as_flag=True)
        if eq:
            values = [inline]
        else:
            values = []
            while i < len(argv) and not argv[i].startswith("--"):
                values.append(argv[i])
                i += 1
        if dot:
            if spec.kind != "dict" or not key:
                raise ConfigError(f"command line: --{name}.{key} sets one key of a dict-valued flag, and {spec.flag} "
                                  "is not one (or the key is missing); pass the flag's value on its own")
            if len(values) != 1:
                raise ConfigError(f"command line: {spec.flag}.{key} takes one value, got {values!r}")
            if not isinstance(out.get(spec.name, {}), dict):
                raise ConfigError(f"command line: {spec.flag}.{key} after {spec.flag} none; drop one of them")
            out[spec.name] = {**out.get(spec.name, {}), key: dict_key_value(values[0])}
            continue
        # a flag given twice: the last value wins, as for every flag (its keys then merge over the recipe's)
        out[spec.name] = _cli_value(spec, values)
    return config, out


def dict_key_value(text: str) -> Any:
    """The value of `--flag.key text`: JSON when it parses (10, 0.7, true, null, [1, 3]), else the
    text itself (`--sampling-config.sde_type dance`)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def merge_dict_flag(base: dict | None, patch: dict | None) -> dict | None:
    """A dict-valued flag given again (the command line over the recipe, a tool's flag over its
    defaults): `patch`'s keys replace `base`'s one by one and the others stay, so
    `{"num_inference_steps": 10}` changes the step count and keeps the geometry, as FlowGRPO's
    `--config.sample.num_steps=10` does. A key whose value is null (None) is removed (back to its
    default). `patch` None (the flag set to none) drops the whole value."""
    if patch is None:
        return None
    merged = dict(base or {})
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    return merged


#: the --sampling-config keys that choose the trained steps: a patch setting any of them chose them itself
TRAINED_STEP_KEYS = ("sde_indices", "sde_pool", "num_sde_steps", "sde_window_size", "sde_window_range",
                     "sde_timestep_fraction", "sde_resample_per_rollout")


def merge_sampling_config(base: dict | None, patch: dict | None) -> dict | None:
    """merge_dict_flag for --sampling-config, where the trained steps follow the step count: a
    patch that changes num_inference_steps and none of TRAINED_STEP_KEYS keeps the steps of
    `base` (a recipe's, a tool's family defaults) that its count still has, in sde_indices and
    sde_pool, and no more num_sde_steps than the pool keeps, instead of leaving them to be refused
    for a value the patch never set. ({"num_inference_steps": 4} over sde_indices [1, 3, 5]:
    [1, 3].) Trained steps of which none fit stay as they are, and are refused, naming them."""
    merged = merge_dict_flag(base, patch)
    n = (patch or {}).get("num_inference_steps")
    if merged is None or not isinstance(n, int) or isinstance(n, bool) or n < 1 \
            or any(k in patch for k in TRAINED_STEP_KEYS):
        return merged
    for key in ("sde_indices", "sde_pool"):
        steps = merged.get(key)
        if isinstance(steps, list) and all(isinstance(i, int) for i in steps):
            kept = [i for i in steps if i < n]
            if kept:
                merged[key] = kept
    pool = merged.get("sde_pool")
    k = merged.get("num_sde_steps")
    if isinstance(pool, list) and pool and isinstance(k, int) and k > len(pool):
        merged["num_sde_steps"] = len(pool)
    return merged


def _cli_value(spec: FlagSpec, values: list[str]) -> Any:
    where = "command line"
    if spec.kind == "bool":
        if not values:
            return True
        if len(values) == 1:
            return _coerce_text(spec, values[0], where)
    elif spec.kind == "list" and values:
        if len(values) == 1 and values[0].lstrip().startswith("["):
            return _coerce_text(spec, values[0], where)
        return list(values)
    elif spec.kind == "pairs" and values:
        if len(values) == 1 and values[0].lstrip().startswith(("[", "{")):
            return _coerce_text(spec, values[0], where)
        return _coerce_pairs(values, f"{where}: {spec.flag}")
    elif len(values) == 1:
        return _coerce_text(spec, values[0], where)
    if not values:
        raise ConfigError(f"command line: {spec.flag} needs a value")
    raise ConfigError(f"command line: {spec.flag} takes one value, got {values!r} (quote JSON values)")


def _build(flat: dict[str, Any], explicit: frozenset) -> RunConfig:
    """Instantiate every section from defaults overridden by `flat`."""
    kwargs: dict[str, Any] = {}
    for sec, cls in SECTIONS.items():
        vals = {k: v for k, v in flat.items() if FLAGS[k].section == sec}
        kwargs[sec] = cls(**vals)
    return RunConfig(**kwargs, explicit=explicit)


def finalize(cfg: RunConfig) -> RunConfig:
    """Fill the derived values Relax derives, without overriding explicit ones.

    - global_batch_size unset -> rollout_batch_size x n_samples_per_prompt;
    - weight_sync_mode not set explicitly -> 'adapter' under --lora-adapter-mode;
    - generative_advantage_std_mode unset -> 'none' with --disable-grpo-std-normalization,
      else 'group';
    - lr_decay_iters unset -> num_rollout x num_updates_per_batch (all optimizer steps);
    - model_adapter_path not set -> the family --model-path's model_index.json names
      (adapter_for_model_dir), else the default family's;
    - short names -> dotpaths: --rollout-engine-class-path native/sglang and
      --reward-scorer-path pickscore/ocr/..., so downstream code only sees dotpaths.
    Contradictions between explicit values are left for preflight to report.
    """
    r = cfg.rollout
    if "model_adapter_path" not in cfg.explicit and cfg.model.model_path:
        cfg.model.model_adapter_path = adapter_for_model_dir(cfg.model.model_path)
    if r.global_batch_size is None and r.rollout_batch_size and r.n_samples_per_prompt:
        r.global_batch_size = r.rollout_batch_size * r.n_samples_per_prompt
    if "weight_sync_mode" not in cfg.explicit and cfg.lora.lora_adapter_mode:
        cfg.sync.weight_sync_mode = "adapter"
    if cfg.grpo.generative_advantage_std_mode is None:
        cfg.grpo.generative_advantage_std_mode = (
            "none" if cfg.grpo.disable_grpo_std_normalization else "group"
        )
    if cfg.optim.lr_decay_iters is None and r.num_rollout:
        cfg.optim.lr_decay_iters = r.num_rollout * max(cfg.grpo.num_updates_per_batch, 1)
    r.rollout_engine_class_path = resolve_engine_path(r.rollout_engine_class_path)
    cfg.reward.reward_scorer_path = resolve_scorer_path(cfg.reward.reward_scorer_path)
    return cfg


def load_config(argv: list[str], env: dict[str, str] | None = None) -> RunConfig:
    """`--config RECIPE.toml` (optional) then CLI flags, which override the recipe.

    Environment expansion applies to recipe values only (the shell already expanded
    the command line). Returns a finalized RunConfig; raises ConfigError on any
    parse problem. Semantic checks are preflight's job (trainer.preflight.validate).
    """
    recipe_path, cli = parse_cli(list(argv))
    # a dict flag on the command line merges over the recipe's value, so that one is read too
    skip = frozenset(name for name in cli if FLAGS[name].kind != "dict")
    flat: dict[str, Any] = read_recipe(recipe_path, env, skip=skip) if recipe_path else {}
    for name, value in cli.items():
        merge = merge_sampling_config if name == "sampling_config" else merge_dict_flag
        flat[name] = merge(flat.get(name), value) if FLAGS[name].kind == "dict" else value
    if cli.get("eval_prompt_data") == []:
        # `--eval-prompt-data none` turns evaluation off: the recipe's eval schedule and held-out
        # scorers, which need an eval set, go with it unless the command line sets them again
        for name in EVAL_SET_FLAGS:
            if name not in cli:
                flat.pop(name, None)
    return finalize(_build(flat, explicit=frozenset(flat)))


#: flags that mean something only with an eval set (dropped with `--eval-prompt-data none`)
EVAL_SET_FLAGS = ("eval_interval", "eval_reward_scorers")


# ----------------------------------------------------------------------------------------------
# World size


def world_size_from_env(env: dict[str, str] | None = None) -> int | None:
    """WORLD_SIZE as set by torchrun, or None outside torchrun."""
    env = os.environ if env is None else env
    raw = env.get("WORLD_SIZE")
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment WORLD_SIZE={raw!r} is not an integer") from None


def recipe_world_size(cfg: RunConfig) -> int | None:
    """actor_num_nodes x actor_num_gpus_per_node (a missing factor counts as 1), or None
    when neither is set."""
    c = cfg.colocate
    if c.actor_num_nodes is None and c.actor_num_gpus_per_node is None:
        return None
    return (c.actor_num_nodes or 1) * (c.actor_num_gpus_per_node or 1)


# ----------------------------------------------------------------------------------------------
# Help


def format_help() -> str:
    """Every flag with its type, default and constraint, grouped by section."""
    lines = [
        "usage: python -m trainer.train --config RECIPE.toml [--flag value ...] [--preflight-only [--quiet]]",
        "",
        "Recipe keys are these flag names (dashes or underscores), at the top level or under the [section]",
        "that lists them here; --config also takes a run's recipe record (JSON). The command line overrides",
        "the recipe; a dict flag's keys merge over the recipe's table (--sampling-config '{\"eta\": 1.0}' or",
        "--sampling-config.eta 1.0; null removes a key). --preflight-only checks and prints the resolved config,",
        "--quiet only the problems. A recipe, a recipe record and every dotpath flag name code that the run",
        "imports: use only ones you trust.",
    ]
    for sec in SECTIONS:
        lines += ["", f"[{sec}]"]
        for spec in FLAGS.values():
            if spec.section != sec:
                continue
            default = json.dumps(_jsonable(spec.default))
            kind = f"one of {', '.join(spec.choices)}" if spec.choices else spec.kind
            lines.append(f"  {spec.flag} ({kind}, default {default})")
            lines.append(f"      {spec.help}")
    return "\n".join(lines)
