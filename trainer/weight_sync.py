"""Actor -> engine weight sync, in-process: gather, rename, manifest, hand off, verify, commit.

Every rank holds one actor shard and one engine. A sync walks the parameters in order, in buckets
(iter_sync_buckets: consecutive parameters up to --weight-sync-bucket-size-mb), gathers each bucket
in the wire dtype (gather_full_tensors: its small tensors packed into one flat all-gather per dtype,
its large ones by per-tensor all-gathers straight into the full tensors; on one rank the local
tensors are handed over as they are, cast only when the dtype differs), and
hands the bucket to the rank's own engine as tensors: no serialization, no IPC, no disk, no copy
beyond the gather (and the flat path's pack / unpack) on the sending side (the engine copies into
its own parameters). Three kinds:

  full     every transformer parameter (full fine-tune);
  merged   every transformer parameter, with each LoRA pair folded in:
           W' = W + (B @ A) * (alpha / rank), computed in fp32 then cast to the wire dtype;
  adapter  only the LoRA tensors (peft names, e.g. "transformer_blocks.0.attn.to_q.lora_A.weight").

Names are stripped of wrapper segments (activation checkpointing, FSDP, torch.compile, peft) before
the adapter's weight_name_map and before the manifest hash: an unstripped name is a name the engine
does not know, and an engine that skips unknown names would drop the weight while reporting success.

A manifest (tensor count, bytes in wire dtype, sha256 over ordered "name:shape" lines) travels with
every handoff (the engine checks it); afterwards the actor compares the engine's
get_weights_checksum() with the checksum of what it sent (full/merged; WeightsChecksum reads each
tensor's raw bits once on its device, one host transfer per sync), and only then commits the new
policy version. Any failure raises WeightSyncError, leaves the committed version where it was
and counts train/weight_sync_failures.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from trainer.train_model import full_tensor, reshard_all
from trainer.core.checksum import WeightsChecksum
from trainer.core.dtypes import DTYPES
from trainer.core.manifest import SYNC_KINDS, WeightManifest, WeightSyncError, build_manifest, name_shape_hash
from trainer.core.modules import ModuleTreeSnapshot, lora_modules, model_has_lora
from trainer.core.names import is_lora_name, strip_wrapper_segments

log = logging.getLogger(__name__)


def merge_lora(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float,
               wire_dtype: torch.dtype | None) -> torch.Tensor:
    """W' = W + (B @ A) * scaling, computed in fp32, returned in wire_dtype (None: W's dtype).

    w [out, in], a [rank, in], b [out, rank], any float dtypes (the master values). fp32 because an
    RL update is ~1e-4 relative to W: added in bf16 it would round away."""
    merged = w.float() + (b.float() @ a.float()) * float(scaling)
    return merged.to(w.dtype if wire_dtype is None else wire_dtype)


class SyncPlan:
    """What a sync of one model walks, computed once and reused while the model's structure holds.

    Built by plan_sync for (model, kind, wire dtype, name map, bucket size, adapter name, gather
    mode): the ordered items (engine name, the parameter objects to gather, their gather dtypes,
    the LoRA module to merge with or None), the bucket boundaries over them, the FSDP2 units to
    reshard before reading, whether the model holds LoRA layers, and the snapshot of the module tree
    (ModuleTreeSnapshot) that decides whether the plan is still valid. Parameter VALUES are never
    cached: the items hold the parameter objects and every sync reads them (and each LoRA module's
    scaling) afresh.
    """

    __slots__ = ("key", "structure", "fsdp_modules", "has_lora", "items", "buckets", "builds")

    def __init__(self, key: tuple, structure: ModuleTreeSnapshot, fsdp_modules: list, has_lora: bool,
                 items: list, buckets: list[tuple[int, int]]) -> None:
        self.key = key
        self.structure = structure
        self.fsdp_modules = fsdp_modules
        self.has_lora = has_lora
        #: (engine name, tensors to gather, their gather dtypes, merge (LoRA module) or None)
        self.items = items
        #: [start, end) ranges over items
        self.buckets = buckets
        #: how many times plan_sync built a plan in the chain this one replaced (tests read it)
        self.builds = 1

    @property
    def tensor_count(self) -> int:
        return len(self.items)


def _kind_errors(kind: str, has_lora: bool) -> None:
    """_check_kind's errors, from a known has-LoRA answer."""
    if kind == "full" and has_lora:
        raise WeightSyncError("a full sync of a LoRA model would send base_layer weights without the adapter; "
                              "use --lora-merge-mode (kind 'merged') or --lora-adapter-mode (kind 'adapter')")
    if kind in ("merged", "adapter") and not has_lora:
        raise WeightSyncError(f"sync kind {kind!r} needs a LoRA model, but the actor holds no LoRA layers "
                              "(--fsdp-trainable-mode full syncs with kind 'full')")


