"""The training loop: one FlowGRPO step per rollout id, read top to bottom as named stages.

    plan -> rollout -> reward -> update -> sync -> checkpoint -> eval -> log

(the checkpoint comes before eval because DCP needs the actor resident, and under
--offload-train the actor leaves the device as soon as the sync is done)

Every rank runs the same loop on its own share of the rollout: it generates its contiguous
block of the global (group, slot) candidate list, scores it, all-gathers the small reward
vectors so every rank computes the same advantages, replays what it generated, and hands
the new weights to its own in-process engine. Large tensors never cross ranks.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from trainer.core.modules import CompileWatch
from trainer.core.redact import redact_url, redact_urls
from trainer.dotpath import import_dotpath
from trainer.models.base import Replay

log = logging.getLogger("trainer")


# ----------------------------------------------------------------------------------------------
# small pure helpers

def sync_kind(cfg: Any) -> str:
    """full FT -> "full"; LoRA with --lora-adapter-mode -> "adapter"; LoRA otherwise -> "merged"."""
    if cfg.fsdp.fsdp_trainable_mode == "full":
        return "full"
    return "adapter" if cfg.lora.lora_adapter_mode else "merged"


def adapter_contract(cfg: Any, lora_targets: list[str] | None) -> dict[str, Any]:
    """What must agree between a checkpoint and the run resuming it (checked by assert_resumable)."""
    lora = cfg.fsdp.fsdp_trainable_mode == "lora"
    return {
        "mode": cfg.fsdp.fsdp_trainable_mode,
        "task": cfg.model.generation_task,
        "model_adapter_path": cfg.model.model_adapter_path,
        "base_model_hash": base_model_hash(cfg.model.model_path, cfg.model.model_revision),
        "lora_rank": cfg.lora.lora_rank if lora else 0,
        "lora_alpha": cfg.lora.lora_alpha if lora else None,
        "lora_dropout": cfg.lora.lora_dropout if lora else None,
        "lora_target_modules": sorted(lora_targets) if lora and lora_targets else None,
        "weight_sync_mode": sync_kind(cfg),
    }


def base_model_hash(model_path: str, revision: str | None) -> str:
    """sha256 over the transformer's config and its weight files' names and sizes (cheap: no
    weight bytes are read) plus the revision. Changes when the base model is swapped."""
    import hashlib

    h = hashlib.sha256()
    tdir = Path(model_path) / "transformer"
    cfg = tdir / "config.json"
    if cfg.is_file():
        h.update(cfg.read_bytes())
    for f in sorted(tdir.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    h.update(str(revision).encode())
    return h.hexdigest()[:16]


def git_revision() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except Exception:  # noqa: BLE001 - a recipe record without a revision is still useful
        return None


def package_versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in ("torch", "diffusers", "transformers", "peft", "safetensors", "numpy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


@dataclass
class Timer:
    """Wall time of one stage, host-synchronised on CUDA so the figure is the stage's own, and
    the stage's memory: the device's allocation peak within it (CUDA) and the process's resident
    host memory at its end (where /proc is)."""

    device: torch.device
    start: float = 0.0
    peak_device_gb: float | None = None
    host_rss_gb: float | None = None

    def __enter__(self) -> "Timer":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_device_gb = torch.cuda.max_memory_allocated(self.device) / 1e9
        self.elapsed = time.perf_counter() - self.start
        self.host_rss_gb = host_memory_gb().get("rss")

    def memory(self, stage: str) -> dict[str, float]:
        """perf/mem_peak_gb/<stage> (device) and perf/host_rss_gb/<stage>, where known."""
        out = {}
        if self.peak_device_gb is not None:
            out[f"perf/mem_peak_gb/{stage}"] = self.peak_device_gb
        if self.host_rss_gb is not None:
            out[f"perf/host_rss_gb/{stage}"] = self.host_rss_gb
        return out


class GcClock:
    """Seconds the Python cyclic garbage collector ran, on any thread, and its full (generation 2)
    collections, between two take() calls: a pause in the step that no stage's own work explains
    (a compiled run holds millions of Python objects, and a full collection walks them all).
    Installed from construction until close(). One collection runs at a time, under the GIL, so
    the callbacks never overlap; take() subtracts what it read, so a collection that ends while it
    reads counts toward the next take."""

    def __init__(self) -> None:
        self._t0 = 0.0
        self.seconds, self.full = 0.0, 0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.full += int(info.get("generation") == 2)

    def take(self) -> dict[str, float]:
        """perf/gc_time and perf/gc_full_collections since the last take."""
        seconds, full = self.seconds, self.full
        self.seconds -= seconds
        self.full -= full
        return {"perf/gc_time": seconds, "perf/gc_full_collections": float(full)}

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


def host_memory_gb() -> dict[str, float]:
    """This process's resident host memory now ("rss") and its high-water mark ("hwm"), in GB,
    from /proc/self/status; {} where there is no /proc. Pinned offload buffers count: they are
    resident by construction."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return {}
    keys = {"VmRSS:": "rss", "VmHWM:": "hwm"}
    out = {}
    for line in lines:
        head, *rest = line.split()
        if head in keys and rest:
            out[keys[head]] = int(rest[0]) * 1024 / 1e9  # the kernel reports kB
    return out


def _scorer_inputs(traj: Any, sources: dict | None = None) -> tuple[list[torch.Tensor], list[str], list[dict]]:
    """(images, prompts, metadata) of a rollout's trajectory for a scorer; empty lists for a rank
    without candidates (it still joins the score gather). sources: the engine's reads of this
    rollout's source files (take_sources), reused rather than read again."""
    if traj is None:
        return [], [], []
    metadata = [m or {} for m in traj.metadata]
    if traj.geometry.media:  # an edit: the scorers get the source pixels the engine conditioned on
        from trainer.models.edit_source import with_source_pixels
        from trainer.rewards.base import SOURCE_IMAGES_KEY

        metadata = with_source_pixels(metadata, [(traj.height, traj.width)] * len(traj), SOURCE_IMAGES_KEY,
                                      sources)
    return list(traj.images.unbind(0)), list(traj.prompts), metadata


def take_sources(engine: Any) -> dict:
    """The source files the engine read for its last generate call (NativeEngine.last_sources;
    {} for an engine without them), handed over once: the engine's reference is dropped, so an
    eval set's decoded sources are not held through the steps that follow."""
    sources = getattr(engine, "last_sources", None) or {}
    if sources:
        engine.last_sources = {}
    return sources


def _viewable(media: torch.Tensor, gap: int = 2) -> torch.Tensor:
    """One candidate as one image [3, H, W] for the watch's image statistics: an image as it is,
    a video [F, 3, H, W] as its frame strip at its own size (trainer.video_artifacts.frame_strip:
    8 evenly spaced frames side by side). TensorBoard shows it as _shown does."""
    if media.dim() == 4:
        from trainer.video_artifacts import frame_strip

        return frame_strip(media, gap=gap)
    return media


def _shown(media: torch.Tensor) -> torch.Tensor:
    """One candidate as TensorBoard shows it: an image as it is (the grid sizes it), a video
    [F, 3, H, W] as its view_strip (trainer.video_artifacts: a few frames at a readable height,
    already sized, so the grid must take it as given: _grid_sizing)."""
    if media.dim() == 4:
        from trainer.video_artifacts import view_strip

        return view_strip(media)
    return media


def _grid_sizing(video: bool) -> dict[str, Any]:
    """The grid's tile sizing for a rollout's candidates: a video's strips as _shown sized them,
    images brought to the grid's own tile side."""
    return {"tile_side": None} if video else {}


def _source_tiles(traj: Any, row: int, metadata: list[dict] | None) -> list[tuple[str, torch.Tensor]]:
    """(caption, uint8 [3, H, W]) of each source image candidate `row` was conditioned on: the
    pixels the scorers got (metadata: _scorer_inputs' third list, SOURCE_IMAGES_KEY, the engine's
    read of the file at the candidate's size), captioned with the file's name (no directories); []
    for a candidate without sources."""
    from trainer.models.edit_source import SOURCE_PATHS_KEY
    from trainer.rewards.base import SOURCE_IMAGES_KEY

    pixels = (metadata[row] or {}).get(SOURCE_IMAGES_KEY) if metadata else None
    if not pixels:
        return []
    names = [os.path.basename(str(p)) for p in (traj.metadata[row] or {}).get(SOURCE_PATHS_KEY) or ()]
    tiles = []
    for j, px in enumerate(pixels):
        name = names[j] if j < len(names) else f"{j}"
        label = "source" if len(pixels) == 1 else f"source {j}"
        tiles.append((f"{label}: {name}", torch.as_tensor(px).permute(2, 0, 1).contiguous()))
    return tiles


def engine_options(rollout: Any, fp8_fast_accum: bool = False) -> dict[str, Any]:
    """The engine keywords the rollout flags set, only those set: the native engine's speed
    options (--rollout-compile, --rollout-precision, with it --fp8-fast-accum; another engine need
    not know them), the SGLang engine's attention backend, and the text window
    (--max-sequence-length; unset: the family's own)."""
    options = {k: v for k, v in (("compile_blocks", bool(rollout.rollout_compile)),
                                 ("precision", rollout.rollout_precision),
                                 ("fp8_fast_accum", fp8_fast_accum and rollout.rollout_precision == "fp8"))
               if v not in (False, "default")}
    if rollout.max_sequence_length is not None:
        options["max_sequence_length"] = int(rollout.max_sequence_length)
    if rollout.sglang_attention_backend:
        options["attention_backend"] = rollout.sglang_attention_backend
    return options


