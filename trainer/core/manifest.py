"""The weight manifest: what a sync promises to deliver (tensor count, bytes, ordered name/shape
hash), built by the sender and checked by every receiver, and the error both raise."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Iterable

SYNC_KINDS = ("full", "merged", "adapter")


class WeightSyncError(RuntimeError):
    """A weight handoff to an engine failed; the policy version was not committed."""


@dataclass
class WeightManifest:
    """What a sync promises to deliver, checked by the receiver.

    tensor_count / total_bytes: over all tensors of the sync (wire dtype bytes).
    name_shape_hash: sha256 over the ordered "name:shape" lines (name_shape_hash).
    kind: "full" (whole transformer), "merged" (base with LoRA folded in) or "adapter".
    """

    kind: str
    tensor_count: int
    total_bytes: int
    name_shape_hash: str
    version: int


def name_shape_hash(names_shapes: Iterable[tuple[str, Iterable[int]]]) -> str:
    """sha256 hex over the ordered lines "name:d0,d1,...\\n" (a scalar has an empty shape).

    Order matters: it is the order the tensors are sent in.
    """
    # one update over the joined lines: the same digest as line by line, without a call per line
    lines = [f"{name}:{','.join(map(str, map(int, shape)))}\n" for name, shape in names_shapes]
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def build_manifest(kind: str, named_tensors: list[tuple[str, Any]], version: int) -> WeightManifest:
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