def plan_sync(model: nn.Module, kind: str, *, wire_dtype: torch.dtype | None, bucket_bytes: int,
              name_map: Callable[[str], str] | None = None, adapter_name: str = "default",
              gather_mode: str | None = None, cached: SyncPlan | None = None) -> SyncPlan:
    """The sync plan of `model` for these settings, with every FSDP2 unit resharded.

    `cached` (a plan this function returned before) is returned as it is when it was built for the
    same settings and the same model object and its module tree is unchanged (ModuleTreeSnapshot;
    checked after resharding the plan's FSDP2 units, since an unsharded unit holds other parameter
    objects); otherwise the model is walked and a new plan built. Raises WeightSyncError when
    `kind` does not fit the model, as iter_sync_buckets does."""
    if kind not in SYNC_KINDS:
        raise ValueError(f"sync kind must be one of {SYNC_KINDS}, got {kind!r}")
    key = (kind, wire_dtype, name_map, int(bucket_bytes), adapter_name, gather_mode)
    builds = 0
    if cached is not None:
        builds = cached.builds
        if cached.key == key and cached.structure._root() is model:
            for m in cached.fsdp_modules:
                m.reshard()
            if cached.structure.unchanged(model):
                _kind_errors(kind, cached.has_lora)
                return cached
    plan = _build_plan(model, kind, key, wire_dtype=wire_dtype, bucket_bytes=bucket_bytes, name_map=name_map,
                       adapter_name=adapter_name)
    plan.builds = builds + 1
    return plan


def _build_plan(model: nn.Module, kind: str, key: tuple, *, wire_dtype: torch.dtype | None, bucket_bytes: int,
                name_map: Callable[[str], str] | None, adapter_name: str) -> SyncPlan:
    from torch.distributed.fsdp import FSDPModule

    loras = _check_kind(model, kind)
    # an unsharded parameter left by a forward without reshard holds the all-gathered param_dtype
    # copy, not the master values, and its memory is better free during a sync
    reshard_all(model)
    structure = ModuleTreeSnapshot(model)  # after the reshard: the sharded parameter objects
    fsdp_modules = [m for m in structure.modules() if isinstance(m, FSDPModule)]
    base_weight_of = {f"{n}.base_layer.weight": m for n, m in loras.items()}
    name_map = name_map or (lambda n: n)
    wire_size = None if wire_dtype is None else torch.empty((), dtype=wire_dtype).element_size()
    items: list[tuple[str, list[torch.Tensor], list[torch.dtype | None], Any]] = []
    buckets: list[tuple[int, int]] = []
    start, size = 0, 0
    for raw_name, param in model.named_parameters():
        is_lora = is_lora_name(raw_name)
        if is_lora != (kind == "adapter"):
            continue  # adapter: only LoRA tensors; merged: LoRA is folded into the base weight
        name = name_map(strip_wrapper_segments(raw_name, adapter_name))
        if kind == "adapter":
            item = (name, [param], [wire_dtype], None)
        elif raw_name in base_weight_of:
            m = base_weight_of[raw_name]
            if adapter_name not in m.lora_A:
                raise WeightSyncError(f"{raw_name}: LoRA adapter {adapter_name!r} missing on this module")
            # merged in fp32 from the master values: base, A and B gathered in their own dtypes
            item = (name, [param, m.lora_A[adapter_name].weight, m.lora_B[adapter_name].weight], [None] * 3, m)
        else:
            item = (name, [param], [wire_dtype], None)
        items.append(item)
        size += param.numel() * (wire_size or param.element_size())
        if size >= bucket_bytes:
            buckets.append((start, len(items)))
            start, size = len(items), 0
    if start < len(items):
        buckets.append((start, len(items)))
    return SyncPlan(key, structure, fsdp_modules, bool(loras), items, buckets)


