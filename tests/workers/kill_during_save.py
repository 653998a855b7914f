"""The trainer's entry point with a SIGKILL planted inside one checkpoint save, as a power cut
would strike: `torchrun ... -m tests.workers.kill_during_save --config RECIPE ...` with
$KILL_DURING_SAVE = "<point>:<iteration>:<rank>" kills that rank at that point of that save and
otherwise trains exactly as `-m trainer.train`.

Points, in save_checkpoint's write order:
  shards     the DCP shards are written, this rank's RNG state is not
  sidecars   rank 0 has written the JSON sidecars; the ranks have not yet agreed to commit
  committed  COMMITTED is written, the latest-iteration markers are not
"""

from __future__ import annotations

import os
import signal
import sys

import torch.distributed as dist

from trainer import checkpoint as ck
from trainer import train

KILL_AT_ENV = "KILL_DURING_SAVE"


def plant(point: str, iteration: int, rank: int) -> None:
    """Wrap the checkpoint module's functions so that `rank` dies at `point` of save `iteration`.
    The loop imports save_checkpoint when it saves, so it gets the wrapped one."""
    saving: list[int] = []

    def kill_at(here: str) -> None:
        if here == point and saving == [iteration] and dist.get_rank() == rank:
            os.kill(os.getpid(), signal.SIGKILL)

    save, rng_state, all_ranks_ok, write = ck.save_checkpoint, ck._rng_state, ck._all_ranks_ok, ck.atomic_write_bytes

    def save_checkpoint(save_root, task, it, **kwargs):
        saving[:] = [it]
        try:
            return save(save_root, task, it, **kwargs)
        finally:
            saving.clear()

    def rng_state_after_shards():  # called right after the shards are written
        kill_at("shards")
        return rng_state()

    def all_ranks_ok_after_sidecars(ok):  # the vote that follows the sidecar writes
        kill_at("sidecars")
        return all_ranks_ok(ok)

    def atomic_write_then_maybe_die(path, data, **kwargs):
        write(path, data, **kwargs)
        if os.path.basename(path) == ck.COMMITTED:
            kill_at("committed")

    ck.save_checkpoint, ck._rng_state = save_checkpoint, rng_state_after_shards
    ck._all_ranks_ok, ck.atomic_write_bytes = all_ranks_ok_after_sidecars, atomic_write_then_maybe_die


if __name__ == "__main__":
    point, iteration, rank = os.environ[KILL_AT_ENV].split(":")
    plant(point, int(iteration), int(rank))
    sys.exit(train.main())
