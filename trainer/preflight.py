"""Launch-time validation of a RunConfig: every violation at once, before any model loads.

`validate(cfg, world_size)` checks Relax's "Preflight validation" list (errors
and warnings) plus this trainer's own rules (candidate split over the torchrun world,
paths that must exist, and every flag of config.UNSUPPORTED_FLAGS that is set). It
collects every problem and raises one PreflightError listing them, one line per
violation naming the flag(s) and the fix; warnings are returned for the caller to log.
A value outside a flag's choices never gets here: the config parser refuses it.

Imports no torch and loads nothing: only the config, the task vocabulary and the
torch-free sampling-config parser.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from trainer.config import (
    DEFAULT_MODEL_ADAPTER,
    EDIT_ADAPTERS,
    ENGINE_SHORT_NAMES,
    FLAGS,
    GENERATION_TASKS,
    PIPELINE_ADAPTERS,
    SCORER_SHORT_NAMES,
    SCORERS_NEEDING_MODEL,
    UNSUPPORTED_FLAGS,
    RunConfig,
    pipeline_class_name,
    recipe_world_size,
    resolve_engine_path,
    resolve_scorer_path,
)
from trainer import checkpoint_index as ci
from trainer.sampling import (
    SDE_TYPES,
    SamplingConfigError,
    parse_sampling_config,
    resolve_sde_indices,
    trainable_step_zero_routes,
    trained_steps_problem,
)

HEADER = "Generative RL config validation failed:"

_DOTPATH_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
_PACKAGE_ROOT = Path(__file__).resolve().parent.parent
_SHIPPED_DOTPATHS = frozenset(
    [DEFAULT_MODEL_ADAPTER, *ENGINE_SHORT_NAMES.values(), *SCORER_SHORT_NAMES.values()]
)

#: Relax's relax.* dotpaths -> what replaces them here
RELAX_REPLACEMENTS = {
    "relax.models.qwen_image.adapter.QwenImageAdapter": DEFAULT_MODEL_ADAPTER,
    "relax.backends.sglang.diffusion_engine.SGLangNativeGenerationEngine": (
        "'sglang' (trainer.engine.sglang_engine.SGLangEngine) or 'native' "
        "(trainer.engine.native.NativeEngine)"
    ),
    "relax.engine.rewards.pickscore.PickScoreScorer": "trainer.rewards.pickscore.PickScoreScorer",
}


class PreflightError(ValueError):
    """The config cannot run. `problems` holds one line per violation."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__(HEADER + "".join(f"\n  - {p}" for p in self.problems))


def validate(cfg: RunConfig, world_size: int | None = None, *, torchrun: bool = True) -> list[str]:
    """Check `cfg` for a run on `world_size` ranks; return warnings, raise PreflightError.

    world_size: the ranks the job really has (torchrun's WORLD_SIZE; 1 for a process started
    without torchrun, `torchrun=False`), or None to check the recipe on its own (its
    --actor-num-nodes x --actor-num-gpus-per-node; when neither is known the per-rank checks
    are skipped with a warning).
    """
    errors: list[str] = []
    warnings: list[str] = []
    world = _check_world(cfg, world_size, errors, warnings, torchrun=torchrun)
    _check_task_and_model(cfg, errors)
    _check_video_task(cfg, errors)
    _check_engine(cfg, errors)
    _check_fp8_device(cfg, errors)
    _check_trainable(cfg, errors, warnings)
    _check_sync(cfg, errors)
    _check_sampling(cfg, errors)
    _check_colocate(cfg, world, errors)
    _check_geometry(cfg, world, errors, warnings)
    _check_model_bounds(cfg, errors)
    _check_grpo(cfg, errors)
    _check_algorithm(cfg, errors, warnings)
    _check_optim(cfg, errors, warnings)
    _check_reward(cfg, errors)
    _check_artifacts_eval_ckpt(cfg, errors, warnings)
    _check_compile_cache(cfg, errors, warnings)
    _check_unsupported(cfg, errors, warnings)
    if errors:
        raise PreflightError(errors)
    return warnings


# ----------------------------------------------------------------------------------------------
# helpers


def _check_dotpath(flag: str, value: str, errors: list[str]) -> None:
    """Shape module.Class; relax.* named with its replacement; trainer.* module file exists."""
    if value.startswith("relax.") or value == "relax":
        repl = RELAX_REPLACEMENTS.get(value)
        hint = f"use {repl}" if repl else "point it at a trainer.* implementation"
        errors.append(f"{flag} {value}: Relax's relax.* modules do not exist here; {hint}")
        return
    if not _DOTPATH_RE.match(value):
        errors.append(f"{flag} {value!r} is not a dotpath of the form package.module.Class")
        return
    module = value.rsplit(".", 1)[0]
    if module.split(".")[0] == "trainer":
        rel = Path(*module.split("."))
        if not ((_PACKAGE_ROOT / rel).with_suffix(".py").is_file() or (_PACKAGE_ROOT / rel / "__init__.py").is_file()):
            shipped = value in _SHIPPED_DOTPATHS
            hint = "this implementation is not in this build" if shipped else "check the spelling"
            errors.append(f"{flag} {value}: module file {rel}.py does not exist in this checkout; {hint}")


def _check_scorer(flag: str, name: str, errors: list[str], dotpath_flag: str | None = None) -> None:
    """A scorer flag's value: a shipped short name, or a dotpath (_check_dotpath, its errors
    under `dotpath_flag` when given); a bare word that is neither gets the short names and the
    closest one."""
    from trainer.config import unknown_scorer_name

    if not name.startswith("relax") and (problem := unknown_scorer_name(flag, name)):
        errors.append(problem)
    else:
        _check_dotpath(dotpath_flag or flag, resolve_scorer_path(name), errors)


def _positive_int(flag: str, value: int | None, errors: list[str], *, minimum: int = 1, required: bool = False) -> bool:
    """True when `value` is set and >= minimum; otherwise record why (if required or set)."""
    if value is None:
        if required:
            errors.append(f"{flag} is required (an integer >= {minimum})")
        return False
    if value < minimum:
        errors.append(f"{flag} must be >= {minimum}, got {value}")
        return False
    return True


def _need_existing(flag: str, value: str | None, kind: str, errors: list[str], *, required: bool,
                   alternative: str = "") -> None:
    """`kind` is 'dir' or 'file'; `alternative` is added to the fix of a missing path."""
    what = "directory" if kind == "dir" else "file"
    if not value:
        if required:
            errors.append(f"{flag} is required (an existing {what})")
        return
    p = Path(value)
    ok = p.is_dir() if kind == "dir" else p.is_file()
    if not ok:
        state = "is not a " + what if p.exists() else "does not exist"
        errors.append(f"{flag} {value}: {state}; point it at an existing local {what} (nothing is downloaded)"
                      + (f", {alternative}" if alternative else ""))


# ----------------------------------------------------------------------------------------------
# groups of rules


def _check_world(cfg: RunConfig, world_size: int | None, errors: list[str], warnings: list[str], *,
                 torchrun: bool = True) -> int | None:
    recipe_world = recipe_world_size(cfg)
    c = cfg.colocate
    for flag, v in (("--actor-num-nodes", c.actor_num_nodes), ("--actor-num-gpus-per-node", c.actor_num_gpus_per_node)):
        if v is not None and v < 1:
            errors.append(f"{flag} must be >= 1, got {v}")
            recipe_world = None
    if world_size is not None:
        if world_size < 1:
            errors.append(f"world size must be >= 1, got {world_size}")
            return None
        if recipe_world is not None and recipe_world != world_size and not torchrun:
            errors.append(
                f"--actor-num-nodes x --actor-num-gpus-per-node = {recipe_world} but this process was not "
                f"started by torchrun, so it would run alone with all {recipe_world} ranks' candidates; launch "
                f"with `torchrun --nproc-per-node {recipe_world} -m trainer.train ...` (or `bash run.sh train "
                f"RECIPE`), or set --actor-num-gpus-per-node 1 --actor-num-nodes 1 for one process"
            )
        # under torchrun another world size trains the same recipe (_check_geometry says how the
        # ranks share it, or why this world cannot)
        return world_size
    if recipe_world is None:
        warnings.append(
            "world size unknown (no WORLD_SIZE and no --actor-num-gpus-per-node): the per-rank "
            "candidate split was not checked"
        )
    return recipe_world


def _check_task_and_model(cfg: RunConfig, errors: list[str]) -> None:
    m = cfg.model
    if m.generation_task not in GENERATION_TASKS:
        errors.append(
            f"--generation-task {m.generation_task!r} is not in GENERATION_TASKS {GENERATION_TASKS}; "
            "set --generation-task t2i"
        )
    if not m.model_adapter_path:
        errors.append(f"--model-adapter-path is required (e.g. {DEFAULT_MODEL_ADAPTER})")
    else:
        _check_dotpath("--model-adapter-path", m.model_adapter_path, errors)
    _need_existing("--model-path", m.model_path, "dir", errors, required=True)
    # a known family's directory with another known family's adapter fails at the first load,
    # after minutes; model_index.json says which it is (a custom adapter is not second-guessed)
    pipeline = pipeline_class_name(m.model_path) if m.model_path else None
    want = PIPELINE_ADAPTERS.get(pipeline or "")
    if want and m.model_adapter_path in PIPELINE_ADAPTERS.values() and m.model_adapter_path != want:
        errors.append(f"--model-adapter-path {m.model_adapter_path} does not fit --model-path {m.model_path}: its "
                      f"model_index.json is a {pipeline}; use --model-adapter-path {want}")
    _check_edit_task(cfg, errors)


