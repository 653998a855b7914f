"""torchrun worker (CPU, gloo) for tests/test_ema_dist.py: the actor's EMA shards under FSDP2.

Each rank trains the tiny transformer with --ema-decay 0.8 and interval 2 on its own batch,
records the gathered trainable parameters after every optimizer step, and compares its own EMA
shard (and the gathered EMA) with the EMA computed from that history by its definition.
Writes <out_dir>/rank<r>.json: {"checks": {name: bool}} or {"error": traceback}.
Usage: python -m torch.distributed.run --nproc-per-node N tests/dist/ema_worker.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
warnings.filterwarnings("ignore", message="FSDP2-wrapped module.*returned a view tensor")

import torch  # noqa: E402

from tests.dist.tiny import ADAPTER, full_params, make_batch, make_cfg, replay, tiny_transformer  # noqa: E402
from trainer.actor import Actor  # noqa: E402
from trainer.distributed import build_mesh, init_distributed, shutdown_and_exit  # noqa: E402

DECAY, INTERVAL = 0.8, 2


def checks(rank: int, world: int, mesh, out: dict) -> None:
    from torch.distributed.tensor import DTensor

    cfg = make_cfg("full", optim__ema_decay=DECAY, optim__ema_update_interval=INTERVAL)
    actor = Actor(tiny_transformer(), mesh, cfg, device=torch.device("cpu"), adapter=ADAPTER)
    names = set(actor.ema.names)
    trainable = lambda: {n: t for n, t in full_params(actor.model).items() if n in names}  # noqa: E731
    history = [trainable()]
    actor.optimizer.register_step_post_hook(lambda *a: history.append(trainable()))
    for r in range(2):
        actor.train_step(make_batch(4, seed=10 * r + rank), torch.tensor([1.0, -1.0, 0.5, -0.5]), replay)
    ref = {n: t.double().clone() for n, t in history[0].items()}
    for step in range(1, len(history)):
        if step % INTERVAL == 0:
            ref = {n: DECAY * ref[n] + (1 - DECAY) * history[step][n].double() for n in ref}
    shadow = actor.ema.state_dict()
    params = {n: p for n, p in actor.model.named_parameters() if p.requires_grad}
    out["four_steps_two_updates"] = len(history) == 5 and actor.ema.updates == 2
    out["same_placement_as_param"] = all(isinstance(shadow[n], DTensor) and shadow[n].placements == params[n].placements
                                         and shadow[n]._local_tensor.shape == params[n]._local_tensor.shape
                                         for n in params)
    out["shards_are_fp32"] = all(t._local_tensor.dtype == torch.float32 for t in shadow.values())
    # this rank's shard against the matching rows of the reference (FSDP2 shards dim 0)
    ok = True
    for n, t in shadow.items():
        local = t._local_tensor.double()
        full = ref[n]
        rows = -(-full.shape[0] // world)
        want = full[rank * rows: rank * rows + local.shape[0]]
        ok &= local.shape == want.shape and torch.allclose(local, want, rtol=1e-6, atol=1e-6)
    out["local_shards_match_reference"] = bool(ok)
    gathered = {n: t.full_tensor().double() for n, t in shadow.items()}
    out["gathered_matches_reference"] = all(torch.allclose(gathered[n], ref[n], rtol=1e-6, atol=1e-6) for n in ref)
    out["ema_lags_live"] = any(not torch.allclose(gathered[n], history[-1][n].double()) for n in ref)


def main() -> None:
    out_dir = sys.argv[1]
    info = init_distributed("cpu")
    result: dict = {"rank": info.rank, "world_size": info.world_size, "checks": {}}
    code = 0
    try:
        checks(info.rank, info.world_size, build_mesh("cpu"), result["checks"])
    except Exception:
        result["error"] = traceback.format_exc()
        code = 1
    with open(os.path.join(out_dir, f"rank{info.rank}.json"), "w") as f:
        json.dump(result, f, indent=1)
    shutdown_and_exit(code)


if __name__ == "__main__":
    main()
