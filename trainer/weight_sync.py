"""Actor -> engine weight sync, in-process: gather, rename, manifest, hand off, verify, commit.

Every rank holds one actor shard and one engine. A sync gathers each trained tensor with
DTensor.full_tensor() (a collective: all ranks walk the same names in the same order), converts it
to the wire dtype, and hands it to the rank's own engine as a tensor: no serialization, no IPC, no
disk. Three kinds:

  full     every transformer parameter (full fine-tune);
  merged   every transformer parameter, with each LoRA pair folded in:
           W' = W + (B @ A) * (alpha / rank), computed in fp32 then cast to the wire dtype;
  adapter  only the LoRA tensors (peft names, e.g. "transformer_blocks.0.attn.to_q.lora_A.weight").

Names are stripped of wrapper segments (activation checkpointing, FSDP, torch.compile, peft) before
the adapter's weight_name_map and before the manifest hash: an unstripped name is a name the engine
does not know, and an engine that skips unknown names would drop the weight while reporting success.

A manifest (tensor count, bytes in wire dtype, sha256 over ordered "name:shape" lines) travels with
every handoff (the engine checks it); afterwards the actor compares the engine's
get_weights_checksum() with the checksum of what it sent (full/merged), and only then commits the
new policy version. Any failure raises WeightSyncError, leaves the committed version where it was
and counts train/weight_sync_failures.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn as nn

from trainer.engine.base import WeightManifest, WeightSyncError

log = logging.getLogger(__name__)

#: module-path segments inserted by wrappers, removed before a name leaves the actor
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod", "base_layer")
#: prefixes inserted by peft's PeftModel
WRAPPER_PREFIXES = ("base_model.model.",)

WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SYNC_KINDS = ("full", "merged", "adapter")


def strip_wrapper_segments(name: str, adapter_name: str = "default") -> str:
    """Remove wrapper segments from a parameter name.

    "transformer_blocks.0._checkpoint_wrapped_module.attn.to_q.base_layer.weight"
        -> "transformer_blocks.0.attn.to_q.weight"
    "transformer_blocks.0.attn.to_q.lora_A.default.weight"
        -> "transformer_blocks.0.attn.to_q.lora_A.weight"   (peft's adapter-name segment)
    """
    for prefix in WRAPPER_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
    parts = name.split(".")
    out: list[str] = []
    for i, part in enumerate(parts):
        if part in WRAPPER_SEGMENTS:
            continue
        if part == adapter_name and i > 0 and parts[i - 1] in ("lora_A", "lora_B", "lora_embedding_A",
                                                                 "lora_embedding_B", "lora_magnitude_vector"):
            continue
        out.append(part)
    return ".".join(out)


def name_shape_hash(names_shapes: Iterable[tuple[str, Iterable[int]]]) -> str:
    """sha256 hex over the ordered lines "name:d0,d1,...\\n" (a scalar has an empty shape).

    Order matters: it is the order the tensors are sent in.
    """
    h = hashlib.sha256()
    for name, shape in names_shapes:
        h.update(f"{name}:{','.join(str(int(d)) for d in shape)}\n".encode())
    return h.hexdigest()


def build_manifest(kind: str, named_tensors: list[tuple[str, torch.Tensor]], version: int) -> WeightManifest:
    """Manifest of exactly these tensors: count, total bytes (their dtype), ordered name/shape hash."""
    if kind not in SYNC_KINDS:
        raise ValueError(f"sync kind must be one of {SYNC_KINDS}, got {kind!r}")
    return WeightManifest(
        kind=kind,
        tensor_count=len(named_tensors),
        total_bytes=sum(t.numel() * t.element_size() for _, t in named_tensors),
        name_shape_hash=name_shape_hash((n, t.shape) for n, t in named_tensors),
        version=version,
    )


def verify_manifest(named_tensors: list[tuple[str, Any]], manifest: WeightManifest) -> None:
    """Raise WeightSyncError unless the tensors match the manifest (count, bytes, name/shape hash).

    Receivers call this on what they got; the sender calls it on what it built.
    """
    got = build_manifest(manifest.kind, named_tensors, manifest.version)
    problems = []
    if got.tensor_count != manifest.tensor_count:
        problems.append(f"tensor count {got.tensor_count} != manifest {manifest.tensor_count}")
    if got.total_bytes != manifest.total_bytes:
        problems.append(f"bytes {got.total_bytes} != manifest {manifest.total_bytes}")
    if got.name_shape_hash != manifest.name_shape_hash:
        problems.append("ordered name/shape hash differs from the manifest")
    if problems:
        raise WeightSyncError(f"weight sync ({manifest.kind}, version {manifest.version}) does not match "
                              f"its manifest: {'; '.join(problems)}")


class WeightsChecksum:
    """Order-independent checksum of named tensor VALUES (dtype-independent, device-independent math).

    Per tensor: float64 sum, sum of |x| and a position-weighted sum (weights 1..1009 cycling, so a
    permutation changes it); the line "name:shape:<three float.hex>" of every tensor, sorted by
    name, is hashed with sha256. Engines compute get_weights_checksum() with this same class over
    their (diffusers-named) transformer parameters, so equal values give equal checksums.
    The per-tensor reductions run on the tensor's device; there is one host transfer in hexdigest().
    """

    def __init__(self) -> None:
        self._names: list[tuple[str, tuple[int, ...]]] = []
        self._stats: list[torch.Tensor] = []

    def update(self, name: str, tensor: torch.Tensor) -> None:
        x = tensor.detach().reshape(-1).to(torch.float64)
        w = (torch.arange(x.numel(), device=x.device, dtype=torch.int64) % 1009 + 1).to(torch.float64)
        self._names.append((name, tuple(tensor.shape)))
        self._stats.append(torch.stack([x.sum(), x.abs().sum(), (x * w).sum()]))

    def hexdigest(self) -> str:
        by_device: dict[torch.device, list[int]] = {}
        for i, s in enumerate(self._stats):
            by_device.setdefault(s.device, []).append(i)
        values: list[list[float]] = [[] for _ in self._stats]
        for idx in by_device.values():  # one host transfer per device
            for i, row in zip(idx, torch.stack([self._stats[i] for i in idx]).cpu().tolist()):
                values[i] = row
        rows = sorted(zip(self._names, values), key=lambda r: r[0][0])
        h = hashlib.sha256()
        for (name, shape), stats in rows:
            h.update(f"{name}:{','.join(map(str, shape))}:{':'.join(float(v).hex() for v in stats)}\n".encode())
        return h.hexdigest()


def weights_checksum(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """WeightsChecksum over `named_tensors` (see the class)."""
    acc = WeightsChecksum()
    for name, tensor in named_tensors:
        acc.update(name, tensor)
    return acc.hexdigest()


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on this rank (DTensor.full_tensor() is a collective)."""
    from torch.distributed.tensor import DTensor

    t = t.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t


def lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    """name -> peft LoraLayer for every LoRA-wrapped module of `model` (empty when none)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # peft missing: then there cannot be LoRA layers either
        return {}
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def model_has_lora(model: nn.Module) -> bool:
    return bool(lora_modules(model))


def iter_sync_tensors(model: nn.Module, kind: str, *, wire_dtype: torch.dtype | None,
                      name_map: Callable[[str], str] | None = None,
                      adapter_name: str = "default") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (engine name, full tensor in wire dtype) for a sync of `kind`, in parameter order.

    Every rank must consume the whole iterator (each full_tensor() is a collective).
    full:    every parameter; the model must not hold LoRA layers.
    merged:  every non-LoRA parameter; a LoRA base weight is W + (B @ A) * scaling, in fp32.
    adapter: only lora_A / lora_B weights (peft names without the adapter-name segment).
    """
    if kind not in SYNC_KINDS:
        raise ValueError(f"sync kind must be one of {SYNC_KINDS}, got {kind!r}")
    loras = lora_modules(model)
    if kind == "full" and loras:
        raise WeightSyncError("a full sync of a LoRA model would send base_layer weights without the adapter; "
                              "use --lora-merge-mode (kind 'merged') or --lora-adapter-mode (kind 'adapter')")
    if kind in ("merged", "adapter") and not loras:
        raise WeightSyncError(f"sync kind {kind!r} needs a LoRA model, but the actor holds no LoRA layers "
                              "(--fsdp-trainable-mode full syncs with kind 'full')")
    base_weight_of = {f"{n}.base_layer.weight": m for n, m in loras.items()}
    name_map = name_map or (lambda n: n)

    def out(raw_name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        name = name_map(strip_wrapper_segments(raw_name, adapter_name))
        return name, (tensor if wire_dtype is None else tensor.to(wire_dtype))

    for raw_name, param in model.named_parameters():
        is_lora = any(seg in raw_name.split(".") for seg in ("lora_A", "lora_B"))
        if kind == "adapter":
            if is_lora:
                yield out(raw_name, _full(param))
            continue
        if is_lora:
            continue  # merged: folded into the base weight below
        if raw_name in base_weight_of:
            m = base_weight_of[raw_name]
            if adapter_name not in m.lora_A:
                raise WeightSyncError(f"{raw_name}: LoRA adapter {adapter_name!r} missing on this module")
            a = _full(m.lora_A[adapter_name].weight).float()
            b = _full(m.lora_B[adapter_name].weight).float()
            w = _full(param)
            merged = w.float() + (b @ a) * float(m.scaling[adapter_name])
            yield out(raw_name, merged.to(w.dtype if wire_dtype is None else wire_dtype))
        else:
            yield out(raw_name, _full(param))


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
    bucket_size_mb: full/merged tensors are gathered and handed over in buckets of about this size,
      so the transient footprint is one bucket, not a second copy of the model.
    lora_config: {"rank", "alpha", "target_modules"} for adapter syncs.
    verify_checksum: compare engine.get_weights_checksum() with the sent tensors' checksum (full and
      merged kinds; an adapter sync is verified by its manifest).
    """

    def __init__(self, kind: str, *, wire_dtype: str | None = "bf16", bucket_size_mb: float = 512,
                 name_map: Callable[[str], str] | None = None, lora_config: dict | None = None,
                 verify_checksum: bool = True, policy_version: int = 0) -> None:
        if kind not in SYNC_KINDS:
            raise ValueError(f"--weight-sync-mode resolves to one of {SYNC_KINDS}, got {kind!r}")
        if wire_dtype is not None and wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"--weight-sync-wire-dtype must be one of {tuple(WIRE_DTYPES)}, got {wire_dtype!r}")
        if bucket_size_mb <= 0:
            raise ValueError(f"--weight-sync-bucket-size-mb must be > 0, got {bucket_size_mb}")
        if kind == "adapter" and not lora_config:
            raise ValueError("adapter sync needs lora_config (rank, alpha, target_modules)")
        self.kind = kind
        self.wire_dtype = None if wire_dtype is None else WIRE_DTYPES[wire_dtype]
        self.bucket_bytes = int(bucket_size_mb * 1024 * 1024)
        self.name_map = name_map
        self.lora_config = dict(lora_config or {})
        self.verify_checksum = verify_checksum
        self.policy_version = policy_version
        self.failures = 0
        self.last_manifest: WeightManifest | None = None

    def state_dict(self) -> dict[str, int]:
        return {"policy_version": self.policy_version, "weight_sync_failures": self.failures}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.policy_version = int(state["policy_version"])
        self.failures = int(state.get("weight_sync_failures", 0))

    def sync(self, model: nn.Module, engine: Any) -> dict[str, float]:
        """Gather, hand off, verify, commit. Returns the train/* and perf/* sync series.

        Collective: every rank calls it with its own engine. Raises WeightSyncError on any failure
        (version not committed, train/weight_sync_failures incremented).
        """
        version = self.policy_version + 1
        engine_version = getattr(engine, "policy_version", None)
        t0 = time.perf_counter()
        try:
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
            log.exception("could not restore the engine's policy_version to %d", self.policy_version)

    def _handoff(self, model: nn.Module, engine: Any, version: int) -> WeightManifest:
        tensors = iter_sync_tensors(model, self.kind, wire_dtype=self.wire_dtype, name_map=self.name_map)
        if self.kind == "adapter":
            named = list(tensors)
            manifest = build_manifest("adapter", named, version)
            engine.set_lora_tensors(named, manifest, self.lora_config)
            return manifest
        if engine_holds_lora(engine):
            raise WeightSyncError(f"a {self.kind} sync into an engine whose transformer holds LoRA layers would "
                                  "be silently dropped; never mix --lora-adapter-mode and full/merged syncs on one engine")
        names_shapes: list[tuple[str, tuple[int, ...]]] = []
        total_bytes = 0
        checksum = WeightsChecksum() if self.verify_checksum else None
        bucket: list[tuple[str, torch.Tensor]] = []
        bucket_bytes = 0

        def flush() -> None:
            nonlocal bucket, bucket_bytes
            if bucket:
                engine.update_weights_from_tensors(bucket, build_manifest(self.kind, bucket, version))
            bucket, bucket_bytes = [], 0

        for name, tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            names_shapes.append((name, tuple(tensor.shape)))
            total_bytes += nbytes
            if checksum is not None:
                checksum.update(name, tensor)
            bucket.append((name, tensor))
            bucket_bytes += nbytes
            if bucket_bytes >= self.bucket_bytes:
                flush()
        flush()
        manifest = WeightManifest(kind=self.kind, tensor_count=len(names_shapes), total_bytes=total_bytes,
                                  name_shape_hash=name_shape_hash(names_shapes), version=version)
        if checksum is not None:
            expected, got = checksum.hexdigest(), engine.get_weights_checksum()
            if got != expected:
                raise WeightSyncError(f"engine checksum after the {self.kind} sync differs from the sent tensors "
                                      f"(expected {expected[:16]}..., engine {str(got)[:16]}...): a tensor was "
                                      "dropped, renamed or altered on the way in")
        return manifest