def make_replay_fn(adapter: Any, *, one_forward: bool = True) -> Replay:
    """The update's replay over `adapter` (models.base.Replay): replay(model, rows) -> logp
    [b, S] of every trained-step column of `rows`, replay.moments(model, rows) -> the KL's
    TransitionMoments; the sampler settings and geometry are each trajectory's own.
    one_forward=False: one forward per column (the baseline the tests compare it with)."""
    return Replay(adapter, one_forward=one_forward)


def make_velocity_fn(adapter: Any):
    """velocity_fn(model, rows, x_t, sigma) -> v [b, ...]: the adapter's conditional velocity of
    `model` at latents x_t [b, ...] (the DiT's layout, as recorded) and noise levels sigma [b],
    under `rows`' recorded conditioning: the DiT call the replay makes, for the nft update. The
    scheduler timestep is sigma x num_train_timesteps, the ratio the rollout recorded
    (timesteps / sigmas of its trained column), so the update feeds the DiT what the sampler
    would at that sigma."""
    from trainer.models.base import module_device_dtype

    def velocity(model: torch.nn.Module, rows: Any, x_t: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        device, dtype = module_device_dtype(model)
        scale = torch.round(rows.timesteps[:, -1].float() / rows.sigmas[:, -1].float()).to(device)
        t = sigma.float().to(device) * scale
        conditions = {k: v.to(device) for k, v in rows.conditions.items()}
        x = x_t.to(device=device, dtype=dtype or x_t.dtype).contiguous()
        return adapter.velocity(model, x, t, conditions, rows.geometry, rows.sampler, rollout_dtype=rows.latents.dtype)

    return velocity


def nft_draw_seed(rollout_seed: int, rollout_id: int) -> int:
    """The seed of rollout `rollout_id`'s nft draws (training sigmas and noise; each candidate's
    own is nft.nft_candidate_seed of it and the candidate's global id): a pure function of the
    run seed and the rollout, so a resumed run, and a run on another world size, draws the same."""
    return (int(rollout_seed) * 1_000_003 + int(rollout_id) * 7919) % (2 ** 63)


def evaluate_with_ema(actor: Any, syncer: Any, engine: Any, evaluate: Any) -> Any:
    """Run `evaluate()` with the engine holding the actor's EMA weights, then give the engine the
    live weights back, so the next training rollout samples the policy being trained.

    The EMA values are swapped into the actor's parameters (the live ones kept in a copy) only
    for the sync; the actor holds the live weights again before the eval samples, and under
    --offload-train it is off the device while the engine evaluates (onloaded twice, once per
    sync). Both syncs commit the engine's current policy version label again, through a copy of
    the syncer, so the run's version, manifest and failure count are those of the live policy.
    Collective, like every sync."""
    import contextlib
    import copy

    from trainer.train_model import reshard_all

    def hand_over(swap: bool) -> None:
        was_off = actor.offloaded
        if was_off:
            actor.onload()
        reshard_all(actor.model)  # the swap writes the sharded parameters
        twin = copy.copy(syncer)
        with actor.ema.swapped_in() if swap else contextlib.nullcontext():
            twin.sync(actor.model, engine, version=syncer.policy_version)
        if was_off:
            actor.offload()

    hand_over(swap=True)
    try:
        return evaluate()
    finally:
        hand_over(swap=False)


def weights_fingerprint(model: torch.nn.Module) -> float:
    """abs-sum of the trainable weights over all ranks (a full reduction: debug only)."""
    from trainer.train_model import local_shard as _local
    from trainer.distributed import all_reduce_sum, collective_device

    total = torch.zeros((), dtype=torch.float64, device=collective_device())
    for p in model.parameters():
        if p.requires_grad:
            total += _local(p).detach().double().abs().sum().to(total.device)
    return float(all_reduce_sum(total.reshape(1))[0])


class RunError(RuntimeError):
    """The run cannot go on for a reason the message fully states (a scorer that cannot be
    built, nothing to resume, a scorer that never answers): printed as one line, no traceback."""


def build_reward_manager(reward: Any, device: Any, held_out: tuple[str, str | None] | None = None) -> Any:
    """The configured scorer, built (or, for --reward-runtime remote, probed with a GET) now; with
    `held_out` = (scorer, model path), that --eval-reward-scorers entry's scorer instead. The
    trainer calls it once per scorer at start-up and holds the managers for the run.

    Generic over scorers: whatever --reward-scorer-path names is constructed, and a failure
    becomes a RunError naming the flag, the scorer and the constructor's own message (which
    names the missing file)."""
    from trainer.rewards.manager import reward_manager_from_config

    remote = reward.reward_runtime == "remote" and held_out is None
    if held_out is not None:
        where = f"--eval-reward-scorers entry {held_out[0]}" + (f"={held_out[1]}" if held_out[1] else "")
    elif remote:
        where = f"--reward-endpoint {redact_url(reward.reward_endpoint)}"
    else:
        where = f"--reward-scorer-path {reward.reward_scorer_path} (--reward-model-path {reward.reward_model_path})"
    try:
        if held_out is None:
            manager = reward_manager_from_config(reward, device)
        else:
            manager = reward_manager_from_config(reward, device, scorer_path=held_out[0], model_path=held_out[1])
        if remote:
            manager.components  # noqa: B018 - the GET that proves the endpoint answers
    except Exception as e:  # noqa: BLE001 - any constructor's failure, reported in one line
        detail = " ".join(str(e).split())
        raise RunError(f"the reward scorer could not be set up from {where}: {type(e).__name__}: {detail}") from None
    return manager


# ----------------------------------------------------------------------------------------------
# the trainer

#: eval prompts per set whose images go to TensorBoard at each eval (each a row of its candidates)
EVAL_IMAGE_PROMPTS = 16
#: eval prompts per set listed in the per-prompt table (TensorBoard text, eval/<set>/per_prompt)
EVAL_TABLE_PROMPTS = 256
#: the rollout grid (rollout/candidates): this many prompts, one row each, of this many candidates
ROLLOUT_GRID_PROMPTS = 4
ROLLOUT_GRID_CANDIDATES = 8
#: a video's grids show fewer: each candidate is a strip of frames (trainer.video_artifacts.view_strip),
#: several times an image's pixels (a 240 x 416 clip's strip is ~190 KB of PNG on photographic
#: content); the rollout grid this many prompts of this many candidates, the eval EVAL_VIDEO_PROMPTS
#: prompts (the rollout's index.html shows every clip, playing)
ROLLOUT_GRID_VIDEO_PROMPTS = 1
ROLLOUT_GRID_VIDEO_CANDIDATES = 4
EVAL_VIDEO_PROMPTS = 2
#: long side of an eval image as it is sent to rank 0 for TensorBoard (the grid shows tiles
#: of at most metrics.TILE_SIDE[1] pixels: a full-size image would cross the wire for nothing)
EVAL_THUMB_SIDE = 256

class Trainer:
    """Everything one rank holds: the actor, the engine, the scorer, the data order."""

    def __init__(self, cfg: Any, info: Any, recipe_name: str = "run") -> None:
        from trainer.actor import Actor
        from trainer.train_model import load_in_waves
        from trainer.core.dtypes import resolve_dtype
        from trainer.data import PromptDataset, load_eval_sets
        from trainer.distributed import build_mesh
        from trainer.metrics import MetricsLogger
        from trainer.models.base import apply_attention_policy
        from trainer.sampling import parse_sampling_config
        from trainer.weight_sync import WeightSyncer

        self.cfg, self.info = cfg, info
        #: this process's start (the whole run's wall time adds the earlier parts' from the checkpoint)
        self.started_at = time.perf_counter()
        self.earlier_wall_time = 0.0
        #: the recipe file's name: names the recipe record and the TensorBoard run
        self.recipe_name = recipe_name
        self.rank, self.world, self.device = info.rank, info.world_size, info.device
        self.task = cfg.model.generation_task
        self.group_size = int(cfg.rollout.n_samples_per_prompt)
        self.num_groups = int(cfg.rollout.rollout_batch_size)
        self.sampling = parse_sampling_config(cfg.rollout.sampling_config)
        #: --algorithm nft: every rollout (and eval) samples with the deterministic ODE path
        self.nft = cfg.grpo.algorithm == "nft"
        if self.nft:
            from trainer.nft import ode_rollout_sampling

            self.sampling = ode_rollout_sampling(self.sampling)
        self.adapter = import_dotpath(cfg.model.model_adapter_path, "--model-adapter-path")()
        apply_attention_policy(self.adapter, self.device)

        # data: the order is a pure function of (seed, rollout id), identical on every rank
        media_root = cfg.rollout.media_root
        self.dataset = PromptDataset.from_jsonl(cfg.rollout.prompt_data, task=self.task, media_root=media_root)
        self.order = self.dataset.order(self.num_groups, int(cfg.rollout.rollout_seed))
        self.eval_sets = (load_eval_sets(cfg.eval.eval_prompt_data, task=self.task, media_root=media_root)
                          if cfg.eval.eval_prompt_data else {})

        # the scorer before the policy: a scorer directory missing files or a dead endpoint must
        # cost seconds, not a 57 GB pipeline load and a rollout
        self.reward_manager = build_reward_manager(cfg.reward, self.device)
        from trainer.rewards.watch import HackingWatch, WatchSettings, parse_eval_scorers

        #: the held-out scorers of --eval-reward-scorers, built now for the same reason
        self.eval_reward_managers = [build_reward_manager(cfg.reward, self.device, held_out=entry)
                                     for entry in parse_eval_scorers(cfg.reward.eval_reward_scorers)]

        # the engine samples in the dtype the actor replays in: a bf16 rollout replayed in fp32
        # differs by ~3e-4 per element, which the 1e-4 clip range would see as policy drift
        compute_dtype = resolve_dtype(cfg.fsdp.fsdp_param_dtype) or torch.float32
        engine_cls = import_dotpath(cfg.rollout.rollout_engine_class_path, "--rollout-engine-class-path")
        # every rank reads the whole pipeline from disk through host memory (~57 GB for the real
        # model): --fsdp-load-wave-size gates the engine's load like the actor's
        #: start-up figures (load times per wave, memory after each load), logged with rollout 0's
        self.load_metrics: dict[str, float] = {}
        engine_waves: list[float] = []
        options = engine_options(cfg.rollout, cfg.fsdp.fp8_fast_accum)
        with Timer(self.device) as t:
            self.engine = load_in_waves(
                lambda: engine_cls(cfg.model.model_path, device=self.device, dtype=compute_dtype,
                                   max_batch_size=int(cfg.rollout.engine_batch_size or 0),
                                   revision=cfg.model.model_revision, adapter=self.adapter, **options),
                int(cfg.fsdp.fsdp_load_wave_size or 0), engine_waves)
        self._record_load("engine", t, engine_waves)

        self.mesh = build_mesh(self.device.type)
        num_rollout = int(cfg.rollout.num_rollout)
        actor_waves: list[float] = []
        with Timer(self.device) as t:
            self.actor = Actor.from_adapter(self.adapter, cfg.model.model_path, self.mesh, cfg, device=self.device,
                                            total_optimizer_steps=num_rollout * int(cfg.grpo.num_updates_per_batch),
                                            load_timings=actor_waves)
        self._record_load("actor", t, actor_waves)
        self.replay_fn = make_replay_fn(self.adapter)
        # graphs compiled per stage and dynamo's recompile-limit hits (see _count_graphs)
        self._compile_watch = (CompileWatch() if cfg.rollout.rollout_compile or cfg.fsdp.fsdp_compile else None)
        self.velocity_fn = make_velocity_fn(self.adapter) if self.nft else None
        lora_targets = (self.actor.lora_config or {}).get("target_modules")
        self.contract = adapter_contract(cfg, list(lora_targets) if lora_targets else None)
        self.syncer = WeightSyncer(sync_kind(cfg), wire_dtype=cfg.sync.weight_sync_wire_dtype,
                                   bucket_size_mb=cfg.sync.weight_sync_bucket_size_mb,
                                   name_map=self.adapter.weight_name_map, lora_config=self.actor.lora_config)

        tb_dir = cfg.logging.tensorboard_dir or (str(Path(cfg.checkpoint.save) / "tensorboard") if cfg.checkpoint.save else None)
        self.metrics = MetricsLogger(tb_dir, self.rank, run_name=recipe_name)
        self.checkpoint_failures = 0
        #: rollouts of the whole run (across resumes) in which every group failed to score
        self.failed_rollouts = 0
        #: rank 0's --eval-base figures, for the end summary
        self.base_eval: dict[str, float] = {}
        #: rollouts in a row in which every group failed to score (no update happened)
        self.failed_rollouts_in_a_row = 0
        self.start_rollout = 0
        #: reward component names, as the scorer returned them on the latest rollout
        self.components: list[str] = []
        self.watch = None if cfg.reward.no_hacking_watch else HackingWatch(WatchSettings.from_config(cfg.reward))
        #: one worker thread for the watch's image statistics (_start_watch), off the critical path
        self._watch_pool = ThreadPoolExecutor(1, thread_name_prefix="watch") if self.watch is not None else None
        #: the garbage collector's time per step (perf/gc_time), while fit runs
        self._gc_clock: GcClock | None = None
        self.stop_reason: str | None = None
        #: PNGs and sidecars written off the critical path (--artifact-writer-queue; None: in the rollout stage)
        self.artifact_writer = None
        if int(cfg.artifacts.artifact_writer_queue) > 0 and cfg.artifacts.artifact_root:
            from trainer.artifact_writer import ArtifactWriter

            self.artifact_writer = ArtifactWriter(int(cfg.artifacts.artifact_writer_queue))

    # -- start-up ------------------------------------------------------------------------------
    def _record_load(self, what: str, t: Timer, waves: list[float]) -> None:
        """perf/load_<what>_time (the whole build: read, cast, shard), its per-wave read times and
        the memory it left; logged once, with the first rollout's figures."""
        m = self.load_metrics
        m[f"perf/load_{what}_time"] = t.elapsed
        for i, w in enumerate(waves):
            m[f"perf/load_{what}_wave{i}_time"] = w
        memory = t.memory(f"load_{what}")
        m.update(memory)
        if self.rank == 0:
            log.info("loaded the %s in %.1f s (waves: %s)%s", what, t.elapsed, ", ".join(f"{w:.1f} s" for w in waves),
                     "".join(f"; {k.split('/')[1]} {v:.1f} GB" for k, v in memory.items()))

    def write_recipe_record(self) -> Path | None:
        """<artifact_root>/recipes/<name>-<time>.json: what this run was started with."""
        if self.rank != 0 or not self.cfg.artifacts.artifact_root:
            return None
        from trainer.artifacts import atomic_write_bytes

        cfg = self.cfg
        name = self.recipe_name
        record = {
            "prompt_data": cfg.rollout.prompt_data,
            "eval_prompt_data": [list(p) for p in cfg.eval.eval_prompt_data or []],
            "data_order": {"rollout_seed": cfg.rollout.rollout_seed, "rollout_batch_size": self.num_groups},
            "sampling_config": self.sampling.to_dict(),
            "sampling_fingerprint": self.sampling.fingerprint(),
            "advantage_std_mode": cfg.grpo.generative_advantage_std_mode,
            "weight_sync_mode": sync_kind(cfg),
            "world_size": self.world,
            "git_revision": git_revision(),
            "packages": package_versions(),
            "config": cfg.to_dict(),
        }
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        path = Path(cfg.artifacts.artifact_root) / "recipes" / f"{name}-{stamp}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        record = redact_urls(record)  # a credential in an endpoint URL must not reach the record
        atomic_write_bytes(path, (json.dumps(record, indent=2, sort_keys=True, default=str) + "\n").encode(), overwrite=True)
        return path

    def maybe_resume(self) -> None:
        """--load: restore model, optimizer, policy version, lr step and RNG from the newest
        COMMITTED iteration, hand the restored weights to the engine, continue at latest + 1."""
        from trainer.checkpoint import load_checkpoint

        load = self.cfg.checkpoint.load
        if not load:
            return
        state = load_checkpoint(load, self.task, model=self.actor.model, optimizer=self.actor.optimizer,
                                adapter_contract=self.contract, trainable_only=self.actor.mode == "lora",
                                iteration=self.cfg.checkpoint.ckpt_step,
                                ema=None if self.actor.ema is None else self.actor.ema.state_dict(),
                                old_policy=None if self.actor.nft_old is None else self.actor.nft_old.state_dict())
        if state is None:  # preflight refuses this; the directory changed since
            raise RunError(f"--load {load} holds no committed checkpoint for task {self.task}; nothing to resume")
        self.actor.load_state_dict(state)
        self.checkpoint_failures = int(state.get("checkpoint_failures", 0))
        # the end summary is the whole run's: its counters and wall time go on from the checkpoint's
        self.failed_rollouts = int(state.get("failed_rollouts", 0))
        self.metrics.failures = int(state.get("metrics_write_failures", 0))
        self.earlier_wall_time = float(state.get("wall_time_s", 0.0))
        # The engine was loaded from --model-path: give it the restored policy under the
        # checkpoint's own version number.
        self.syncer.load_state_dict(state)
        self.syncer.sync(self.actor.model, self.engine, version=self.syncer.policy_version)
        self.start_rollout = int(state["rollout_id"]) + 1
        if self.rank == 0:
            log.info("resumed from %s iteration %d: policy version %d, lr step %d, continuing at rollout %d",
                     load, state["iteration"], self.syncer.policy_version, self.actor.optimizer_steps, self.start_rollout)

    def install_adapter(self) -> None:
        """A fresh run that syncs LoRA adapters hands the engine its adapter (B = 0, so the policy
        is still the base, version 0) before anything samples. Rollout 0 and the base eval then run
        the module structure of every later rollout: a compiled engine compiles its blocks once
        (not without LoRA first and with it after the first update), and an FP8 engine frees its
        bf16 block weights before the first rollout instead of after it (the room a 30-block step
        needs on an 80 GB card from its first rollout on). A resumed run's sync does the same."""
        if self.start_rollout != 0 or self.syncer.kind != "adapter":
            return
        m = self.syncer.sync(self.actor.model, self.engine, version=self.syncer.policy_version)
        self.load_metrics["perf/adapter_install_time"] = m["perf/weight_sync_time"]

    def share_fp8_weights(self) -> None:
        """With an FP8 replay beside an FP8 engine that holds the adapter (installed or resumed
        above), the actor's FP8 layers read the engine's FP8 copies of their frozen weights
        instead of quantizing them at every forward (train_model.share_engine_fp8_weights; byte
        for byte the same, checked). Not under --offload-rollout, where the engine's modules leave
        the device during the update. perf/replay_fp8_shared_layers counts them. Under
        --replay-precision fp8-dgrad a linked layer reads that copy in both directions, so the
        actor's own copy of its weight is freed (core.fp8.release_linked_weights; only a frozen
        base kept whole, --fsdp-frozen-params): perf/replay_fp8_released_gb."""
        from trainer.core.dtypes import resolve_dtype
        from trainer.core.fp8 import release_linked_weights
        from trainer.train_model import share_engine_fp8_weights

        if (self.actor.mode != "lora" or self.cfg.fsdp.replay_precision == "default"
                or self.cfg.colocate.offload_rollout or self.syncer.kind != "adapter"):
            return
        linked, mismatched = share_engine_fp8_weights(self.actor.model, self.engine, self.adapter.weight_name_map,
                                                      resolve_dtype(self.cfg.fsdp.fsdp_param_dtype))
        self.load_metrics["perf/replay_fp8_shared_layers"] = float(linked)
        if mismatched:
            log.warning("%d of the actor's FP8 replay layers differ from the engine's FP8 copy of their weight; "
                        "they quantize their own weight at every forward", mismatched)
        released, nbytes = release_linked_weights(self.actor.model) if linked else (0, 0)
        if linked:
            self.load_metrics["perf/replay_fp8_released_gb"] = nbytes / 1e9
        if released and self.device.type == "cuda":
            torch.cuda.empty_cache()
        if linked and self.rank == 0:
            log.info("the actor's FP8 replay reads the engine's FP8 weights of %d layers%s", linked,
                     f" and freed its own copies of {released} of them ({nbytes / 1e9:.1f} GB)" if released else "")

    # -- one step ------------------------------------------------------------------------------
    def step(self, k: int) -> dict[str, float]:
        from trainer.rewards.post_process import compute_advantages, gather_scores, resolve_std_mode
        from trainer.colocation import begin_update, end_update, sync_engine
        from trainer.rollout import generate_rollout
        from trainer.sampling import rollout_generation_seed

        cfg, colo = self.cfg, self.cfg.colocate
        m: dict[str, float] = {}
        if self._gc_clock is not None:
            self._gc_clock.take()  # from here on, this step's collections
        t_step = time.perf_counter()

        # 1. plan: this rollout's prompt groups (the trained steps are resolved inside the rollout)
        prompts = [self.dataset[i] for i in self.order.groups_for_rollout(k)]

        # 2. rollout: the engine owns the device
        self._count_graphs(m, None)
        with Timer(self.device) as t:
            out = generate_rollout(
                self.engine, self.adapter, prompts, rollout_id=k, sampling=self.sampling, group_size=self.group_size,
                generation_seed=rollout_generation_seed(int(cfg.rollout.generation_seed), k),
                artifact_root=cfg.artifacts.artifact_root,
                task=self.task, retention=int(cfg.artifacts.artifact_retention_rollouts),
                weight_manifest_hash=self._manifest_hash(), writer=self.artifact_writer)
        m["perf/rollout_time"] = t.elapsed
        m.update(t.memory("rollout"))
        self._count_graphs(m, "rollout" if cfg.rollout.rollout_compile else None)
        m.update({k_: v for k_, v in out.stats.items() if k_ != "perf/rollout_time"})
        # the watch's image statistics (CPU work) on a worker thread while the reward and the update
        # run; gathered and judged after the update (_finish_watch)
        watch_job = self._start_watch(out.trajectory)

        # 3. reward: score locally, all-gather the small vectors, same advantages on every rank
        with Timer(self.device) as t:
            manager = self.reward_manager
            local_idx = [g * self.group_size + s for g, s in out.candidates]
            traj = out.trajectory
            inputs = _scorer_inputs(traj, take_sources(self.engine))
            scored = manager.score(*inputs)
            components = gather_scores(scored.components, local_idx, self.num_groups * self.group_size)
            std_mode = resolve_std_mode(cfg.grpo.generative_advantage_std_mode,
                                        cfg.grpo.disable_grpo_std_normalization, self.group_size)
            reward = compute_advantages(components, self.group_size,
                                        required_components=cfg.reward.reward_required_components,
                                        component_weights=cfg.reward.reward_component_weights,
                                        std_mode=std_mode, score_time=scored.score_time,
                                        adv_clip_max=cfg.grpo.adv_clip_max)
        m["perf/reward_time"] = t.elapsed
        m.update(t.memory("reward"))
        m.update(reward.metrics)
        m.update(rollout_throughput(self.num_groups * self.group_size, m["perf/rollout_time"], self.world))
        self._log_histograms(k, reward)
        self._write_index(out, prompts, self.group_size, reward.components, reward.advantages,
                          title=f"{self.task} rollout {k}")
        m.update(scored.failure_metrics())
        self.components = sorted(reward.components)
        self._watch_failed_rollout(k, len(reward.failed_groups))

        # 4. update: the actor owns the device
        self._count_graphs(m, None)
        with Timer(self.device) as t:
            m.update(begin_update(self.actor, self.engine, offload_train=colo.offload_train,
                                  offload_rollout=colo.offload_rollout))
            debug = bool(cfg.fsdp.fsdp_debug_fingerprint)
            if debug:
                m.update(self._logp_parity(traj))
                before = weights_fingerprint(self.actor.model)
            idx = torch.tensor(local_idx, dtype=torch.long)
            from tqdm import tqdm

            with tqdm(desc=f"update {k}", unit="micro-batch", leave=False, disable=not self._progress_bars,
                      dynamic_ncols=True) as bar:
                batch = traj.without_images() if traj is not None else None
                if self.nft:
                    m.update(self.actor.nft_train_step(
                        batch, reward.advantages[idx], self.velocity_fn, self._nft_schedule(),
                        nft_draw_seed(cfg.rollout.rollout_seed, k), reward.valid[idx],
                        progress=bar.update, ids=idx))
                else:
                    m.update(self.actor.train_step(batch, reward.advantages[idx], self.replay_fn,
                                                   reward.valid[idx], progress=bar.update, ids=idx))
            if debug:
                after = weights_fingerprint(self.actor.model)
                m["debug/weights_abs_sum_before"], m["debug/weights_abs_sum_after"] = before, after
                if self.rank == 0:
                    log.info("[fingerprint] rollout %d: trainable abs-sum %.9g -> %.9g (delta %.3g)",
                             k, before, after, after - before)
        m["perf/train_time"] = t.elapsed
        m.update(t.memory("train"))
        self._count_graphs(m, "actor" if cfg.fsdp.fsdp_compile else None)
        self._finish_watch(k, m, watch_job, local_idx, reward)

        # 5. sync: the new weights into this rank's engine, verified, then committed
        with Timer(self.device) as t:
            m.update(sync_engine(self.actor, self.syncer, self.engine, offload_rollout=colo.offload_rollout))
        m["perf/sync_time"] = t.elapsed
        m.update(t.memory("sync"))

        # 6. checkpoint (the actor is still resident, which DCP needs)
        if (self._due(k, cfg.checkpoint.save_interval) or self.stop_reason) and cfg.checkpoint.save:
            self._flush_artifacts(m)  # a checkpoint is taken only with its rollout's artifacts on disk
            with Timer(self.device) as t:
                self.save(k)
            m["perf/checkpoint_time"] = t.elapsed
            m.update(t.memory("checkpoint"))

        # the device goes back to the engine for the next rollout
        with Timer(self.device) as t:
            m.update(end_update(self.actor, self.engine, offload_train=colo.offload_train,
                                offload_rollout=colo.offload_rollout))
        m["perf/end_update_time"] = t.elapsed

        # 7. eval
        if self.eval_sets and self._due(k, cfg.eval.eval_interval):
            self._flush_artifacts(m)
            with Timer(self.device) as t:
                if cfg.eval.eval_use_ema and self.actor.ema is not None:
                    m.update(evaluate_with_ema(self.actor, self.syncer, self.engine, lambda: self.evaluate(k)))
                else:
                    m.update(self.evaluate(k))
            m["perf/eval_time"] = t.elapsed
            m.update(t.memory("eval"))

        if self._compile_watch is not None and (msg := self._compile_watch.limit_warning()) and self.rank == 0:
            log.warning("rollout %d: %s", k, msg)
        m["perf/step_time"] = time.perf_counter() - t_step
        if self._gc_clock is not None:
            m.update(self._gc_clock.take())
        if "hwm" in (host := host_memory_gb()):
            m["perf/host_peak_gb"] = host["hwm"]
        m["train/checkpoint_failures"] = float(self.checkpoint_failures)
        m["train/metrics_write_failures"] = float(self.metrics.failures)
        self._log_images(k, out, reward, inputs[2])
        return m

    def _start_watch(self, traj: Any) -> "Future | None":
        """The watch's per-image statistics of this rank's candidates (as the scorers see them: a
        video as its frame strip), submitted to the watch's worker thread; None without a watch."""
        if self.watch is None:
            return None
        from trainer.rewards.watch import local_watch_statistics

        def job() -> tuple[dict[str, torch.Tensor], float]:
            t0 = time.perf_counter()
            viewed = [_viewable(x, gap=0) for x in (traj.images.unbind(0) if traj is not None else [])]
            return local_watch_statistics(viewed), time.perf_counter() - t0

        return self._watch_pool.submit(job)

    def _finish_watch(self, k: int, m: dict[str, float], job: "Future | None", local_idx: list[int],
                      reward: Any) -> None:
        """Collective (every rank, after the update): this rank's statistics from _start_watch's
        job, gathered like the scores, then the rule. perf/watch_time is what the step waits for
        here (the job's remainder, the gather, the rule); perf/watch_stats_time the job's own
        seconds, spent beside the reward and the update. A failed job raises here."""
        if job is None:
            return
        from trainer.rewards.watch import gathered_watch_metrics

        with Timer(self.device) as t:
            local, m["perf/watch_stats_time"] = job.result()
            m.update(gathered_watch_metrics(self.watch, local, local_idx, self.num_groups * self.group_size,
                                            self.group_size, reward))
        m["perf/watch_time"] = t.elapsed
        if self.watch.suspect:
            log.warning("rollout %d: %s", k, self.watch.message()) if self.rank == 0 else None
            self.stop_reason = self.watch.message() if self.cfg.reward.stop_on_hacking else None

    def _count_graphs(self, m: dict[str, float], stage: str | None) -> None:
        """With compiled blocks: m[f"perf/{stage}_new_graphs"] = graphs compiled since the last
        call, m[f"perf/{stage}_compile_time"] the seconds spent compiling them and
        m[f"perf/{stage}_compile_trace_time"] dynamo's tracing within those (the rest is
        AOTAutograd and inductor, or loading their output from the compile cache); stage None:
        only move the marks. After the first steps the count should read 0; a steady non-zero
        count means an input shape keeps changing, and every graph counts toward dynamo's
        recompile limit."""
        if self._compile_watch is not None:
            new, seconds = self._compile_watch.new_graphs(), self._compile_watch.new_seconds()
            if stage is not None:
                m[f"perf/{stage}_new_graphs"] = float(new)
                m[f"perf/{stage}_compile_time"] = seconds["total"]
                m[f"perf/{stage}_compile_trace_time"] = seconds["trace"]

    def _nft_schedule(self) -> torch.Tensor:
        """The rollout's N step sigmas (terminal 0 excluded): where --nft-timestep-distribution
        draws the training noise levels from."""
        from trainer.rollout import driver_sigmas

        return torch.tensor(driver_sigmas(self.engine, self.sampling)[:-1], dtype=torch.float32)

    @property
    def _progress_bars(self) -> bool:
        """Bars on rank 0 at a terminal only: in a file (train.log, a job's output) every
        redraw would be one more carriage-return frame; the per-rollout line is the progress."""
        return self.rank == 0 and sys.stderr.isatty()

    def _watch_failed_rollout(self, k: int, failed: int) -> None:
        """A rollout whose every group failed to score trains nothing: say so loudly, and stop
        after --reward-max-failed-rollouts of them in a row (every rank computes the same
        gathered rewards, so all ranks stop together)."""
        if failed < self.num_groups:
            self.failed_rollouts_in_a_row = 0
            return
        self.failed_rollouts_in_a_row += 1
        self.failed_rollouts += 1
        limit = int(self.cfg.reward.reward_max_failed_rollouts)
        if self.rank == 0:
            log.error("rollout %d: all %d groups failed to score (no finite reward), so no update happens; %d such "
                      "rollout(s) in a row%s. Check the scorer (--reward-scorer-path / --reward-endpoint)", k,
                      failed, self.failed_rollouts_in_a_row, f", the run stops at {limit}" if limit else "")
        if limit and self.failed_rollouts_in_a_row >= limit:
            raise RunError(
                f"{self.failed_rollouts_in_a_row} consecutive rollouts (up to rollout {k}) in which every group failed "
                f"to score: the scorer returns no finite reward (--reward-scorer-path {self.cfg.reward.reward_scorer_path}"
                f", --reward-endpoint {redact_url(self.cfg.reward.reward_endpoint)}); fix it and resume with --load, "
                f"or raise --reward-max-failed-rollouts (0 = never stop)")

    def _due(self, k: int, interval: int | None) -> bool:
        last = k == int(self.cfg.rollout.num_rollout) - 1
        return bool(interval) and ((k + 1) % int(interval) == 0 or last)

    def _flush_artifacts(self, m: dict[str, float]) -> None:
        """Wait for the writer's pending PNGs and sidecars (a write failure raises here, with
        its message); the wait is perf/artifact_flush_time."""
        if self.artifact_writer is not None:
            t0 = time.perf_counter()
            self.artifact_writer.flush()
            m["perf/artifact_flush_time"] = m.get("perf/artifact_flush_time", 0.0) + time.perf_counter() - t0

    def _manifest_hash(self) -> str | None:
        man = self.syncer.last_manifest
        return man.name_shape_hash if man is not None else None

    @torch.no_grad()
    def _logp_parity(self, batch: Any) -> dict[str, float]:
        """[logp parity]: the replayed pi_old anchor vs the engine's own sampling log-prob."""
        from trainer.distributed import all_reduce_max, collective_device

        replayed = self.replay_fn(self.actor.model, batch).float().cpu()
        diff = (replayed - batch.log_probs.float()).abs().max().reshape(1).to(collective_device())
        worst = float(all_reduce_max(diff)[0])
        if self.rank == 0:
            log.info("[logp parity] max |replayed anchor - sampler log-prob| = %.3g", worst)
        return {"debug/logp_parity_max_abs": worst}

    def _log_images(self, k: int, out: Any, reward: Any, metadata: list[dict] | None = None) -> None:
        """rollout/candidates: up to ROLLOUT_GRID_PROMPTS of rank 0's prompts, one row each (the
        prompt wrapped above it), up to ROLLOUT_GRID_CANDIDATES candidates per row (a video's
        grid: the ROLLOUT_GRID_VIDEO_ limits, each candidate a strip of readable frames), each
        tile captioned with its slot and scores; an edit's row starts with the source image(s)
        its candidates were conditioned on (metadata: the scorer metadata, which carries their
        pixels)."""
        traj = out.trajectory
        if self.rank != 0 or traj is None:
            return
        video = traj.images.dim() == 5
        prompts = ROLLOUT_GRID_VIDEO_PROMPTS if video else ROLLOUT_GRID_PROMPTS
        per_row = ROLLOUT_GRID_VIDEO_CANDIDATES if video else ROLLOUT_GRID_CANDIDATES
        rows = []
        for g in sorted(set(traj.group_indices.tolist()))[:prompts]:
            shown = traj.rows_of_group(g)[:per_row]
            sources = _source_tiles(traj, shown[0], metadata)
            captions = [f"s{int(traj.slots[i])} " + _score_text(reward.components, g * self.group_size + int(traj.slots[i]))
                        for i in shown]
            rows.append((f"group {g}: {traj.prompts[shown[0]]}",
                         [t for _, t in sources] + [_shown(traj.images[i]) for i in shown],
                         [c for c, _ in sources] + captions))
        self.metrics.log_rows_grid(k, "rollout/candidates", rows, **_grid_sizing(video))

    def _write_index(self, out: Any, records: list[Any], group_size: int, comps: dict[str, torch.Tensor],
                     advantages: torch.Tensor | None, *, title: str) -> None:
        """Rank 0: the scored rollout's index.jsonl and index.html in its artifact directory
        (trainer.artifacts.write_rollout_index): every candidate's file beside its prompt, group,
        slot, scores (advantage: a training rollout's) and source files' names. Every rank knows
        every group's record and the gathered scores, so rank 0 writes the whole rollout's."""
        if self.rank != 0 or out.artifact_dir is None:
            return
        from trainer.artifacts import rollout_index, write_rollout_index

        video = out.trajectory is not None and out.trajectory.images.dim() == 5
        if video:
            from trainer.video_artifacts import video_name as media_name
        else:
            from trainer.artifacts import image_name as media_name
        entries = rollout_index([(r.prompt, r.images) for r in records], group_size, comps, advantages,
                                media_name=media_name)
        write_rollout_index(out.artifact_dir, entries, title=title)

    def _log_histograms(self, k: int, reward: Any) -> None:
        """reward/<component>_hist, reward/weighted_total_hist and reward/advantage_hist over the
        rollout's valid candidates (TensorBoard's Histograms tab): the shape a mean hides."""
        from trainer.rewards.post_process import weighted_total

        if self.rank != 0:
            return
        valid = reward.valid
        hists = {f"reward/{c}_hist": v for c, v in reward.components.items()}
        if bool(valid.any()):
            hists["reward/weighted_total_hist"] = weighted_total(reward.components, reward.weights)[valid]
            hists["reward/advantage_hist"] = reward.advantages[valid]
        self.metrics.log_histograms(k, hists)

    # -- eval and checkpoints --------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, k: int, base: bool = False) -> dict[str, float]:
        """Each eval set with the deterministic sde_indices (no per-rollout redraw), so the
        figure is comparable across steps: eval/<name>/<component>_mean and _std over the set's
        images (and eval/<name>/weighted_total_*, the training reward), a per-prompt table and
        the first prompts' images (module helpers below).

        base: the base model's eval before rollout 0 (--eval-base): images under
        <artifact-root>/eval_base/. Its seeds are the eval's own (--generation-seed, per
        candidate, on private generators), so it draws nothing from the training RNG streams."""
        from trainer.rewards.post_process import gather_scores, resolve_weights, weighted_total
        from trainer.rollout import generate_rollout

        cfg = self.cfg
        n = int(cfg.eval.n_samples_per_eval_prompt)
        manager = self.reward_manager
        root = cfg.artifacts.artifact_root
        if base and root:
            root = str(Path(root) / "eval_base")
        out_m: dict[str, float] = {}
        for name, ds in self.eval_sets.items():
            records = [ds[i] for i in range(len(ds))]
            # one set: <root>/eval/<task>/rollout_<k>/; several: one directory per set,
            # <root>/eval/<task>/<name>/rollout_<k>/, so they never collide
            task_dir = self.task if len(self.eval_sets) == 1 else f"{self.task}/{name}"
            out = generate_rollout(self.engine, self.adapter, records, rollout_id=k, sampling=self.sampling,
                                   group_size=n, generation_seed=int(cfg.rollout.generation_seed),
                                   artifact_root=root, task=task_dir,
                                   retention=int(cfg.artifacts.artifact_retention_rollouts), eval=True,
                                   weight_manifest_hash=self._manifest_hash(), writer=self.artifact_writer)
            inputs = _scorer_inputs(out.trajectory, take_sources(self.engine))
            scored = manager.score(*inputs)
            idx = [g * n + s for g, s in out.candidates]
            comps = gather_scores(scored.components, idx, len(records) * n)
            # the training reward's weighted total, from the trained scorer's components only
            weights = resolve_weights(comps, cfg.reward.reward_required_components,
                                      cfg.reward.reward_component_weights)
            trained = {"weighted_total": weighted_total(comps, weights)} if set(weights) <= set(comps) else {}
            for held in self.eval_reward_managers:  # held out: scored here, never trained on
                part = held.score(*inputs)
                held_comps = gather_scores(part.components, idx, len(records) * n)
                means = {f"{name}/{c}": float(v[torch.isfinite(v)].mean()) for c, v in held_comps.items()}
                stds = {f"{name}/{c}": float(v[torch.isfinite(v)].std(unbiased=False)) for c, v in held_comps.items()}
                if self.watch is not None:
                    self.watch.observe_eval(means, stds)
                comps.update({c: v for c, v in held_comps.items() if c not in comps})
            out_m.update(eval_set_metrics(name, {**comps, **trained}))
            self.metrics.log_text(k, f"eval/{name}/per_prompt",
                                  per_prompt_table([r.prompt for r in records], {**comps, **trained}, n,
                                                   EVAL_TABLE_PROMPTS))
            self._write_index(out, records, n, {**comps, **trained}, None,
                              title=f"{self.task} {'base ' if base else ''}eval {name} at rollout {k}")
            self._log_eval_images(k, name, out.trajectory, comps, n, inputs[2])
        return out_m

    def _log_eval_images(self, k: int, set_name: str, traj: Any, comps: dict[str, torch.Tensor], n: int,
                         metadata: list[dict] | None = None) -> None:
        """One image per eval prompt, its n candidates side by side with their scores (an edit's
        source image(s) first; a video's: the first ROLLOUT_GRID_VIDEO_CANDIDATES, of the first
        EVAL_VIDEO_PROMPTS prompts), under the tag eval/<set>/prompt_<index>: the prompt and its
        seeds are the same at every eval, so TensorBoard's slider on that tag shows the same
        candidates changing over training. The first EVAL_IMAGE_PROMPTS prompts of the set,
        whichever rank generated them: each rank sends its share to rank 0 as small uint8
        thumbnails (collective: every rank calls it). metadata: the scorer metadata (the
        sources' pixels)."""
        video = traj is not None and traj.images.dim() == 5
        rows = _eval_thumbnails(traj, EVAL_VIDEO_PROMPTS if video else EVAL_IMAGE_PROMPTS, metadata)
        gathered = gather_to_rank0(rows)
        if self.rank != 0:
            return
        by_group: dict[int, list[_Thumb]] = {}
        for part in gathered:
            for thumb in part:
                by_group.setdefault(thumb.group, []).append(thumb)
        video = any(t.video for ts in by_group.values() for t in ts)
        for g in sorted(by_group)[:EVAL_VIDEO_PROMPTS if video else EVAL_IMAGE_PROMPTS]:
            shown = sorted(by_group[g], key=lambda t: t.slot)[:ROLLOUT_GRID_VIDEO_CANDIDATES if video else None]
            sources = next((t.sources for t in shown if t.sources), ())
            captions = [f"s{t.slot} {_score_text(comps, g * n + t.slot)} | {t.prompt}" for t in shown]
            self.metrics.log_image_grid(k, f"eval/{set_name}/prompt_{g:03d}",
                                        [im for _, im in sources] + [t.image for t in shown],
                                        [c for c, _ in sources] + captions, cols=len(sources) + len(shown),
                                        **_grid_sizing(video))

    def save(self, k: int) -> None:
        """One checkpoint of rollout k; a failed write is counted, never fatal."""
        from trainer.checkpoint import save_checkpoint

        cfg = self.cfg
        state = {
            "rollout_id": k,
            "task": self.task,
            "model_adapter_path": cfg.model.model_adapter_path,
            # what tools/export_checkpoint.py takes as the base when --base-model-path is not given
            "base_model_path": str(Path(cfg.model.model_path).resolve()),
            "sampling_fingerprint": self.sampling.fingerprint(),
            "checkpoint_failures": self.checkpoint_failures,
            "failed_rollouts": self.failed_rollouts,
            "metrics_write_failures": self.metrics.failures,
            "wall_time_s": self.wall_time(),
            **self.actor.state_dict(),
            **self.syncer.state_dict(),
        }
        man = self.syncer.last_manifest
        manifest = None if man is None else {"kind": man.kind, "tensor_count": man.tensor_count,
                                             "total_bytes": man.total_bytes, "name_shape_hash": man.name_shape_hash,
                                             "version": man.version}
        ok = save_checkpoint(cfg.checkpoint.save, self.task, k, model=self.actor.model, optimizer=self.actor.optimizer,
                             trainer_state=state, weight_sync_manifest=manifest, adapter_contract=self.contract,
                             trainable_only=self.actor.mode == "lora",
                             max_to_keep=int(cfg.checkpoint.max_actor_ckpt_to_keep or 0),
                             ema=None if self.actor.ema is None else self.actor.ema.state_dict(),
                             old_policy=None if self.actor.nft_old is None else self.actor.nft_old.state_dict())
        if not ok:
            self.checkpoint_failures += 1

    def evaluate_base(self) -> dict[str, float]:
        """--eval-base: the eval sets through the model as loaded, before any update, logged at
        step 0 so every eval curve starts at the base. Run before rollout 0 only (a resumed run
        has its base eval already)."""
        with Timer(self.device) as t:
            m = self.evaluate(0, base=True)
        m["perf/eval_base_time"] = t.elapsed
        self.metrics.log(0, m)
        if self.rank == 0:
            self.base_eval = m
            log.info("%s", eval_line("base model eval", m))
        return m

    def wall_time(self) -> float:
        """Seconds of the whole run: the earlier parts' up to the checkpoint this one resumed
        (as that checkpoint recorded them), plus this process's so far."""
        return self.earlier_wall_time + time.perf_counter() - self.started_at

    # -- the loop ------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        from tqdm import tqdm

        num_rollout = int(self.cfg.rollout.num_rollout)
        self.install_adapter()  # while the actor is still on the device
        self.share_fp8_weights()
        if self.cfg.colocate.offload_train and not self.actor.offloaded:
            # the engine owns the device from the first rollout on (after any resume sync)
            self.actor.offload()
        if self.cfg.eval.eval_base and self.eval_sets and self.start_rollout == 0:
            self.evaluate_base()
        bar = tqdm(range(self.start_rollout, num_rollout), desc="rollouts", disable=not self._progress_bars,
                   dynamic_ncols=True, leave=True)
        history = []
        self._gc_clock = GcClock()
        t_loop = time.perf_counter()
        try:
            for k in bar:
                metrics = self.step(k)
                if k == self.start_rollout:
                    metrics = {**self.load_metrics, **metrics}
                self.metrics.log(k, metrics)
                history.append({**metrics, "rollout": k})
                if self.rank == 0:
                    # the time left at this run's pace so far (evals and saves included, at their share)
                    eta = (time.perf_counter() - t_loop) / (k + 1 - self.start_rollout) * (num_rollout - k - 1)
                    bar.write(self.metrics.console_line(k, metrics, self.components, total=num_rollout, eta_s=eta))
                    if any(key.startswith("eval/") for key in metrics):
                        bar.write(eval_line(f"eval after rollout {k}", metrics))
                    sys.stdout.flush()  # a log file is block-buffered: each rollout's lines as it ends
                if self.stop_reason:  # every rank fed the watch the same gathered figures: all stop here
                    log.error("stopping after rollout %d (--stop-on-hacking): %s", k, self.stop_reason)
                    break
        except BaseException:
            # the last rollouts' files are still written; a writer failure is logged, not raised
            # over the error the run is stopping for
            if self.artifact_writer is not None:
                self.artifact_writer.close(raise_errors=False)
            raise
        finally:
            if self._watch_pool is not None:  # a step that raised may leave its job running: it ends on its own
                self._watch_pool.shutdown(wait=False)
            self._gc_clock.close()
        if self.artifact_writer is not None:
            self.artifact_writer.close()  # a write failure stops the run here, as it would have in the step
        self.metrics.close()
        return {"history": history, "components": self.components, "stopped": self.stop_reason}


def rollout_throughput(num_candidates: int, rollout_time: float, world_size: int) -> dict[str, float]:
    """perf/rollout_images_per_s (the job's: every candidate of the rollout over the rollout's
    wall time, rank 0's clock) and perf/rollout_images_per_s_per_gpu (that / world size);
    nothing for a zero time."""
    if not rollout_time > 0:
        return {}
    rate = num_candidates / rollout_time
    return {"perf/rollout_images_per_s": rate, "perf/rollout_images_per_s_per_gpu": rate / max(int(world_size), 1)}


def eval_set_metrics(name: str, comps: dict[str, torch.Tensor]) -> dict[str, float]:
    """eval/<name>/<component>_mean and _std (population) over the finite scores of the set."""
    out = {}
    for c, v in comps.items():
        finite = v[torch.isfinite(v)].double()
        out[f"eval/{name}/{c}_mean"] = float(finite.mean()) if finite.numel() else float("nan")
        out[f"eval/{name}/{c}_std"] = float(finite.std(unbiased=False)) if finite.numel() else float("nan")
    return out


def per_prompt_table(prompts: list[str], comps: dict[str, torch.Tensor], n: int, limit: int) -> str:
    """A markdown table, one row per eval prompt (the first `limit`): index, prompt, and each
    component's mean over its n candidates (comps: [len(prompts) * n], prompt-major)."""
    names = sorted(comps)
    head = "| # | prompt | " + " | ".join(f"{c} (mean of {n})" for c in names) + " |"
    lines = [head, "|---|---|" + "---|" * len(names)]
    for g, prompt in enumerate(prompts[:limit]):
        cells = []
        for c in names:
            v = comps[c][g * n:(g + 1) * n]
            v = v[torch.isfinite(v)]
            cells.append(f"{float(v.mean()):.4f}" if v.numel() else "n/a")
        text = " ".join(prompt.split()).replace("|", "\\|")
        lines.append(f"| {g} | {text} | " + " | ".join(cells) + " |")
    if len(prompts) > limit:
        lines.append(f"\n(the first {limit} of {len(prompts)} prompts)")
    return "\n".join(lines)


def _score_text(comps: dict[str, torch.Tensor], index: int) -> str:
    return ", ".join(f"{c}={float(v[index]):.3f}" for c, v in sorted(comps.items()))


class _Thumb(NamedTuple):
    """One eval candidate as sent to rank 0 for TensorBoard (_eval_thumbnails)."""

    group: int
    slot: int
    prompt: str
    #: uint8 [3, h, w]: an image of long side <= EVAL_THUMB_SIDE, a video's view_strip
    image: torch.Tensor
    video: bool
    #: (caption, uint8 [3, h, w] of long side <= EVAL_THUMB_SIDE) per source image of an edit, on
    #: the first candidate of its group this rank holds (a source crosses the wire once per rank)
    sources: tuple[tuple[str, torch.Tensor], ...] = ()


def _thumbnail(im: torch.Tensor) -> torch.Tensor:
    """uint8 [3, h, w] of an image [3, H, W] (float in [0, 1] or uint8), long side <= EVAL_THUMB_SIDE."""
    im = im.detach().cpu()
    im = im.float() / 255.0 if im.dtype == torch.uint8 else im.float()
    side = max(im.shape[-2:])
    if side > EVAL_THUMB_SIDE:
        size = [max(1, round(d * EVAL_THUMB_SIDE / side)) for d in im.shape[-2:]]
        im = torch.nn.functional.interpolate(im[None], size=size, mode="area")[0]
    return (im.clamp(0, 1) * 255 + 0.5).to(torch.uint8)


def _eval_thumbnails(traj: Any, max_group: int, metadata: list[dict] | None = None) -> list[_Thumb]:
    """A _Thumb per candidate of this rank in groups below `max_group` (a video's: of the slots
    below ROLLOUT_GRID_VIDEO_CANDIDATES, all the grid shows); an edit's first candidate of each
    group carries its sources (_source_tiles, from the scorer metadata)."""
    if traj is None:
        return []
    video = traj.images.dim() == 5
    out, seen = [], set()
    for i, g in enumerate(traj.group_indices.tolist()):
        if g >= max_group or video and int(traj.slots[i]) >= ROLLOUT_GRID_VIDEO_CANDIDATES:
            continue
        # a video's strip is sized by view_strip (a few frames at most 160 px high): bounded already
        image = _shown(traj.images[i])
        image = (image.clamp(0, 1) * 255 + 0.5).to(torch.uint8) if video else _thumbnail(image)
        sources = () if g in seen else tuple((c, _thumbnail(t)) for c, t in _source_tiles(traj, i, metadata))
        seen.add(g)
        out.append(_Thumb(int(g), int(traj.slots[i]), str(traj.prompts[i]), image, video, sources))
    return out


def gather_to_rank0(obj: Any) -> list[Any]:
    """[every rank's obj] on rank 0 ([] elsewhere); [obj] without a process group. Collective.
    Only this job's own ranks send (their images), so pickling is safe here."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    rank = dist.get_rank()
    out = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out if rank == 0 else []


def silence_known_harmless_warnings() -> None:
    """FSDP2 warns once per forward that the sharded root transformer "returned a view tensor"
    (its last linear projection reshapes), because an in-place op on that output would skip the
    pre-backward all-gather. Here the output is the velocity, which every consumer (dit_velocity,
    the flow_grpo transition math, CFG) only reads out of place, so for the root transformer
    classes the warning is noise; for any other module it still shows. The roots: every image
    family's `*Transformer2DModel`, Wan's `WanTransformer3DModel` (its unpatchify reshapes too),
    and `WanExperts`, the root of a two-expert Wan model."""
    import warnings

    roots = r"\w*Transformer2DModel|WanTransformer3DModel|WanExperts"
    warnings.filterwarnings("ignore", message=rf"FSDP2-wrapped module \(FSDP(?:{roots})\) returned a view tensor",
                            category=UserWarning)


def _finite(v: Any) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def summarize(history: list[dict[str, float]], components: list[str], window: int = 5) -> dict[str, dict[str, float]]:
    """First-vs-last figures of each reward component over `history` (one dict per rollout, in
    rollout order; its "rollout" key, where present, names the rollout): the mean of
    reward/<c>_mean over the first and the last w rollouts that scored it, and the mean
    within-group std of the component's raw score (reward/<c>_group_std_mean: the learning signal
    it carries). w = min(window, n // 2) for n scored rollouts, so the two windows never share a
    rollout (one rollout alone is both). first_rollouts / last_rollouts: the windows' first and
    last rollout ids."""
    out = {}
    for c in components:
        rows = [(h.get("rollout", i), h) for i, h in enumerate(history) if _finite(h.get(f"reward/{c}_mean"))]
        if not rows:
            continue
        w = min(window, len(rows) // 2) or 1
        first, last = rows[:w], rows[-w:]

        def mean(part: list, key: str) -> float | None:
            # the component's own raw spread: the weighted reward's (reward/group_std_mean) would
            # show a component's weight, or another component's spread
            vals = [float(h[key]) for _, h in part if _finite(h.get(key))]
            return sum(vals) / len(vals) if vals else None

        out[c] = {
            "first_mean": mean(first, f"reward/{c}_mean"),
            "last_mean": mean(last, f"reward/{c}_mean"),
            "group_std_first": mean(first, f"reward/{c}_group_std_mean"),
            "group_std_last": mean(last, f"reward/{c}_group_std_mean"),
            "rollouts": len(rows),
            "window": w,
            "first_rollouts": [first[0][0], first[-1][0]],
            "last_rollouts": [last[0][0], last[-1][0]],
        }
    return out


def summarize_evals(history: list[dict[str, float]], base: dict[str, float] | None = None) -> dict[str, dict]:
    """Per eval set and component ("<set>/<component>", from eval/<set>/<component>_mean): the
    first and the last eval's figure with their rollout ids, how many evals ran, and with
    --eval-base the base model's figure."""
    out: dict[str, dict] = {}
    for i, h in enumerate(history):
        for key, v in h.items():
            if key.startswith("eval/") and key.endswith("_mean") and _finite(v):
                e = out.setdefault(key[len("eval/"):-len("_mean")], {"first": float(v), "first_rollout": h.get("rollout", i),
                                                                     "evals": 0})
                e.update(last=float(v), last_rollout=h.get("rollout", i), evals=e["evals"] + 1)
    for key, v in (base or {}).items():
        if key.startswith("eval/") and key.endswith("_mean") and _finite(v):
            out.setdefault(key[len("eval/"):-len("_mean")], {})["base"] = float(v)
    return out


def eval_line(title: str, metrics: dict[str, float]) -> str:
    """`<title>: <set> <component>=<mean>+-<std> ... | <set> ...` from eval/<set>/<c>_mean and _std."""
    sets: dict[str, list[str]] = {}
    for key, v in sorted(metrics.items()):
        if key.startswith("eval/") and key.endswith("_mean") and key.count("/") == 2:
            _, name, comp = key[:-len("_mean")].split("/")
            std = metrics.get(f"eval/{name}/{comp}_std")
            sets.setdefault(name, []).append(f"{comp}={float(v):.4g}" + (f"+-{float(std):.2g}" if _finite(std) else ""))
    return f"{title}: " + (" | ".join(f"{name} " + " ".join(parts) for name, parts in sets.items()) or "no figures")


def earlier_history(run_dir: Path | None, start_rollout: int) -> tuple[list[dict[str, float]], dict[str, float]]:
    """A resumed run's rollouts before `start_rollout`, read back from the run's own TensorBoard
    events (metrics.read_scalars): one dict per rollout as fit's history holds them, and the
    --eval-base figures of step 0 (logged there before rollout 0's, which carries perf/eval_time
    when it evaluated too). Where a rollout ran twice (a part that ended after its last
    checkpoint), the later write is the one the resumed run continues from. ([], {}) for a
    fresh run, or when the events cannot be read (a note says so)."""
    from trainer.metrics import read_scalars

    if start_rollout <= 0 or run_dir is None:
        return [], {}
    logging.getLogger("tensorboard").setLevel(logging.WARNING)  # its reader narrates every event file it opens
    try:
        scalars = read_scalars(run_dir)
    except Exception as e:  # noqa: BLE001 - the summary is then this part's only, and says so
        log.warning("the end summary covers this part of the run only: %s's events could not be read (%s)",
                    run_dir, e)
        return [], {}
    rows: dict[int, dict[str, float]] = {}
    base: dict[str, float] = {}
    for tag, points in scalars.items():
        for step, value in points:
            if step < start_rollout:
                rows.setdefault(step, {})[tag] = value
    first = rows.get(0, {})
    if "perf/eval_base_time" in first and "perf/eval_time" not in first:
        base = {k: v for k, v in first.items() if k.startswith("eval/")}
        rows[0] = {k: v for k, v in first.items() if not k.startswith("eval/")}
    return [{**rows[k], "rollout": k} for k in sorted(rows)], base


def run_summary(trainer: Any, result: dict[str, Any]) -> dict[str, Any]:
    """The whole run's summary (across resumes): the reward components' first-vs-last windows,
    the evals' first and last figures, rollouts scored and failed, the failure counters and the
    wall time. Rank 0; reads the earlier parts' figures back from the run's TensorBoard events."""
    earlier, base = earlier_history(trainer.metrics.run_dir, trainer.start_rollout)
    history = earlier + result["history"]
    ran = result["history"][-1]["rollout"] + 1 if result["history"] else trainer.start_rollout
    return {
        "summary": summarize(history, result["components"]),
        "eval": summarize_evals(history, trainer.base_eval or base),
        "rollouts": ran,
        "resumed_at": trainer.start_rollout or None,
        "scored_rollouts": ran - trainer.failed_rollouts,
        "failed_rollouts": trainer.failed_rollouts,
        "checkpoint_failures": trainer.checkpoint_failures,
        "metrics_write_failures": trainer.metrics.failures,
        "wall_time_s": round(trainer.wall_time(), 1),
        "this_process_wall_time_s": round(time.perf_counter() - trainer.started_at, 1),
    }


def log_run_summary(s: dict[str, Any]) -> None:
    """The summary in words, a few lines in the log before its JSON line."""
    from trainer.metrics import format_seconds

    resumed = f", resumed at rollout {s['resumed_at']}" if s["resumed_at"] else ""
    log.info("run summary: %d rollouts%s, %d scored, %d failed to score; wall time %s (this process %s); "
             "checkpoint failures %d, metrics write failures %d", s["rollouts"], resumed, s["scored_rollouts"],
             s["failed_rollouts"], format_seconds(s["wall_time_s"]), format_seconds(s["this_process_wall_time_s"]),
             s["checkpoint_failures"], s["metrics_write_failures"])
    for c, f in s["summary"].items():
        std = ""
        if f["group_std_first"] is not None and f["group_std_last"] is not None:
            std = f", within-group std {f['group_std_first']:.4g} -> {f['group_std_last']:.4g}"
        log.info("  reward %s: %.4g (rollouts %d-%d) -> %.4g (rollouts %d-%d)%s", c, f["first_mean"],
                 *f["first_rollouts"], f["last_mean"], *f["last_rollouts"], std)
    for name, e in s["eval"].items():
        base = f"base {e['base']:.4g}, " if "base" in e else ""
        if "first" in e:
            log.info("  eval %s: %s%.4g at rollout %d -> %.4g at rollout %d (%d evals)", name, base, e["first"],
                     e["first_rollout"], e["last"], e["last_rollout"], e["evals"])
        elif base:
            log.info("  eval %s: %s", name, base.rstrip(", "))


def use_compile_cache(path: str | None) -> None:
    """Point torch.compile's kernel cache at `path` (--compile-cache-dir), created private to
    this user, or checked where it exists (preflight's private_dir_problem: a directory someone
    else made or can write is refused, RunError, never used); None leaves torch's default. Before
    any compile: inductor reads TORCHINDUCTOR_CACHE_DIR when it first looks for a kernel."""
    from trainer.preflight import private_dir_problem

    if not path:
        return
    p = Path(path).absolute()
    if problem := private_dir_problem(str(p)):
        raise RunError(f"--compile-cache-dir {path}: {problem}")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(p)


def use_compile_profile(cfg: Any) -> str | None:
    """With compiled blocks and a --save directory: name the run for torch.compile's
    profile-guided dynamic shapes (torch.compiler.config.job_id), so that a resumed run starts
    from the shapes the run found dynamic. Without it every process first compiles each block
    for the exact shapes it meets (a graph that a new prompt length misses in the cache too),
    then again with the text length and batch dynamic; with it a resumed run compiles the dynamic
    graphs at once, and finds them in the compile cache. The profile is written beside the
    kernels (<compile cache>/dynamo/code_state_*.pkl, one per rank) after each compile; the name
    is derived from the --save path, so only the same run's processes share it. A job id the
    environment already sets (TORCH_COMPILE_JOB_ID) is kept as it is. The profile is a pickle that
    dynamo loads, as inductor loads the kernels beside it, so a compiling run whose cache directory
    holds anything another user owns or can write stops here (RunError; preflight's
    torch_compile_cache_problem refused it already, checked again for callers that skip
    preflight): turning the profile off alone would still load their kernels. Returns the job id
    in force, or None (no profile) when nothing compiles or the run has no --save."""
    import hashlib

    import torch.compiler

    from trainer.preflight import torch_compile_cache_problem

    compiles = cfg.rollout.rollout_compile or cfg.fsdp.fsdp_compile
    if compiles and (problem := torch_compile_cache_problem()):
        raise RunError(problem)
    if torch.compiler.config.job_id is not None:  # the user's own
        return torch.compiler.config.job_id
    if not compiles or not cfg.checkpoint.save:
        return None
    run = str(Path(cfg.checkpoint.save).absolute())
    torch.compiler.config.job_id = "flowgrpo-" + hashlib.sha256(run.encode()).hexdigest()[:16]
    return torch.compiler.config.job_id


def trained_nothing(trainer: Any, history: list[dict[str, float]]) -> None:
    """RunError when this process ran rollouts and not one of them scored (every group of each
    failed: no update happened): a run that trained nothing must not end like one that trained.
    Every rank gathered the same rewards, so every rank raises."""
    if not history or any(float(h.get("reward/num_groups", 0)) > 0 for h in history):
        return
    reward = trainer.cfg.reward
    where = (f"--reward-endpoint {redact_url(reward.reward_endpoint)}" if reward.reward_runtime == "remote"
             else f"--reward-scorer-path {reward.reward_scorer_path}")
    first, last = history[0]["rollout"], history[-1]["rollout"]
    raise RunError(
        f"this run trained nothing: none of its {len(history)} rollout(s) ({first}-{last}) scored, every group of "
        f"each failed (no finite reward from {where}; the reasons are logged above and counted in "
        f"reward/failed_candidates_*). Fix the scorer and run again; --reward-max-failed-rollouts (now "
        f"{int(reward.reward_max_failed_rollouts)}) stops a longer run after that many such rollouts in a row")


def run(cfg: Any, recipe: str | None = None) -> int:
    """Build this rank's trainer, resume if asked, train, print a summary; returns the exit code.

    A rank that fails prints its traceback and exits non-zero at once; torchrun then stops the
    other ranks instead of leaving them waiting in a collective.
    """
    from trainer.checkpoint import CheckpointError
    from trainer.data import DataError
    from trainer.distributed import init_distributed, shutdown_and_exit
    from trainer.models.base import ModelFilesError
    from trainer.train import report_fatal

    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    silence_known_harmless_warnings()
    from trainer.cli import quiet_third_party

    quiet_third_party(load=True)  # before the model loads: its loading bars would fill train.log
    code = 0
    info = None
    try:
        use_compile_cache(cfg.fsdp.compile_cache_dir)
        use_compile_profile(cfg)
        info = init_distributed()
        if info.rank != 0:
            logging.getLogger().setLevel(logging.WARNING)
        # the same on every rank: an initial value drawn here (LoRA's A) is then the same tensor
        # whichever rank keeps which shard of it, so the world size does not change the start
        torch.manual_seed(int(cfg.rollout.rollout_seed))
        trainer = Trainer(cfg, info, recipe_name=Path(recipe).stem if recipe else "run")
        trainer.maybe_resume()
        record = trainer.write_recipe_record()
        trainer.metrics.log_run(trainer.start_rollout, trainer.recipe_name, cfg.to_dict())
        result = trainer.fit()
        if info.rank == 0:
            summary = run_summary(trainer, result)
            log_run_summary(summary)
            sys.stderr.flush()
            print(json.dumps({**summary, "stopped_on_hacking": result["stopped"],
                              "recipe_record": str(record) if record else None,
                              "tensorboard_dir": str(trainer.metrics.log_dir) if trainer.metrics.log_dir else None,
                              "artifact_root": cfg.artifacts.artifact_root, "save": cfg.checkpoint.save}), flush=True)
        if result["stopped"]:
            code = 3  # the requested rollouts were not all run: let a scheduler see it
        trained_nothing(trainer, result["history"])
    except (RunError, CheckpointError, DataError, ModelFilesError) as e:  # the message says it all
        rank = info.rank if info is not None else os.environ.get("RANK", "?")
        report_fatal(rank, f"error: {e}")
        code = 1
    except BaseException:  # noqa: BLE001 - report, then take the whole job down
        rank = info.rank if info is not None else os.environ.get("RANK", "?")
        report_fatal(rank, f"training failed:\n{traceback.format_exc()}")
        code = 1
    if code not in (0, 3):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # no collective teardown: the other ranks may be inside one
    shutdown_and_exit(code)
