"""One rollout: plan, generate this rank's share, write artifacts, return the local batch.

    plan       resolve the trained SDE steps once (same on every rank, no communication), the
               driver's sigma schedule, and this rank's contiguous block of the global
               (group, slot) candidate list;
    generate   one engine.generate call for all local candidates (the engine batches them);
    artifacts  one PNG per candidate (an animated WebP for a video, trainer.video_artifacts;
               written by the rank that made it) and one sidecar per
               group; a group split over ranks has its small tracks gathered to the rank that
               holds its slot 0, which writes it. With a trainer.artifact_writer.ArtifactWriter
               the files are prepared here and written by its thread while the step goes on;
    return     this rank's Trajectory (trainer.trajectory) for the reward and the update: each
               rank replays what it generated, large tensors never cross ranks.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from trainer import artifacts
from trainer.models.edit_source import SOURCE_PATHS_KEY, SOURCE_REFS_KEY
from trainer.trajectory import Trajectory

log = logging.getLogger(__name__)


def local_candidates(num_groups: int, group_size: int, rank: int, world_size: int) -> list[tuple[int, int]]:
    """This rank's (group_index, slot) pairs: a contiguous block of the group-major global list
    [(0,0), (0,1), ..., (G-1, K-1)]. With N = G*K candidates, rank r gets
    [r*N//W, (r+1)*N//W) (blocks differ by at most one when W does not divide N)."""
    if num_groups < 0 or group_size < 1:
        raise ValueError(f"need num_groups >= 0 and group_size >= 1, got {num_groups}, {group_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    total = num_groups * group_size
    start, end = rank * total // world_size, (rank + 1) * total // world_size
    return [(i // group_size, i % group_size) for i in range(start, end)]


def rank_of_candidate(index: int, num_candidates: int, world_size: int) -> int:
    """The rank whose local_candidates block holds global candidate `index` (group-major)."""
    if not 0 <= index < num_candidates:
        raise ValueError(f"candidate {index} is outside 0..{num_candidates - 1}")
    # smallest r with (r + 1) * N // W > index
    return next(r for r in range(world_size) if (r + 1) * num_candidates // world_size > index)


def group_owner(group_index: int, group_size: int, num_groups: int, world_size: int) -> int:
    """The rank holding (group_index, slot 0): the writer of the group's sidecar."""
    return rank_of_candidate(group_index * group_size, num_groups * group_size, world_size)


def split_groups(num_groups: int, group_size: int, world_size: int) -> list[int]:
    """Groups whose candidates live on more than one rank (the same answer on every rank)."""
    n = num_groups * group_size
    return [g for g in range(num_groups)
            if rank_of_candidate(g * group_size, n, world_size) != rank_of_candidate((g + 1) * group_size - 1, n, world_size)]


@dataclass
class RolloutOutput:
    """What one rank gets back from a rollout."""

    rollout_id: int | None
    sde_indices: list[int]
    #: this rank's (group_index, slot) pairs, in the order of the trajectory's rows
    candidates: list[tuple[int, int]]
    #: the engine's Trajectory of those candidates (images included), or None when this rank has none
    trajectory: Trajectory | None
    artifact_dir: Path | None
    stats: dict[str, float] = field(default_factory=dict)


def _prompt_and_metadata(item: Any) -> tuple[str, dict[str, Any]]:
    """A prompt group as (prompt, metadata): a trainer.data.PromptRecord, a JSONL-style dict
    {"prompt", "metadata"}, or a bare string."""
    if isinstance(item, str):
        return item, {}
    if isinstance(item, Mapping):
        return str(item["prompt"]), dict(item.get("metadata") or {})
    if hasattr(item, "to_dict"):
        d = item.to_dict()
        return str(d["prompt"]), dict(d.get("metadata") or {})
    raise TypeError(f"a prompt group must be a PromptRecord, a dict with 'prompt' or a str, got {type(item).__name__}")


def _source_images(item: Any) -> list[str]:
    """A prompt group's source image references (a PromptRecord's resolved `images`, a dict's
    "images"), [] for none."""
    images = item.get("images") if isinstance(item, Mapping) else getattr(item, "images", None)
    return [str(p) for p in images or ()]


def _source_refs(item: Any) -> list[str]:
    """A prompt group's source images as its sidecar records them: relative to its prompt file's
    directory (a PromptRecord's media_dir), else as given."""
    base = getattr(item, "media_dir", "")
    return [os.path.relpath(p, base) if base else p for p in _source_images(item)]


def driver_sigmas(engine: Any, sampling: Any) -> list[float]:
    """The driver's N + 1 sigmas for this geometry, from the engine's own scheduler config."""
    if hasattr(engine, "sigma_schedule"):
        return list(engine.sigma_schedule(sampling.height, sampling.width, sampling.num_inference_steps))
    from trainer.sampling import image_seq_len, sigma_schedule

    return sigma_schedule(engine.scheduler_config, sampling.num_inference_steps,
                          image_seq_len(sampling.height, sampling.width, engine.vae_scale_factor))


def _dist_info(rank, world_size):
    import torch.distributed as dist

    active = dist.is_available() and dist.is_initialized()
    if rank is None:
        rank = dist.get_rank() if active else 0
    if world_size is None:
        world_size = dist.get_world_size() if active else 1
    return int(rank), int(world_size), active and world_size > 1


def generate_rollout(
    engine: Any,
    adapter: Any,
    prompts: Sequence[Any],
    *,
    rollout_id: int,
    sampling: Any,
    group_size: int,
    generation_seed: int,
    artifact_root=None,
    task: str = "t2i",
    retention: int = 2,
    eval: bool = False,
    rank: int | None = None,
    world_size: int | None = None,
    weight_manifest_hash: str | None = None,
    writer: Any = None,
    candidates: Sequence[tuple[int, int]] | None = None,
) -> RolloutOutput:
    """Run rollout `rollout_id` over `prompts` (one GRPO group per prompt, `group_size`
    candidates each) on this rank and write its artifacts under `artifact_root` (None: write
    nothing).

    `sampling` is a trainer.sampling.SamplingConfig. Evaluation (`eval=True`) resolves the
    trained steps without the per-rollout redraw (rollout_id None in resolve_sde_indices, the
    fixed `sde_indices` fallback) and writes under <root>/eval/<task>/rollout_<rollout_id>.
    rank / world_size default to torch.distributed's (or 0 / 1). Collective when
    torch.distributed is initialised with more than one rank: every rank must call it.

    `writer` (a trainer.artifact_writer.ArtifactWriter): the files are handed to its thread and
    may not be on disk when this returns (its flush is the caller's); None writes them here.

    `candidates`: the (group_index, slot) pairs to generate here instead of this rank's
    local_candidates block, all in one engine call, with no collective (a caller that picks the
    batches itself, as trainer.evaluation does so that no batch depends on the world size); only
    without `artifact_root`, whose writers assume the contiguous blocks.
    """
    from trainer.sampling import make_sample_id, resolve_sde_indices

    t0 = time.perf_counter()
    rank, world_size, distributed = _dist_info(rank, world_size)
    if candidates is not None and artifact_root is not None:
        raise ValueError("generate_rollout: pass either candidates (a caller-chosen batch) or artifact_root, not both")
    if world_size > 1 and not distributed and artifact_root is not None \
            and split_groups(len(prompts), group_size, world_size):
        raise ValueError(f"rank {rank} of {world_size} without an initialised torch.distributed process group: "
                         "groups split over ranks could not be gathered into one sidecar; initialise the "
                         "process group (torchrun) or pass world_size=1")
    n_steps = int(sampling.num_inference_steps)

    # 1. plan
    sde_indices = resolve_sde_indices(sampling, n_steps, None if eval else rollout_id)
    if not sde_indices:
        raise ValueError(
            "the resolved trained SDE step set is empty: --sampling-config needs sde_indices, or num_sde_steps "
            "(with sde_pool / sde_timestep_fraction); a rollout records and trains only those steps")
    sigmas = driver_sigmas(engine, sampling)
    groups = [_prompt_and_metadata(p) for p in prompts]
    # an editing family is shown each record's source images (a text family ignores them, as before)
    media = ([_source_images(p) for p in prompts] if hasattr(adapter, "encode_condition")
             else [[] for _ in prompts])
    mine = (list(candidates) if candidates is not None
            else local_candidates(len(groups), group_size, rank, world_size))

    # 2. artifact directory and retention (one writer; the others wait for it)
    out_dir = None
    t_settle = 0.0  # waiting for the writer before retention: artifact time of the main thread
    if artifact_root is not None:
        out_dir = artifacts.rollout_dir(artifact_root, task, rollout_id, eval=eval)
        if writer is not None:
            t_settle = time.perf_counter()
            _settle_before_prune(writer, artifact_root, task, eval, rollout_id, retention, distributed)
            t_settle = time.perf_counter() - t_settle
        if rank == 0:
            artifacts.prepare_rollout_dir(artifact_root, task, rollout_id, eval=eval)
            artifacts.prune_stale_artifacts(artifact_root, task, retention, eval=eval, up_to=rollout_id)
        if distributed:
            import torch.distributed as dist

            dist.barrier()

    # 3. generate
    requests = []
    for g, slot in mine:
        prompt, metadata = groups[g]
        sample_id = make_sample_id(sampling.sample_id_mode, g, slot, metadata)
        seed = generation_seed if sampling.driver_xt else generation_seed + g * group_size + slot
        if media[g]:  # the sources travel with the candidate: the engine's input, the sidecar's reference
            metadata = {**metadata, SOURCE_PATHS_KEY: list(media[g]), SOURCE_REFS_KEY: _source_refs(prompts[g])}
        request = adapter.build_rollout_request(
            prompt, group_index=g, slot=slot, sample_id=sample_id, sampling=sampling, sde_indices=sde_indices,
            sigmas=sigmas, generation_seed=seed, metadata=metadata)
        requests.append(dataclasses.replace(request, media=list(media[g])) if media[g] else request)
    t_gen = time.perf_counter()
    traj = engine.generate(requests) if requests else None
    t_gen = time.perf_counter() - t_gen
    if traj is not None:
        adapter.validate_trajectory(traj)
        if traj.sample_ids != [r.sample_id for r in requests]:
            raise RuntimeError(f"the engine returned candidates {traj.sample_ids[:3]}... for requests "
                               f"{[r.sample_id for r in requests][:3]}...: rows must follow the request order")
        fingerprint = sampling.fingerprint()
        traj = traj.with_provenance(rollout_id, [
            artifacts.candidate_manifest(traj, i, sampling_fingerprint=fingerprint,
                                         weight_manifest_hash=weight_manifest_hash, rollout_id=rollout_id)
            for i in range(len(traj))])

    # 4. artifacts (with a writer: the main thread's part only, the copy and the hand-over)
    t_write = time.perf_counter()
    if artifact_root is not None:
        jobs = _artifact_jobs(traj, out_dir, groups, group_size, world_size, distributed, rank, task=task,
                              rollout_id=rollout_id, sampling=sampling, weight_manifest_hash=weight_manifest_hash,
                              copy_images=writer is not None)
        if writer is None:
            for job in jobs:
                job()
            if distributed:
                import torch.distributed as dist

                dist.barrier()
        else:
            from trainer.artifact_writer import tree_key

            writer.submit(tree_key(artifact_root, task, eval), rollout_id, jobs,
                          label=f"{'eval ' if eval else ''}rollout {rollout_id} in {out_dir}")
    t_write = time.perf_counter() - t_write + t_settle

    stats = {
        "rollout/candidates_local": float(len(traj) if traj is not None else 0),
        "perf/rollout_generate_time": t_gen,
        "perf/rollout_artifact_time": t_write,
        "perf/rollout_time": time.perf_counter() - t0,
    }
    for part in ("encode", "denoise", "decode"):  # the native engine's split of the generation
        if requests and f"{part}_time" in getattr(engine, "last_stats", {}):
            stats[f"perf/rollout_{part}_time"] = engine.last_stats[f"{part}_time"]
    if writer is not None:
        stats["perf/artifact_writer_time"] = writer.take_busy_time()
    return RolloutOutput(rollout_id=rollout_id, sde_indices=list(sde_indices), candidates=mine,
                         trajectory=traj, artifact_dir=out_dir, stats=stats)


def _settle_before_prune(writer: Any, root, task: str, eval: bool, rollout_id: int, retention: int,
                         distributed: bool) -> None:
    """Retention after the writes it depends on: wait for this rank's writes into the
    directories the coming prune deletes, and with several ranks hold a barrier so rank 0 prunes
    only when every rank's are done (every rank decides alike: no barrier is left unmatched)."""
    from trainer.artifact_writer import tree_key

    tree = tree_key(root, task, eval)
    doomed = writer.retention_barrier(tree, rollout_id, int(retention))
    if doomed:
        writer.wait(tree, doomed)
        if distributed:
            import torch.distributed as dist

            dist.barrier()


def _artifact_jobs(traj: Trajectory | None, out_dir: Path, groups, group_size: int, world_size: int,
                   distributed: bool, rank: int, *, task, rollout_id, sampling, weight_manifest_hash,
                   copy_images: bool) -> list[Any]:
    """This rank's artifact writes as closures, in the order the files are written: its PNGs,
    then the sidecars of the groups it owns. Everything collective (the gather of split groups)
    and everything that reads shared Python objects (the sidecar metadata, serialised here)
    happens now, on the calling thread; a closure touches only data nothing else holds
    (copy_images: a private copy of the images, for a writer thread while the scorer reads the
    trajectory's). Run in order, the closures write exactly what write_png / write_group_sidecar
    write."""
    import functools

    jobs: list[Any] = []
    by_group: dict[int, Trajectory] = {}
    if traj is not None:
        images = traj.images.clone() if copy_images else traj.images
        for i in range(len(traj)):
            jobs.append(_media_job(out_dir, int(traj.group_indices[i]), int(traj.slots[i]), images[i]))
        for g in dict.fromkeys(traj.group_indices.tolist()):
            # a list index copies every row tensor: the part is this rollout's own
            by_group[int(g)] = traj[traj.rows_of_group(g)].without_images()
    split = set(split_groups(len(groups), group_size, world_size)) if distributed else set()
    if split:
        import torch.distributed as dist

        # only the split groups' small tracks travel (no images: each rank wrote its own PNGs)
        payload = {g: part for g, part in by_group.items() if g in split}
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, payload)
        for src, part in enumerate(gathered):
            if src == rank:
                continue
            for g, rows in (part or {}).items():
                if group_owner(g, group_size, len(groups), world_size) == rank:
                    by_group[g] = Trajectory.cat([by_group[g], rows]) if g in by_group else rows
    for g, rows in sorted(by_group.items()):
        if g in split and group_owner(g, group_size, len(groups), world_size) != rank:
            continue
        # write_group_sidecar's two halves: the payload (metadata as strings) now, the bytes later
        tensors, metadata = artifacts.group_sidecar_payload(rows, task=task, rollout_id=rollout_id, sampling=sampling,
                                                            weight_manifest_hash=weight_manifest_hash)
        jobs.append(functools.partial(artifacts.write_sidecar, out_dir / artifacts.sidecar_name(g), tensors,
                                      metadata))
    return jobs


def _media_job(out_dir: Path, group: int, slot: int, media: Any) -> Any:
    """The write of one candidate's file: a PNG of an image [3, H, W], an animated WebP of a
    video [F, 3, H, W] (trainer.video_artifacts), both beside the group's sidecar."""
    import functools

    if media.dim() == 4:
        from trainer.video_artifacts import video_name, write_video

        return functools.partial(write_video, out_dir / video_name(group, slot), media)
    return functools.partial(artifacts.write_png, out_dir / artifacts.image_name(group, slot), media)