def iter_sync_tensors(model: nn.Module, kind: str, *, wire_dtype: torch.dtype | None,
                      name_map: Callable[[str], str] | None = None,
                      adapter_name: str = "default") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (engine name, full tensor in wire dtype) for a sync of `kind`, in parameter order.

    Every rank must consume the whole iterator (each full_tensor() is a collective).
    full:    every parameter; the model must not hold LoRA layers.
    merged:  every non-LoRA parameter; a LoRA base weight is W + (B @ A) * scaling, in fp32.
    adapter: only lora_A / lora_B weights (peft names without the adapter-name segment).
    """
    loras = _check_kind(model, kind)
    base_weight_of = {f"{n}.base_layer.weight": m for n, m in loras.items()}
    name_map = name_map or (lambda n: n)

    def out(raw_name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        name = name_map(strip_wrapper_segments(raw_name, adapter_name))
        return name, (tensor if wire_dtype is None else tensor.to(wire_dtype))

    for raw_name, param in model.named_parameters():
        is_lora = is_lora_name(raw_name)
        if kind == "adapter":
            if is_lora:
                yield out(raw_name, full_tensor(param))
            continue
        if is_lora:
            continue  # merged: folded into the base weight below
        if raw_name in base_weight_of:
            m = base_weight_of[raw_name]
            if adapter_name not in m.lora_A:
                raise WeightSyncError(f"{raw_name}: LoRA adapter {adapter_name!r} missing on this module")
            a, b = full_tensor(m.lora_A[adapter_name].weight), full_tensor(m.lora_B[adapter_name].weight)
            yield out(raw_name, merge_lora(full_tensor(param), a, b, m.scaling[adapter_name], wire_dtype))
        else:
            yield out(raw_name, full_tensor(param))


def _check_kind(model: nn.Module, kind: str) -> dict[str, nn.Module]:
    """The model's LoRA layers, after checking that `kind` fits the model (WeightSyncError if not)."""
    if kind not in SYNC_KINDS:
        raise ValueError(f"sync kind must be one of {SYNC_KINDS}, got {kind!r}")
    loras = lora_modules(model)
    _kind_errors(kind, bool(loras))
    return loras