def _check_edit_task(cfg: RunConfig, errors: list[str]) -> None:
    """--generation-task i2i pairs with an editing family and records that carry source images
    (present on disk, one count per prompt file's records); t2i with a text-to-image family. A
    custom adapter is not second-guessed about its family."""
    m = cfg.model
    adapter = m.model_adapter_path
    if adapter in PIPELINE_ADAPTERS.values():
        edit = adapter in EDIT_ADAPTERS
        if m.generation_task == "i2i" and not edit:
            from trainer.config import VIDEO_ADAPTERS

            kind = "text-to-video" if adapter in VIDEO_ADAPTERS else "text-to-image"
            errors.append(f"--generation-task i2i needs an image-editing family, but --model-adapter-path {adapter} "
                          f"is a {kind} one; point --model-path at an editing model (model_index.json "
                          "QwenImageEditPlusPipeline or FluxKontextPipeline) with --model-adapter-path "
                          f"{' or '.join(sorted(EDIT_ADAPTERS))}, or set --generation-task t2i")
        elif m.generation_task == "t2i" and edit:
            errors.append(f"--model-adapter-path {adapter} is an image-editing family: it trains records with "
                          "source images; set --generation-task i2i (or use a text-to-image --model-path)")
    _need_existing("--media-root", cfg.rollout.media_root, "dir", errors, required=False)
    if m.generation_task != "i2i":
        return
    from trainer.data import DataError, PromptDataset

    files = [("--prompt-data", cfg.rollout.prompt_data)]
    files += [(f"--eval-prompt-data {name}", path) for name, path in cfg.eval.eval_prompt_data]
    for flag, path in files:
        if not path or not Path(path).is_file():
            continue
        try:
            ds = PromptDataset.from_jsonl(path, task="i2i", media_root=cfg.rollout.media_root)
        except DataError:
            continue  # _check_data_contents reports it (media outside the roots included)
        where = [f"{path}:{line}" for rec, line in zip(ds.records, ds.lines) if not rec.images]
        if where:
            errors.append(f"{flag}: {len(where)} record(s) have no source image (e.g. {', '.join(where[:3])}); an "
                          "i2i record lists its images (\"images\": [...], one <image> each in the prompt): build "
                          "the file with tools/prepare_data.py --source edit")
        from trainer.models.edit_source import source_file_problems

        bad = source_file_problems(ds)
        if bad:
            errors.append(f"{flag}: {len(bad)} source image(s) no rollout can use: {'; '.join(bad[:10])}"
                          f"{'; ...' if len(bad) > 10 else ''}; fix or drop those records (tools/inspect_data.py "
                          "--decode-media checks them)")
        counts = sorted({len(rec.images) for rec in ds.records if rec.images})
        if len(counts) > 1:
            errors.append(f"{flag}: records carry {' or '.join(map(str, counts))} source images; one rollout samples "
                          "one sequence layout, so every record of a prompt file needs the same number of images")


def _check_wan_experts(model_path: str | None, sampling: dict, algorithm: str, errors: list[str]) -> None:
    """A Wan directory's experts (trainer.models.wan.read_boundary_ratio: a two-expert declaration
    the pipeline could not run, a declared expert's missing subfolder), guidance_scale_2, which
    needs two experts and CFG (guidance_scale > 1), and --algorithm nft, which two experts do not
    train: from JSON only, before any weights load."""
    from trainer.models.wan import WAN_SECOND_EXPERT, read_boundary_ratio

    if not model_path or not (Path(model_path) / "model_index.json").exists():
        return  # _need_existing names a missing directory, loading a missing model_index.json
    try:  # a model_index.json that is no JSON object, or that would drop an expert, is named here
        ratio = read_boundary_ratio(model_path)
    except ValueError as e:
        errors.append(str(e))
        return
    if ratio is not None and algorithm == "nft":
        # nft draws each rank's noise levels from its own seed, so one micro-batch would run
        # the high-noise expert on one rank and both on another: FSDP2 gathers each block's
        # weights collectively, and ranks calling different blocks would wait for each other
        errors.append(f"--algorithm nft with --model-path {model_path}, a two-expert (Wan2.2 A14B) model: nft's "
                      "per-rank noise levels would make the ranks run different experts, which the sharded "
                      "actor cannot; use --algorithm flowgrpo (the default) with this model")
    if ratio is not None and not (Path(model_path) / WAN_SECOND_EXPERT).is_dir():
        errors.append(f"--model-path {model_path}: model_index.json declares {WAN_SECOND_EXPERT} (Wan2.2's low-noise "
                      f"expert) but there is no {WAN_SECOND_EXPERT}/ subfolder; restore it from the model's "
                      "Diffusers checkpoint")
    g2 = sampling.get("guidance_scale_2")
    if g2 is None:
        return
    if ratio is None:
        errors.append(f"--sampling-config guidance_scale_2 is {g2}, but --model-path {model_path} has one DiT: it is "
                      "the low-noise expert's scale of a two-expert (Wan2.2 A14B) model; remove it")
    elif not isinstance(sampling.get("guidance_scale", 1.0), (int, float)) or sampling.get("guidance_scale", 1.0) <= 1:
        errors.append(f"--sampling-config guidance_scale_2 is {g2} but guidance_scale is "
                      f"{sampling.get('guidance_scale', 1.0)}: WanPipeline runs CFG (for both experts) only when "
                      "guidance_scale > 1; set guidance_scale > 1 or remove guidance_scale_2")


def _check_video_task(cfg: RunConfig, errors: list[str]) -> None:
    """t2v against the family, the frames and the scorer (the rules of docs/video.md): t2v needs a
    video family and a video geometry (trainer.video's rules), a video family and frames need t2v,
    and a scorer reads the task's track (an image scorer scores a video's frames only through the
    framewise wrapper; an edit scorer needs i2i's sources, as a frame scorer too; t2i and i2i score
    images). A custom
    adapter or scorer is not second-guessed."""
    from trainer.config import VIDEO_ADAPTERS, VIDEO_SCORERS
    from trainer.video import video_geometry_problems

    task, adapter = cfg.model.generation_task, cfg.model.model_adapter_path
    sampling = cfg.rollout.sampling_config if isinstance(cfg.rollout.sampling_config, dict) else {}
    frames = sampling.get("num_frames", 1)
    shipped = adapter in PIPELINE_ADAPTERS.values()
    if task == "t2v" and shipped and adapter not in VIDEO_ADAPTERS:
        errors.append(f"--generation-task t2v needs a video family, but --model-adapter-path {adapter} draws images: "
                      f"use a WanPipeline directory ({VIDEO_ADAPTERS[0]}) or --generation-task t2i")
    if task == "t2i" and adapter in VIDEO_ADAPTERS:
        errors.append(f"--model-adapter-path {adapter} is a video family: set --generation-task t2v (and "
                      "--sampling-config num_frames, e.g. 33)")
    if task in ("t2i", "i2i") and frames != 1:  # an edit is an image too
        errors.append(f"--sampling-config num_frames {frames} asks for a video, but --generation-task {task} samples "
                      "images: set --generation-task t2v with a video family (Wan2.1), or drop num_frames for images")
    if adapter in VIDEO_ADAPTERS:
        _check_wan_experts(cfg.model.model_path, sampling, cfg.grpo.algorithm, errors)
    if task == "t2v":
        if isinstance(frames, int) and not isinstance(frames, bool) and frames < 5:
            errors.append(f"--sampling-config num_frames is {frames}: --generation-task t2v samples videos; set "
                          "num_frames to 4k + 1 >= 5 (FlowGRPO's Wan recipe: 33, Wan2.1's default: 81)")
        elif frames != 1:
            errors.extend(video_geometry_problems(frames, sampling.get("height", 384), sampling.get("width", 384)))
    rw = cfg.reward
    scorer = resolve_scorer_path(rw.reward_scorer_path)
    if rw.reward_runtime == "remote" or scorer is None:
        return
    image_scorer = scorer in SCORER_SHORT_NAMES.values() and scorer not in VIDEO_SCORERS
    edit_scorer = scorer.startswith("trainer.rewards.edit.")
    if task == "t2v" and image_scorer and edit_scorer:
        errors.append(f"--reward-scorer-path {rw.reward_scorer_path} scores an edit against its source images, but "
                      "--generation-task t2v has no source: use a video scorer (video_ocr, temporal_consistency, "
                      "video_vlm_judge) or framewise with an image scorer")
    elif task == "t2v" and image_scorer:
        errors.append(f"--reward-scorer-path {rw.reward_scorer_path} scores images, but --generation-task t2v samples "
                      f"videos: score its frames with --reward-scorer-path framewise --reward-frame-scorer "
                      f"{rw.reward_scorer_path} (--reward-frame-reduction mean|min), or use a video scorer "
                      "(video_ocr, temporal_consistency, video_vlm_judge)")
    if task == "t2i" and edit_scorer:
        errors.append(f"--reward-scorer-path {rw.reward_scorer_path} scores an edit against its source images, but "
                      "--generation-task t2i has no source: use an image scorer (e.g. pickscore, ocr, color), or "
                      "--generation-task i2i with an editing family")
    if task in ("t2i", "i2i") and scorer in VIDEO_SCORERS:
        fix = "an edit scorer (color_edit, clip_preserve, edit_judge)" if task == "i2i" else \
            "an image scorer (e.g. ocr, pickscore, color)"
        errors.append(f"--reward-scorer-path {rw.reward_scorer_path} scores videos, but --generation-task {task} "
                      f"samples images: use {fix}")
    if scorer == SCORER_SHORT_NAMES["framewise"]:
        inner = resolve_scorer_path(rw.reward_frame_scorer)
        if inner in VIDEO_SCORERS:
            errors.append(f"--reward-frame-scorer {rw.reward_frame_scorer} is a video scorer; framewise applies an "
                          "IMAGE scorer to frames (e.g. ocr, pickscore, color)")
        elif inner and inner.startswith("trainer.rewards.edit."):
            errors.append(f"--reward-frame-scorer {rw.reward_frame_scorer} scores an edit against its source images, "
                          "which a video's frames do not have: use an image scorer (e.g. ocr, pickscore, color)")
        elif inner:
            _check_scorer("--reward-frame-scorer", rw.reward_frame_scorer, errors)
        if rw.reward_frame_every is not None and rw.reward_frame_count is not None:
            errors.append("--reward-frame-every and --reward-frame-count are two frame rules; set one of them")
        for flag, value in (("--reward-frame-every", rw.reward_frame_every),
                            ("--reward-frame-count", rw.reward_frame_count)):
            if value is not None:
                _positive_int(flag, value, errors)


