"""A background writer for rollout artifacts (PNGs and trajectory sidecars).

The rollout stage hands the writer one rollout's files at a time, as closures over data the
main thread no longer touches (a copy of the images, sidecar payloads whose metadata is already
serialised), and goes on to the reward and the update while one thread per rank encodes and
writes them through the same atomic writes the synchronous path uses (trainer.artifacts).

Guarantees, the same as writing synchronously except for *when* a file appears:

- memory is bounded: at most `max_rollouts` rollouts' data are held (queued or being written);
  a submit beyond that blocks until the oldest rollout is on disk;
- a failed write is never swallowed: the thread stops writing, and the next submit, wait or
  flush raises ArtifactWriteError on the main thread with the original error's type and
  message (the original chained as its cause); the rollouts it then did not write are named;
- retention never races a write: `retention_barrier` names the submitted rollouts that the
  coming prune would delete, so the caller waits for exactly those before pruning;
- the caller flushes before a checkpoint, before eval and at the end of the run (`close`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Hashable, Iterable, Sequence

log = logging.getLogger(__name__)

#: one file's write; runs on the writer thread
Job = Callable[[], Any]


class ArtifactWriteError(RuntimeError):
    """Writing a rollout's artifacts failed on the writer thread; the message carries the
    original error's, which is also chained as the cause."""


@dataclass
class _Rollout:
    key: tuple[Hashable, int]
    label: str
    jobs: Sequence[Job]
    done: threading.Event = field(default_factory=threading.Event)


def _is_doomed(later: int, keep: int) -> bool:
    """A rollout directory with `later` newer directories of its tree (the coming rollout's
    included) is removed by a prune that keeps the `keep` newest."""
    return keep > 0 and later >= keep


class ArtifactWriter:
    """One writer thread with a queue of at most `max_rollouts` rollouts (>= 1)."""

    def __init__(self, max_rollouts: int, name: str = "artifact-writer") -> None:
        if int(max_rollouts) < 1:
            raise ValueError(f"an artifact writer needs max_rollouts >= 1, got {max_rollouts} "
                             "(0 means writing synchronously, without a writer)")
        self.max_rollouts = int(max_rollouts)
        self._slots = threading.Semaphore(self.max_rollouts)
        self._queue: queue.SimpleQueue[_Rollout | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending: dict[tuple[Hashable, int], _Rollout] = {}
        #: per tree, the rollout ids submitted in order and not yet waited for by a prune
        self._submitted: dict[Hashable, list[int]] = {}
        self._error: BaseException | None = None
        self._failed: str | None = None
        self._skipped: list[str] = []
        self._busy = 0.0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- main thread ---------------------------------------------------------------------------
    def submit(self, tree: Hashable, rollout_id: int, jobs: Iterable[Job], label: str | None = None) -> float:
        """Queue one rollout's writes; blocks while `max_rollouts` rollouts are held. Returns
        the seconds spent blocked. Raises ArtifactWriteError if an earlier write failed."""
        if self._closed:
            raise RuntimeError("the artifact writer is closed")
        self.raise_if_failed()
        item = _Rollout((tree, int(rollout_id)), label or f"rollout {rollout_id} ({tree})", list(jobs))
        t0 = time.perf_counter()
        self._slots.acquire()
        blocked = time.perf_counter() - t0
        with self._lock:
            self._pending[item.key] = item
            self._submitted.setdefault(tree, []).append(int(rollout_id))
        self._queue.put(item)
        return blocked

    def retention_barrier(self, tree: Hashable, rollout_id: int, keep: int) -> list[int]:
        """The submitted rollouts of `tree` that a prune at `rollout_id` keeping `keep` would
        delete; they leave the writer's record, so the caller must wait for them now
        (`wait`) and, with several ranks, hold a barrier before rank 0 prunes.

        Rollouts of a tree run in increasing id, each creating its directory before it is
        submitted, so a submitted rollout has exactly (its successors in the record + the coming
        rollout) newer directories up to `rollout_id`. The answer depends only on the sequence
        of submits, which every rank makes alike: every rank reaches the same decision."""
        with self._lock:
            ids = [i for i in self._submitted.get(tree, []) if i < int(rollout_id)]
            doomed = [i for n, i in enumerate(ids) if _is_doomed(len(ids) - n, keep)]
            self._submitted[tree] = [i for i in self._submitted.get(tree, []) if i not in doomed]
        return doomed

    def wait(self, tree: Hashable, rollout_ids: Iterable[int]) -> None:
        """Block until those rollouts' files are written (or skipped after a failure), then
        raise ArtifactWriteError if any write failed."""
        for rid in rollout_ids:
            with self._lock:
                item = self._pending.get((tree, int(rid)))
            if item is not None:
                item.done.wait()
        self.raise_if_failed()

    def flush(self) -> None:
        """Block until every submitted write is done; raise ArtifactWriteError if one failed."""
        with self._lock:
            items = list(self._pending.values())
        for item in items:
            item.done.wait()
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        with self._lock:
            error, failed, skipped = self._error, self._failed, list(self._skipped)
        if error is None:
            return
        not_written = f"; not written either: {', '.join(skipped)}" if skipped else ""
        raise ArtifactWriteError(f"writing the artifacts of {failed} failed on the writer thread: "
                                 f"{type(error).__name__}: {error}{not_written}") from error

    def take_busy_time(self) -> float:
        """Seconds the thread spent writing since the last call."""
        with self._lock:
            busy, self._busy = self._busy, 0.0
        return busy

    @property
    def pending(self) -> int:
        """Rollouts queued or being written."""
        with self._lock:
            return len(self._pending)

    def close(self, *, raise_errors: bool = True) -> None:
        """Write everything still queued, stop the thread. With raise_errors=False (the run is
        already failing) a write failure is logged instead of raised, so it does not hide the
        run's own error; either way the log says which rollouts' artifacts were not written."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()
        try:
            self.raise_if_failed()
        except ArtifactWriteError as e:
            if raise_errors:
                raise
            log.error("%s", e)

    # -- writer thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            t0 = time.perf_counter()
            try:
                if self._error is None:  # after a failure nothing more is written: the run stops
                    for job in item.jobs:
                        job()
                else:
                    with self._lock:
                        self._skipped.append(item.label)
            except BaseException as e:  # noqa: BLE001 - handed to the main thread, never lost
                with self._lock:
                    self._error, self._failed = e, item.label
            finally:
                item.jobs = ()  # release the rollout's tensors before the slot
                with self._lock:
                    self._busy += time.perf_counter() - t0
                    self._pending.pop(item.key, None)
                item.done.set()
                self._slots.release()


def tree_key(root: Any, task: str, eval: bool) -> str:
    """The writer's name for one rollout-directory tree (what one prune lists)."""
    from trainer.artifacts import task_root

    return str(Path(task_root(root, task, eval=eval)))
