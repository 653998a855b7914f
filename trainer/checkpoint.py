"""Distributed checkpoints: DCP shards plus the JSON sidecars resume needs.

Layout (one directory per iteration, i.e. per rollout id):

    <save>/<task>/iter_0000020/
        fsdp/                       DCP shards (model + optimizer, + "ema.*" when --ema-decay > 0)
        rng_rank0.pt ...            per-rank RNG state: tensors and numbers (RNG_FORMAT), read with
                                    torch.load(weights_only=True), never as an arbitrary pickle
        trainer_state.json          rollout id, policy version, lr_scheduler_steps, ...
        weight_sync_manifest.json
        adapter_contract.json
        COMMITTED                   written last; the only marker resume trusts
    <save>/latest_checkpointed_iteration.txt
    <save>/<task>/latest_checkpointed_iteration.txt

The write order is fixed (shards -> RNG -> JSON sidecars -> COMMITTED -> markers -> rotation) and COMMITTED
is written only after a MIN all-reduce confirms every rank wrote its part, so a crash at any
point leaves either a complete checkpoint or one that resume ignores.

A checkpoint directory is trusted input, like a recipe: DCP's own .metadata file is a pickle
that torch.distributed.checkpoint unpickles. Resume and export only checkpoints you wrote.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from trainer.artifacts import atomic_write_bytes
from trainer.core.files import fsync_dir
from trainer.ema import EMA_PREFIX
from trainer.checkpoint_index import (  # noqa: F401 - re-exported: the checkpoint API in one module
    COMMITTED,
    LATEST,
    committed_iterations,
    iteration_dir,
    iteration_dirs,
    latest_committed_iteration,
)

logger = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.json"
MANIFEST = "weight_sync_manifest.json"
CONTRACT = "adapter_contract.json"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be trusted or does not match this run; the message names the file."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _all_ranks_ok(ok: bool) -> bool:
    """MIN all-reduce of a per-rank success flag (gloo and nccl both reduce int tensors)."""
    if not dist.is_initialized():
        return ok
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _broadcast_outcome(message: str | None) -> str | None:
    """Rank 0's error message (or None) delivered to every rank."""
    if not dist.is_initialized():
        return message
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def rotate_checkpoints(save_root: str | os.PathLike, task: str, keep: int) -> list[int]:
    """Delete the oldest committed checkpoints so that `keep` committed ones remain, and the
    uncommitted leftovers of crashed saves older than the newest committed one. Returns the
    removed committed iterations. keep <= 0 keeps everything.

    Called only after a new checkpoint is COMMITTED: a kill or a failed write at any moment
    then still leaves `keep` committed checkpoints (deleting first would leave none with keep 1).
    An old iteration loses its COMMITTED marker (durably) before any shard goes, so a kill inside
    the deletion leaves an uncommitted directory, which resume ignores and the next rotation
    removes, never a committed one with shards missing.
    """
    removed: list[int] = []
    found = iteration_dirs(save_root, task)
    committed = sorted(it for it, ok in found.items() if ok)
    if not committed:
        return removed
    for it, ok in sorted(found.items()):
        # resume never trusts an uncommitted directory; one older than the newest commit is dead
        if not ok and it < committed[-1]:
            shutil.rmtree(iteration_dir(save_root, task, it))
    if keep > 0:
        for it in committed[:-keep]:
            _remove_committed(iteration_dir(save_root, task, it))
            removed.append(it)
    return removed


def _remove_committed(d: Path) -> None:
    """Uncommit `d` (unlink COMMITTED, fsync the directory), then delete it."""
    (d / COMMITTED).unlink(missing_ok=True)
    fsync_dir(d)
    shutil.rmtree(d)


#: the per-rank RNG file's format: tensors and plain numbers only, so torch.load(weights_only=True)
#: reads it and no file handed to --load can make the loader run code
RNG_FORMAT = "flowgrpo-rng/2"