def _check_engine(cfg: RunConfig, errors: list[str]) -> None:
    r = cfg.rollout
    engine = r.rollout_engine_class_path
    if not engine:
        errors.append(f"--rollout-engine-class-path is required: one of {sorted(ENGINE_SHORT_NAMES)} or a dotpath")
    else:
        _check_dotpath("--rollout-engine-class-path", resolve_engine_path(engine), errors)
        if resolve_engine_path(engine) == ENGINE_SHORT_NAMES["sglang"] and not _sglang_importable():
            errors.append(
                f"--rollout-engine-class-path {engine}: sglang is not installed in this environment and the "
                "SGLang engine needs it; install it with `pip install .[sglang]` (GPU), or use the CPU test venv "
                "made by `bash run.sh setup-sglang` (.venv-sglang)")
        _check_engine_capabilities(cfg, engine, errors)
    caps = engine_capabilities(resolve_engine_path(engine)) if engine else None
    if r.sglang_attention_backend and engine and not (caps is not None and caps.attention_backend):
        errors.append(f"--sglang-attention-backend {r.sglang_attention_backend} needs --rollout-engine-class-path "
                      f"sglang (this run's engine is {engine}); drop the flag")


def engine_capabilities(engine_path: str):
    """The `capabilities` (engine.base.EngineCapabilities) a shipped trainer.* engine class
    declares; its module is imported (cheap: an engine imports its runtime, e.g. sglang, only
    when built). None for a custom engine (not second-guessed) or one that does not import."""
    from trainer.dotpath import import_dotpath

    if not engine_path.startswith("trainer.") or not _DOTPATH_RE.match(engine_path):
        return None
    try:
        return getattr(import_dotpath(engine_path, "--rollout-engine-class-path"), "capabilities", None)
    except Exception:  # a broken path is _check_dotpath's to report
        return None


def _check_engine_capabilities(cfg: RunConfig, engine: str, errors: list[str]) -> None:
    """What the run asks of the engine against what its class declares it can do."""
    caps = engine_capabilities(resolve_engine_path(engine))
    if caps is None:
        return
    r, why = cfg.rollout, caps.reasons
    adapter = cfg.model.model_adapter_path
    if caps.families is not None and adapter in PIPELINE_ADAPTERS.values() and adapter not in caps.families:
        errors.append(f"--rollout-engine-class-path {engine} with --model-adapter-path {adapter}: {caps.name} "
                      f"{why.get('families', 'does not serve it')}; this family runs on --rollout-engine-class-path "
                      "native")
    sampling = r.sampling_config if isinstance(r.sampling_config, dict) else {}
    guidance = sampling.get("guidance_scale", 1.0)
    if not caps.true_cfg and isinstance(guidance, (int, float)) and float(guidance) > 1.0:
        errors.append(f"--rollout-engine-class-path {engine} with --sampling-config guidance_scale {guidance}: "
                      f"{caps.name} {why.get('true_cfg', 'samples without CFG')}; use --rollout-engine-class-path "
                      "native for true CFG, or guidance_scale 1.0")
    for flag, on, able in (("--rollout-compile", r.rollout_compile, caps.compile),
                           ("--rollout-precision fp8", r.rollout_precision == "fp8", caps.fp8)):
        if on and not able:
            errors.append(f"--rollout-engine-class-path {engine} with {flag}: that option belongs to the native "
                          f"engine ({why.get('kernels', 'not this one')}); drop it or use --rollout-engine-class-path "
                          "native")
    sde_type = sampling.get("sde_type")
    if isinstance(sde_type, str) and sde_type in SDE_TYPES and sde_type not in caps.sde_types:
        errors.append(f"--rollout-engine-class-path {engine} with --sampling-config sde_type {sde_type!r}: "
                      f"{caps.name}'s {why.get('sde_types', 'sampler is checked for')} "
                      f"{' and '.join(repr(t) for t in caps.sde_types)} only; use --rollout-engine-class-path native "
                      f"for {sde_type!r}")


def _check_fp8_device(cfg: RunConfig, errors: list[str]) -> None:
    """--rollout-precision fp8 and --replay-precision fp8 / fp8-dgrad on CUDA need FP8 tensor cores (compute
    capability 8.9: Ada, Hopper and later); known before any model loads. On CPU the same math
    runs (slowly)."""
    import torch

    flags = [(flag, value) for flag, value in (("--rollout-precision", cfg.rollout.rollout_precision),
                                               ("--replay-precision", cfg.fsdp.replay_precision)) if value != "default"]
    if not flags or not torch.cuda.is_available():
        return
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        for flag, value in flags:
            errors.append(f"{flag} {value} needs a GPU with FP8 tensor cores (compute capability >= 8.9); this one "
                          f"is {major}.{minor} ({torch.cuda.get_device_name()}): use {flag} default")


