"""torchrun worker for the checkpoint tests: 2 ranks, gloo, a small FSDP2 model.

Writes one JSON result per rank to $RESULT_DIR/rank<r>.json; the test asserts on them.
"""

import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from tests.workers.fs_faults import failing_shard_writes, read_only
from trainer import checkpoint as ck
from trainer.train_model import full_tensor


def build(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4))
    # A frozen parameter: excluded when trainable_only, so (like a LoRA base reloaded from
    # --model-path) it must come out of `build` identical whatever the seed.
    with torch.no_grad():
        model[2].bias.fill_(0.5)
    model[2].bias.requires_grad_(False)
    for block in model:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, opt


def step(model, opt):
    x = torch.randn(4, 8)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def full(model):
    return {n: full_tensor(p).clone() for n, p in model.named_parameters()}


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    save = os.environ["SAVE_DIR"]
    out = {}
    contract = {"mode": "full", "lora_rank": 0, "task": "t2i"}

    model, opt = build(0)
    torch.manual_seed(100 + rank)
    step(model, opt)
    ok1 = ck.save_checkpoint(save, "t2i", 1, model=model, optimizer=opt, trainer_state={"rollout_id": 1},
                             weight_sync_manifest={"tensor_count": 5}, adapter_contract=contract,
                             trainable_only=True, max_to_keep=0)
    ref = full(model)
    ref_rand = torch.rand(3).tolist()  # the RNG stream right after the save
    step(model, opt)
    # rank 1 "dies" while writing its shards: nothing of iteration 2 may be trusted
    with failing_shard_writes() if rank == 1 else contextlib.nullcontext():
        ok2 = ck.save_checkpoint(save, "t2i", 2, model=model, optimizer=opt, trainer_state={"rollout_id": 2},
                                 weight_sync_manifest={}, adapter_contract=contract, trainable_only=True,
                                 max_to_keep=0)
    out["ok1"], out["ok2"] = ok1, ok2
    out["latest_after_crash"] = ck.latest_committed_iteration(save, "t2i")

    model2, opt2 = build(1)  # different init: the load must overwrite it
    state = ck.load_checkpoint(save, "t2i", model=model2, optimizer=opt2, adapter_contract=contract,
                               trainable_only=True)
    out["loaded_rollout_id"] = state["rollout_id"]
    got = full(model2)
    out["trainable_equal"] = all(torch.equal(got[n], ref[n]) for n in ref if n != "2.bias")
    out["rng_equal"] = torch.rand(3).tolist() == ref_rand
    # the optimizer continues identically: one more step from each must agree
    torch.manual_seed(7)
    step(model2, opt2)
    model3, opt3 = build(2)
    ck.load_checkpoint(save, "t2i", model=model3, optimizer=opt3, adapter_contract=contract, trainable_only=True)
    torch.manual_seed(7)
    step(model3, opt3)
    out["optimizer_resumes"] = all(torch.equal(a, b) for a, b in zip(full(model2).values(), full(model3).values()))

    # rotation keeps N committed, removes the crashed leftover
    for it in (3, 4, 5):
        ck.save_checkpoint(save, "t2i", it, model=model, optimizer=opt, trainer_state={"rollout_id": it},
                           weight_sync_manifest={}, adapter_contract=contract, trainable_only=True, max_to_keep=2)
    out["after_rotation"] = ck.committed_iterations(save, "t2i")
    out["dirs_after_rotation"] = sorted(os.listdir(os.path.join(save, "t2i")))

    # a contract mismatch is refused on every rank, naming the difference
    try:
        ck.load_checkpoint(save, "t2i", model=model2, optimizer=opt2, trainable_only=True,
                           adapter_contract={**contract, "lora_rank": 8})
        out["mismatch_error"] = None
    except ck.CheckpointError as e:
        out["mismatch_error"] = str(e)

    def save_it(it, **kw):
        return ck.save_checkpoint(save, "t2i", it, model=model, optimizer=opt, trainer_state={"rollout_id": it},
                                  weight_sync_manifest={}, adapter_contract=contract, trainable_only=True, **kw)

    # overwriting a committed iteration is refused on every rank, as a counted failure
    out["overwrite_ok"] = save_it(5)
    out["iter5_state"] = json.load(open(os.path.join(save, "t2i", "iter_0000005", "trainer_state.json")))

    # keep 1 with a failing write: the committed checkpoints stay, rotation waits for a commit
    with failing_shard_writes() if rank == 1 else contextlib.nullcontext():
        out["keep1_failed_ok"] = save_it(6, max_to_keep=1)
    out["after_keep1_failure"] = ck.committed_iterations(save, "t2i")
    out["keep1_ok"] = save_it(6, max_to_keep=1)
    out["after_keep1"] = ck.committed_iterations(save, "t2i")

    # a checkpoint directory that turned read-only mid-run: a failure on every rank, not a crash
    dist.barrier()
    with read_only(os.path.join(save, "t2i")) if rank == 0 else contextlib.nullcontext():
        dist.barrier()
        out["read_only_ok"] = save_it(7, max_to_keep=1)
        dist.barrier()
    out["after_read_only"] = ck.committed_iterations(save, "t2i")

    with open(os.path.join(os.environ["RESULT_DIR"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
