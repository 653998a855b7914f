"""Colocation: the hand-over of one device between the engine (rollout) and the actor (update).

The loop calls, per step: begin_update after the rollout, sync_engine after the update, and
end_update after a due checkpoint. `--offload-train` / `--offload-rollout` say which side's
storage leaves the device while the other works; on a card large enough for both, neither moves.
A failed release or resume is fatal: it raises, never warns.
"""

from __future__ import annotations

from typing import Any


def begin_update(actor: Any, engine: Any, *, offload_train: bool, offload_rollout: bool) -> dict[str, float]:
    """Rollout -> update: the engine's modules leave the device (--offload-rollout), then the actor's
    storage comes back (--offload-train). Failures propagate (fatal)."""
    metrics: dict[str, float] = {}
    if offload_rollout:
        engine.release_memory()
    if offload_train and actor.offloaded:
        metrics.update(actor.onload())
    return metrics


def sync_engine(actor: Any, syncer: Any, engine: Any, *, offload_rollout: bool) -> dict[str, float]:
    """Update -> sync: onload only the engine's transformer (tags=("weights",)), then hand the new
    weights to it (weight_sync.WeightSyncer). A sync failure leaves the policy version uncommitted
    and propagates (fatal)."""
    if offload_rollout:
        engine.resume_memory(("weights",))
    return syncer.sync(actor.model, engine)


def end_update(actor: Any, engine: Any, *, offload_train: bool, offload_rollout: bool) -> dict[str, float]:
    """Sync -> next rollout: release the actor (--offload-train), then bring the rest of the engine
    back. Separate from sync_engine because a due checkpoint is written between the two (DCP reads
    the actor's resident storage). Failures propagate (fatal).

    Before the first rollout, with --offload-train, call actor.offload() once."""
    metrics: dict[str, float] = {}
    if offload_train:
        metrics.update(actor.offload())
    if offload_rollout:
        engine.resume_memory()
    return metrics