def _sglang_importable() -> bool:
    """The sglang package is installed here (a spec lookup; nothing is imported). A directory
    named sglang on sys.path without an __init__.py (a namespace package) is not it."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin is not None and spec.origin.endswith("__init__.py")


def _check_trainable(cfg: RunConfig, errors: list[str], warnings: list[str]) -> None:
    f, lo = cfg.fsdp, cfg.lora
    mode = f.fsdp_trainable_mode
    if mode == "lora" and lo.lora_rank <= 0:
        errors.append(f"--fsdp-trainable-mode lora needs --lora-rank > 0, got {lo.lora_rank}")
    from trainer.core.adapter_config import MAX_LORA_RANK

    if lo.lora_rank > MAX_LORA_RANK:  # peft would allocate rank x width per layer before anything checks it
        errors.append(f"--lora-rank {lo.lora_rank} is above {MAX_LORA_RANK}, wider than any layer of the supported "
                      "models; LoRA ranks are typically 4-256")
    if lo.lora_rank > 0 and mode != "lora":
        errors.append(
            f"--lora-rank {lo.lora_rank} without --fsdp-trainable-mode lora; set both for LoRA, or "
            "--lora-rank 0 for full fine-tune"
        )
    if lo.lora_rank < 0:
        errors.append(f"--lora-rank must be >= 0, got {lo.lora_rank}")
    if f.replay_precision != "default" and mode != "lora":
        errors.append(f"--replay-precision {f.replay_precision} with --fsdp-trainable-mode {mode}: it runs the "
                      "frozen base of the LoRA-wrapped linears in FP8, and a full fine-tune trains every weight; use "
                      "--fsdp-trainable-mode lora, or --replay-precision default")
    if f.replay_fp8_layers != "lora-base" and f.replay_precision == "default":
        errors.append(f"--replay-fp8-layers {f.replay_fp8_layers} with --replay-precision default: it chooses which "
                      "frozen linears an FP8 replay covers, and the replay is not in FP8; add --replay-precision fp8 "
                      "(or fp8-dgrad), or drop --replay-fp8-layers")
    if f.fp8_fast_accum and f.replay_precision == "default" and cfg.rollout.rollout_precision == "default":
        errors.append("--fp8-fast-accum without an FP8 GEMM to apply it to: it sets how the FP8 GEMMs of "
                      "--rollout-precision fp8 and --replay-precision fp8 / fp8-dgrad accumulate; add one of those, or "
                      "drop --fp8-fast-accum")
    if f.fsdp_frozen_params == "replicate" and f.fsdp_cpu_offload:
        errors.append("--fsdp-frozen-params replicate with --fsdp-cpu-offload: replicated frozen weights stay on "
                      "the device, which the offload is there to empty; use --fsdp-frozen-params shard (or auto)")
    if mode == "lora":
        if lo.lora_dropout != 0:
            errors.append(
                f"--lora-dropout {lo.lora_dropout}: must be 0.0 under LoRA (a stochastic forward breaks "
                "the ratio == 1 anchor of the first update)"
            )
        if f.fsdp_cpu_offload:
            errors.append(
                "--fsdp-cpu-offload is rejected under --fsdp-trainable-mode lora (gradient clipping over "
                "CPU-offloaded adapter DTensors has no collective backend); use --offload-train"
            )
        if f.fsdp_master_dtype != "fp32":
            warnings.append(
                "--fsdp-trainable-mode lora without --fsdp-master-dtype fp32: bf16 masters round off the "
                "~1e-4 relative RL updates and the policy stops moving"
            )
        if lo.lora_alpha <= 0:
            errors.append(f"--lora-alpha must be > 0, got {lo.lora_alpha}")
    elif f.fsdp_cpu_offload:
        warnings.append(
            "--fsdp-cpu-offload: gradient clipping over CPU-offloaded DTensors is known to fail "
            "('No backend type associated with device type cpu'); prefer --offload-train"
        )
    if mode == "full":
        if cfg.sync.weight_sync_mode != "full":
            errors.append(
                f"--weight-sync-mode {cfg.sync.weight_sync_mode!r} under --fsdp-trainable-mode full; "
                "full fine-tune syncs the whole transformer: use --weight-sync-mode full"
            )
        if lo.lora_adapter_mode or lo.lora_merge_mode:
            errors.append(
                "--lora-adapter-mode / --lora-merge-mode need --fsdp-trainable-mode lora; remove them "
                "for full fine-tune"
            )
    if lo.lora_adapter_mode and lo.lora_merge_mode:
        errors.append("--lora-adapter-mode and --lora-merge-mode are exclusive; pick one")
    if lo.lora_target_modules is not None and not lo.lora_target_modules:
        errors.append("--lora-target-modules is an empty list; leave it unset to use the adapter's own targets")
    if f.fsdp_activation_checkpointing_every < 1:
        errors.append(f"--fsdp-activation-checkpointing-every must be >= 1 (1 = every block), got "
                      f"{f.fsdp_activation_checkpointing_every}")
    elif f.fsdp_activation_checkpointing_every > 1 and not f.fsdp_activation_checkpointing:
        errors.append(f"--fsdp-activation-checkpointing-every {f.fsdp_activation_checkpointing_every} without "
                      "--fsdp-activation-checkpointing: nothing is checkpointed, so it would change nothing; add "
                      "--fsdp-activation-checkpointing, or drop it")
    if f.fsdp_load_wave_size < 0:
        errors.append(f"--fsdp-load-wave-size must be >= 0 (0 = all ranks at once), got {f.fsdp_load_wave_size}")
    if not f.fsdp_trainable_attr:
        errors.append("--fsdp-trainable-attr is empty; the default is 'transformer'")


def _check_sync(cfg: RunConfig, errors: list[str]) -> None:
    s, lo = cfg.sync, cfg.lora
    if lo.lora_adapter_mode and s.weight_sync_mode != "adapter":
        errors.append(
            f"--lora-adapter-mode with an explicit --weight-sync-mode {s.weight_sync_mode}: adapter mode "
            "syncs only LoRA tensors; drop --weight-sync-mode (it is derived) or set it to adapter"
        )
    elif s.weight_sync_mode == "adapter" and not lo.lora_adapter_mode:
        errors.append("--weight-sync-mode adapter needs --lora-adapter-mode (and --fsdp-trainable-mode lora)")
    if s.weight_sync_bucket_size_mb < 1:
        errors.append(f"--weight-sync-bucket-size-mb must be >= 1, got {s.weight_sync_bucket_size_mb}")


def _check_sampling(cfg: RunConfig, errors: list[str]) -> None:
    """Fold trainer.sampling's own problem list and step-0 routes into `errors`."""
    raw = cfg.rollout.sampling_config
    try:
        parsed = parse_sampling_config(raw)
    except SamplingConfigError as exc:
        errors.extend(exc.problems)
        # Still report step-0 routes: re-parse without the keys already reported, so one run
        # of preflight lists both kinds of problem.
        rest = {k: v for k, v in (raw or {}).items() if k not in exc.keys}
        try:
            parsed = parse_sampling_config(rest)
        except SamplingConfigError:
            return
        errors.extend(trainable_step_zero_routes(parsed))
        return
    if cfg.grpo.algorithm == "nft":
        return  # nft samples with the deterministic ODE path: the config's trained steps are not used
    # the evaluation fallback (no redraw): empty exactly when no rollout trains a step
    steps = resolve_sde_indices(parsed, parsed.num_inference_steps, None)
    problem = trained_steps_problem(steps, parsed.num_inference_steps)
    if problem:
        errors.append(f"--sampling-config trains no SDE step: {problem}")
    errors.extend(trainable_step_zero_routes(parsed))


def _check_colocate(cfg: RunConfig, world: int | None, errors: list[str]) -> None:
    c, r = cfg.colocate, cfg.rollout
    n = r.rollout_num_gpus_per_engine
    if n < 1:
        errors.append(f"--rollout-num-gpus-per-engine must be >= 1, got {n}")
    else:
        if world is not None and world % n:
            errors.append(
                f"--rollout-num-gpus-per-engine {n} does not divide the actor world size {world}; each "
                "engine's devices must tile the FSDP ranks"
            )
        if n > 1:
            errors.append(
                f"--rollout-num-gpus-per-engine {n}: each rank runs its own in-process engine on its own "
                "device, so only 1 is supported; remove the flag"
            )
    if c.rollout_num_gpus is not None and world is not None and c.rollout_num_gpus != world:
        errors.append(
            f"--rollout-num-gpus {c.rollout_num_gpus} != world size {world}: with colocation every rank "
            "runs an engine; remove the flag"
        )
    if c.resource is not None:
        _check_resource(c.resource, world, errors)


def _check_resource(res: dict, world: int | None, errors: list[str]) -> None:
    def total(key: str) -> int | None:
        v = res.get(key)
        if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in v)):
            errors.append(f"--resource {key!r} must be [nodes, devices_per_node] with positive integers, got {v!r}")
            return None
        return v[0] * v[1]

    unknown = sorted(set(res) - {"actor", "rollout"})
    if unknown:
        errors.append(f"--resource has unknown roles {unknown}; only 'actor' and 'rollout' exist")
    actor, rollout = total("actor"), total("rollout")
    if actor is None or rollout is None:
        return
    if res["actor"] != res["rollout"]:
        errors.append(
            f"--resource actor {res['actor']} != rollout {res['rollout']}: colocation runs both on the "
            "same devices"
        )
    elif world is not None and actor != world:
        errors.append(f"--resource actor {res['actor']} = {actor} devices but the world size is {world}")


def _check_model_bounds(cfg: RunConfig, errors: list[str]) -> None:
    """What the model directory can draw (its family adapter's geometry_bounds, read from its JSON
    configs) against the sampling geometry and the text window, before any weights load. Only
    for the shipped families: a custom adapter is not imported here."""
    r, adapter_path = cfg.rollout, cfg.model.model_adapter_path
    if adapter_path not in PIPELINE_ADAPTERS.values():
        return
    from trainer.dotpath import import_dotpath
    from trainer.models.base import geometry_problems

    try:
        sampling = parse_sampling_config(r.sampling_config)
    except ValueError:  # reported by _check_sampling
        sampling = None
    window = r.max_sequence_length if r.max_sequence_length is not None and r.max_sequence_length >= 1 else None
    errors.extend(geometry_problems(import_dotpath(adapter_path, "--model-adapter-path"), cfg.model.model_path,
                                    sampling and sampling.height, sampling and sampling.width, window))


def _check_geometry(cfg: RunConfig, world: int | None, errors: list[str], warnings: list[str]) -> None:
    r, g = cfg.rollout, cfg.grpo
    ok_b = _positive_int("--rollout-batch-size", r.rollout_batch_size, errors, required=True)
    ok_n = _positive_int("--n-samples-per-prompt", r.n_samples_per_prompt, errors, required=True)
    ok_u = _positive_int("--num-updates-per-batch", g.num_updates_per_batch, errors)
    ok_m = _positive_int("--micro-batch-size", g.micro_batch_size, errors)
    _positive_int("--num-rollout", r.num_rollout, errors, required=True)
    if r.engine_batch_size < 0:
        errors.append(f"--engine-batch-size must be >= 0 (0 = auto), got {r.engine_batch_size}")
    if r.max_sequence_length is not None:
        _positive_int("--max-sequence-length", r.max_sequence_length, errors)
    if ok_n and r.n_samples_per_prompt < 2:
        warnings.append(
            "--n-samples-per-prompt 1: a group of one has no reward variance, every advantage is 0; use 2 or more"
        )
    if ok_u and g.num_updates_per_batch == 1 and g.algorithm != "nft":  # nft has no importance ratio
        warnings.append(
            "--num-updates-per-batch 1: the importance ratio is always exactly 1, so the clipped loss never "
            "clips; use 2 or more"
        )
    if not (ok_b and ok_n):
        return
    total = r.rollout_batch_size * r.n_samples_per_prompt
    gbs = r.global_batch_size if r.global_batch_size is not None else total
    if gbs != total:
        errors.append(
            f"--global-batch-size {gbs} != --rollout-batch-size {r.rollout_batch_size} x "
            f"--n-samples-per-prompt {r.n_samples_per_prompt} = {total}; set it to {total} or leave it unset"
        )
        return
    if world is None:
        return
    recipe_world = recipe_world_size(cfg)
    written = f" (the recipe names {recipe_world})" if recipe_world not in (None, world) else ""
    if total % world:
        errors.append(
            f"--rollout-batch-size x --n-samples-per-prompt = {total} candidates do not divide evenly over "
            f"{world} ranks{written}; make the product a multiple of {world}"
        )
        return
    per_rank = total // world
    if not (ok_u and ok_m):
        return
    if per_rank % g.num_updates_per_batch:
        errors.append(
            f"--num-updates-per-batch {g.num_updates_per_batch} does not divide the {per_rank} candidates per "
            f"rank ({total} / {world} ranks{written}); pick a divisor of {per_rank}"
        )
        return
    per_update = per_rank // g.num_updates_per_batch
    if per_update % g.micro_batch_size:
        errors.append(
            f"--micro-batch-size {g.micro_batch_size} does not divide the {per_update} candidates of each "
            f"update on a rank ({per_rank} per rank{written} / --num-updates-per-batch {g.num_updates_per_batch}); "
            f"pick a divisor of {per_update}"
        )
    elif written:
        warnings.append(world_change_report(total, g.num_updates_per_batch, g.micro_batch_size, recipe_world, world))


