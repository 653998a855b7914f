"""Process-group lifecycle and the one place the device mesh is built.

Every other module receives the mesh (or the process group behind it) from here; nothing else calls
`init_device_mesh`. The job runs one process per GPU (NCCL) or per CPU slot (gloo), started by
torchrun, which provides RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT.

Mesh dimensions are named so that a later parallelism (e.g. a replicate dimension for HSDP) can be
added without touching the callers: today the only dimension is `dp_shard`, the FSDP2 shard group.
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

#: name of the FSDP2 shard dimension of the mesh
DP_SHARD = "dp_shard"


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None or value == "" else int(value)


def init_distributed(device_type: str | None = None, timeout_s: float = 1800.0) -> DistInfo:
    """Initialise the default process group (idempotent) and pick this rank's device.

    device_type: "cuda" or "cpu"; None picks cuda when available. CUDA uses NCCL and binds
    cuda:LOCAL_RANK; CPU uses gloo. Without torchrun's environment a single-process group
    (world size 1) is created on a free local port so that the same code runs unlaunched.
    """
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device_type='cuda' was requested but torch.cuda.is_available() is False; "
                           "run on a GPU machine or use the CPU (gloo) path")
    backend = "nccl" if device_type == "cuda" else "gloo"
    local_rank = _env_int("LOCAL_RANK", 0)
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
            os.environ.setdefault("LOCAL_RANK", "0")
        kwargs = {"backend": backend, "timeout": datetime.timedelta(seconds=timeout_s)}
        if device_type == "cuda":
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
                    device=device, backend=dist.get_backend())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_mesh(device_type: str) -> DeviceMesh:
    """THE device mesh of the job: 1-D, dimension named `dp_shard`, all ranks.

    Requires an initialised default process group (see init_distributed).
    """
    if not dist.is_initialized():
        raise RuntimeError("build_mesh needs an initialised process group: call init_distributed() first")
    return init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=(DP_SHARD,))


def barrier() -> None:
    """A barrier that is a no-op outside a process group."""
    if dist.is_initialized():
        dist.barrier()


def all_reduce_max(values: torch.Tensor) -> torch.Tensor:
    """Element-wise MAX over ranks of a small tensor (returned in place); no-op unlaunched."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Element-wise SUM over ranks of a small tensor (returned in place); no-op unlaunched."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Device small collective tensors of `group` (None: the default group) must live on: cuda for
    NCCL, cpu for gloo."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def teardown() -> None:
    """Destroy the default process group if there is one (after a barrier so no rank leaves early)."""
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def shutdown_and_exit(code: int = 0) -> NoReturn:
    """Clean exit for torchrun ranks: destroy the process group, flush, then os._exit(code).

    Why os._exit: about 1 run in 10 of gloo/torchrun aborted with SIGABRT ("terminate called
    without an active exception") during interpreter teardown AFTER all work and after
    destroy_process_group(); skipping the interpreter's own teardown removed it. Only call this
    once everything that must reach disk has been written and closed.
    """
    try:
        if code == 0:
            teardown()
        elif dist.is_initialized():
            # a failing rank must not wait on a barrier its peers may never reach
            dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