def _shard0_rows(t: torch.Tensor) -> tuple[int, int] | None:
    """(rows per rank, this rank's rows) when `t` is a DTensor sharded Shard(0) over a 1-D mesh of
    more than one rank, laid out like torch.chunk (FSDP2's layout); None otherwise."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor) or t.dim() == 0:
        return None
    mesh = t.device_mesh
    if mesh.ndim != 1 or mesh.size() == 1 or len(t.placements) != 1:
        return None
    pl = t.placements[0]
    if type(pl) is not Shard or pl.dim != 0:
        return None
    world, dim0 = mesh.size(), t.shape[0]
    per_rank = -(-dim0 // world)
    mine = max(0, min(per_rank, dim0 - mesh.get_local_rank() * per_rank))
    local = t._local_tensor
    if local.shape[0] != mine or tuple(local.shape[1:]) != tuple(t.shape[1:]):
        return None
    return per_rank, mine


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


#: how gather_full_tensors gathers the Shard(0) DTensors of one call over several ranks:
#:   "auto"        a tensor whose full size in the gather dtype is below FLAT_GATHER_MAX_BYTES goes
#:                 through the flat path, a bigger one through the per-tensor path (the default);
#:   "flat"        every tensor through the flat path;
#:   "per_tensor"  every tensor through the per-tensor path.
#: flat: per (process group, gather dtype) every local shard is packed into one buffer and ONE
#: all-gather fills a [world, flat] buffer, which is unpacked into the full tensors: one collective
#: for any number of tensors, at the price of a pack and an unpack copy. per_tensor: one all-gather
#: per tensor (one grouped launch on NCCL) straight into the full tensor, no unpack copy.
GATHER_MODES = ("auto", "flat", "per_tensor")
DEFAULT_GATHER_MODE = "auto"
#: "auto"'s split. The flat path costs copies proportional to a tensor's bytes (its shard packed,
#: its full value unpacked: ~1.5x its size through device memory on 2 ranks, ~12 us for 16 MiB at
#: 4.3 TB/s); the per-tensor path costs a fixed amount per tensor (one more all-gather in the group,
#: assumed of the order of 10 us): the two meet near 16 MiB (tools/bench.py times both paths to
#: check it). At Qwen-Image shape 16 MiB also splits the model cleanly: every weight matrix
#: (>= 18.9 MB in bf16) gathers on its own; every bias, norm, small embedding and LoRA tensor
#: (<= 1.6 MB; 1,090 tensors, 13.5 MB) goes flat.
FLAT_GATHER_MAX_BYTES = 16 << 20
#: the pack / unpack copies use one multi-tensor copy for tensors up to this many elements and a
#: plain copy above (a multi-tensor copy of large tensors was ~10x slower than plain copies, measured on an H200)
_FOREACH_COPY_MAX_NUMEL = 1 << 20


def takes_flat_path(nbytes: int, mode: str) -> bool:
    """Whether a Shard(0) tensor of `nbytes` (full size, gather dtype) is gathered by the flat path
    under gather `mode` (see GATHER_MODES)."""
    if mode not in GATHER_MODES:
        raise ValueError(f"gather mode must be one of {GATHER_MODES}, got {mode!r}")
    return mode == "flat" or (mode == "auto" and nbytes < FLAT_GATHER_MAX_BYTES)


def _copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """dsts[i].copy_(srcs[i]) for all i (casting where the dtypes differ): one multi-tensor copy
    for the small ones, plain copies for the large ones."""
    small_d, small_s = [], []
    for d, s in zip(dsts, srcs):
        if d.numel() <= _FOREACH_COPY_MAX_NUMEL:
            small_d.append(d)
            small_s.append(s)
        else:
            d.copy_(s)
    if small_d:
        torch._foreach_copy_(small_d, small_s)


class _Shard0:
    """One Shard(0) DTensor of a gather: its local rows and where its full value goes."""

    __slots__ = ("index", "local", "per_rank", "mine", "rest", "dim0", "world", "dtype", "group")

    def __init__(self, index: int, t: Any, dtype: torch.dtype | None, per_rank: int, mine: int) -> None:
        self.index = index
        self.local = t._local_tensor.detach()
        self.dtype = dtype or self.local.dtype
        self.per_rank, self.mine = per_rank, mine
        self.rest = tuple(t.shape[1:])
        self.dim0 = t.shape[0]
        self.world = t.device_mesh.size()
        self.group = t.device_mesh.get_group()

    @property
    def row(self) -> int:
        return math.prod(self.rest)

    @property
    def full_bytes(self) -> int:
        return self.dim0 * self.row * self.dtype.itemsize


def _gather_fn():
    import torch.distributed as dist

    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _start_flat(items: list[_Shard0]) -> tuple[Any, Callable[[], list[torch.Tensor]]]:
    """Pack the local rows of `items` (one group, one dtype) into one buffer, each tensor's slot
    padded to its per-rank row count, and start ONE all-gather into [world, flat]. Returns (work or
    None, finish): finish() copies each tensor's full value out of the gathered buffer (rank r's slot
    of a tensor is its rows r * per_rank ..., so the slots side by side, rank-major, ARE the full
    layout) and returns them, the padding rows dropped."""
    first = items[0]
    world, dtype, device = first.world, first.dtype, first.local.device
    sizes = [it.per_rank * it.row for it in items]
    offsets = [0]
    for s in sizes:
        offsets.append(offsets[-1] + s)
    total = offsets[-1]
    fulls = [torch.empty((world * it.per_rank, *it.rest), dtype=dtype, device=device) for it in items]
    done = [full[:it.dim0] for full, it in zip(fulls, items)]
    if total == 0:  # nothing to move (every rank sees the same shapes, so every rank skips)
        return None, lambda: done
    flat_in = torch.empty(total, dtype=dtype, device=device)  # padding rows stay unset: they are dropped
    dsts, srcs = [], []
    for it, off in zip(items, offsets):
        if it.mine and it.row:
            dsts.append(flat_in[off:off + it.mine * it.row].view(it.mine, *it.rest))
            srcs.append(it.local)
    _copy_all(dsts, srcs)
    gathered = torch.empty(world * total, dtype=dtype, device=device)  # 1-D like the input (gloo wants it so)
    work = _gather_fn()(gathered, flat_in, group=first.group, async_op=True)
    gathered = gathered.view(world, total)

    def finish(_sent: torch.Tensor = flat_in) -> list[torch.Tensor]:  # holds the input until the gather is done
        dsts, srcs = [], []
        for full, off, size in zip(fulls, offsets, sizes):
            if size:
                by_rank = full.view(world, size)
                for r in range(world):  # contiguous pieces: a multi-tensor copy takes them in few launches
                    dsts.append(by_rank[r])
                    srcs.append(gathered[r, off:off + size])
        _copy_all(dsts, srcs)
        return done

    return work, finish


def gather_full_tensors(tensors: list[torch.Tensor], dtypes: list[torch.dtype | None],
                        mode: str | None = None) -> list[torch.Tensor]:
    """The full value of every tensor, in dtypes[i] (None: its own dtype). Collective: every rank
    calls it with the same (sharded) tensors in the same order and the same `mode`.

    plain tensor                      -> itself (cast only if the dtype differs);
    DTensor on a one-rank mesh        -> its local tensor: nothing to gather, no copy;
    DTensor Shard(0) on a 1-D mesh    -> gathered with the others of this call, by one of two paths
                                         (mode: GATHER_MODES; None = DEFAULT_GATHER_MODE):
        flat        per (process group, gather dtype) ONE all-gather of all their local shards,
                    packed (and cast) into one buffer, each padded to its per-rank row count; each
                    full tensor is then copied out of the [world, flat] result;
        per_tensor  one all-gather per tensor, all issued before any is waited on (one coalesced
                    NCCL launch), each straight into a fresh [world * rows_per_rank, ...] tensor
                    whose first dim0 rows are the full tensor (rank-major along dim 0 IS the full
                    layout): no copy beyond the gather; the input is packed only when it must be
                    cast or padded (the last rank's short chunk);
    any other DTensor                 -> full_tensor() (a collective of its own).
    The gathers run in the target dtype, so a narrower wire dtype also halves the traffic. Both
    paths give the bits of the per-parameter full_tensor().to(dtype), in every mode.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    mode = DEFAULT_GATHER_MODE if mode is None else mode
    if mode not in GATHER_MODES:
        raise ValueError(f"gather mode must be one of {GATHER_MODES}, got {mode!r}")
    out: list[torch.Tensor | None] = [None] * len(tensors)
    flat: dict[tuple[Any, torch.dtype], list[_Shard0]] = {}
    pending: list[tuple[int, torch.Tensor, torch.Tensor, int, Any]] = []  # index, out, in, dim0, group
    casts: list[tuple[int, torch.Tensor, torch.dtype]] = []  # local tensors to cast: one multi-tensor copy

    def local(i: int, t: torch.Tensor, dtype: torch.dtype | None) -> None:
        if dtype is None or t.dtype == dtype:
            out[i] = t
        else:
            casts.append((i, t, dtype))

    for i, (t, dtype) in enumerate(zip(tensors, dtypes)):
        if not isinstance(t, DTensor):
            local(i, t.detach(), dtype)
        elif t.device_mesh.size() == 1:
            # the local tensor itself (DTensor.detach()/to_local() dispatch costs ~10 us per parameter)
            local(i, t._local_tensor.detach(), dtype)
        elif (rows := _shard0_rows(t)) is None:
            out[i] = _cast(t.detach().full_tensor(), dtype)  # before any async gather: ops stay in order
        else:
            it = _Shard0(i, t, dtype, *rows)
            if takes_flat_path(it.full_bytes, mode):
                flat.setdefault((it.group, it.dtype), []).append(it)
                continue
            shard = it.local  # not `local`: that name is the helper above, still called for later tensors
            if it.mine == it.per_rank and shard.dtype == it.dtype and shard.is_contiguous():
                inp = shard
            else:
                inp = torch.zeros((it.per_rank, *it.rest), dtype=it.dtype, device=shard.device)
                inp[:it.mine].copy_(shard)
            full = torch.empty((it.world * it.per_rank, *it.rest), dtype=it.dtype, device=shard.device)
            pending.append((i, full, inp, it.dim0, it.group))
    works: list[Any] = []
    finishes: list[tuple[list[_Shard0], Callable[[], list[torch.Tensor]]]] = []
    for items in flat.values():  # insertion order: the same on every rank
        work, finish = _start_flat(items)
        if work is not None:
            works.append(work)
        finishes.append((items, finish))
    if pending:
        gather = _gather_fn()
        by_group: dict[Any, list] = {}
        for p in pending:
            by_group.setdefault(p[4], []).append(p)
        for group, ops in by_group.items():
            device = ops[0][2].device
            if device.type == "cuda" and "nccl" in str(dist.get_backend(group)):  # one grouped launch
                from torch.distributed.distributed_c10d import _coalescing_manager

                with _coalescing_manager(group=group, device=device, async_ops=True) as cm:
                    for _, full, inp, _, _ in ops:
                        gather(full, inp, group=group)
                works.append(cm)
            else:
                works += [gather(full, inp, group=group, async_op=True) for _, full, inp, _, _ in ops]
    for w in works:
        w.wait()
    for items, finish in finishes:
        for it, full in zip(items, finish()):
            out[it.index] = full
    for i, full, _, dim0, _ in pending:
        out[i] = full[:dim0]
    if casts:  # e.g. an adapter sync on one rank: 960 fp32 LoRA factors to bf16 in a few launches
        dsts = [torch.empty(t.shape, dtype=dtype, device=t.device) for _, t, dtype in casts]
        _copy_all(dsts, [t for _, t, _ in casts])
        for (i, _, _), d in zip(casts, dsts):
            out[i] = d
    return out  # type: ignore[return-value]


def iter_sync_buckets(model: nn.Module, kind: str, *, wire_dtype: torch.dtype | None, bucket_bytes: int,
                      name_map: Callable[[str], str] | None = None, adapter_name: str = "default",
                      gather_mode: str | None = None,
                      plan: SyncPlan | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield the tensors of a sync of `kind` as buckets [(engine name, full tensor in wire dtype)].

    Collective: every rank must consume the whole iterator. A bucket is the next parameters in
    named_parameters order (a transformer block's parameters are consecutive) until their wire
    bytes reach `bucket_bytes` (at least one parameter; a LoRA base weight travels with its A/B);
    its tensors are gathered together (gather_full_tensors with `gather_mode`: small tensors by one
    flat all-gather per dtype, large ones per tensor straight into the full tensors; on one rank the
    local tensors themselves). The tensors of a bucket may be the
    model's own storage: read them, never modify them. Every FSDP2 unit is resharded first, so the
    values are the master shards' (cast to the wire dtype); names, order and values equal
    iter_sync_tensors' (the per-parameter full_tensor() reference) on a resharded model.
    full:    every parameter; the model must not hold LoRA layers.
    merged:  every non-LoRA parameter; a LoRA base weight is W + (B @ A) * scaling, in fp32.
    adapter: only lora_A / lora_B weights.
    plan: a SyncPlan for this model and these settings (plan_sync; WeightSyncer keeps one across
    syncs); None walks the model now (an uncached plan). Either way the buckets are the same.
    """
    if plan is None:
        plan = plan_sync(model, kind, wire_dtype=wire_dtype, bucket_bytes=bucket_bytes, name_map=name_map,
                         adapter_name=adapter_name, gather_mode=gather_mode)
    items = plan.items
    for start, end in plan.buckets:
        bucket = items[start:end]
        flat = [t for _, ts, _, _ in bucket for t in ts]
        dts = [d for _, _, ds, _ in bucket for d in ds]
        full = iter(gather_full_tensors(flat, dts, gather_mode))
        named = []
        for name, ts, _, lora in bucket:
            if lora is None:
                named.append((name, next(full)))
            else:
                got = [next(full) for _ in ts]
                named.append((name, merge_lora(*got, lora.scaling[adapter_name], wire_dtype)))
        yield named


def engine_holds_lora(engine: Any) -> bool:
    """Best-effort: does the engine's transformer hold LoRA layers? (the engine checks too)."""
    probe = getattr(engine, "holds_lora", None)
    if callable(probe):
        return bool(probe())
    if isinstance(probe, bool):
        return probe
    transformer = getattr(engine, "transformer", None)
    return isinstance(transformer, nn.Module) and model_has_lora(transformer)


class WeightSyncer:
    """Owns the committed policy version and the sync counters of one rank.

    kind: "full" | "merged" | "adapter" (see module docstring).
    wire_dtype: "bf16" | "fp16" | "fp32" | None (None keeps each tensor's dtype).
    bucket_size_mb: a bucket is the next parameters in order (a block's are consecutive) until their
      wire bytes reach this size (at least one parameter); each bucket is gathered by one grouped
      all-gather and handed to the engine with its own manifest, so the transient footprint is one
      bucket, not a second copy of the model. Adapter tensors are gathered in such buckets too and
      handed over in one call.
    lora_config: {"rank", "alpha", "target_modules"} for adapter syncs.
    verify_checksum: compare engine.get_weights_checksum() with the sent tensors' checksum (full and
      merged kinds; an adapter sync is verified by its manifest).
    gather_mode: how several ranks gather a bucket (GATHER_MODES; None = DEFAULT_GATHER_MODE); every
      mode hands over the same bits, only the speed differs (tools/bench.py times them).
    """

    def __init__(self, kind: str, *, wire_dtype: str | None = "bf16", bucket_size_mb: float = 512,
                 name_map: Callable[[str], str] | None = None, lora_config: dict | None = None,
                 verify_checksum: bool = True, policy_version: int = 0, gather_mode: str | None = None) -> None:
        if kind not in SYNC_KINDS:
            raise ValueError(f"--weight-sync-mode resolves to one of {SYNC_KINDS}, got {kind!r}")
        if wire_dtype is not None and wire_dtype not in DTYPES:
            raise ValueError(f"--weight-sync-wire-dtype must be one of {tuple(DTYPES)}, got {wire_dtype!r}")
        if bucket_size_mb <= 0:
            raise ValueError(f"--weight-sync-bucket-size-mb must be > 0, got {bucket_size_mb}")
        if gather_mode is not None and gather_mode not in GATHER_MODES:
            raise ValueError(f"gather_mode must be one of {GATHER_MODES}, got {gather_mode!r}")
        if kind == "adapter" and not lora_config:
            raise ValueError("adapter sync needs lora_config (rank, alpha, target_modules)")
        self.kind = kind
        self.wire_dtype = None if wire_dtype is None else DTYPES[wire_dtype]
        self.bucket_bytes = int(bucket_size_mb * 1024 * 1024)
        self.name_map = name_map
        self.lora_config = dict(lora_config or {})
        self.verify_checksum = verify_checksum
        self.gather_mode = gather_mode
        self.policy_version = policy_version
        self.failures = 0
        self.last_manifest: WeightManifest | None = None
        #: the sync plan of the last synced model (plan_sync): reused while its module tree holds
        self.plan: SyncPlan | None = None

    def state_dict(self) -> dict[str, int]:
        return {"policy_version": self.policy_version, "weight_sync_failures": self.failures}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.policy_version = int(state["policy_version"])
        self.failures = int(state.get("weight_sync_failures", 0))

    def sync(self, model: nn.Module, engine: Any, *, version: int | None = None) -> dict[str, float]:
        """Gather, hand off, verify, commit. Returns the train/* and perf/* sync series.

        version: the policy version to commit (None: the next one, policy_version + 1; the
        current one re-commits the same policy, e.g. a fresh LoRA run's adapter before rollout 0).
        Collective: every rank calls it with its own engine. Raises WeightSyncError on any failure
        (version not committed, train/weight_sync_failures incremented).
        """
        version = self.policy_version + 1 if version is None else int(version)
        engine_version = getattr(engine, "policy_version", None)
        t0 = time.perf_counter()
        try:
            with torch.no_grad():  # nothing here needs autograd, and its bookkeeping costs host time per tensor
                manifest = self._handoff(model, engine, version)
            engine.commit_weight_version(version)
            if getattr(engine, "policy_version", version) != version:
                raise WeightSyncError(f"engine reports policy_version {engine.policy_version} after "
                                      f"commit_weight_version({version})")
        except Exception as exc:
            self.failures += 1
            self._roll_back(engine, engine_version)
            if isinstance(exc, WeightSyncError):
                raise
            raise WeightSyncError(f"weight sync to version {version} failed: {exc!r}") from exc
        self.policy_version = version
        self.last_manifest = manifest
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return {
            "train/policy_version": float(version),
            "train/weight_sync_tensors": float(manifest.tensor_count),
            "train/weight_sync_gb": manifest.total_bytes / 1e9,
            "train/weight_sync_failures": float(self.failures),
            "perf/weight_sync_time": time.perf_counter() - t0,
        }

    def _roll_back(self, engine: Any, engine_version: int | None) -> None:
        """Put the engine's version label back to what it was before the attempt (a retry rebuilds
        the same version). The weights themselves may be partly replaced: the caller must not
        sample with this engine before a successful sync."""
        try:
            if engine_version is not None and getattr(engine, "policy_version", engine_version) != engine_version:
                engine.commit_weight_version(engine_version)
        except Exception:  # the sync error is what the caller must see; this is best effort
            log.exception("could not restore the engine's policy_version to %d", engine_version)

    def _handoff(self, model: nn.Module, engine: Any, version: int) -> WeightManifest:
        self.plan = plan = plan_sync(model, self.kind, wire_dtype=self.wire_dtype, bucket_bytes=self.bucket_bytes,
                                     name_map=self.name_map, gather_mode=self.gather_mode, cached=self.plan)
        buckets = iter_sync_buckets(model, self.kind, wire_dtype=self.wire_dtype, bucket_bytes=self.bucket_bytes,
                                    name_map=self.name_map, gather_mode=self.gather_mode, plan=plan)
        if self.kind == "adapter":
            named = [pair for bucket in buckets for pair in bucket]  # gathered copies or local views
            manifest = build_manifest("adapter", named, version)
            engine.set_lora_tensors(named, manifest, self.lora_config)
            return manifest
        if engine_holds_lora(engine):
            raise WeightSyncError(f"a {self.kind} sync into an engine whose transformer holds LoRA layers would "
                                  "be silently dropped; never mix --lora-adapter-mode and full/merged syncs on one engine")
        names_shapes: list[tuple[str, tuple[int, ...]]] = []
        total_bytes = 0
        checksum = WeightsChecksum() if self.verify_checksum else None
        # checksum what the engine will store: its dtype when it names one (a cast only if it differs)
        engine_dtype = getattr(engine, "dtype", None)
        engine_dtype = engine_dtype if isinstance(engine_dtype, torch.dtype) else None
        for bucket in buckets:
            for name, tensor in bucket:
                names_shapes.append((name, tuple(tensor.shape)))
                total_bytes += tensor.numel() * tensor.element_size()
                if checksum is not None:
                    checksum.update(name, tensor, engine_dtype)
            engine.update_weights_from_tensors(bucket, build_manifest(self.kind, bucket, version))
        manifest = WeightManifest(kind=self.kind, tensor_count=len(names_shapes), total_bytes=total_bytes,
                                  name_shape_hash=name_shape_hash(names_shapes), version=version)
        if checksum is not None:
            expected, got = checksum.hexdigest(), engine.get_weights_checksum()
            if got != expected:
                raise WeightSyncError(f"engine checksum after the {self.kind} sync differs from the sent tensors "
                                      f"(expected {expected[:16]}..., engine {str(got)[:16]}...): a tensor was "
                                      "dropped, renamed or altered on the way in")
        return manifest