def _rng_state() -> dict[str, Any]:
    """Every generator resume must restore, as tensors and plain numbers (see RNG_FORMAT)."""
    py_version, py_internal, py_gauss = random.getstate()
    np_algorithm, np_key, np_pos, np_has_gauss, np_cached = np.random.get_state()
    state = {
        "format": RNG_FORMAT,
        "python": {"version": int(py_version), "state": torch.tensor(py_internal, dtype=torch.int64),
                   "gauss_next": py_gauss},
        "numpy": {"algorithm": str(np_algorithm), "key": torch.from_numpy(np_key.astype(np.int64)),
                  "pos": int(np_pos), "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def _rng_bytes() -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(_rng_state(), buf)
    return buf.getvalue()


def _old_format_globals() -> list:
    """What the RNG files of earlier versions need beyond plain data: numpy's uint32 key array.
    Reconstructing an array calls no other code, so these alone keep weights_only's guarantee."""
    try:
        from numpy._core import multiarray
    except ImportError:  # numpy 1.x
        from numpy.core import multiarray

    reconstruct = multiarray._reconstruct
    return [(reconstruct, "numpy.core.multiarray._reconstruct"), (reconstruct, "numpy._core.multiarray._reconstruct"),
            np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def read_rng_file(path: Path) -> dict[str, Any]:
    """The RNG state in `path`, read with torch.load(weights_only=True): plain data only, never an
    arbitrary pickled object. Raises CheckpointError naming the file when it is damaged or holds
    anything else (a pickle that would run code is refused unread, and the refusal names what
    it asked for)."""
    import pickle

    try:
        with torch.serialization.safe_globals(_old_format_globals()):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        try:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception:  # noqa: BLE001 - the names only decorate the message
            names = []
        asks = f" (it names {', '.join(sorted(names)[:4])})" if names else ""
        raise CheckpointError(
            f"{path} holds Python objects other than RNG state{asks}; loading them could run code, so it is not "
            f"read. A checkpoint is trusted input: resume only checkpoints you wrote. To resume this one anyway "
            f"without its RNG state (the run continues, not bit-identically), delete the rng_rank*.pt files of "
            f"{path.parent}; or resume an earlier iteration with --ckpt-step N") from None
    except Exception as e:  # noqa: BLE001 - a truncated file raises a raw zip error
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {e}); the checkpoint is "
                              f"damaged: resume an earlier iteration with --ckpt-step N") from None
    if not isinstance(state, dict) or "torch" not in state or "python" not in state or "numpy" not in state:
        raise CheckpointError(f"{path} is not an RNG state file (no python / numpy / torch entries); the checkpoint "
                              f"is damaged: resume an earlier iteration with --ckpt-step N")
    return state


def _parse_rng_state(state: dict[str, Any], path: Path) -> dict[str, Any]:
    """The generator states in `state` (RNG_FORMAT, or the tuples earlier versions wrote), each
    tried on a scratch generator first, so that a bad file is refused before anything is loaded."""
    try:
        py, npy = state["python"], state["numpy"]
        if state.get("format") == RNG_FORMAT:
            py = (int(py["version"]), tuple(int(v) for v in py["state"].tolist()), py["gauss_next"])
            npy = (str(npy["algorithm"]), npy["key"].numpy().astype(np.uint32), int(npy["pos"]),
                   int(npy["has_gauss"]), float(npy["cached_gaussian"]))
        random.Random().setstate(py)
        np.random.RandomState().set_state(npy)
        torch.Generator().set_state(state["torch"])
        cuda = list(state.get("cuda") or [])
        if not all(isinstance(t, torch.Tensor) for t in cuda):
            raise TypeError("the cuda entry is not a list of tensors")
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
        raise CheckpointError(f"{path} does not hold a usable RNG state ({type(e).__name__}: {e}); the checkpoint "
                              f"is damaged: resume an earlier iteration with --ckpt-step N") from None
    return {"python": py, "numpy": npy, "torch": state["torch"], "cuda": cuda}


def _set_rng_state(state: dict[str, Any]) -> None:
    """Restore the generators from _parse_rng_state's result."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _dcp_state(model, optimizer, trainable_only: bool, ema, old_policy=None) -> dict:
    """What DCP saves and loads in place: "model", "optim" (when there is an optimizer), "ema"
    (only when the run keeps one, so an EMA-off checkpoint has exactly the keys it always had)
    and "nft_old" (--algorithm nft's old policy, ParamEMA.state_dict(); a checkpoint without it
    cannot resume an nft run: its keys are then missing, which load_checkpoint refuses)."""
    model_sd, optim_sd = _state_dicts(model, optimizer, trainable_only)
    state = {"model": model_sd}
    if optim_sd is not None:
        state["optim"] = optim_sd
    if ema:
        state["ema"] = ema
    if old_policy:
        state["nft_old"] = old_policy
    return state


def _state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, trainable_only: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    # ignore_frozen_params: a LoRA checkpoint stores the adapter, not the 20 B frozen base,
    # which is reloaded from --model-path on resume.
    opts = StateDictOptions(ignore_frozen_params=trainable_only)
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model, options=opts), None
    return get_state_dict(model, optimizer, options=opts)


def optimizer_stateless_params(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of trainable parameters that AdamW holds no state for (never had a gradient).

    Recorded at save time so that resume can tell "absent because it never existed" from
    "absent because the checkpoint is incomplete"."""
    stateful = {id(p) for p in optimizer.state.keys()}
    return sorted(n for n, p in model.named_parameters() if p.requires_grad and id(p) not in stateful)


def save_checkpoint(
    save_root: str | os.PathLike,
    task: str,
    iteration: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    trainer_state: dict[str, Any],
    weight_sync_manifest: dict[str, Any] | None,
    adapter_contract: dict[str, Any],
    trainable_only: bool,
    max_to_keep: int = 0,
    ema: dict[str, torch.Tensor] | None = None,
    old_policy: dict[str, torch.Tensor] | None = None,
) -> bool:
    """Write one checkpoint on every rank (collective). Returns True when it was committed.

    Every failure is logged loudly and returns False on every rank (the caller counts it in
    train/checkpoint_failures and carries on): a failed preparation on rank 0 (a read-only or
    vanished --save), a failed shard or sidecar write. Committed iterations are never
    overwritten and rotation (`max_to_keep` > 0) runs only after the new checkpoint is committed.
    `ema` (trainer.ema.ParamEMA.state_dict(), or None without an EMA) is written under "ema.";
    without it the DCP keys are exactly the model's and the optimizer's.
    """
    import torch.distributed.checkpoint as dcp

    rank = _rank()
    out = iteration_dir(save_root, task, iteration)

    error = None
    if rank == 0:
        try:
            if (out / COMMITTED).exists():
                # preflight refuses runs that could get here; this guards a changed directory
                raise CheckpointError(
                    f"{out} is already a committed checkpoint; refusing to overwrite it. Resume with "
                    f"--load {save_root} (continues after the latest iteration) or choose another --save."
                )
            if out.exists():  # leftovers of a crashed save of this same iteration
                shutil.rmtree(out)
            (out / "fsdp").mkdir(parents=True, exist_ok=True)
        except BaseException as e:  # noqa: BLE001 - every rank must learn of it
            error = f"preparing {out} failed: {e!r}"
    error = _broadcast_outcome(error)
    if error is not None:
        if rank == 0:
            logger.error("CHECKPOINT WRITE FAILED: %s; iteration %d was NOT saved", error, iteration)
        return False

    ok = True
    try:
        state = _dcp_state(model, optimizer, trainable_only, ema, old_policy)
        # DCP gathers every rank's write result, so one rank's failure raises on all of them
        # (no rank is left waiting in a collective).
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(out / "fsdp")))
        atomic_write_bytes(out / f"rng_rank{rank}.pt", _rng_bytes())
    except BaseException as e:  # CheckpointException derives from BaseException
        if isinstance(e, KeyboardInterrupt):
            raise
        logger.error("CHECKPOINT WRITE FAILED on rank %d for %s: %r", rank, out, e)
        ok = False

    if rank == 0 and ok:
        try:
            state = dict(trainer_state)
            state["iteration"] = iteration
            state["world_size"] = _world()
            if optimizer is not None:
                state["optimizer_stateless_params"] = optimizer_stateless_params(model, optimizer)
            atomic_write_bytes(out / TRAINER_STATE, json.dumps(state, indent=2, sort_keys=True).encode())
            atomic_write_bytes(out / MANIFEST, json.dumps(weight_sync_manifest or {}, indent=2, sort_keys=True).encode())
            atomic_write_bytes(out / CONTRACT, json.dumps(adapter_contract, indent=2, sort_keys=True).encode())
        except BaseException as e:  # noqa: BLE001
            logger.error("CHECKPOINT WRITE FAILED on rank 0 (sidecars) for %s: %r", out, e)
            ok = False

    committed = _all_ranks_ok(ok)
    if committed and rank == 0:
        try:
            atomic_write_bytes(out / COMMITTED, f"{iteration}\n".encode())
            for marker_dir in (Path(save_root), Path(save_root) / task):
                atomic_write_bytes(marker_dir / LATEST, f"{iteration}\n".encode(), overwrite=True)
        except BaseException as e:  # noqa: BLE001 - a missing marker is still "not committed"
            logger.error("CHECKPOINT WRITE FAILED on rank 0 (commit marker) for %s: %r", out, e)
            committed = (out / COMMITTED).is_file()
    if not committed and rank == 0:
        logger.error("checkpoint iteration %d was NOT committed (a rank failed); resume ignores %s", iteration, out)
    if committed and rank == 0 and max_to_keep:
        try:
            removed = rotate_checkpoints(save_root, task, max_to_keep)
            if removed:
                logger.info("checkpoint rotation removed iterations %s", removed)
        except OSError as e:  # the new checkpoint is safe; an old one merely stays on disk
            logger.error("checkpoint rotation under %s failed (older iterations kept): %r", Path(save_root) / task, e)
    committed = _broadcast_outcome("ok" if committed else None) is not None
    if dist.is_initialized():
        dist.barrier()
    return committed