def world_change_report(total: int, updates: int, micro_batch: int, recipe_world: int, world: int) -> str:
    """What a recipe written for `recipe_world` ranks becomes on `world`: the same training (the
    global geometry defines it: the same updates of the same candidates, the same optimizer
    steps), only each rank's share of an update and its micro-batches (gradient accumulation)
    change."""
    def share(w: int) -> str:
        per = total // w // updates
        if total % w or (total // w) % updates or per % micro_batch:
            return f"{w} ranks could not share it"
        n_mb = per // micro_batch
        return f"{w} rank{'s' if w > 1 else ''} replay {per} candidates each in {n_mb} micro-batch{'es' if n_mb > 1 else ''} of {micro_batch}"

    return (f"the recipe names {recipe_world} ranks and this run has {world}: the same training, {total} "
            f"candidates per rollout in {updates} update{'s' if updates > 1 else ''} of {total // updates} "
            f"({updates} optimizer step{'s' if updates > 1 else ''} per rollout); of each update, {share(world)} "
            f"and accumulate the gradient, where the recipe's {share(recipe_world)}")


def _check_grpo(cfg: RunConfig, errors: list[str]) -> None:
    g = cfg.grpo
    if not (g.eps_clip > 0):
        errors.append(f"--eps-clip must be > 0, got {g.eps_clip} (FlowGRPO recipes use 1e-4)")
    if g.eps_clip_high is not None and not (g.eps_clip_high > 0):
        errors.append(f"--eps-clip-high must be > 0 when set, got {g.eps_clip_high}")
    if not g.kl_coef >= 0:
        errors.append(f"--kl-coef must be >= 0, got {g.kl_coef}")
    elif g.kl_coef > 0 and not g.use_kl_loss:
        errors.append(f"--kl-coef {g.kl_coef} without --use-kl-loss: the KL term is added to the loss only with "
                      "--use-kl-loss; pass it, or set --kl-coef 0")
    elif g.use_kl_loss and not g.kl_coef > 0:
        errors.append("--use-kl-loss with --kl-coef 0 adds nothing: set --kl-coef > 0 (e.g. 0.04), or drop "
                      "--use-kl-loss")
    elif g.use_kl_loss and cfg.fsdp.fsdp_trainable_mode != "lora":
        errors.append("--use-kl-loss with --fsdp-trainable-mode full: the KL's reference policy is the base model "
                      "with the LoRA adapter disabled, and a frozen full-size reference copy is not built; use "
                      "--fsdp-trainable-mode lora, or drop --use-kl-loss")
    if not (math.isfinite(g.adv_clip_max) and g.adv_clip_max >= 0):
        errors.append(f"--adv-clip-max must be a finite number >= 0 (0 = off; FlowGRPO uses 5), got {g.adv_clip_max}")
    mode = g.generative_advantage_std_mode
    if g.disable_grpo_std_normalization and mode in ("group", "batch"):
        errors.append(
            f"--disable-grpo-std-normalization contradicts --generative-advantage-std-mode {mode}; drop one "
            "(the disable flag means 'none')"
        )


def _check_algorithm(cfg: RunConfig, errors: list[str], warnings: list[str]) -> None:
    """--algorithm nft's own values and the options it does not combine with; --grpo-guard's."""
    g = cfg.grpo
    sc = cfg.rollout.sampling_config if isinstance(cfg.rollout.sampling_config, dict) else {}
    if g.grpo_guard:
        sde_type = sc.get("sde_type", "sde")
        if g.algorithm == "nft":
            errors.append("--grpo-guard with --algorithm nft: GRPO-Guard normalises FlowGRPO's importance ratio and "
                          "nft has none; drop --grpo-guard, or use --algorithm flowgrpo")
        elif sde_type == "cps":
            errors.append("--grpo-guard with --sampling-config sde_type 'cps': its normalisation is derived for the "
                          "Gaussian log-density of 'sde' / 'dance', and the CPS score has no 1 / (2 std^2); use "
                          "sde_type 'sde', or drop --grpo-guard")
    _check_old_logprob_source(cfg, errors, warnings)
    if g.algorithm != "nft":
        return
    if not (math.isfinite(g.nft_beta) and g.nft_beta > 0):
        errors.append(f"--nft-beta must be a finite number > 0, got {g.nft_beta} (DiffusionNFT uses 1.0)")
    if g.nft_sigmas_per_forward < 0:
        errors.append(f"--nft-sigmas-per-forward must be >= 0 (0: all of a micro-batch's noise levels in one "
                      f"forward), got {g.nft_sigmas_per_forward}")
    if not (0.0 < g.nft_timestep_fraction <= 1.0):
        errors.append(f"--nft-timestep-fraction must be in (0, 1], got {g.nft_timestep_fraction} (DiffusionNFT: 0.99)")
    if g.nft_old_decay_flat < 0 or not (math.isfinite(g.nft_old_decay_rate) and g.nft_old_decay_rate >= 0):
        errors.append(f"--nft-old-decay-flat ({g.nft_old_decay_flat}) and --nft-old-decay-rate "
                      f"({g.nft_old_decay_rate}) must be >= 0")
    if not (0.0 <= g.nft_old_decay_max < 1.0):
        errors.append(f"--nft-old-decay-max must be in [0, 1), got {g.nft_old_decay_max} (DiffusionNFT: 0.5)")
    if not g.adv_clip_max > 0:
        errors.append("--algorithm nft needs --adv-clip-max > 0: it maps each advantage to the optimality probability "
                      "clip(A, -max, max) / (2 max) + 1/2; set e.g. --adv-clip-max 5 (DiffusionNFT's value)")
    guidance = sc.get("guidance_scale", 1.0)
    if isinstance(guidance, (int, float)) and float(guidance) > 1.0:
        errors.append(f"--algorithm nft with --sampling-config guidance_scale {guidance}: nft trains and samples "
                      "CFG-free (the loss is on the conditional velocity alone); set guidance_scale 1.0")
    if g.use_kl_loss or g.kl_coef:
        errors.append("--algorithm nft with --use-kl-loss / --kl-coef: the KL term is defined on FlowGRPO's SDE "
                      "transitions, which nft does not record; drop them (the soft old policy is nft's anchor)")
    engine = cfg.rollout.rollout_engine_class_path
    if engine:
        # a custom engine declares nothing preflight can trust here, so it is refused like one without the capability
        caps = engine_capabilities(resolve_engine_path(engine))
        if caps is None or not caps.ode_final_latents:
            why = "" if caps is None else f" ({caps.name} {caps.reasons.get('ode_final_latents', 'does not')})"
            errors.append(f"--algorithm nft with --rollout-engine-class-path {engine}: nft takes the clean final "
                          f"latents of an ODE rollout, which only the native engine returns{why}; use "
                          "--rollout-engine-class-path native")


def _check_old_logprob_source(cfg: RunConfig, errors: list[str], warnings: list[str]) -> None:
    """--old-logprob-source rollout: refused where pi_old needs more than log-probs, warned where
    the sampler is not the replay to the bit (the first update's ratio then carries the gap)."""
    g, r = cfg.grpo, cfg.rollout
    if g.old_logprob_source != "rollout":
        return
    if g.algorithm == "nft":
        errors.append("--old-logprob-source rollout with --algorithm nft: nft records no log-probs (its old policy "
                      "is a soft parameter copy); drop --old-logprob-source, or use --algorithm flowgrpo")
    if g.grpo_guard:
        errors.append("--old-logprob-source rollout with --grpo-guard: GRPO-Guard needs pi_old's transition means, "
                      "which only the anchor replay computes; use --old-logprob-source replay, or drop --grpo-guard")
    engine = r.rollout_engine_class_path
    inexact = [flag for flag, on in (
        ("--rollout-compile", r.rollout_compile),
        ("--rollout-precision fp8", r.rollout_precision == "fp8"),
        (f"--replay-precision {cfg.fsdp.replay_precision}", cfg.fsdp.replay_precision != "default"),
        ("--rollout-engine-class-path sglang",
         bool(engine) and resolve_engine_path(engine) == ENGINE_SHORT_NAMES["sglang"])) if on]
    if inexact:
        warnings.append(f"--old-logprob-source rollout with {', '.join(inexact)}: the sampler's log-probs are not the "
                        "replay's to the bit, so the first update's ratio is not exactly 1 but carries the "
                        "rollout-to-replay gap (logged as train/rollout_logprob_gap_max); use --old-logprob-source "
                        "replay for the exact pi_old")


def _check_optim(cfg: RunConfig, errors: list[str], warnings: list[str]) -> None:
    o, f = cfg.optim, cfg.fsdp
    if not (o.lr > 0) or not math.isfinite(o.lr):
        errors.append(f"--lr must be a finite number > 0, got {o.lr}")
    elif not (0 <= o.min_lr <= o.lr):
        errors.append(f"--min-lr {o.min_lr} must be in [0, --lr {o.lr}]")
    if o.lr_warmup_iters < 0:
        errors.append(f"--lr-warmup-iters must be >= 0, got {o.lr_warmup_iters}")
    if f.fsdp_lr_scheduler != "constant":
        if o.lr_decay_iters is None:
            errors.append(f"--fsdp-lr-scheduler {f.fsdp_lr_scheduler} needs --lr-decay-iters (optimizer steps)")
        elif o.lr_decay_iters < 1:
            errors.append(f"--lr-decay-iters must be >= 1, got {o.lr_decay_iters}")
    if o.lr_decay_style is not None and f.fsdp_lr_scheduler == "constant":
        warnings.append(
            f"--lr-decay-style {o.lr_decay_style} has no effect: the post-warmup shape is --fsdp-lr-scheduler "
            "(constant); set --fsdp-lr-scheduler linear/cosine instead"
        )
    if o.weight_decay < 0:
        errors.append(f"--weight-decay must be >= 0, got {o.weight_decay}")
    for flag, v in (("--adam-beta1", o.adam_beta1), ("--adam-beta2", o.adam_beta2)):
        if not (0 <= v < 1):
            errors.append(f"{flag} must be in [0, 1), got {v}")
    if not (o.adam_eps > 0):
        errors.append(f"--adam-eps must be > 0, got {o.adam_eps}")
    if not (o.clip_grad > 0):
        errors.append(f"--clip-grad must be > 0, got {o.clip_grad}")
    _check_ema(cfg, errors)


def _check_ema(cfg: RunConfig, errors: list[str]) -> None:
    o = cfg.optim
    if not (0.0 <= o.ema_decay < 1.0):
        errors.append(f"--ema-decay must be in [0, 1) (0 = no EMA), got {o.ema_decay}")
    if o.ema_update_interval < 1:
        errors.append(f"--ema-update-interval must be >= 1, got {o.ema_update_interval}")
    elif o.ema_update_interval != 1 and o.ema_decay == 0:
        errors.append(f"--ema-update-interval {o.ema_update_interval} has no effect without an EMA: "
                      "set --ema-decay in (0, 1) or drop --ema-update-interval")
    if cfg.eval.eval_use_ema and o.ema_decay == 0:
        errors.append("--eval-use-ema needs an EMA to evaluate: set --ema-decay in (0, 1) or drop --eval-use-ema")


def _check_reward(cfg: RunConfig, errors: list[str]) -> None:
    rw = cfg.reward
    if rw.reward_runtime == "remote" and not rw.reward_endpoint:
        errors.append("--reward-runtime remote needs --reward-endpoint URL")
    scorer = resolve_scorer_path(rw.reward_scorer_path)
    if scorer is None:
        if rw.reward_runtime != "remote":
            errors.append(
                "--reward-scorer-path is required unless --reward-runtime remote (e.g. pickscore, ocr, "
                "jpeg_compressibility, color)"
            )
    else:
        _check_scorer("--reward-scorer-path", rw.reward_scorer_path, errors)
    if scorer in SCORERS_NEEDING_MODEL and rw.reward_runtime != "remote":
        _need_existing("--reward-model-path", rw.reward_model_path, "dir", errors, required=True)
    elif rw.reward_model_path:
        _need_existing("--reward-model-path", rw.reward_model_path, "dir", errors, required=False)
    if rw.reward_max_failed_rollouts < 0:
        errors.append(f"--reward-max-failed-rollouts must be >= 0 (0 = never stop), got {rw.reward_max_failed_rollouts}")
    weights = rw.reward_component_weights or {}
    for name, w in weights.items():
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            errors.append(f"--reward-component-weights {name!r}: weight must be a finite number, got {w!r}")
    for comp in rw.reward_required_components or []:
        if comp not in weights:
            errors.append(
                f"--reward-required-components {comp!r} has no --reward-component-weights entry; add "
                f'{{"{comp}": 1.0}}'
            )
    _check_judge_and_watch(cfg, errors)


def _check_judge_and_watch(cfg: RunConfig, errors: list[str]) -> None:
    """The VLM judge's limits, the held-out eval scorers and the reward-hacking watch's thresholds:
    all knowable before anything loads."""
    import re

    rw = cfg.reward
    if rw.reward_judge_score_max <= rw.reward_judge_score_min:
        errors.append(f"--reward-judge-score-max ({rw.reward_judge_score_max}) must exceed --reward-judge-score-min "
                      f"({rw.reward_judge_score_min})")
    for flag, value in (("--reward-judge-max-concurrency", rw.reward_judge_max_concurrency),
                        ("--reward-judge-max-tokens", rw.reward_judge_max_tokens),
                        ("--hacking-baseline-rollouts", rw.hacking_baseline_rollouts),
                        ("--hacking-patience", rw.hacking_patience)):
        _positive_int(flag, value, errors)
    _positive_int("--reward-judge-max-retries", rw.reward_judge_max_retries, errors, minimum=0)
    for flag, value in (("--reward-judge-timeout-s", rw.reward_judge_timeout_s),
                        ("--hacking-reward-rise", rw.hacking_reward_rise),
                        ("--hacking-stat-threshold", rw.hacking_stat_threshold),
                        ("--hacking-heldout-drop", rw.hacking_heldout_drop)):
        if not (math.isfinite(value) and value > 0):
            errors.append(f"{flag} must be a number > 0, got {value}")
    try:
        if re.compile(rw.reward_judge_score_regex).groups < 1:
            errors.append(f"--reward-judge-score-regex {rw.reward_judge_score_regex!r} needs a group: its first group "
                          f"is the score, e.g. '(-?\\d+(?:\\.\\d+)?)'")
    except re.error as e:
        errors.append(f"--reward-judge-score-regex {rw.reward_judge_score_regex!r} is not a regular expression: {e}")
    if "{prompt}" not in rw.reward_judge_prompt_template and resolve_scorer_path(rw.reward_scorer_path) == \
            resolve_scorer_path("vlm_judge"):
        errors.append("--reward-judge-prompt-template has no {prompt} placeholder: the judge would never see the "
                      "prompt it grades")
    if not rw.eval_reward_scorers:
        return
    if not cfg.eval.eval_prompt_data:
        errors.append("--eval-reward-scorers scores the eval sets only: it needs --eval-prompt-data NAME FILE")
    from trainer.rewards.watch import parse_eval_scorers

    try:
        entries = parse_eval_scorers(rw.eval_reward_scorers)
    except ValueError as e:
        errors.append(str(e))
        return
    for name, model_path in entries:
        scorer = resolve_scorer_path(name)
        _check_scorer("--eval-reward-scorers entry", name, errors, dotpath_flag=f"--eval-reward-scorers entry {name!r}")
        if scorer in SCORERS_NEEDING_MODEL and not model_path:
            errors.append(f"--eval-reward-scorers entry {name!r} needs its model directory: '{name}=/local/model/dir'")
        if model_path:
            _need_existing(f"--eval-reward-scorers entry {name!r}", model_path, "dir", errors, required=True)


def _check_artifacts_eval_ckpt(cfg: RunConfig, errors: list[str], warnings: list[str]) -> None:
    a, e, ck = cfg.artifacts, cfg.eval, cfg.checkpoint
    if not a.artifact_root:
        errors.append("--artifact-root is required (a directory for trajectory sidecars and PNGs)")
    elif Path(a.artifact_root).exists() and not Path(a.artifact_root).is_dir():
        errors.append(f"--artifact-root {a.artifact_root} exists and is not a directory")
    if a.artifact_retention_rollouts <= 0:
        warnings.append(
            f"--artifact-retention-rollouts {a.artifact_retention_rollouts} keeps every rollout's sidecars and "
            "images: the artifact root grows without bound"
        )
    if a.artifact_writer_queue < 0:
        errors.append(f"--artifact-writer-queue must be >= 0 (0 writes artifacts synchronously), "
                      f"got {a.artifact_writer_queue}")
    _need_existing("--prompt-data", cfg.rollout.prompt_data, "file", errors, required=True)
    names = [n for n, _ in e.eval_prompt_data]
    if len(set(names)) != len(names):
        errors.append(f"--eval-prompt-data names must be unique, got {names}")
    errors.extend(eval_name_problems(names))
    for name, path in e.eval_prompt_data:
        # a recipe's eval set may not exist where the recipe is reused (the demo's is made by its run)
        _need_existing(f"--eval-prompt-data {name}", path, "file", errors, required=True,
                       alternative="or pass --eval-prompt-data none to train without evaluation")
    if e.eval_interval is not None and e.eval_interval < 1:
        errors.append(f"--eval-interval must be >= 1, got {e.eval_interval}; to train without evaluation pass "
                      "--eval-prompt-data none (or --eval-interval none)")
    elif e.eval_interval is not None:
        if _positive_int("--eval-interval", e.eval_interval, errors) and not e.eval_prompt_data:
            errors.append("--eval-interval needs --eval-prompt-data NAME PATH")
    elif e.eval_prompt_data:
        warnings.append("--eval-prompt-data is set but --eval-interval is not: no evaluation will run")
    _positive_int("--n-samples-per-eval-prompt", e.n_samples_per_eval_prompt, errors)
    if ck.save_interval is not None:
        if _positive_int("--save-interval", ck.save_interval, errors) and not ck.save:
            errors.append("--save-interval needs --save DIR")
    if ck.max_actor_ckpt_to_keep is not None:
        _positive_int("--max-actor-ckpt-to-keep", ck.max_actor_ckpt_to_keep, errors)
    elif ck.rotate_ckpt:
        errors.append("--rotate-ckpt needs --max-actor-ckpt-to-keep N (how many checkpoints to keep)")
    if ck.load:
        _need_existing("--load", ck.load, "dir", errors, required=True)
    if ck.ckpt_step is not None and ck.ckpt_step < 0:
        errors.append(f"--ckpt-step must be >= 0 (an iteration number), got {ck.ckpt_step}")
    if ck.save and Path(ck.save).exists() and not Path(ck.save).is_dir():
        errors.append(f"--save {ck.save} exists and is not a directory")
    if cfg.model.generation_task in GENERATION_TASKS:
        _check_resume(cfg, errors)
    _check_output_paths(cfg, errors)
    _check_data_contents(cfg, errors)


def tensorboard_dir(cfg: RunConfig) -> str | None:
    """Where the run's TensorBoard events go: --tensorboard-dir, else <save>/tensorboard."""
    lg, ck = cfg.logging, cfg.checkpoint
    return lg.tensorboard_dir or (str(Path(ck.save) / "tensorboard") if ck.save else None)


def _same_dir(a: str, b: str) -> bool:
    return Path(a).resolve() == Path(b).resolve()


def _check_resume(cfg: RunConfig, errors: list[str]) -> None:
    """--load must hold what it promises, and no run writes over an earlier run's outputs:
    a fresh start (no --load) needs an unused --save and TensorBoard directory, a resume may
    only continue in its own --load directory or in an unused one."""
    ck, task = cfg.checkpoint, cfg.model.generation_task
    if ck.ckpt_step is not None and not ck.load:
        errors.append(f"--ckpt-step {ck.ckpt_step} needs --load DIR (the checkpoint directory to resume from)")
    loadable = bool(ck.load) and Path(ck.load).is_dir()
    committed = ci.committed_iterations(ck.load, task) if loadable else []
    # <save>/<task> given for <save>: one fix, and the --save rules below judge <save> itself
    task_root = ci.task_dir_root(ck.load) if loadable and not committed else None
    load_root = str(task_root) if task_root is not None else ck.load
    if task_root is not None:
        errors.append(f"--load {ck.load} is the task directory inside the checkpoint directory {task_root}: pass "
                      f"--load {task_root}, the --save directory of the run to resume (it reads "
                      f"{task}/iter_* itself)")
    elif loadable and not committed:
        errors.append(f"--load {ck.load} holds no committed {task} checkpoint: found {ci.describe_load_dir(ck.load, task)}; "
                      "point --load at the --save directory of the run to resume, or drop --load to start fresh")
    if loadable and committed and ck.ckpt_step is not None and ck.ckpt_step not in committed:
        errors.append(f"--ckpt-step {ck.ckpt_step} is not a committed iteration of --load {ck.load}; "
                      f"committed: {committed}")
    elif loadable and committed:
        _check_rollouts_left(cfg, ck.ckpt_step if ck.ckpt_step is not None else committed[-1], errors)
    save_dir = ck.save if ck.save and Path(ck.save).is_dir() else None
    # uncommitted directories alone are a crashed first save: nothing to resume or to keep
    earlier = ci.committed_iterations(save_dir, task) if save_dir else []
    start_over = "or choose a new --save, or delete the earlier run's directories to start over"
    if save_dir and not ck.load and earlier:
        errors.append(f"--save {ck.save} already holds checkpoints of an earlier run (iterations {earlier}) and "
                      f"--load is not set: resume it with --load {ck.save} {start_over}; nothing is overwritten")
    elif save_dir and ck.load and earlier and not _same_dir(save_dir, load_root):
        errors.append(f"--save {ck.save} holds checkpoints of another run (iterations {sorted(earlier)}) while resuming "
                      f"from --load {load_root}: pass --save {load_root} to continue in place, or an empty --save to "
                      "branch off")
    elif save_dir and committed and ck.ckpt_step is not None and _same_dir(save_dir, ck.load):
        newer = [it for it in committed if it > ck.ckpt_step]
        if newer:
            errors.append(f"--ckpt-step {ck.ckpt_step} resumes before committed iterations {newer} of --save {ck.save}, "
                          "which the resumed run would write again: pass a new, empty --save to branch off from "
                          f"iteration {ck.ckpt_step} (nothing is overwritten)")
    _check_artifact_root_reuse(cfg, earlier, errors)
    tb = tensorboard_dir(cfg)
    if tb and not ck.load and Path(tb).is_dir() and any(Path(tb).glob("events.out.tfevents*")):
        resume = f"resume with --load {ck.save}, or" if earlier else "its run left no committed checkpoint:"
        errors.append(f"TensorBoard directory {tb} already holds an earlier run's events and --load is not set: {resume} "
                      f"pass another --tensorboard-dir (or delete {tb}) to start over")


def _check_rollouts_left(cfg: RunConfig, iteration: int, errors: list[str]) -> None:
    """A resume from `iteration` (the rollout id its checkpoint was saved after) continues at
    iteration + 1 and stops before --num-rollout, which counts every rollout of the run: a total
    that is not larger would load everything and train nothing."""
    total = cfg.rollout.num_rollout
    done = iteration + 1
    if total is not None and 1 <= total <= done:
        errors.append(f"--num-rollout {total} is the run's total number of rollouts, and the checkpoint resumed from "
                      f"--load {cfg.checkpoint.load} (iteration {iteration}) has already run rollouts 0-{iteration} "
                      f"({done}): nothing would be trained. Pass --num-rollout {done + total} to train {total} more, "
                      "or any total above " + str(done))


#: an eval set's name becomes a directory (<artifact root>/eval/<task>/<name>/) and a metric tag
_EVAL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_ROLLOUT_DIR_RE = re.compile(r"^rollout_\d{7,}$")


def eval_name_problems(names: list[str]) -> list[str]:
    """An eval set name is one plain path component: "../x" or "a/b" would put its rollouts (and
    retention's deletions) outside <artifact root>/eval/<task>/."""
    return [f"--eval-prompt-data name {name!r} must be 1-64 letters, digits, '_', '-' or '.', starting with a "
            "letter or digit (it names a directory under the artifact root and a metric tag)"
            for name in names if not _EVAL_NAME_RE.match(str(name))]


def _rollout_dirs_in(root: Path, task: str) -> list[Path]:
    """rollout_* directories an earlier run of `task` left under `root` (training, eval, and each
    eval set's own directory)."""
    found = []
    for base in (root / task, root / "eval" / task):
        if not base.is_dir():
            continue
        for entry in base.iterdir():
            if _ROLLOUT_DIR_RE.match(entry.name) and entry.is_dir():
                found.append(entry)
            elif entry.is_dir() and base.name == task and base.parent.name == "eval":
                found.extend(p for p in entry.iterdir() if _ROLLOUT_DIR_RE.match(p.name) and p.is_dir())
    return sorted(found)


def _check_artifact_root_reuse(cfg: RunConfig, earlier: list[int], errors: list[str]) -> None:
    """A fresh start (no --load) would replace an earlier run's rollout directories of the same
    ids: refused like a --save holding checkpoints; a resume (--load) continues them."""
    root, ck = cfg.artifacts.artifact_root, cfg.checkpoint
    if ck.load or not root or not Path(root).is_dir():
        return
    found = _rollout_dirs_in(Path(root), cfg.model.generation_task)
    if found:
        resume = f"resume with --load {ck.save}, or" if earlier else "its run left no committed checkpoint:"
        shown = ", ".join(str(p.relative_to(root)) for p in found[:3]) + (", ..." if len(found) > 3 else "")
        errors.append(f"--artifact-root {root} already holds rollouts of an earlier run ({shown}) and --load is not "
                      f"set: {resume} choose a new --artifact-root (or delete those directories) to start over; "
                      "nothing is overwritten")


def _check_output_paths(cfg: RunConfig, errors: list[str]) -> None:
    """Output directories can be created and written now, not only at the first save."""
    a, ck = cfg.artifacts, cfg.checkpoint
    for flag, value in (("--save", ck.save), ("--artifact-root", a.artifact_root),
                        ("--tensorboard-dir", tensorboard_dir(cfg))):
        if value:
            problem = writable_dir_problem(value)
            if problem:
                errors.append(f"{flag} {value}: {problem}")


def _check_compile_cache(cfg: RunConfig, errors: list[str], warnings: list[str]) -> None:
    """The directories compiled kernels are loaded from are safe to run code from
    (compile_cache_problem): --compile-cache-dir, creatable and writable, or, without it, torch's
    own cache (TORCHINDUCTOR_CACHE_DIR, else its default under the temp directory, which another
    user of a shared host can create first); and TRITON_CACHE_DIR where the environment sets it."""
    path = cfg.fsdp.compile_cache_dir
    compiles = cfg.rollout.rollout_compile or cfg.fsdp.fsdp_compile
    if path and not compiles:
        warnings.append(f"--compile-cache-dir {path} has no effect without --rollout-compile or --fsdp-compile")
    if path:
        # no probe file: one appearing in a shared parent (/tmp) would tell another user when to plant
        # the directory; the run creates it exclusively anyway (prepare_compile_cache)
        problem = writable_dir_problem(path, probe=False) or compile_cache_problem(path)
        if problem:
            errors.append(f"--compile-cache-dir {path}: {problem}")
    elif compiles and (problem := torch_compile_cache_problem()):
        errors.append(f"{problem}; or pass --compile-cache-dir DIR (the run creates it private to you)")
    triton_dir = os.environ.get("TRITON_CACHE_DIR")
    if compiles and triton_dir and (problem := compile_cache_problem(triton_dir)):
        errors.append(f"TRITON_CACHE_DIR {triton_dir}: {problem}; or unset it")


def torch_compile_cache_dir() -> tuple[str, str]:
    """The directory torch.compile caches kernels in when --compile-cache-dir is not given, and
    where that comes from (the environment or torch's default), found without creating it."""
    if env := os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return os.path.abspath(env), "TORCHINDUCTOR_CACHE_DIR"
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # older torch kept it beside the other runtime helpers
        from torch._inductor.runtime.runtime_utils import default_cache_dir
    return default_cache_dir(), "torch's default cache"


def torch_compile_cache_problem() -> str | None:
    """compile_cache_problem of the cache torch.compile loads kernels from now
    (torch_compile_cache_dir), as a message that names it; None when it is safe."""
    path, source = torch_compile_cache_dir()
    problem = compile_cache_problem(path)
    return problem and f"--rollout-compile / --fsdp-compile load compiled kernels from {source} {path}: {problem}"


def compile_cache_problem(path: str) -> str | None:
    """Why the process must not load compiled kernels from `path` (None when it may): inductor
    imports the Python and loads the libraries it finds there, so a way for another user to put a
    file there is a way to run code in this process. Refused: an entry of `path` (itself
    included) that another user owns, or that group or others can write while they can reach it
    (below a directory of this user's that grants them no search permission, as the 0700 one
    --compile-cache-dir creates, they cannot, whatever the umask gave the files); and an
    ancestor of `path` that another user than root owns, or that group or others can write
    without the sticky bit (they could rename `path` away and put their own in its place)."""
    p = Path(path).absolute()
    uid = os.geteuid() if hasattr(os, "geteuid") else None  # the owner of what the process creates; None: no POSIX
    for anc in Path(os.path.realpath(p)).parents if uid is not None else ():
        if not anc.exists():
            continue
        st = anc.stat()
        if st.st_uid not in (uid, 0):
            return (f"its parent {anc} is owned by uid {st.st_uid}, who could replace it; the run would load code "
                    "from it. Use a directory under one of your own")
        if st.st_mode & 0o022 and not st.st_mode & 0o1000:
            return (f"its parent {anc} is writable by group or others without the sticky bit (mode "
                    f"{st.st_mode & 0o7777:o}), so they could replace it; the run would load code from it. "
                    "Use a directory under one of your own")
    if not p.exists():
        return None

    def entries():  # (entry, whether group and others can reach it)
        yield p, True
        sealed: dict[str, bool] = {}  # a directory group and others cannot search, or one inside it
        for root, dirs, files in os.walk(p):
            st = os.lstat(root)
            sealed[root] = sealed.get(os.path.dirname(root), False) or (st.st_uid == uid and not st.st_mode & 0o011)
            for name in (*dirs, *files):
                yield Path(root) / name, not sealed[root]

    for e, reachable in entries():
        st = e.lstat()
        if uid is not None and st.st_uid != uid:
            return (f"{e} is owned by uid {st.st_uid}, not by this user; the run would load code from it. "
                    "Use a directory of your own")
        if reachable and st.st_mode & 0o022 and not e.is_symlink():
            return (f"{e} is writable by group or others (mode {st.st_mode & 0o777:o}); the run would load code "
                    f"from it. Fix: chmod -R go-w {p}, or use a new directory")
    return None


def prepare_compile_cache(cfg: RunConfig) -> str | None:
    """Make the directory compiled kernels will be loaded from this user's, before anything
    compiles; the problem as a message naming the flag (None when it is fine). Preflight only
    checks, and creates nothing, so in a parent others can write (/tmp) the directory can appear
    between its check and the first compile, made by another user who then owns what inductor
    imports: hence one exclusive create here, then the check of whatever is there
    (private_dir_problem). Every rank runs it: one creates, the others find the directory and
    check it the same way. The directory is --compile-cache-dir where given, else torch's own
    cache when the run compiles (torch itself would create that one with exist_ok)."""
    if path := cfg.fsdp.compile_cache_dir:
        problem = private_dir_problem(path)
        return problem and f"--compile-cache-dir {path}: {problem}"
    if not (cfg.rollout.rollout_compile or cfg.fsdp.fsdp_compile):
        return None
    path, source = torch_compile_cache_dir()
    problem = private_dir_problem(path)
    return problem and (f"--rollout-compile / --fsdp-compile load compiled kernels from {source} {path}: {problem}; "
                        "or pass --compile-cache-dir DIR (the run creates it private to you)")


def private_dir_problem(path: str) -> str | None:
    """Create `path` private to this user (mode 0700), or check the one already there; None
    when the process may load code from it. The last component is made by one mkdir that fails
    when anything has that name (never mkdir(exist_ok=True), which takes whatever another user
    put there first); what is found is then held to the same rule as a directory the user names:
    a directory owned by the effective uid, not writable by group or others, nor anything in it,
    and parents nobody else can swap it out of (compile_cache_problem)."""
    p = Path(path).absolute()
    try:
        p.parent.mkdir(parents=True, exist_ok=True)  # parents: owner and mode checked below
    except OSError as e:
        return f"cannot create its parent {p.parent} ({e.strerror or e}); choose a directory of your own"
    if not p.exists() and (problem := compile_cache_problem(str(p))):  # its parents: nothing made in theirs
        return problem
    try:
        os.mkdir(p, 0o700)
    except FileExistsError:
        pass  # another rank of this run made it, or the user, or someone else: checked below
    except OSError as e:
        return f"cannot create it ({e.strerror or e}); choose a directory of your own"
    try:
        st = p.stat()
    except OSError as e:
        return f"cannot read it ({e.strerror or e}); choose a directory of your own"
    import stat

    if not stat.S_ISDIR(st.st_mode):
        return f"{p} is not a directory; choose a new path"
    euid = os.geteuid() if hasattr(os, "geteuid") else None
    if euid is not None and st.st_uid != euid:
        return (f"{p} is owned by uid {st.st_uid}, not by this user (uid {euid}): someone else created it, and the "
                "run would load code from it. Nothing was loaded; remove it, or choose a directory under one of "
                "your own")
    if st.st_mode & 0o022:
        return (f"{p} is writable by group or others (mode {st.st_mode & 0o777:o}); the run would load code from "
                f"it. Fix: chmod go-w {p}, or choose a new directory")
    return compile_cache_problem(str(p))


def writable_dir_problem(path: str, probe: bool = True) -> str | None:
    """Why `path` cannot be used as an output directory (None when it can): probed by creating
    a file in it or in its nearest existing ancestor, since permission bits do not tell the
    whole story (read-only mounts, immutable directories, root). probe=False asks access(2)
    instead, which leaves no trace (it still sees a read-only mount): for a directory whose
    creation must not be announced to whoever watches a shared parent."""
    import tempfile

    p = Path(path).absolute()
    existing = p
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a regular file, so the directory cannot be created under it; choose another path"
    if not probe:
        return None if os.access(existing, os.W_OK | os.X_OK) else f"cannot write in {existing}; choose a writable directory"
    try:
        fd, probe = tempfile.mkstemp(prefix=".preflight-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"cannot write in {existing} ({e.strerror or e}); choose a writable directory"
    return None


def _check_data_contents(cfg: RunConfig, errors: list[str]) -> None:
    """Every prompt file parses (the error names file:line), before any model loads."""
    from trainer.data import DataError, PromptDataset

    task = cfg.model.generation_task if cfg.model.generation_task in GENERATION_TASKS else None
    files = [("--prompt-data", cfg.rollout.prompt_data)]
    files += [(f"--eval-prompt-data {name}", path) for name, path in cfg.eval.eval_prompt_data]
    for flag, path in files:
        if path and Path(path).is_file():
            try:
                PromptDataset.from_jsonl(path, task=task, media_root=cfg.rollout.media_root)
            except DataError as e:
                errors.append(f"{flag}: {e}")


def _check_unsupported(cfg: RunConfig, errors: list[str], warnings: list[str]) -> None:
    """Every flag of UNSUPPORTED_FLAGS that is set, i.e. not at its default (an empty string
    counts as unset): an error saying why and what to use instead, or a warning for a flag that
    merely has no effect."""
    for name, why in UNSUPPORTED_FLAGS.items():
        spec, value = FLAGS[name], cfg.get(name)
        if value == spec.default or value == "":
            continue
        shown = "" if value is True else f" {value if isinstance(value, str) else json.dumps(value)}"
        if not why.rejected:
            warnings.append(f"{spec.flag}{shown} has no effect: {why.reason}")
            continue
        fix = ("remove the flag" if spec.default is None or spec.default is False
               else "leave it on" if spec.default is True else f"set it to {json.dumps(spec.default)}")
        errors.append(f"{spec.flag}{shown} is rejected: {why.reason}; {fix}")