def assert_resumable(saved: dict[str, Any], expected: dict[str, Any], path: str | os.PathLike) -> None:
    """Refuse to resume when the adapter contract differs; the message names every difference.

    Alpha in particular cannot be recovered from the weights: a wrong one silently rescales
    the policy, so every key counts."""
    diffs = []
    for key in sorted(set(saved) | set(expected)):
        if saved.get(key) != expected.get(key):
            diffs.append(f"  {key}: checkpoint has {saved.get(key)!r}, this run has {expected.get(key)!r}")
    if diffs:
        raise CheckpointError(
            f"cannot resume from {path}: the adapter contract differs:\n" + "\n".join(diffs)
            + "\nRun with the checkpoint's settings, or start a fresh run with another --save."
        )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing although the directory is COMMITTED; the checkpoint is "
                              f"damaged: resume from an earlier iteration or start fresh") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); the checkpoint is damaged") from None


def load_checkpoint(
    load_root: str | os.PathLike,
    task: str,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    adapter_contract: dict[str, Any],
    trainable_only: bool,
    iteration: int | None = None,
    ema: dict[str, torch.Tensor] | None = None,
    old_policy: dict[str, torch.Tensor] | None = None,
) -> dict[str, Any] | None:
    """Restore model, optimizer and this rank's RNG from the newest COMMITTED iteration
    (or `iteration`). Returns the trainer_state dict, or None when there is nothing to load.

    `ema`: the run's EMA tensors (ParamEMA.state_dict()), loaded in place. A checkpoint without
    EMA state cannot give them: that raises (silently restarting the average from the resumed
    weights would make the run differ from an uninterrupted one). A checkpoint with EMA state
    loaded by a run without an EMA drops it, with a warning."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    if iteration is None:
        iteration = latest_committed_iteration(load_root, task)
        if iteration is None:
            return None
    d = iteration_dir(load_root, task, iteration)
    if not (d / COMMITTED).is_file():
        raise CheckpointError(f"{d} has no COMMITTED marker: it was never completely written; pick a committed iteration")
    trainer_state = _read_json(d / TRAINER_STATE)
    assert_resumable(_read_json(d / CONTRACT), adapter_contract, d / CONTRACT)

    # read and check this rank's RNG file before anything is loaded in place
    rng_file = d / f"rng_rank{_rank()}.pt"
    rng = None
    if trainer_state.get("world_size") != _world():
        logger.warning("RNG state not restored from %s (world size %s -> %s)", d, trainer_state.get("world_size"),
                       _world())
    elif not rng_file.is_file():
        logger.warning("RNG state not restored: %s is missing; the run continues, not bit-identically", rng_file)
    else:
        rng = _parse_rng_state(read_rng_file(rng_file), rng_file)

    state = _dcp_state(model, optimizer, trainable_only, ema, old_policy)

    if not (d / "fsdp" / ".metadata").is_file():
        raise CheckpointError(f"{d / 'fsdp' / '.metadata'} is missing although {d.name} is COMMITTED: the checkpoint "
                              f"is damaged; resume an earlier iteration with --ckpt-step N or start fresh")
    reader = FileSystemReader(str(d / "fsdp"))
    try:
        metadata = reader.read_metadata()
        saved_keys = set(metadata.state_dict_metadata.keys())
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{d / 'fsdp'}: cannot read the DCP metadata ({e!r}); the checkpoint is damaged") from None
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    wanted, _ = flatten_state_dict(state)
    saved_ema = any(k.startswith(EMA_PREFIX) for k in saved_keys)
    if ema and not saved_ema:
        raise CheckpointError(
            f"{d / 'fsdp'} holds no EMA state ('{EMA_PREFIX}*'), but this run has --ema-decay > 0: it was written "
            f"by a run without an EMA. Resume with --ema-decay 0, or start a fresh run with another --save.")
    if saved_ema and not ema:
        logger.warning("%s holds EMA state; this run has no EMA (--ema-decay 0), so it is not loaded", d / "fsdp")
    missing = sorted(k for k in wanted if k not in saved_keys)
    stateless = set(trainer_state.get("optimizer_stateless_params", []))
    bad = [k for k in missing if not (k.startswith("optim.state.") and _param_of_optim_key(k) in stateless)]
    if bad:
        raise CheckpointError(
            f"{d / 'fsdp'} lacks {len(bad)} entries this run needs, e.g. {bad[:3]}; the checkpoint was written "
            f"by a different model / trainable set. Use a matching --load or start fresh."
        )
    _check_shard_files(d / "fsdp", metadata)
    try:
        dcp.load(state, checkpoint_id=str(d / "fsdp"), planner=DefaultLoadPlanner(allow_partial_load=bool(missing)))
    except BaseException as e:  # CheckpointException derives from BaseException
        if isinstance(e, KeyboardInterrupt):
            raise
        raise CheckpointError(f"loading {d / 'fsdp'} failed: {e!r}") from None
    opts = StateDictOptions(ignore_frozen_params=trainable_only, strict=False)
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, state["model"], options=opts)
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=opts)

    if rng is not None:
        _set_rng_state(rng)
    return trainer_state


def _check_shard_files(fsdp_dir: Path, metadata: Any) -> None:
    """Every shard file the DCP metadata points into exists and is long enough, so a truncated
    or missing shard is named by its file instead of surfacing as a read error deep in DCP."""
    need: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is not None:
            need[rel] = max(need.get(rel, 0), int(info.offset) + int(info.length))
    for rel, size in sorted(need.items()):
        f = fsdp_dir / rel
        have = f.stat().st_size if f.is_file() else None
        if have is None or have < size:
            state = "is missing" if have is None else f"has {have} bytes, the metadata needs {size}"
            raise CheckpointError(f"{f} {state}: the checkpoint is damaged; resume an earlier iteration "
                                  f"with --ckpt-step N or start fresh")


def _param_of_optim_key(key: str) -> str:
    """"optim.state.<param name>.<state key>" -> "<param name>"."""
    body = key[len("optim.state."):]
    return body.rsplit(".", 1)[0]
